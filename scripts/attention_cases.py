"""One layer of Llama-3-8B's decode attention (KV store, stage 1, merge) on scripts/bench_attention.py's
harness, for the cases named on the command line: BATCHxCONTEXT (every request that long) or
BATCHxSHORT/LONG (the first half of the requests SHORT tokens, the rest LONG). Prints microseconds
per layer, the first request's split count and the KV bytes read per second.

It uses the nano/ of the directory it runs in, so a copy of another tree can be timed beside this
one (BENCHMARKS.md, nineteenth round):
    python scripts/attention_cases.py 64x136 64x4096 64x136/1088
    (cd /path/to/other/tree && python /path/to/this/scripts/attention_cases.py 64x136)"""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_attention import LLAMA_3_8B, bench_case, kv_bytes_per_layer  # noqa: E402

import nano.triton_attn as triton_attn  # noqa: E402


def contexts(case: str) -> list[int]:
    batch, lengths = case.split("x")
    short, _, long = lengths.partition("/")
    half = int(batch) // 2
    return [int(short)] * (int(batch) - half) + [int(long or short)] * half


def main():
    print(f"nano from {os.path.dirname(triton_attn.__file__)}, {torch.cuda.get_device_name()}")
    for case in sys.argv[1:]:
        lengths = contexts(case)
        us, splits = bench_case(LLAMA_3_8B, False, len(lengths), lengths)
        nbytes = kv_bytes_per_layer(LLAMA_3_8B, 1, sum(lengths), False)
        print(f"{case}: {us:.1f} us ({splits} splits), {nbytes / us / 1e6:.2f} TB/s", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
