"""Offline throughput: many requests queued at once, how many output tokens per second come out.

    python -m nano.bench_throughput --model llama-3-8b --load-format dummy --num-prompts 256

The workload is nano-vllm's bench.py: `--num-prompts` requests of random token ids, input and
output lengths drawn uniformly from their ranges (100..1024 by default), EOS ignored so every
request produces exactly its output length, all queued before the first step. The engine's
continuous batching then decides everything: how many prompts each prefill takes, how large
the decode batch grows as the KV pool allows, when finished requests make room for waiting ones.
Output tokens / wall time is the number that says how well that goes.

In the same run it times a peer on the same model shape (random weights, always): HF transformers'
continuous-batching `generate_batch`, on the first `--peer-prompts` requests (it is much slower; on
a GPU only: on CPU it took 29 s for two requests of 6 tokens).
It takes one output length for all requests, so it gets the mean of theirs; both sides count
the tokens they actually produced.

torch is imported inside the functions, not at the top: see cli.py.
"""

import time

from nano.cli import ArgumentParser, UsageError, add_engine_args, build_engine, cli, resolve_model_or_shape


def random_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                    seed: int) -> list[tuple[list[int], int]]:
    """-> [(prompt ids, output length)], lengths uniform in each inclusive range."""
    import torch

    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(num):
        n_in = int(torch.randint(input_range[0], input_range[1] + 1, (1,), generator=g))
        n_out = int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=g))
        requests.append((torch.randint(10, vocab, (n_in,), generator=g).tolist(), n_out))
    return requests


def run_nano(engine, requests) -> tuple[int, float]:
    """-> (output tokens, seconds) for all requests queued at once."""
    import torch

    from nano.sampling import SamplingParams

    for prompt, n_out in requests:
        engine.add_request(prompt, SamplingParams(max_new_tokens=n_out, ignore_eos=True))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += len(engine.step())
    return produced, time.perf_counter() - started


def run_hf_peer(model_dir, requests, dtype, device) -> tuple[int, float]:
    """HF transformers' continuous batching on the same model shape, with its own random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    mean_out = round(sum(n for _, n in requests) / len(requests))
    config = GenerationConfig(max_new_tokens=mean_out, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompts = [prompt for prompt, _ in requests]
    model.generate_batch(prompts[:2], generation_config=config)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config)
    seconds = time.perf_counter() - started
    return sum(len(out.generated_tokens) for out in outputs.values()), seconds


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m nano.bench_throughput", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model folder or shipped shape; default: llama-3-8b on a GPU, smollm2-135m on CPU")
    p.add_argument("--num-prompts", type=int, default=256, help="requests, all queued at once")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX]")
    p.add_argument("--peer-prompts", type=int, default=64,
                   help="requests for the HF transformers peer, on a GPU only (0: no peer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    add_engine_args(p)
    return p


def run(args):
    import torch

    if args.num_prompts < 1 or args.peer_prompts < 0 or not 0 <= args.seed < 2**63:
        raise UsageError("--num-prompts must be >= 1, --peer-prompts >= 0, --seed in [0, 2^63)")
    for flag, (low, high) in [("--input-len", args.input_len), ("--output-len", args.output_len)]:
        if not 1 <= low <= high:
            raise UsageError(f"{flag} {low} {high}: need 1 <= MIN <= MAX")
    engine = build_engine(args, model_dir := resolve_model_or_shape(args, default_shape=True))
    longest = args.input_len[1] + args.output_len[1]
    if longest > engine.context_length:  # else the engine cuts requests short, and the count is of fewer tokens
        raise UsageError(f"the longest request, {args.input_len[1]} + {args.output_len[1]} tokens, does not fit "
                         f"the context of {engine.context_length} tokens")
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, engine.cfg.vocab_size, args.seed)
    shortest = (args.input_len[0],) * 2, (min(args.output_len[0], 8),) * 2  # a warm-up that fits where they do
    run_nano(engine, random_requests(4, *shortest, engine.cfg.vocab_size, args.seed + 1))
    engine.stats.update(dict.fromkeys(engine.stats, 0))  # in place: the scheduler counts into it too
    tokens, seconds = run_nano(engine, requests)
    s = engine.stats
    print(f"nano: {len(requests)} requests, {sum(len(r) for r, _ in requests)} input tokens, {tokens} output tokens "
          f"in {seconds:.2f} s = {tokens / seconds:,.0f} output tok/s "
          f"(prefill {s['prefill_s']:.2f} s in {s['prefill_steps']} steps at "
          f"{s['prefill_tokens'] / max(s['prefill_s'], 1e-9):,.0f} tok/s, decode {s['decode_s']:.2f} s in "
          f"{s['decode_steps']} steps at {s['decode_tokens'] / max(s['decode_s'], 1e-9):,.0f} tok/s)", flush=True)
    if args.peer_prompts and engine.device.type != "cuda":
        print("HF transformers generate_batch: not timed on CPU, where it is far too slow (--peer-prompts 0: no peer)")
    elif args.peer_prompts:
        del engine
        torch.cuda.empty_cache()
        peer_requests = requests[: args.peer_prompts]
        peer_tokens, peer_seconds = run_hf_peer(model_dir, peer_requests, getattr(torch, args.dtype or "bfloat16"),
                                                args.device)
        print(f"HF transformers generate_batch: {len(peer_requests)} requests, {peer_tokens} output tokens in "
              f"{peer_seconds:.2f} s = {peer_tokens / peer_seconds:,.0f} output tok/s")
        print(f"nano / HF: {(tokens / seconds) / (peer_tokens / peer_seconds):.2f}x")


def main(argv=None):
    cli(build_parser, run, argv)


if __name__ == "__main__":
    main()
