"""Decode attention over a batch of mixed lengths, as an offline run's batches are: bench_throughput's
256 requests have prompts of 100..1024 tokens, so its first decode batches hold requests of every
length in that range, and later ones the requests with long outputs. One layer of Llama-3-8B's
shape on scripts/bench_attention.py's harness, us per layer and the fraction of the copy
bandwidth, for the tiles the backend picks and others: for the long requests' launch
(`_decode_config`), and where the short requests' launch ends and which tile it runs
(`SHORT_CONTEXT`, `SHORT_TILE`).
Run on a GPU: `python scripts/decode_mixed_lengths.py`."""

import random
import sys

import torch

sys.path.insert(0, ".")
from scripts.bench_attention import LLAMA_3_8B, bench_case, decode_tiles, kv_bytes_per_layer  # noqa: E402

from nano.bench_latency import measure_copy_bandwidth  # noqa: E402

# (batch, shortest, longest): the start of bench_throughput's decode, its middle (requests whose
# outputs pass 500 tokens), its end; and bench_latency's batch 160 of 136-token requests.
CASES = [(256, 100, 1030), (160, 100, 1030), (144, 605, 1529), (96, 605, 1529), (160, 136, 136), (128, 136, 136)]
# (the long requests' tile, the short ones' longest context, their tile); None: as shipped. Tiles
# are (BLOCK_N, warps, stages).
VARIANTS = [(None, None, None), ((128, 8, 3), None, None), ((128, 4, 2), None, None), ((128, 8, 2), None, None),
            ((64, 8, 3), None, None), ((64, 4, 4), None, None), ((64, 8, 2), None, None),
            (None, 512, None), (None, 128, None), (None, 512, (32, 2, 3)), (None, None, (16, 4, 2))]


def main():
    copy_gbps = measure_copy_bandwidth("cuda") / 1e9
    print(f"GQA decode, mixed lengths, bf16, {torch.cuda.get_device_name()}, copy {copy_gbps:.0f} GB/s")
    for batch_size, low, high in CASES:
        rng = random.Random(0)
        contexts = [rng.randint(low, high) for _ in range(batch_size)]
        nbytes = kv_bytes_per_layer(LLAMA_3_8B, 1, sum(contexts), False)
        for tile, short_context, short_tile in VARIANTS:
            with decode_tiles(tile, short_context, short_tile):
                us, splits = bench_case(LLAMA_3_8B, False, batch_size, contexts)
            print(f"batch {batch_size}, contexts {low}..{high}, tile {tile or 'as shipped'}, short up to "
                  f"{short_context or 'as shipped'} on {short_tile or 'as shipped'}, {splits} splits: "
                  f"{us:.1f} us, {nbytes / us / 1e3 / copy_gbps:.0%} of copy", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
