"""Greedy sampling's argmax over bf16 logits: torch's reduction against nano's two-launch kernel
(ops.argmax, triton_ops.py), at batch 1, 64, 160 and 256 of Llama-3's vocabulary and batch 1 of
DeepSeek-V2's, in CUDA graphs (scripts/matmul_probe.py's timing). "warm" runs over one buffer, as
a step does right after lm_head wrote it; "cold" over 400 MB of copies, none still in the L2 cache.
Usage: python scripts/argmax_probe.py"""

import sys

import torch

sys.path[:0] = [".", "scripts"]
from matmul_probe import cold_weights, time_per_call  # noqa: E402

from nano import ops  # noqa: E402

SHAPES = [(1, 128256), (1, 102400), (64, 128256), (160, 128256), (256, 128256)]


def main():
    torch.manual_seed(0)
    kernel = ops.kernels().argmax
    for rows, vocab in SHAPES:
        cold = cold_weights(rows, vocab)
        warm = cold[:1] * 64
        times = {}
        for name, fn in (("torch", ops.argmax.reference), ("nano", kernel)):
            assert torch.equal(fn(cold[0]), cold[0].argmax(dim=-1))
            for case, logits in (("warm", warm), ("cold", cold)):
                times[name, case] = time_per_call(lambda _, x, __: fn(x), logits, None, [None] * len(logits))
        print(f"batch {rows:3d} x {vocab}: " + ", ".join(
            f"{case} torch {times['torch', case]:.1f} us, nano {times['nano', case]:.1f} us" for case in ("warm", "cold")),
            flush=True)
        del cold, warm


if __name__ == "__main__":
    main()
