"""Decode attention over a batch of mixed lengths, as an offline run's batches are: bench_throughput's
256 requests have prompts of 100..1024 tokens, so its first decode batches hold requests of every
length in that range, and later ones the requests with long outputs. One layer of Llama-3-8B's
shape on scripts/bench_attention.py's harness, us per layer and the fraction of the copy
bandwidth, for the tile the backend picks and two others.
Run on a GPU: `python scripts/decode_mixed_lengths.py`."""

import random
import sys

import torch

sys.path.insert(0, ".")
from scripts.bench_attention import LLAMA_3_8B, bench_case, kv_bytes_per_layer  # noqa: E402

import nano.triton_attn as triton_attn  # noqa: E402
from nano.bench_latency import measure_copy_bandwidth  # noqa: E402

# (batch, shortest, longest): the start of bench_throughput's decode, its middle (requests whose
# outputs pass 500 tokens), its end; and bench_latency's batch 160 of 136-token requests.
CASES = [(256, 100, 1030), (160, 100, 1030), (144, 605, 1529), (64, 1000, 2048), (160, 136, 136)]
TILES = [None, (64, 4, 3), (32, 4, 3)]  # None: the backend's own (BLOCK_N, warps, stages)


def main():
    copy_gbps = measure_copy_bandwidth("cuda") / 1e9
    print(f"GQA decode, mixed lengths, bf16, {torch.cuda.get_device_name()}, copy {copy_gbps:.0f} GB/s")
    original = triton_attn._decode_config
    for batch_size, low, high in CASES:
        rng = random.Random(0)
        contexts = [rng.randint(low, high) for _ in range(batch_size)]
        nbytes = kv_bytes_per_layer(LLAMA_3_8B, 1, sum(contexts), False)
        for tile in TILES:
            if tile is not None:
                triton_attn._decode_config = lambda k_dim, tile=tile: (*tile, 8) if k_dim <= 128 else original(k_dim)
            us, splits = bench_case(LLAMA_3_8B, False, batch_size, contexts)
            triton_attn._decode_config = original
            print(f"batch {batch_size}, contexts {low}..{high}, tile {tile or 'as shipped'}, {splits} splits: "
                  f"{us:.1f} us, {nbytes / us / 1e3 / copy_gbps:.0%} of copy", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
