"""Decode attention micro-benchmark: how close the split-KV kernels come to the memory bandwidth.

A decode step reads every cached key and value of every request once and does about two flops per
byte read, so its speed limit is memory bandwidth: time >= KV bytes / bandwidth. This measures the
Triton backend's decode (KV store + split stage + merge stage) in bfloat16 for the Llama-3-8B shape
(32 query heads on 8 KV heads of 128) and the DeepSeek-V2 MLA shape (16 heads on one 576-wide
latent row whose first 512 channels are the value), at batch 1/32/128 and context 1k/4k/16k, and
prints a markdown table: time per layer, KV bytes read, achieved GB/s and the fraction of the
device's copy bandwidth, measured at start.

Like the engine, it captures a decode step over many layers in a CUDA graph and replays it: small
cases get enough layers that their KV (hundreds of MB) cannot sit in the 60 MB L2 cache between
replays, so the numbers are DRAM numbers, and launch gaps inside the graph count, as they do in a
real step. Every token sits in a random pool slot. Run on a GPU: `python scripts/bench_attention.py`.
"""

import contextlib
import sys

import torch
import triton

sys.path.insert(0, ".")
from nano.bench_latency import measure_copy_bandwidth  # noqa: E402
from nano.config import parse_config  # noqa: E402
from nano.forward_batch import ForwardBatch  # noqa: E402
from nano.kv_cache import KVPool, kv_bytes_per_token  # noqa: E402
import nano.triton_attn as triton_attn  # noqa: E402
from nano.triton_attn import TritonAttnBackend  # noqa: E402

BATCH_SIZES = (1, 32, 128)
CONTEXTS = (1024, 4096, 16384)
MIN_BYTES_PER_STEP = 512 << 20  # about 8x the L2 cache
MAX_LAYERS = 256

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "num_attention_heads": 16, "intermediate_size": 10944, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
}


def kv_bytes_per_layer(raw: dict, batch_size: int, context: int, use_mla: bool) -> int:
    """Bytes of K/V one layer's decode attention must read. MLA's value lies inside its key row."""
    cfg = parse_config(dict(raw, num_hidden_layers=1))
    return batch_size * context * kv_bytes_per_token(cfg, torch.bfloat16, use_mla)


@contextlib.contextmanager
def decode_tiles(long_tile=None, short_context=None, short_tile=None):
    """Run 128-wide decode heads with these settings of triton_attn, then put them back (None: as
    shipped): the long requests' tile (`_decode_config`'s BLOCK_N, warps, stages), where the short
    requests' launch ends (`SHORT_CONTEXT`), and its tile (`SHORT_TILE`)."""
    shipped = triton_attn._decode_config, triton_attn.SHORT_CONTEXT, triton_attn.SHORT_TILE
    if long_tile is not None:
        triton_attn._decode_config = lambda k_dim: (*long_tile, 8) if k_dim <= 128 else shipped[0](k_dim)
    triton_attn.SHORT_CONTEXT, triton_attn.SHORT_TILE = short_context or shipped[1], short_tile or shipped[2]
    try:
        yield
    finally:
        triton_attn._decode_config, triton_attn.SHORT_CONTEXT, triton_attn.SHORT_TILE = shipped


def bench_case(raw: dict, use_mla: bool, batch_size: int, context: int | list[int], configure=None) -> tuple[float, int]:
    """-> (microseconds per layer, number of KV splits the backend chose for the first request).
    context: every request's length, or a list of each one's. configure(backend), when given, may
    change the backend before it runs (scripts/tune_mla_decode.py)."""
    contexts = context if isinstance(context, list) else [context] * batch_size
    layer_bytes = kv_bytes_per_layer(raw, 1, sum(contexts), use_mla)
    num_layers = max(1, min(MAX_LAYERS, triton.cdiv(MIN_BYTES_PER_STEP, layer_bytes)))
    cfg = parse_config(dict(raw, num_hidden_layers=num_layers))
    pool = KVPool(cfg, sum(contexts) + 1, torch.bfloat16, "cuda", use_mla)
    for buf in pool.k_buffers + ([] if use_mla else pool.v_buffers):
        buf.normal_()
    # Request b's tokens in random slots (slot 0 stays reserved); its new token goes in its last slot.
    slots = (torch.randperm(sum(contexts), device="cuda") + 1).to(torch.int32).split(contexts)
    req_to_token = torch.zeros(batch_size, max(contexts), dtype=torch.int32, device="cuda")
    for row, row_slots in enumerate(slots):
        req_to_token[row, : len(row_slots)] = row_slots
    batch = ForwardBatch.decode([0] * batch_size, contexts, list(range(batch_size)),
                                torch.stack([s[-1] for s in slots]), "cuda")
    backend = TritonAttnBackend(pool, req_to_token, batch_size, cfg.num_heads)
    if configure is not None:
        configure(backend)

    (kv_heads, k_dim), (_, v_dim) = pool.k_buffers[0].shape[1:], pool.v_buffers[0].shape[1:]
    q = torch.randn(batch_size, cfg.num_heads, k_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch_size, kv_heads, k_dim, dtype=torch.bfloat16, device="cuda")
    v = k[..., :v_dim] if use_mla else torch.randn(batch_size, kv_heads, v_dim, dtype=torch.bfloat16, device="cuda")

    def step():
        backend.init_forward_metadata(batch)
        for layer in range(num_layers):
            backend.forward(q, k, v, layer, batch, k_dim ** -0.5)

    step()  # compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = triton.testing.do_bench(graph.replay, return_mode="median")
    return ms * 1e3 / num_layers, int(backend.num_kv_splits[0])


def main():
    cases = [("Llama-3-8B 32q/8kv x128", LLAMA_3_8B, False), ("DeepSeek-V2 MLA 16q/1kv 576/512", DEEPSEEK_V2_LITE, True)]
    copy_gbps = measure_copy_bandwidth("cuda") / 1e9
    print(f"decode attention, bf16, one layer, {torch.cuda.get_device_name()}, copy bandwidth {copy_gbps:.0f} GB/s\n")
    print(f"| shape | batch | context | splits | time (us) | KV read (MB) | GB/s | of {copy_gbps:.0f} GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, raw, use_mla in cases:
        for batch_size in BATCH_SIZES:
            for context in CONTEXTS:
                us, splits = bench_case(raw, use_mla, batch_size, context)
                nbytes = kv_bytes_per_layer(raw, batch_size, context, use_mla)
                gbps = nbytes / us / 1e3
                print(f"| {name} | {batch_size} | {context} | {splits} | {us:.1f} | {nbytes / 1e6:.1f} | "
                      f"{gbps:.0f} | {gbps / copy_gbps:.0%} |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
