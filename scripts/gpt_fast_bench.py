"""A peer for BENCHMARKS.md: gpt-fast's Llama-3-8B decode step (bf16, random weights), timed as generate.py does.

    python scripts/gpt_fast_bench.py --model-file peers/gpt_fast_model.py --batch-size 1 64

--model-file: gpt-fast's model.py, copied verbatim from github.com/meta-pytorch/gpt-fast (formerly pytorch-labs) at
commit 6ecad9b5b6b987d17ac4303965545873d0192086 into peers/ (git-ignored): fetched public code, not part of nano.
Its attention there is FlexAttention. The functions below, the inductor settings and the sampling (temperature 0.8,
top-k 200: its benchmark defaults) are its generate.py's; decode_one_token is compiled mode="reduce-overhead",
fullgraph=True, prefill runs eager. Per batch size B, compiled afresh: caches for B rows of input_len + output_len
tokens, one random 128-token prompt repeated over the rows (as generate.py does), then 1 + --rounds generations, the
first a warm-up. Each is an untimed prefill, then output_len - 1 = 15 decode steps timed as one block (sync, steps,
sync). Printed: the median block / 15 in ms per step, and nano/bench_latency.py's bandwidth figure (weights but the
embedding table, plus the KV of B * (input_len + output_len // 2) tokens, per step, over a device copy's).
CPU test: --tiny --no-compile (no sync, no bandwidth fraction there)."""

import argparse
import importlib.util
import statistics
import sys
import time

import torch
import torch._functorch.config
import torch._inductor.config
from torch.nn.attention.flex_attention import create_block_mask

torch._inductor.config.coordinate_descent_tuning = True  # generate.py's settings
torch._inductor.config.triton.unique_kernel_names = True
torch._inductor.config.fx_graph_cache = True
torch._functorch.config.enable_autograd_cache = True
SAMPLING = {"temperature": 0.8, "top_k": 200}  # its defaults, which its README's benchmark runs use


# ---- from here to build_model: gpt-fast's generate.py (the commit above), comments and type hints left out ----
def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def logits_to_probs(logits, temperature=1.0, top_k=None):
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    return torch.nn.functional.softmax(logits, dim=-1)


def sample(logits, temperature=1.0, top_k=None):
    probs = logits_to_probs(logits[:, -1], temperature, top_k)
    return multinomial_sample_one_no_sync(probs), probs


def causal_mask(b, h, q, kv):
    return q >= kv


def prefill(model, x, input_pos, **sampling_kwargs):
    mask = create_block_mask(causal_mask, 1, 1, input_pos.shape[0], model.max_seq_length, device=x.device)
    return sample(model(mask, x, input_pos), **sampling_kwargs)[0]


def decode_one_token(model, x, input_pos, block_mask, **sampling_kwargs):
    assert input_pos.shape[-1] == 1
    block_index = input_pos // block_mask.BLOCK_SIZE[0]
    mask = block_mask[:, :, block_index]
    mask.mask_mod = block_mask.mask_mod
    mask.seq_lengths = (1, model.max_seq_length)
    return sample(model(mask, x, input_pos), **sampling_kwargs)


@torch.no_grad()
def generation(model, prompt, output_len, decode, sync, **kw):
    """generate(): prefill, then output_len - 1 decode steps; returns the seconds of the decode steps alone."""
    bs, T, dev = prompt.size(0), prompt.size(1), prompt.device
    cur = prefill(model, prompt, torch.arange(0, T, device=dev), **kw).clone().view(bs, -1)
    input_pos = torch.tensor([T], device=dev, dtype=torch.int)
    block_mask = create_block_mask(causal_mask, 1, 1, model.max_seq_length, model.max_seq_length, device=dev)
    new = []
    sync()
    started = time.perf_counter()
    for _ in range(output_len - 1):  # decode_n_tokens
        next_token, next_prob = decode(model, cur, input_pos, block_mask, **kw)
        input_pos += 1
        new.append((next_token.clone(), next_prob.clone()))  # the token and the probs, cloned as there
        cur = next_token.clone()
    sync()
    return time.perf_counter() - started


def build_model(model_file, tiny, dev):
    """gpt-fast's Transformer, bf16, random weights on dev; its file is module gpt_fast_model (dynamo needs that)."""
    spec = importlib.util.spec_from_file_location("gpt_fast_model", model_file)
    sys.modules[spec.name] = gf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gf)
    cfg = gf.ModelArgs.from_name("llama-3-8b") if not tiny else gf.ModelArgs(
        block_size=1024, n_layer=2, n_head=4, n_local_heads=2, dim=256, intermediate_size=512, vocab_size=2048)
    with torch.device("meta"):
        model = gf.Transformer(cfg)
    model = model.to_empty(device=dev).to(torch.bfloat16).eval()
    for p in model.parameters():  # nn.init runs without grad
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    return model, cfg


def main():
    global create_block_mask
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-file", default="peers/gpt_fast_model.py", help="gpt-fast's model.py")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16, help="tokens per row: 1 from prefill + the decode steps")
    p.add_argument("--rounds", type=int, default=5, help="timed generations per batch size, after one warm-up")
    p.add_argument("--no-compile", action="store_true", help="decode eagerly (the CPU test)")
    p.add_argument("--tiny", action="store_true", help="2 layers, dim 256, vocab 2048 (the CPU test)")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, cfg = build_model(args.model_file, args.tiny, dev)
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "tok_embeddings.weight")
    kv_per_token = cfg.n_layer * 2 * cfg.n_local_heads * cfg.head_dim * 2  # K and V, bf16
    sync, peak = (lambda: None), None
    if dev.type == "cuda":
        sys.path.insert(0, ".")
        from nano.bench_latency import measure_copy_bandwidth
        sync, peak = torch.cuda.synchronize, measure_copy_bandwidth(dev)
        print(f"{torch.cuda.get_device_name(dev)}: device-to-device copy {peak / 1e9:.0f} GB/s, torch {torch.__version__}")
    if not args.no_compile:
        create_block_mask = torch.compile(create_block_mask)
    print(f"gpt-fast: {cfg.n_layer} layers, dim {cfg.dim}, {dev}, compile {not args.no_compile}, {vars(args)}")
    torch.manual_seed(1234)
    for bs in args.batch_size:
        torch._dynamo.reset()  # a fresh compile (and CUDA graph pool) per batch size, as one generate.py run each
        decode = decode_one_token if args.no_compile else torch.compile(decode_one_token, mode="reduce-overhead",
                                                                        fullgraph=True)
        model.max_batch_size = model.max_seq_length = -1  # else setup_caches keeps a larger batch's caches
        with torch.device(dev):
            model.setup_caches(max_batch_size=bs, max_seq_length=args.input_len + args.output_len)
        prompt = torch.randint(0, 1024, (args.input_len,), device=dev).view(1, -1).repeat(bs, 1)
        rounds = [generation(model, prompt, args.output_len, decode, sync, **SAMPLING) for _ in range(1 + args.rounds)]
        step = statistics.median(rounds[1:]) / (args.output_len - 1)
        nbytes = weights + bs * (args.input_len + args.output_len // 2) * kv_per_token
        floor = f" = {nbytes / step / peak:.0%} of the copy bandwidth (floor {nbytes / peak * 1e3:.2f} ms)" if peak else ""
        print(f"batch {bs:3d}: {step * 1e3:.3f} ms/step, {bs / step:.0f} tok/s (warm-up, compiling: {rounds[0]:.0f} s); "
              f"{weights / 1e9:.2f} GB weights + {(nbytes - weights) / 1e9:.3f} GB KV: {nbytes / step / 1e9:.0f} GB/s"
              + floor, flush=True)


if __name__ == "__main__":
    main()
