"""Decode matmuls at 128-192 rows, the sizes where cuBLAS reads Llama-3-8B's weights slowest: cuBLAS
as nano calls it, cuBLAS on a transposed copy of the weight, cuBLAS at padded row counts, and a Triton
GEMM whose MMA runs the weight's rows on its long side (the batch is its short side) with split-K.
The L2 cache is cold as in a decode step (matmul_probe.py's graph over weight copies).
Usage: python scripts/gemm_probe.py [ROWS ...]"""

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from matmul_probe import LLAMA_SHAPES, cold_weights, report, time_per_call  # noqa: E402
# weight rows, batch rows, K step, splits of K, warps, stages: the most stages that fit in shared memory
TILINGS = [(bw, bx, bk, splits, 4 if bw * bx <= 128 * 64 else 8, 4 if (bw + bx) * bk * 2 * 4 <= 200_000 else 3)
           for bw, bx, bk, splits in itertools.product([64, 128], [64, 128, 256], [64, 128], [1, 2, 4])]


@triton.jit
def swapped_gemm_kernel(x_ptr, w_ptr, part_ptr, M, N, K, k_per_split,
                        BW: tl.constexpr, BX: tl.constexpr, BK: tl.constexpr):
    """part[split, m, n] = sum over this split's k of x[m, k] w[n, k]. Axis 0 walks the batch's
    blocks, so the programs that share a weight tile run side by side and read it once from HBM."""
    xs = tl.program_id(0) * BX + tl.arange(0, BX)
    ws = tl.program_id(1) * BW + tl.arange(0, BW)
    split = tl.program_id(2)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BW, BX], dtype=tl.float32)
    for k0 in range(split * k_per_split, (split + 1) * k_per_split, BK):
        w = tl.load(w_ptr + ws[:, None] * K + k0 + ks[None, :])                                  # [BW, BK]
        x = tl.load(x_ptr + xs[None, :] * K + k0 + ks[:, None], mask=xs[None, :] < M, other=0.0)  # [BK, BX]
        acc += tl.dot(w, x)
    tl.store(part_ptr + split * M * N + xs[None, :] * N + ws[:, None], acc, mask=xs[None, :] < M)


@triton.jit
def sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=offs < numel, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < numel)


def swapped_gemm(tiling, parts):
    bw, bx, bk, splits, warps, stages = tiling

    def run(x, w, out):
        m, k = x.shape
        part = out if splits == 1 else parts[: splits * out.numel()]
        grid = (triton.cdiv(m, bx), w.shape[0] // bw, splits)
        swapped_gemm_kernel[grid](x, w, part, m, w.shape[0], k, k // splits, BW=bw, BX=bx, BK=bk,
                                  num_warps=warps, num_stages=stages)
        if splits > 1:
            sum_splits_kernel[(triton.cdiv(out.numel(), 1024),)](part, out, out.numel(), SPLITS=splits, BLOCK=1024)
    return run


def main():
    row_counts = [int(a) for a in sys.argv[1:]] or [128, 160]
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, (n, k) in LLAMA_SHAPES.items():
        nbytes = n * k * 2
        weights = cold_weights(n, k, device)
        copies = len(weights)
        for m in row_counts:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in weights]
            line = f"{name:8s} M={m:4d}  cublas {report(time_per_call(lambda x, w, o: torch.mm(x, w.t(), out=o), weights, x, outs), nbytes)}"
            for padded in (m + 8, m + 16, m + 32, 192, 256):
                if padded > m and padded <= 256:
                    xp = torch.randn(padded, k, device=device, dtype=torch.bfloat16)
                    op = [torch.empty(padded, n, device=device, dtype=torch.bfloat16) for _ in weights]
                    line += f"  @{padded} {time_per_call(lambda x, w, o: torch.mm(x, w.t(), out=o), weights, xp, op):6.1f}"
            print(line, flush=True)
            transposed = [w.t().contiguous() for w in weights[: copies // 2 + 1]]
            print(f"{name:8s} M={m:4d}  cublas, weight stored [K, N]: "
                  f"{report(time_per_call(lambda x, w, o: torch.mm(x, w, out=o), transposed, x, outs), nbytes)}", flush=True)
            del transposed
            parts = torch.empty(4 * m * n, device=device, dtype=torch.float32)
            timed = []
            for tiling in TILINGS:
                if n % tiling[0] or k % (tiling[2] * tiling[3]) or (tiling[1] > 64 and tiling[1] >= 2 * m):
                    continue
                try:
                    timed.append((time_per_call(swapped_gemm(tiling, parts), weights, x, outs, replays=5), tiling))
                except triton.runtime.errors.OutOfResources:
                    continue
            timed.sort()
            best = timed[0][1]
            swapped_gemm(best, parts)(x, weights[0], outs[0])
            torch.testing.assert_close(outs[0], x @ weights[0].t(), atol=2e-2, rtol=2e-2)
            print(f"{name:8s} M={m:4d}  swapped triton, five fastest (weight rows, batch rows, K step, splits, warps, stages): "
                  + "; ".join(f"{report(t, nbytes)} {c}" for t, c in timed[:5]), flush=True)
        del weights


if __name__ == "__main__":
    main()
