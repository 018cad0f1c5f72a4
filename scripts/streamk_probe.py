"""Can a stream-K GEMM fill the GPU where cuBLAS's tiles cannot? At 160 rows cuBLAS runs
Llama-3-8B's gate/up matmul as 112 programs (28,672 weight rows in tiles of 256) and q/k/v as 96,
on an H200's 132 multiprocessors: 15% and 27% of them idle while the matmul reads its weights.

Stream-K (Osama et al., 2023, arXiv:2301.03598) gives each of P persistent programs an equal share
of all (tile, K-step) iterations, so every multiprocessor works until the end. A tile whose K range
is cut between programs is finished by the program holding its last K step: the others store
their float32 partial sums and raise a flag, and it adds them. Each program walks its range from
the end backwards, so the partials it waits for are the first thing the programs before it compute
(and Triton's interpreter, which runs programs one after another, finds them ready).

The weight's rows are the MMA's long side and the batch its short side (160 rows: a 128-row and a
32-row block, nothing padded to 256). Usage: `python scripts/streamk_probe.py check` (the interpreter
on CPU, against torch) or `python scripts/streamk_probe.py [ROWS ...] [--shapes qkv,o,gate_up,down]` on a GPU.
"""

import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _mac(acc1, acc2, w_desc, x1_desc, x2_desc, w_row, k_first, k_last,
         BK: tl.constexpr, BX1: tl.constexpr, HAS_X2: tl.constexpr):
    """acc1 [BW, BX1] (+ acc2 [BW, BX2]) += w[w_row:w_row + BW, k] x[:, k]^T over K steps [k_first, k_last),
    every tile loaded by the tensor memory accelerator (rows past the tensor read as zeros)."""
    for step in range(k_first, k_last):
        w = w_desc.load([w_row, step * BK])                                  # [BW, BK]
        acc1 = tl.dot(w, x1_desc.load([0, step * BK]).T, acc1)              # [BW, BX1]
        if HAS_X2:
            acc2 = tl.dot(w, x2_desc.load([BX1, step * BK]).T, acc2)        # [BW, BX2]
    return acc1, acc2


@triton.jit
def streamk_kernel(x1_desc, x2_desc, w_desc, out_ptr, part_ptr, flag_ptr, M, N, K, stride_o,
                   BW: tl.constexpr, BK: tl.constexpr, BX1: tl.constexpr, BX2: tl.constexpr, HAS_X2: tl.constexpr):
    """out [M, N] = x [M, K] w [N, K]^T; grid (P,). part [P, BW, BX1 + BX2] float32, flag [P] int32 (zeros)."""
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    steps_per_tile = K // BK
    total = (N // BW) * steps_per_tile
    start, it = pid * total // num_programs, (pid + 1) * total // num_programs
    x_rows1, x_rows2 = tl.arange(0, BX1), BX1 + tl.arange(0, BX2)  # also the partial sums' columns
    while it > start:  # this program's segments, last first
        tile = (it - 1) // steps_per_tile
        first = tl.maximum(start, tile * steps_per_tile)
        k_first, k_last = first - tile * steps_per_tile, it - tile * steps_per_tile
        w_rows = tile * BW + tl.arange(0, BW)
        acc1 = tl.zeros([BW, BX1], dtype=tl.float32)
        acc2 = tl.zeros([BW, BX2], dtype=tl.float32)
        acc1, acc2 = _mac(acc1, acc2, w_desc, x1_desc, x2_desc, tile * BW, k_first, k_last, BK, BX1, HAS_X2)
        rows = tl.arange(0, BW)
        if k_last < steps_per_tile:  # another program ends this tile: hand it the partial sum
            part = part_ptr + pid * BW * (BX1 + BX2) + rows[:, None] * (BX1 + BX2)
            tl.store(part + x_rows1[None, :], acc1)
            if HAS_X2:
                tl.store(part + x_rows2[None, :], acc2)
            tl.debug_barrier()  # every thread's stores before the flag
            tl.atomic_xchg(flag_ptr + pid, 1, sem="release")
        else:
            q, covered = pid - 1, k_first  # add the partials of the programs before, down to K step 0
            while covered > 0:
                q_start = q * total // num_programs
                if q_start < (q + 1) * total // num_programs:  # a program with no steps raises no flag
                    while tl.atomic_add(flag_ptr + q, 0, sem="acquire") == 0:
                        pass
                    tl.debug_barrier()
                    part = part_ptr + q * BW * (BX1 + BX2) + rows[:, None] * (BX1 + BX2)
                    acc1 += tl.load(part + x_rows1[None, :], cache_modifier=".cg")
                    if HAS_X2:
                        acc2 += tl.load(part + x_rows2[None, :], cache_modifier=".cg")
                    tl.atomic_xchg(flag_ptr + q, 0)  # ready for the next call
                covered = tl.maximum(q_start, tile * steps_per_tile) - tile * steps_per_tile
                q -= 1
            out = out_ptr + w_rows[:, None]
            tl.store(out + x_rows1[None, :] * stride_o, acc1.to(out_ptr.dtype.element_ty), mask=x_rows1[None, :] < M)
            if HAS_X2:
                tl.store(out + x_rows2[None, :] * stride_o, acc2.to(out_ptr.dtype.element_ty), mask=x_rows2[None, :] < M)
        it = first


def batch_blocks(m: int) -> tuple[int, int, bool]:
    """The batch's rows as a block of at most 128 and a second block for the rest -> (first block,
    second block, whether the second has rows): without any, a 16-row block stands in, unused."""
    bx1 = min(128, max(16, triton.next_power_of_2(m)))
    return bx1, max(16, triton.next_power_of_2(m - bx1)), m > bx1


class StreamK:
    def __init__(self, programs: int, bw: int, bk: int, warps: int, stages: int, max_m: int = 256, device="cuda"):
        self.programs, self.bw, self.bk, self.warps, self.stages = programs, bw, bk, warps, stages
        self.part = torch.empty(programs, bw, 2 * max_m, dtype=torch.float32, device=device)
        self.flag = torch.zeros(programs, dtype=torch.int32, device=device)

    def __call__(self, x, w, out):
        (m, k), n = x.shape, w.shape[0]
        assert n % self.bw == 0 and k % self.bk == 0
        bx1, bx2, has_x2 = batch_blocks(m)
        x1, x2 = (TensorDescriptor.from_tensor(x, [rows, self.bk]) for rows in (bx1, bx2))
        streamk_kernel[(self.programs,)](x1, x2, TensorDescriptor.from_tensor(w, [self.bw, self.bk]), out, self.part,
                                         self.flag, m, n, k, out.stride(0), BW=self.bw, BK=self.bk, BX1=bx1, BX2=bx2,
                                         HAS_X2=has_x2, num_warps=self.warps, num_stages=self.stages)


def check():
    """The interpreter on CPU: every split of tiles between programs, against torch."""
    torch.manual_seed(0)
    for (m, n, k), programs, bw in itertools.product([(5, 64, 64), (40, 128, 96), (150, 64, 32)], [1, 3, 7, 16], [16, 32]):
        x, w = torch.randn(m, k), torch.randn(n, k)
        out = torch.full((m, n), float("nan"))
        run = StreamK(programs, bw, 16, 4, 1, max_m=256, device="cpu")
        run(x, w, out)
        torch.testing.assert_close(out, x @ w.t(), atol=1e-3, rtol=1e-3)
        assert not run.flag.any(), "every flag raised was taken down"
        print(f"M={m} N={n} K={k} programs={programs} BW={bw}: ok", flush=True)


def main(row_counts: list[int], shapes: list[str]):
    sys.path.insert(0, os.path.dirname(__file__))
    from matmul_probe import LLAMA_SHAPES, cold_weights, report, time_per_call, torch_matmul
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [(sms, bw, bk, warps, stages) for (bw, warps), bk, stages in itertools.product(
        [(64, 4), (128, 8), (256, 8), (256, 16)], [64, 128], [3, 4, 5])]
    torch.manual_seed(0)
    for name, (n, k) in ((name, LLAMA_SHAPES[name]) for name in shapes):
        weights, nbytes = cold_weights(n, k), n * k * 2
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            line = f"{name:8s} M={m:4d}  cublas {report(time_per_call(torch_matmul, weights, x, outs), nbytes)}"
            timed = []
            for config in configs:
                run = StreamK(*config)
                try:
                    timed.append((time_per_call(run, weights, x, outs), config))
                except triton.runtime.errors.OutOfResources:
                    continue
                run(x, weights[0], outs[0])
                torch.testing.assert_close(outs[0], x @ weights[0].t(), atol=3e-2, rtol=3e-2)
            for us, config in sorted(timed)[:3]:
                line += f"  streamk {report(us, nbytes)} {config}"
            print(line, flush=True)
        del weights


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        check()
    else:
        shapes = sys.argv[sys.argv.index("--shapes") + 1].split(",") if "--shapes" in sys.argv else ["qkv", "o", "gate_up", "down"]
        main([int(a) for a in sys.argv[1:] if a.isdigit()] or [64, 128, 160], shapes)
