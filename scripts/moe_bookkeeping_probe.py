"""DeepSeek-V2-Lite's MoE bookkeeping on the GPU, per layer: the router (ops.route, at each tokens-per-
program of its logits kernel) and the pairs' alignment (align_pairs_by_expert) against the torch
sort it replaced (argsort, searchsorted, gathers, a scatter), at decode and prefill sizes.
Each is timed in a CUDA graph of 26 calls, one per MoE layer, each with its own inputs. With
--against DIR, also the alignment of another tree's nano/ (DIR/nano/moe_kernels.py, e.g. a
`git archive` of an older commit), checked equal to this one.
Usage: python scripts/moe_bookkeeping_probe.py [--against DIR]"""

import importlib.util
import sys

import torch

sys.path.insert(0, ".")
from nano import moe_kernels  # noqa: E402
from nano.moe_kernels import align_pairs_by_expert, fused_moe_config  # noqa: E402

E, SHARED, TOP_K, HIDDEN, LAYERS = 64, 2, 6, 2048, 26


def us_per_call(calls) -> float:
    for call in calls:  # compile and warm up
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 20 / len(calls)


def align_with_torch(expert_ids, num_experts, block_m):
    pair_expert, num_pairs = expert_ids.flatten(), expert_ids.numel()
    max_blocks = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    order = pair_expert.argsort(stable=True)
    sorted_experts = pair_expert[order]
    experts = torch.arange(num_experts, device=pair_expert.device)
    first = torch.searchsorted(sorted_experts, experts)
    count = torch.searchsorted(sorted_experts, experts, right=True) - first
    padded = (count + block_m - 1) // block_m * block_m
    rank = torch.arange(num_pairs, device=pair_expert.device) - first[sorted_experts]
    sorted_pair_ids = pair_expert.new_full((max_blocks * block_m,), num_pairs)
    sorted_pair_ids[(padded.cumsum(0) - padded)[sorted_experts] + rank] = order
    expert_or_none = torch.cat([pair_expert, pair_expert.new_full((1,), -1)])
    return sorted_pair_ids, expert_or_none[sorted_pair_ids[::block_m]]


def other_tree_align(directory: str):
    spec = importlib.util.spec_from_file_location("other_moe_kernels", f"{directory}/nano/moe_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.align_pairs_by_expert


def main():
    torch.manual_seed(0)
    other = other_tree_align(sys.argv[sys.argv.index("--against") + 1]) if "--against" in sys.argv else None
    for tokens in (1, 8, 32, 64, 128, 160, 256, 2048, 20480):
        x = [torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        w = [torch.randn(E, HIDDEN, device="cuda") / 50 for _ in range(LAYERS)]
        router = []
        for block_t in (2, 4, 8, 16):
            moe_kernels.ROUTER_BLOCK_T = block_t
            calls = [lambda x=x, w=w: moe_kernels.route(x, w, TOP_K, False, 1.0, SHARED) for x, w in zip(x, w)]
            router.append(f"{block_t} tokens a program {us_per_call(calls):.1f}")
        ids = [moe_kernels.route(x, w, TOP_K, False, 1.0, SHARED)[1] for x, w in zip(x, w)]
        block_m = fused_moe_config(tokens, TOP_K, E, SHARED)["BLOCK_M"]
        kernel = us_per_call([lambda i=i: align_pairs_by_expert(i, E + SHARED, block_m) for i in ids])
        torch_sort = us_per_call([lambda i=i: align_with_torch(i, E + SHARED, block_m) for i in ids])
        for i in ids[:2]:
            assert all(torch.equal(a, b) for a, b in zip(align_pairs_by_expert(i, E + SHARED, block_m),
                                                         align_with_torch(i, E + SHARED, block_m)))
        line = f"alignment: kernel {kernel:.1f} us, torch {torch_sort:.1f} us"
        if other is not None:
            assert all(torch.equal(a, b) for a, b in zip(other(ids[0], E + SHARED, block_m),
                                                         align_with_torch(ids[0], E + SHARED, block_m)))
            line += f", the other tree {us_per_call([lambda i=i: other(i, E + SHARED, block_m) for i in ids]):.1f} us"
        print(f"{tokens:6d} tokens | router (us a layer): {'; '.join(router)} | {line}", flush=True)


if __name__ == "__main__":
    main()
