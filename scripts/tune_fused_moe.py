"""Time the MoE kernels' tile sizes on this GPU, for DeepSeek-V2-Lite's experts, at the token counts
a MoE layer sees (decode batches and prefill), and print the fastest beside the ones nano uses now.
Usage: python scripts/tune_fused_moe.py [--sweep] [TOKENS ...] (without --sweep: only nano's tiles)

Each case is one layer's experts: 6 of 64 routed experts per token, at random, plus the 2 shared
ones every token uses (moe_kernels.py), each of width 1408 on hidden 2048. Up to 8 tokens both
forms are timed (nano runs the mat-vec form, gate_up_matvec then down_matvec, up to 4); from 16
only the grouped matmul (the up/gate
product, N = 2 * 1408, K = 2048, and the down product, N = 2048, K = 1408, with the pairs'
alignment). The bandwidth column is the bytes of the experts the routing touched, read once, over
the time of both products.
"""

import itertools
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from nano import moe_kernels  # noqa: E402
from nano.moe_kernels import align_pairs_by_expert, fused_moe_config, fused_moe_matmul  # noqa: E402

E, SHARED, TOP_K, HIDDEN, INTER = 64, 2, 6, 2048, 1408
SLOTS = TOP_K + SHARED
sweep = "--sweep" in sys.argv
counts = [int(a) for a in sys.argv[1:] if a != "--sweep"] or [1, 2, 4, 8, 16, 32, 64, 128, 160, 256, 1024, 8192]
torch.manual_seed(0)
gate_up = (torch.randn(2 * (E + SHARED) * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 50).view(
    2, E + SHARED, INTER, HIDDEN)
down = (torch.randn(HIDDEN, (E + SHARED) * INTER, device="cuda", dtype=torch.bfloat16) / 50).view(
    HIDDEN, E + SHARED, INTER).transpose(0, 1)
fused_candidates = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                    for m, n, k, w, s in itertools.product([16, 32, 64], [64, 128], [64, 128, 256], [4, 8], [3, 4])
                    if not (m == 64 and k == 256)]
matvec_candidates = [dict(GATE_UP_BLOCK_N=gn, GATE_UP_BLOCK_K=gk, DOWN_TILE=down, ONE_TOKEN_DOWN_TILE=down)
                     for (gn, gk), down in itertools.product(
                         [(8, 256), (16, 256), (32, 256), (16, 128), (16, 512), (4, 512), (8, 512), (4, 1024)],
                         [(4, 128, 4), (8, 128, 4), (16, 128, 4), (8, 64, 4), (8, 256, 4), (8, 256, 8), (4, 256, 4),
                          (16, 256, 8), (4, 512, 4), (2, 512, 4)])]


def graph_time(run) -> float:
    """Milliseconds of one run, replayed as a CUDA graph (as decode runs it: no launch overhead)."""
    run()  # compiles the kernels outside the capture
    return do_bench_cudagraph(run, rep=20)


def fused_time(x, h, ids, weights, config) -> float:
    """Milliseconds of both grouped products (and the pairs' alignment) for one layer."""
    def run():
        pairs = align_pairs_by_expert(ids, E + SHARED, config["BLOCK_M"])
        fused_moe_matmul(x, gate_up, *pairs, config, pairs_per_row=SLOTS)
        fused_moe_matmul(h, down, *pairs, config, pair_weights=weights)
    return graph_time(run)


def matvec_time(x, ids, weights, tiles) -> float:
    """Milliseconds of the mat-vec form's two kernels for one layer, with these tile sizes."""
    for name, value in tiles.items():
        setattr(moe_kernels, name, value)

    def run():
        moe_kernels.down_matvec(moe_kernels.gate_up_matvec(x, gate_up, ids), down, ids, weights)
    return graph_time(run)


def report(tokens, gigabytes, now, now_tiles, results):
    print(f"T={tokens:5d}: now {now * 1e3:7.1f} us ({gigabytes / now:5.2f} TB/s) {now_tiles}")
    for ms, config in sorted(results, key=lambda r: r[0])[:3]:
        print(f"         best {ms * 1e3:7.1f} us ({gigabytes / ms:5.2f} TB/s) {config}")
    sys.stdout.flush()


def timed(measure, candidates) -> list:
    results = []
    for config in candidates if sweep else []:
        try:
            results.append((measure(config), config))
        except (triton.runtime.errors.OutOfResources, RuntimeError):
            continue  # the tiles do not fit this GPU's shared memory or registers
    return results


print(f"{torch.cuda.get_device_name()}; {len(matvec_candidates)} mat-vec and {len(fused_candidates)} grouped tilings")
matvec_now = {name: getattr(moe_kernels, name) for name in matvec_candidates[0]}
for tokens in counts:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    routed = torch.rand(tokens, E, device="cuda").topk(TOP_K, dim=-1).indices
    ids = torch.cat([routed, torch.arange(E, E + SHARED, device="cuda").expand(tokens, -1)], dim=1)
    weights = torch.rand(tokens, SLOTS, device="cuda")
    gigabytes = ids.unique().numel() * 3 * INTER * HIDDEN * 2 / 1e9
    h = torch.randn(tokens * SLOTS, INTER, device="cuda", dtype=torch.bfloat16)  # the down product's input
    current = fused_moe_config(tokens, TOP_K, E, SHARED)
    if tokens <= 8:  # the mat-vec form runs; the grouped one beside it, with nano's tiles
        now = matvec_time(x, ids, weights, matvec_now)
        report(tokens, gigabytes, now, matvec_now, timed(lambda t: matvec_time(x, ids, weights, t), matvec_candidates))
        for name, value in matvec_now.items():  # nano's tiles back
            setattr(moe_kernels, name, value)
        print(f"       grouped {fused_time(x, h, ids, weights, current) * 1e3:7.1f} us {current}")
    else:
        now = fused_time(x, h, ids, weights, current)
        report(tokens, gigabytes, now, current, timed(lambda c: fused_time(x, h, ids, weights, c), fused_candidates))
