"""Would a decode step run faster if the next matmul's weight were already in the L2 cache? Large
decode batches leave the GPU's memory idle for much of a layer: decode attention gathers its K/V at
about two thirds of the copy bandwidth, and the small kernels between the matmuls read little
(BENCHMARKS.md, fifteenth round). This experiment patches Llama's layers so that a kernel on a
second CUDA stream, forked at the start of a piece, asks the L2 to fetch a later matmul's weight
(PTX `prefetch.global.L2`, with an eviction priority), while the main stream runs; the main stream
joins it before that matmul. The prefetch moves no bytes to the multiprocessors and changes no
result: the tokens stay right.

    python scripts/l2_prefetch.py VARIANT[,VARIANT...] [--bench latency|profile] -- BENCH_ARGS
    python scripts/l2_prefetch.py o -- --model llama-3-8b --load-format dummy --batch-size 64 160

Variants: none; o (o_proj's weight, from the start of attention: during q/k/v, rope, the KV store
and decode attention); down=MB (the first MB megabytes of down_proj's weight, from the start of the
MLP: during gate/up and SiLU-and-mul); policy=last|normal (the eviction priority the fetched lines
get, evict_last unless set); rows=N (prefetch only in passes of at least N rows, 2 unless set).
Run on a GPU. On an H200 every variant made the step slower or no faster: the fetch slows the
matmuls it runs beside more than it speeds up its own (BENCHMARKS.md, seventeenth round).
"""

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
import decode_ablation  # noqa: E402
import nano.model as model  # noqa: E402

LINE, LINES_PER_PROGRAM = 128, 1024
settings = {"o": False, "down": 0, "policy": "last", "rows": 2}


@triton.jit
def _prefetch_kernel(base, num_lines, LINE: tl.constexpr, LINES: tl.constexpr, ASM: tl.constexpr):
    """Each program asks the L2 for LINES lines of LINE bytes of `base` (bytes); nothing comes back."""
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    addresses = base + tl.minimum(lines, num_lines - 1).to(tl.int64) * LINE
    tl.inline_asm_elementwise(ASM, "=r,l", [addresses], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(weight: torch.Tensor, max_bytes: int | None = None):
    raw = weight.view(-1).view(torch.uint8)
    lines = min(raw.numel(), max_bytes or raw.numel()) // LINE
    asm = f"prefetch.global.L2::evict_{settings['policy']} [$1]; mov.u32 $0, 0;"
    _prefetch_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](raw, lines, LINE=LINE, LINES=LINES_PER_PROGRAM, ASM=asm,
                                                             num_warps=4)


side = decode_ablation.SideStream()


def _wanted(x) -> bool:
    return x.is_cuda and x.shape[0] >= settings["rows"]


def patch():
    attention_forward, swiglu_forward, linear_forward = (model.LlamaAttention.forward, model.SwiGLU.forward,
                                                         model.Linear.forward)

    def attention(self, x, batch, attn):
        if settings["o"] and _wanted(x):
            side.fork(lambda: prefetch(self.o_proj.weight))
            self.o_proj.join_first = True
        return attention_forward(self, x, batch, attn)

    def linear(self, x):
        if getattr(self, "join_first", False):
            side.join()
        return linear_forward(self, x)

    def swiglu(self, x):
        if settings["down"] and _wanted(x):
            side.fork(lambda: prefetch(self.down_proj.weight, settings["down"] << 20))
            self.down_proj.join_first = True
        return swiglu_forward(self, x)

    model.LlamaAttention.forward, model.SwiGLU.forward, model.Linear.forward = attention, swiglu, linear


def apply(variant: str):
    name, _, value = variant.partition("=")
    if name == "o":
        settings["o"] = True
    elif name in ("down", "rows"):
        settings[name] = int(value)
    elif name == "policy":
        settings["policy"] = value
    elif name != "none":
        sys.exit(f"unknown variant {variant!r}")


def main():
    patch()  # the patched forwards read `settings` as each pass runs: the variants set it first
    decode_ablation.main(apply)


if __name__ == "__main__":
    main()
