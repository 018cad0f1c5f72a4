"""Which tile makes grouped-query decode attention (Llama-3-8B: 32 query heads on 8 KV heads of
128) stream fastest, from batch 1 to 160, at short and long contexts?

The GQA decode kernel (triton_attn.py) runs one tile (`_decode_config`: tokens per tile, warps,
pipeline stages) at every batch size, but for the short requests of a batch that fills the GPU
unsplit (`SHORT_TILE`); a split is at least `min_split_tokens` long (0 below: one tile). This times
each tile on every request on scripts/bench_attention.py's harness and prints each case's four
fastest. Short tiles win at large batches of short requests and lose at long contexts
(BENCHMARKS.md). Run on a GPU: `python scripts/tune_gqa_decode.py`.
"""

import itertools
import sys

import torch

sys.path.insert(0, ".")
from scripts.bench_attention import LLAMA_3_8B, bench_case, decode_tiles, kv_bytes_per_layer  # noqa: E402

from nano.bench_latency import measure_copy_bandwidth  # noqa: E402

TILES = [(128, 4, 3), (64, 4, 3), (64, 4, 2), (64, 8, 3), (32, 4, 3), (32, 2, 3), (16, 2, 3), (16, 4, 3)]  # BLOCK_N, warps, stages
# (batch, context, the split floors tried: 0 is one tile)
CASES = [(160, 136, [128]), (160, 272, [128]), (160, 544, [128]), (160, 1088, [128]), (128, 136, [128]),
         (128, 544, [128]), (96, 136, [128]), (96, 544, [128]), (64, 136, [128]), (64, 544, [128]),
         (8, 136, [0, 128]), (1, 136, [0, 128]), (1, 4096, [0, 128]), (8, 4096, [0, 128])]


def main():
    copy_gbps = measure_copy_bandwidth("cuda") / 1e9
    print(f"GQA decode, bf16, {torch.cuda.get_device_name()}, copy {copy_gbps:.0f} GB/s\n")
    for batch_size, context, floors in CASES:
        nbytes = kv_bytes_per_layer(LLAMA_3_8B, batch_size, context, False)
        results = []
        for tile, floor in itertools.product(TILES, floors):
            def configure(backend, floor=floor, tile=tile):
                backend.min_split_tokens = floor or tile[0]

            with decode_tiles(tile, short_tile=tile):  # the short requests' launch runs it too
                us, splits = bench_case(LLAMA_3_8B, False, batch_size, context, configure)
            results.append((us, tile, floor or tile[0], splits))
            print(f"batch {batch_size} context {context} tile {tile} min_split {floor or tile[0]} splits {splits}: "
                  f"{us:.1f} us, {nbytes / us / 1e3 / copy_gbps:.0%} of copy", flush=True)
            torch.cuda.empty_cache()
        best = ", ".join(f"{us:.1f} us {tile} min {floor} ({splits} splits)" for us, tile, floor, splits in sorted(results)[:4])
        print(f"FASTEST at batch {batch_size}, context {context}: {best}", flush=True)


if __name__ == "__main__":
    main()
