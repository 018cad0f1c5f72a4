"""Which split count and tile shape make MLA decode attention stream fastest on this GPU?

The MLA decode kernel (triton_attn.py) serves 16 query heads from one 576-wide latent row per
token. Two knobs set its speed: how many programs the batch is split into (the backend's
`target_programs`: programs per multiprocessor, which set the split cap), and the
kernel's tile (`_decode_config`: tokens per tile, warps, pipeline stages); at batch 1 and short
context the floor on a split's length (`min_split_tokens`) sets the split count. Each split also writes
a [16, 512] float32 partial output (32 KB) that the merge reads back, so splits cost bytes as well
as buying parallelism. This times every combination on scripts/bench_attention.py's harness at
batch 1 (context 160 and 4k), 32 and 128 (4k and 16k), and prints each case's best against the
current choice.
Run on a GPU: `python scripts/tune_mla_decode.py`.
"""

import itertools
import sys

import torch

sys.path.insert(0, ".")
from scripts.bench_attention import DEEPSEEK_V2_LITE, bench_case, kv_bytes_per_layer  # noqa: E402

import nano.triton_attn as triton_attn  # noqa: E402
from nano.bench_latency import measure_copy_bandwidth  # noqa: E402

CASES = [(1, 160), (1, 4096), (32, 4096), (32, 16384), (128, 4096), (128, 16384)]
PROGRAMS_PER_SM = (1, 2, 4, 8)
MIN_SPLIT_TOKENS = (16, 32, 56)  # tried at batch 1 only, where the split cap is not what binds
TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (16, 4, 2)]  # BLOCK_N, warps, stages


def main():
    copy_gbps = measure_copy_bandwidth("cuda") / 1e9
    # the current choice at batch > 1 (programs per SM) and at batch 1 (min split tokens: one tile)
    block_n, num_warps, num_stages, per_sm = triton_attn._decode_config(576)
    tile = (block_n, num_warps, num_stages)
    current = ((per_sm, tile), (block_n, tile))
    knob_name = ("programs/SM", "min split tokens")
    num_sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    print(f"MLA decode, bf16, {torch.cuda.get_device_name()}, copy {copy_gbps:.0f} GB/s; current: "
          f"{current[0][0]} programs/SM, {current[1][0]} min split tokens, tile {current[0][1]}\n")
    print("| batch | context | programs/SM (batch 1: min split tokens) | BLOCK_N, warps, stages | splits | us | of copy |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    original = triton_attn._decode_config
    for batch_size, context in CASES:
        nbytes = kv_bytes_per_layer(DEEPSEEK_V2_LITE, batch_size, context, True)
        results = []
        knob = MIN_SPLIT_TOKENS if batch_size == 1 else PROGRAMS_PER_SM
        for value, tile in itertools.product(knob, TILES):
            triton_attn._decode_config = lambda k_dim, tile=tile: (*tile, per_sm) if k_dim > 256 else original(k_dim)

            def configure(backend, value=value):
                if batch_size == 1:
                    backend.min_split_tokens = value
                else:
                    backend.target_programs = value * num_sms

            try:
                us, splits = bench_case(DEEPSEEK_V2_LITE, True, batch_size, context, configure)
            except Exception as e:  # a tile that does not fit shared memory
                print(f"| {batch_size} | {context} | {value} | {tile} | | failed: {type(e).__name__} | |")
                continue
            fraction = nbytes / us / 1e3 / copy_gbps
            results.append((us, value, tile))
            print(f"| {batch_size} | {context} | {value} | {tile} | {splits} | {us:.1f} | {fraction:.0%} |", flush=True)
            torch.cuda.empty_cache()
        us, value, tile = min(results)
        now = next(r for r in results if (r[1], r[2]) == current[batch_size == 1])
        print(f"best at batch {batch_size}, context {context}: {knob_name[batch_size == 1]} {value}, tile {tile}, {us:.1f} us "
              f"({nbytes / us / 1e3 / copy_gbps:.0%}); current {now[0]:.1f} us ({nbytes / now[0] / 1e3 / copy_gbps:.0%})")
    triton_attn._decode_config = original


if __name__ == "__main__":
    main()
