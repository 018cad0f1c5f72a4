"""Decode matmuls at 1-160 rows: cuBLAS, cuBLASLt and a plain Triton GEMM (the fastest of 48 tilings)
for each weight of Llama-3-8B (and, at 1 and 8 rows, DeepSeek-V2-Lite's dense ones), with the L2
cache cold as in a decode step: a CUDA graph runs the matmul over enough copies of the weight
(400 MB) that none is still cached when its turn comes again.
Usage: python scripts/matmul_probe.py [ROWS ...]"""

import itertools
import sys
import time

import torch
import triton
import triton.language as tl

SHAPES = {"llama qkv": (6144, 4096), "llama o": (4096, 4096), "llama gate_up": (28672, 4096),
          "llama down": (4096, 14336), "ds fused_a": (3648, 2048), "ds o": (2048, 2048),
          "ds dense gate_up": (21888, 2048), "ds dense down": (2048, 10944)}
TILINGS = [c for c in itertools.product([32, 64, 128], [64, 128], [64, 128], [4, 8], [3, 4])  # BM, BN, BK, warps, stages
           if c[0] * c[2] + c[1] * c[2] <= 256 * 128]


@triton.jit
def matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out = x w^T; the row blocks are the grid's first axis, so the programs that share a weight
    tile run side by side."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptr + rows[:, None] * K + k0 + ks[None, :], mask=rows[:, None] < M, other=0.0)
        acc += tl.dot(a, tl.load(w_ptr + cols[None, :] * K + k0 + ks[:, None]))
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] < M)


def triton_matmul(tiling):
    bm, bn, bk, warps, stages = tiling

    def run(x, w, out):
        grid = (triton.cdiv(x.shape[0], bm), w.shape[0] // bn)
        matmul_kernel[grid](x, w, out, x.shape[0], w.shape[0], x.shape[1], BM=bm, BN=bn, BK=bk,
                            num_warps=warps, num_stages=stages)
    return run


def torch_matmul(x, w, out):
    torch.mm(x, w.t(), out=out)


LLAMA_SHAPES = {name.removeprefix("llama "): shape for name, shape in SHAPES.items() if name.startswith("llama")}


def cold_weights(n: int, k: int, device="cuda") -> list[torch.Tensor]:
    """Copies of a random [n, k] bf16 weight, enough (400 MB, at least 2) that a graph running a
    matmul over each in turn finds none still in the L2 cache."""
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) / 50 for _ in range(max(2, -(-400_000_000 // (n * k * 2))))]


def time_per_call(run, weights, x, outs, replays=20) -> float:
    """Microseconds a call, replaying one CUDA graph that runs `run` once over each weight copy."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture stream
        for w, out in zip(weights, outs):
            run(x, w, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, out in zip(weights, outs):
            run(x, w, out)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays / len(weights) * 1e6


def main():
    row_counts = [int(a) for a in sys.argv[1:]] or [1, 8, 32, 64, 96, 128, 160]
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = cold_weights(n, k)
        for m in row_counts:
            if name.startswith("ds") and m > 8:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            line = f"{name:18s} M={m:4d}"
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                line += f"  {library} {report(time_per_call(torch_matmul, weights, x, outs), nbytes)}"
            torch.backends.cuda.preferred_blas_library("cublas")
            if m >= 16 and name.startswith("llama"):
                timed = []
                for tiling in (t for t in TILINGS if t[0] <= triton.next_power_of_2(m) and n % t[1] == 0):
                    try:
                        timed.append((time_per_call(triton_matmul(tiling), weights, x, outs), tiling))
                    except triton.runtime.errors.OutOfResources:  # too many stages for shared memory
                        continue
                best = min(timed)
                triton_matmul(best[1])(x, weights[0], outs[0])
                torch.testing.assert_close(outs[0], x @ weights[0].t(), atol=2e-2, rtol=2e-2)
                line += f"  triton {report(best[0], nbytes)} {best[1]}"
            print(line, flush=True)
        del weights


def report(us: float, nbytes: int) -> str:
    return f"{us:7.1f} us {nbytes / us / 1e6:4.2f} TB/s"


if __name__ == "__main__":
    main()
