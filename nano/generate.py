"""The command line: `python -m nano.generate --prompt "What is the capital of France?"`.

This is where a reader starts. `main` parses flags, resolves the model folder (fetching the
embedded default on first use), turns prompts into token ids with the tokenizer and chat template,
and hands them to the engine (engine.py), which batches them. Tokens come back step by step:
- one prompt: its completion streams to stdout as tokens arrive;
- several prompts: each completion is printed, in prompt order, as soon as it and every one
  before it are done, under a `--- prompt i ---` line.
stdout holds only generated text (and those separators); progress and stats go to stderr.
Bad input ends with a one-line `error: ...` and exit status 2, never a traceback.
"""

import argparse
import sys
from pathlib import Path

import torch

from nano.config import ConfigError, load_config
from nano.loader import WeightError
from nano.sampling import SamplingParams

SHIPPED_CONFIGS = Path(__file__).parent / "configs"  # config.json of known shapes, for --load-format dummy


class UsageError(Exception):
    """Bad flags or input; the message is shown as one line."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m nano.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model folder, or a shipped shape name "
                   f"({', '.join(sorted(d.name for d in SHIPPED_CONFIGS.iterdir()))}); "
                   "default: the embedded SmolLM2-135M-Instruct, fetched on first use")
    p.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                   help="dummy: random weights in the model's real shapes")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    p.add_argument("--prompt-file", help="a file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-chat-template", action="store_true", help="send the raw prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    add_engine_args(p)
    return p


def add_engine_args(p: argparse.ArgumentParser):
    """Flags shared with bench_latency."""
    has_cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if has_cuda else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                   help="default: triton on GPU, torch on CPU")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="fraction of free device memory (after weights) for the KV cache")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens (overrides --mem-fraction)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's")
    p.add_argument("--disable-mla", action="store_true", help="DeepSeek: plain multi-head attention, expanded K/V")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=160)
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism: split the model over this many GPUs")


def resolve_model(name: str | None, load_format: str) -> Path:
    """--model value -> a folder holding config.json."""
    if name is None:
        from nano.default_model import ensure_default_model

        return ensure_default_model()
    if (SHIPPED_CONFIGS / name).is_dir() and not Path(name).exists():
        if load_format != "dummy":
            raise UsageError(f"{name!r} is a shipped shape without weights: add --load-format dummy, "
                             "or pass a model folder")
        return SHIPPED_CONFIGS / name
    path = Path(name)
    if not path.is_dir():
        raise UsageError(f"model folder {name} does not exist")
    return path


def engine_from_args(args, model_dir: Path):
    from nano.engine import Engine

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available")
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    for flag, value, low in [("--mem-fraction", args.mem_fraction, 0), ("--max-total-tokens", args.max_total_tokens, 0),
                             ("--max-running-requests", args.max_running_requests, 0),
                             ("--context-length", args.context_length, 1), ("--cuda-graph-max-bs", args.cuda_graph_max_bs, 0),
                             ("--tp-size", args.tp_size, 0)]:
        if value is not None and value <= low:
            raise UsageError(f"{flag} must be > {low}, got {value}")
    if args.mem_fraction >= 1:
        raise UsageError(f"--mem-fraction must be below 1, got {args.mem_fraction}")
    backend = args.attention_backend or ("triton" if on_gpu else "torch")
    return Engine(
        model_dir, device=device, dtype=dtype, attention_backend=backend,
        load_format=args.load_format, mem_fraction=args.mem_fraction, max_total_tokens=args.max_total_tokens,
        max_requests=args.max_running_requests, context_length=args.context_length,
        use_mla=not args.disable_mla, cuda_graph=on_gpu and backend == "triton" and not args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs, tp_size=args.tp_size,
    )


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
    if not prompts:
        raise UsageError("no prompt: give --prompt TEXT or --prompt-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise UsageError(f"prompt {i + 1} is empty")
    return prompts


def run(args):
    from nano.tokenizer import StreamDecoder, Tokenizer, TokenizerError

    prompts = read_prompts(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    model_dir = resolve_model(args.model, args.load_format)
    load_config(model_dir)  # a broken folder fails fast, before the tokenizer and the weights
    try:
        tokenizer = Tokenizer(model_dir)
    except TokenizerError as e:
        if args.load_format != "dummy":
            raise
        raise UsageError(f"{e}; a shipped shape has no tokenizer: time it with python -m nano.bench_latency") from None
    engine = engine_from_args(args, model_dir)
    stop_ids = set(tokenizer.eos_token_ids) | set(engine.cfg.eos_token_ids)
    requests = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode_prompt(prompt, use_chat_template=not args.no_chat_template)
        try:
            requests.append(engine.add_request(ids, params, stop_ids))
        except ValueError as e:
            raise UsageError(f"prompt {i + 1}: {e}") from None
    print(f"{len(requests)} prompt(s), {sum(len(r.prompt_ids) for r in requests)} prompt tokens", file=sys.stderr)

    decoders = {r.rid: StreamDecoder(tokenizer, r.prompt_ids) for r in requests}
    texts = {r.rid: [] for r in requests}
    next_to_print = 0
    while engine.has_work():
        for req, token in engine.step():
            piece = decoders[req.rid].push(token)
            if len(requests) == 1:
                sys.stdout.write(piece)
                sys.stdout.flush()
            else:
                texts[req.rid].append(piece)
        while len(requests) > 1 and next_to_print < len(requests) and requests[next_to_print].finished:
            req = requests[next_to_print]
            sys.stdout.write(f"--- prompt {next_to_print + 1} ---\n{''.join(texts[req.rid])}\n")
            sys.stdout.flush()
            next_to_print += 1
    if len(requests) == 1:
        sys.stdout.write("\n")
    s = engine.stats
    print(f"prefill: {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s "
          f"({s['prefill_tokens'] / max(s['prefill_s'], 1e-9):.1f} tok/s); "
          f"decode: {s['decode_tokens']} tokens in {s['decode_s']:.3f} s "
          f"({s['decode_tokens'] / max(s['decode_s'], 1e-9):.1f} tok/s)", file=sys.stderr)


def main(argv=None):
    from nano.cuda_graph_runner import GraphCaptureError
    from nano.default_model import DefaultModelError
    from nano.tokenizer import TokenizerError

    try:
        args = build_parser().parse_args(argv)
        run(args)
    except (UsageError, ConfigError, WeightError, TokenizerError, DefaultModelError, GraphCaptureError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
