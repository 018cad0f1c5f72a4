"""One-row linears (decode at batch 1): cuBLAS against a Triton mat-vec shaped like nano's
ops.linear (triton_ops.py) over 36 tilings (rows per program, K step, warps), for Llama-3-8B's
and DeepSeek-V2-Lite's weights, with the L2 cache cold as in a decode step (a CUDA graph over
400 MB of weight copies: scripts/matmul_probe.py). Prints cuBLAS and the three fastest tilings.
Usage: python scripts/matvec_probe.py"""

import itertools
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "scripts")
from matmul_probe import cold_weights, report, time_per_call, torch_matmul

SHAPES = {"llama qkv": (6144, 4096), "llama o": (4096, 4096), "llama gate_up": (28672, 4096),
          "llama down": (4096, 14336), "llama lm_head": (128256, 4096), "ds fused_a": (3648, 2048),
          "ds o": (2048, 2048), "ds dense gate_up": (21888, 2048)}
TILINGS = list(itertools.product([4, 8, 16, 32], [256, 512, 1024], [2, 4, 8]))  # rows, K step, warps


@triton.jit
def matvec_kernel(x_ptr, w_ptr, out_ptr, K, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + k0 + cols).to(tl.float32)
        acc += tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0 + cols[None, :]).to(tl.float32) * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


def triton_matvec(tiling):
    rows, k_step, warps = tiling

    def run(x, w, out):
        matvec_kernel[(w.shape[0] // rows,)](x, w, out, w.shape[1], BN=rows, BK=k_step, num_warps=warps)
    return run


def main():
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = cold_weights(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
        results = []
        for tiling in TILINGS:
            if n % tiling[0] or k % tiling[1] or tiling[0] * tiling[1] > 16384:
                continue
            results.append((time_per_call(triton_matvec(tiling), weights, x, outs), tiling))
            triton_matvec(tiling)(x, weights[0], outs[0])
            torch.testing.assert_close(outs[0].float(), x.float() @ weights[0].float().t(), atol=2e-2, rtol=2e-2)
        best = "; ".join(f"{report(us, nbytes)} {tiling}" for us, tiling in sorted(results)[:3])
        print(f"{name:16s} cublas {report(time_per_call(torch_matmul, weights, x, outs), nbytes)} | mat-vec {best}", flush=True)
        del weights, outs


if __name__ == "__main__":
    main()
