"""Time fused_moe_matmul's tile sizes on this GPU, for DeepSeek-V2-Lite's experts, at the token
counts a MoE layer sees (decode batches and prefill), and print the fastest per count beside the
one nano uses now. Usage: python scripts/tune_fused_moe.py [TOKENS ...]

Each case is one layer's routed experts: the up/gate product (N = 2 * 1408, K = 2048) and the down
product (N = 2048, K = 1408), with random routing (6 of 64 experts per token). The bandwidth column
is the bytes of the experts the routing touched, read once, over the time of both products.
"""

import itertools
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, ".")
from nano.moe_kernels import align_pairs_by_expert, expert_matvec, fused_moe_config, fused_moe_matmul  # noqa: E402

E, TOP_K, HIDDEN, INTER = 64, 6, 2048, 1408
counts = [int(a) for a in sys.argv[1:]] or [4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 256, 1024, 8192]
torch.manual_seed(0)
w13 = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 50
w2 = torch.randn(E, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / 50
candidates = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
              for m, n, k, w, s in itertools.product([16, 32, 64], [64, 128], [64, 128, 256], [4, 8], [3, 4])
              if not (m == 64 and k == 256)]


def graph_time(run) -> float:
    """Milliseconds of one run, replayed as a CUDA graph (as decode runs it: no launch overhead)."""
    run()  # compiles the kernels outside the capture
    return do_bench_cudagraph(run, rep=20)


def layer_time(x, h, ids, weights, config) -> float:
    """Milliseconds of both products (and the pairs' alignment) for one layer."""
    def run():
        pairs = align_pairs_by_expert(ids, E, config["BLOCK_M"])
        fused_moe_matmul(x, w13, *pairs, config, pairs_per_row=TOP_K)
        fused_moe_matmul(h, w2, *pairs, config, pair_weights=weights)
    return graph_time(run)


def matvec_time(x, h, ids) -> float:
    """Milliseconds of the mat-vec form's two products for one layer."""
    def run():
        expert_matvec(x, w13, ids)
        expert_matvec(h.view(*ids.shape, INTER), w2, ids)
    return graph_time(run)


print(f"{torch.cuda.get_device_name()}; {len(candidates)} candidate tile sizes")
for tokens in counts:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(tokens * TOP_K, INTER, device="cuda", dtype=torch.bfloat16)  # the down product's input
    ids = torch.rand(tokens, E, device="cuda").topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, device="cuda")
    touched = ids.unique().numel()
    gigabytes = touched * (w13[0].numel() + w2[0].numel()) * 2 / 1e9
    current = fused_moe_config(tokens, TOP_K, E)
    results = []
    for config in candidates:
        try:
            results.append((layer_time(x, h, ids, weights, config), config))
        except (triton.runtime.errors.OutOfResources, RuntimeError):
            continue  # the tiles do not fit this GPU's shared memory or registers
    results.sort(key=lambda r: r[0])
    now = layer_time(x, h, ids, weights, current)
    print(f"T={tokens:5d}: now {now * 1e3:7.1f} us ({gigabytes / now:5.2f} TB/s) {current}")
    if tokens <= 16:
        mv = matvec_time(x, h, ids)
        print(f"       matvec {mv * 1e3:7.1f} us ({gigabytes / mv:5.2f} TB/s)")
    for ms, config in results[:3]:
        print(f"         best {ms * 1e3:7.1f} us ({gigabytes / ms:5.2f} TB/s) {config}")
    sys.stdout.flush()
