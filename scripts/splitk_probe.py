"""Decode matmuls at 64-160 rows with K split by hand: cuBLAS's strided-batched GEMM over S slices of
K, each writing its own partial product, against one cuBLAS GEMM as nano calls it. The partials would
be summed by the kernel that reads the matmul's output next (the residual add and RMSNorm after
o_proj and down_proj, SiLU-and-mul after gate/up), so the sum is timed apart, here as torch's.
L2 cold as in a decode step (matmul_probe.py's graph over weight copies). us per call.
Usage: python scripts/splitk_probe.py [--shapes o,down] [--short] [ROWS ...]
(--short: two halves in bf16 only, the form nano runs, without the sum)"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from matmul_probe import LLAMA_SHAPES, cold_weights, report, time_per_call  # noqa: E402


def k_slices(t: torch.Tensor, s: int) -> torch.Tensor:
    """[R, K] -> a view [s, R, K/s] of its s column blocks (no copy: cuBLAS takes the strides)."""
    r, k = t.shape
    return t.as_strided((s, r, k // s), (k // s, k, 1))


def split_k(s: int, out_dtype):
    """[M, K] x [N, K]^T -> s partial products [s, M, N], in float32 with out_dtype (bmm.dtype_out)."""
    def run(x, w, part):
        a, b = k_slices(x, s), k_slices(w, s).transpose(1, 2)
        torch.bmm(a, b, out=part) if out_dtype is None else torch.bmm(a, b, out_dtype=out_dtype, out=part)
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rows", type=int, nargs="*", default=[64, 128, 160])
    p.add_argument("--shapes", default=",".join(LLAMA_SHAPES))
    p.add_argument("--short", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = LLAMA_SHAPES[name]
        nbytes = n * k * 2
        weights = cold_weights(n, k)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            line = f"{name:8s} M={m:4d}  cublas {report(time_per_call(lambda x, w, o: torch.mm(x, w.t(), out=o), weights, x, outs), nbytes)}"
            for s, dtype in [(2, torch.bfloat16)] if args.short else [(s, d) for s in (2, 4) for d in (torch.bfloat16, torch.float32)]:
                parts = [torch.empty(s, m, n, device="cuda", dtype=dtype) for _ in weights]
                run = split_k(s, None if dtype == torch.bfloat16 else dtype)
                try:
                    t = time_per_call(run, weights, x, parts)
                except (RuntimeError, TypeError) as e:
                    line += f"  | S={s} {str(dtype)[6:]}: {type(e).__name__} {str(e)[:60]}"
                    continue
                run(x, weights[0], parts[0])
                torch.testing.assert_close(parts[0].float().sum(0), (x @ weights[0].t()).float(), atol=3e-2, rtol=3e-2)
                line += f"  | S={s} {str(dtype)[6:]} {t:6.1f}"
                if not args.short:
                    summed = time_per_call(lambda x, w, o: torch.sum(o, 0, dtype=torch.bfloat16), weights, x, parts)
                    line += f" (+sum {summed:4.1f})"
            print(line, flush=True)
        del weights


if __name__ == "__main__":
    main()
