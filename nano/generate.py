"""The command line: `python -m nano.generate --prompt "What is the capital of France?"`.

This is where a reader starts. `main` parses flags, resolves the model folder (fetching the
embedded default on first use), turns prompts into token ids with the tokenizer and chat template,
and hands them to the engine (engine.py), which batches them. Tokens come back step by step:
- one prompt: its completion streams to stdout as tokens arrive;
- several prompts: each completion is printed, in prompt order, as soon as it and every one
  before it are done, under a `--- prompt i ---` line.
stdout holds only generated text (and those separators); progress and stats go to stderr.
Bad input ends with a one-line `error: ...` and exit status 2, Ctrl-C with exit status 130, never
with a traceback. That is `cli`'s job, which bench_latency.py shares; this module imports only the
standard library at its top, so that the seconds spent importing torch happen inside `cli` too.
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

SHIPPED_CONFIGS = Path(__file__).parent / "configs"  # config.json of known shapes, for benchmarks
SHAPES = sorted(d.name for d in SHIPPED_CONFIGS.iterdir())

EXAMPLES = """examples:
  python -m nano.generate --prompt "What is the capital of France?"
  python -m nano.generate --model weights/Llama-3.1-8B-Instruct --prompt "Hello" --prompt "Bonjour"
  echo "Write a haiku about the sea." | python -m nano.generate --prompt-file - --temperature 0.8 --seed 1
"""


class UsageError(Exception):
    """Bad flags or input; the message is shown as one line."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's default (a flag whose default is None or off explains it in its own
    words) and keeps the examples' line breaks."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        super().__init__(formatter_class=HelpFormatter, **kwargs)

    def error(self, message):  # one line instead of argparse's usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m nano.generate", epilog=EXAMPLES,
                       description="Generate text with a Llama or DeepSeek-V2 model:\n"
                       "the completion on stdout, progress and statistics on stderr.")
    p.add_argument("--model", help="a Hugging Face model folder (see weights/README.md); default: the embedded "
                   "SmolLM2-135M-Instruct, fetched on first use")
    p.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    p.add_argument("--prompt-file", help="a file with one prompt per line; - reads standard input")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set of tokens whose probability reaches p")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: unseeded)")
    p.add_argument("--no-chat-template", action="store_true", help="send the raw prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    add_engine_args(p)
    return p


def add_engine_args(p: argparse.ArgumentParser):
    """Flags of every command that builds an engine: generate, the benchmarks, the server."""
    import torch

    has_cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if has_cuda else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--load-format", choices=["safetensors", "dummy"], default=None,
                   help="dummy: random weights in the real shapes (gibberish, for timing); default: dummy "
                   "for a shipped shape, else safetensors")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                   help="default: triton on GPU, torch on CPU")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="fraction of free memory (after weights) for the KV cache; on CPU at most 1 GiB")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens (overrides --mem-fraction)")
    p.add_argument("--max-running-requests", type=int, default=256, help="requests decoded together at most")
    p.add_argument("--context-length", type=int, default=None, help="tokens per request; default: the model's")
    p.add_argument("--disable-mla", action="store_true", help="DeepSeek: plain multi-head attention, expanded K/V")
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode without CUDA graphs on GPU")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch captured as a CUDA graph (default: --max-running-requests)")
    p.add_argument("--disable-radix-cache", action="store_true", help="compute every prompt in full")
    p.add_argument("--disable-overlap", action="store_true",
                   help="book each decode pass's tokens before launching the next")
    p.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="most prompt tokens one prefill step computes; longer prompts take several (0 or -1: off)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism: split the model over this many GPUs")


def shipped_shape(name: str | None) -> Path | None:
    """The config folder of a shipped shape name (unless a folder of that name exists here), else None."""
    if name in SHAPES and not Path(name).exists():
        return SHIPPED_CONFIGS / name
    return None


def resolve_model(name: str | None) -> Path:
    """--model value -> a folder holding config.json."""
    if name is None:
        from nano.default_model import ensure_default_model

        return ensure_default_model()
    if shipped_shape(name):
        raise UsageError(f"{name} is a shape for benchmarks, with no weights or tokenizer: time it with "
                         f"python -m nano.bench_latency --model {name}, or pass a model folder (weights/README.md)")
    path = Path(name)
    if not path.is_dir():
        raise UsageError(f"{name} is a file, not a model folder" if path.exists() else f"model folder {name} does not exist")
    return path


def resolve_model_or_shape(args) -> Path:
    """--model for commands that also take a shipped shape (the benchmarks, the server): a shape's
    config folder, with dummy weights unless --load-format says otherwise, or a model folder."""
    shape = shipped_shape(args.model)
    args.load_format = args.load_format or ("dummy" if shape else "safetensors")
    return shape or resolve_model(args.model)


def parse_device(name: str):
    """--device value -> a torch.device that is there to use."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: nano runs on cpu or cuda (cuda:N for the N-th GPU)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}, but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}, but there are only {torch.cuda.device_count()} CUDA devices")
    return device


def engine_from_args(args, model_dir: Path):
    import torch

    from nano.engine import Engine

    device = parse_device(args.device)
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    if on_gpu and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16; use --dtype float16")
    for flag, value, low in [("--max-total-tokens", args.max_total_tokens, 0),
                             ("--max-running-requests", args.max_running_requests, 0),
                             ("--context-length", args.context_length, 1), ("--cuda-graph-max-bs", args.cuda_graph_max_bs, 0),
                             ("--tp-size", args.tp_size, 0)]:
        if value is not None and value <= low:
            raise UsageError(f"{flag} must be > {low}, got {value}")
    if args.chunked_prefill_size < -1:
        raise UsageError(f"--chunked-prefill-size must be > 0, or 0 or -1 for off; got {args.chunked_prefill_size}")
    if not 0 < args.mem_fraction < 1:  # NaN fails this too
        raise UsageError(f"--mem-fraction must be between 0 and 1, got {args.mem_fraction}")
    backend = args.attention_backend or ("triton" if on_gpu else "torch")
    interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    if backend == "triton" and not on_gpu and not interpreted:
        raise UsageError("--attention-backend triton needs a GPU (on CPU, TRITON_INTERPRET=1 runs its kernels "
                         "in Triton's interpreter, slowly)")
    if (on_gpu or backend == "triton") and importlib.util.find_spec("triton") is None:
        raise UsageError("nano's GPU kernels are written in Triton, which is not installed: pip install triton")
    cuda_graph = on_gpu and backend == "triton" and not args.disable_cuda_graph
    if args.cuda_graph_max_bs is not None and not cuda_graph:
        raise UsageError("--cuda-graph-max-bs: CUDA graphs run only on a GPU, with the triton backend, "
                         "without --disable-cuda-graph")
    return Engine(
        model_dir, device=device, dtype=dtype, attention_backend=backend,
        load_format=args.load_format or "safetensors", mem_fraction=args.mem_fraction, max_total_tokens=args.max_total_tokens,
        max_requests=args.max_running_requests, context_length=args.context_length,
        use_mla=not args.disable_mla, cuda_graph=cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
        radix_cache=not args.disable_radix_cache, chunked_prefill_size=args.chunked_prefill_size,
        tp_size=args.tp_size, overlap=not args.disable_overlap,
    )


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text()
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError("no prompt: give --prompt TEXT or --prompt-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise UsageError(f"prompt {i + 1} is empty")
        try:  # bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes
            prompt.encode()
        except UnicodeEncodeError:
            raise UsageError(f"prompt {i + 1} is not UTF-8 text") from None
    return prompts


def run(args):
    from nano.config import load_config
    from nano.sampling import SamplingParams
    from nano.tokenizer import StreamDecoder, Tokenizer

    prompts = read_prompts(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    model_dir = resolve_model(args.model)
    load_config(model_dir)  # a broken folder fails fast, before the tokenizer and the weights
    tokenizer = Tokenizer(model_dir)
    if not args.no_chat_template and not tokenizer.has_chat_template:
        print(f"note: {model_dir} has no chat template; the prompts go to the model as raw text", file=sys.stderr)
    engine = engine_from_args(args, model_dir)
    stop_ids = set(tokenizer.eos_token_ids) | set(engine.cfg.eos_token_ids)
    requests = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode_prompt(prompt, use_chat_template=not args.no_chat_template)
        try:
            requests.append(engine.add_request(ids, params, stop_ids))
        except ValueError as e:
            raise UsageError(f"prompt {i + 1}: {e}") from None
        if requests[-1].params.max_new_tokens < params.max_new_tokens:
            print(f"note: prompt {i + 1}: the context leaves room for {requests[-1].params.max_new_tokens} new tokens",
                  file=sys.stderr)
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
    # prefill also samples each request's first token; decode makes the rest, one per step and request
    computed = s["prefill_tokens"] - s["cached_tokens"]
    print(f"prefill: {s['prefill_tokens']:,} prompt tokens, {s['cached_tokens']:,} from the prefix cache, "
          f"{computed:,} computed -> {len(requests)} first token(s) in {s['prefill_s']:.3f} s "
          f"({computed / max(s['prefill_s'], 1e-9):,.1f} tok/s); "
          f"decode: {s['decode_tokens']:,} more tokens in {s['decode_s']:.3f} s "
          f"({s['decode_tokens'] / max(s['decode_s'], 1e-9):,.1f} tok/s)", file=sys.stderr)


def one_line_errors() -> tuple[type[Exception], ...]:
    """What a command reports as one `error: ...` line with exit status 2 (imported here, not at
    the top, so that an interrupt during the heavy imports is caught like any other)."""
    from nano.config import ConfigError
    from nano.cuda_graph_runner import GraphCaptureError
    from nano.default_model import DefaultModelError
    from nano.loader import WeightError
    from nano.memory import NotEnoughMemoryError
    from nano.tokenizer import TokenizerError

    return UsageError, ConfigError, WeightError, TokenizerError, DefaultModelError, GraphCaptureError, NotEnoughMemoryError


def cli(build_parser, run, argv=None):
    """Parse flags with `build_parser()` and `run(args)`. A known failure ends with one line
    `error: ...` and exit status 2, Ctrl-C with exit status 130, neither with a traceback."""
    try:
        errors = one_line_errors()
        try:
            run(build_parser().parse_args(argv))
        except errors as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # stdout's reader has gone (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit fails again
        sys.exit(1)


def main(argv=None):
    cli(build_parser, run, argv)


if __name__ == "__main__":
    main()
