"""Prefix cache and chunked prefill, each measured with and without it in one run.

    python scripts/prefix_bench.py --model llama-3-8b --load-format dummy
    python scripts/prefix_bench.py --model smollm2-135m --load-format dummy --device cpu \\
        --prefix-len 64 --suffix-len 8 --num-requests 8 --long-len 256 --num-running 4 --chunk-sizes 64

(a) shared prefix: `num_requests` prompts share a `prefix_len`-token prefix and end in
    `suffix_len` unique tokens; each asks for one token, so every step is a prefill. A round of
    different random prompts runs first, untimed (kernels compile). Then the first request of
    the timed round runs alone, untimed: it puts the prefix in the cache (as an earlier user of
    the same system prompt would have). The clock covers the prefill steps of the other
    num_requests - 1, submitted together. Without the radix cache the same steps compute every
    token of every prompt. Chunked prefill is as the flags say, the same in both runs.
(b) long prompt: `num_running` requests decode; a `long_len`-token prompt arrives. Each running
    request's token times are recorded from its last token before the arrival until the long
    prompt's first token and a few steps more; the largest gap between two consecutive tokens
    is the stall its user sees. Reported with it: the long prompt's time to first token (what
    chunking costs it). The round runs twice per setting and the second is reported.

Dummy weights do not care about the trained context length, so a long prompt beyond the model's
gets a copy of its config with the context raised.
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
from nano.cli import add_engine_args, build_engine, resolve_model_or_shape  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_tokens(g, n, vocab):
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def build(args, model_dir, **overrides):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return build_engine(argparse.Namespace(**(vars(args) | overrides)), model_dir)


def shared_prefix_round(engine, args, seed) -> tuple[float, int, int]:
    """-> (seconds, prompt tokens, of which cached) of the timed requests' prefill."""
    g, vocab = torch.Generator().manual_seed(seed), engine.cfg.vocab_size
    prefix = random_tokens(g, args.prefix_len, vocab)
    prompts = [prefix + random_tokens(g, args.suffix_len, vocab) for _ in range(args.num_requests)]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts[:1], one)  # warms the cache with the prefix; not timed
    before = dict(engine.stats)
    sync(engine.device)
    started = time.perf_counter()
    engine.generate(prompts[1:], one)
    sync(engine.device)
    return (time.perf_counter() - started, engine.stats["prefill_tokens"] - before["prefill_tokens"],
            engine.stats["cached_tokens"] - before["cached_tokens"])


def long_prompt_round(engine, args, seed) -> tuple[float, float, float]:
    """-> (largest inter-token gap of a running request, median gap, long prompt's time to first token)."""
    g, vocab = torch.Generator().manual_seed(seed), engine.cfg.vocab_size
    chunk = engine.scheduler.prefill_budget if engine.scheduler.chunking else args.long_len
    warm_steps, after_steps = 4, 4
    # enough tokens to keep decoding through every chunk step and the decode step after each
    params = SamplingParams(max_new_tokens=warm_steps + 2 * -(-args.long_len // chunk) + after_steps + 2, ignore_eos=True)
    running = [engine.add_request(random_tokens(g, args.running_len, vocab), params) for _ in range(args.num_running)]
    while len(engine.scheduler.running) < len(running):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    sync(engine.device)
    arrived = time.perf_counter()
    last = {r.rid: arrived for r in running}  # their last token came just now
    long = engine.add_request(random_tokens(g, args.long_len, vocab), SamplingParams(max_new_tokens=after_steps, ignore_eos=True))
    gaps, first_token = [], None
    while not long.finished:
        events = engine.step()
        sync(engine.device)
        now = time.perf_counter()
        for req, _ in events:
            if req is long:
                first_token = first_token or now
            else:
                gaps.append(now - last[req.rid])
                last[req.rid] = now
    while engine.has_work():  # let the running requests finish, untimed
        engine.step()
    return max(gaps), sorted(gaps)[len(gaps) // 2], first_token - arrived


def with_context(model_dir: Path, needed: int, scratch: Path) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    if config["max_position_embeddings"] >= needed:
        return model_dir
    config["max_position_embeddings"] = needed
    (scratch / "config.json").write_text(json.dumps(config))
    return scratch


def main(argv=None):
    p = argparse.ArgumentParser(prog="python scripts/prefix_bench.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=100)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--long-len", type=int, default=16384)
    p.add_argument("--num-running", type=int, default=64)
    p.add_argument("--running-len", type=int, default=128, help="prompt tokens of each running request")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[8192, 2048], help="chunked prefill sizes for (b)")
    p.add_argument("--only", choices=["a", "b"], default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    model_dir = resolve_model_or_shape(args)

    if args.only in (None, "a"):
        pool = 2 * (args.prefix_len + args.num_requests * (args.suffix_len + 1))  # two rounds' worth
        print(f"(a) shared prefix: {args.num_requests - 1} requests timed, each {args.prefix_len} shared + "
              f"{args.suffix_len} unique tokens, after one untimed request that warms the cache", flush=True)
        for radix in (False, True):
            engine = build(args, model_dir, disable_radix_cache=not radix, max_total_tokens=args.max_total_tokens or pool,
                           disable_cuda_graph=True)  # every step is a prefill
            shared_prefix_round(engine, args, seed=0)  # kernels compile
            seconds, tokens, cached = shared_prefix_round(engine, args, seed=1)
            print(f"  radix cache {'on ' if radix else 'off'}: prefill {tokens:,} tokens, {cached:,} from the "
                  f"prefix cache, {tokens - cached:,} computed, in {seconds:.3f} s", flush=True)
            del engine

    if args.only in (None, "b"):
        context = args.running_len + args.long_len + 64
        pool = args.num_running * (args.running_len + 4 * args.long_len // min(args.chunk_sizes) + 64) + args.long_len + 64
        print(f"(b) long prompt: {args.long_len} tokens arrive while {args.num_running} requests decode", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            folder = with_context(model_dir, context, Path(scratch))
            for chunk in [0, *args.chunk_sizes]:
                engine = build(args, folder, chunked_prefill_size=chunk, max_total_tokens=args.max_total_tokens or pool,
                               max_running_requests=max(args.max_running_requests, args.num_running + 1))
                long_prompt_round(engine, args, seed=0)  # kernels compile, graphs warm
                worst, median, ttft = long_prompt_round(engine, args, seed=1)
                label = f"chunked prefill {chunk}" if chunk > 0 else "chunked prefill off"
                print(f"  {label:>21}: running requests' largest inter-token gap {worst * 1e3:9.1f} ms "
                      f"(median {median * 1e3:.1f} ms); long prompt's first token after {ttft * 1e3:.1f} ms", flush=True)
                del engine


if __name__ == "__main__":
    main()
