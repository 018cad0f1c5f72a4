"""What each compiled decode-attention kernel asks of a multiprocessor: shared memory and registers,
from Triton's compiled kernels after bench_attention.py's harness has run them (Llama-3-8B's shape
at batch 160 with short and long requests, so both stage-1 launches compile; batch 8, split and
merged; DeepSeek-V2-Lite's MLA at batch 160). Those two numbers decide how many programs of a
launch run on a multiprocessor at once (BENCHMARKS.md, seventeenth round).
Run on a GPU: `python scripts/decode_kernel_resources.py`."""

import sys

sys.path.insert(0, ".")
from scripts.bench_attention import DEEPSEEK_V2_LITE, LLAMA_3_8B, bench_case  # noqa: E402

import nano.triton_attn as triton_attn  # noqa: E402


def compiled_kernels(cache, depth=0):
    """The compiled kernels in a Triton JIT function's caches, however its version nests them."""
    if hasattr(cache, "metadata") and hasattr(cache, "asm"):
        yield cache
    elif depth < 4 and isinstance(cache, dict | tuple | list):
        for value in cache.values() if isinstance(cache, dict) else cache:
            yield from compiled_kernels(value, depth + 1)


def main():
    bench_case(LLAMA_3_8B, False, 160, [136] * 80 + [600] * 80)
    bench_case(LLAMA_3_8B, False, 8, 600)
    bench_case(DEEPSEEK_V2_LITE, True, 160, 600)
    for name in ("_decode_split_kernel", "_decode_merge_kernel", "_store_kv_kernel"):
        for kernel in compiled_kernels(getattr(triton_attn, name).device_caches):
            meta = kernel.metadata
            print(f"{name}: {meta.num_warps} warps, {meta.num_stages} stages, {meta.shared} bytes of shared memory, "
                  f"{kernel.n_regs} registers a thread, {kernel.n_spills} spilled", flush=True)


if __name__ == "__main__":
    main()
