"""Decode attention's cost that does not grow with the bytes read: one layer of Llama-3-8B's decode
attention (KV store, stage 1, merge) on scripts/bench_attention.py's harness, at 16-160 requests of
136 and 250 tokens, for the short requests' tile (triton_attn.SHORT_TILE), the other tile's pipeline
stages, and with one split forced ("cap1": every program serves a whole request, no merge).
Prints microseconds per layer beside the time the KV bytes take at 4.1 TB/s. Usage:
    python scripts/decode_fixed_cost.py tiles     # SHORT_TILE, per case
    python scripts/decode_fixed_cost.py stages    # SHORT_TILE x the 128-wide tile's stages"""

import sys

import torch

sys.path.insert(0, ".")
from scripts.bench_attention import LLAMA_3_8B, bench_case, decode_tiles, kv_bytes_per_layer  # noqa: E402

TILES = [(16, 2, 3), (16, 2, 2), (16, 1, 2), (16, 1, 3), (32, 2, 2), (16, 4, 2), (32, 4, 2)]  # tokens, warps, stages
TILE_CASES = [(160, 136, 0), (152, 136, 0), (144, 136, 0), (136, 136, 0), (128, 136, 0), (96, 136, 0), (160, 250, 0),
              (64, 136, 0), (64, 136, 1), (32, 136, 0), (32, 136, 1), (64, 250, 0), (64, 250, 1), (16, 136, 0),
              (16, 136, 1)]  # (batch, context, force one split)
STAGE_CASES = [(160, 136, 0), (64, 136, 1), (16, 136, 1), (16, 136, 0), (64, 136, 0)]
SHORT_TILES = [(16, 2, 3), (16, 2, 1), (16, 2, 2), (16, 1, 1)]
LONG_TILES = [(128, 4, 3), (128, 4, 1), (64, 4, 1), (64, 4, 2)]


def one_split(backend):
    backend.target_programs = backend.num_kv_splits.shape[0] * backend.num_kv_heads


def run(cases, tiles_for):
    for batch_size, context, force_one in cases:
        nbytes = kv_bytes_per_layer(LLAMA_3_8B, batch_size, context, False)
        results = []
        for short_tile, long_tile in tiles_for(batch_size, force_one):
            with decode_tiles(long_tile, short_tile=short_tile):
                us, splits = bench_case(LLAMA_3_8B, False, batch_size, context, one_split if force_one else None)
            results.append(f"{short_tile}/{long_tile}: {us:.1f}")
            torch.cuda.empty_cache()
        print(f"{batch_size}x{context}{' cap1' if force_one else ''} splits {splits} ({nbytes / 1e6:.0f} MB, "
              f"{nbytes / 4.1e6:.1f} us at 4.1 TB/s): " + "; ".join(results), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["stages"]:
        run(STAGE_CASES, lambda bs, force_one: [(s, lt) for s in SHORT_TILES for lt in (LONG_TILES[:1] if force_one else LONG_TILES)])
    else:  # the short tile matters where one split serves each request (batches from 67, or forced)
        run(TILE_CASES, lambda bs, force_one: [(t, (128, 4, 3)) for t in (TILES if force_one or bs > 66 else TILES[:1])])
