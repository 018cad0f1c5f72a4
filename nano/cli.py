"""The command-line plumbing every command shares: flags, model and device resolution, errors.

generate, bench_latency, bench_throughput and the server build an engine from the same flags.
This module turns those flags into an `EngineConfig` (engine.py's defaults; the GPU's are filled in
here), finds the model folder (fetching the embedded default on first use, or a shipped shape for
the benchmarks), and runs a command inside `cli`: bad input ends with a one-line `error: ...` and exit
status 2, Ctrl-C with exit status 130, never with a traceback. It imports only the standard
library at its top, so that the seconds spent importing torch happen inside `cli` too.
"""

import argparse
import importlib.util
import io
import os
import sys
from pathlib import Path

SHIPPED_CONFIGS = Path(__file__).parent / "configs"  # config.json of known shapes, for benchmarks
SHAPES = sorted(d.name for d in SHIPPED_CONFIGS.iterdir())


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


def add_engine_args(p: argparse.ArgumentParser):
    """Flags of every command that builds an engine: generate, the benchmarks, the server. Their
    defaults are EngineConfig's, or the device's (engine_config)."""
    import torch

    from nano.engine import CHUNK_SIZES, CPU_THREADS
    from nano.engine import EngineConfig as default

    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--load-format", choices=["safetensors", "dummy"], help="dummy: random weights in the real shapes "
                   "(gibberish, for timing); default: dummy for a shipped shape, else safetensors")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--attention-backend", choices=["torch", "triton"], help="default: triton on GPU, torch on CPU")
    p.add_argument("--mem-fraction", type=float, default=default.mem_fraction,
                   help="fraction of free memory (after weights) for the KV cache; on CPU at most 1 GiB")
    p.add_argument("--max-total-tokens", type=int, help="KV cache size in tokens (overrides --mem-fraction)")
    p.add_argument("--max-running-requests", type=int, default=default.max_running_requests,
                   help="requests decoded together at most")
    p.add_argument("--context-length", type=int,
                   help="tokens per request; default: the model's, or the KV cache's if smaller")
    p.add_argument("--disable-mla", action="store_true", help="DeepSeek: plain multi-head attention, expanded K/V")
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode without CUDA graphs on GPU")
    p.add_argument("--cuda-graph-max-bs", type=int, help="largest decode batch in a CUDA graph, rounded down "
                   "to 1, 2, 4 or a multiple of 8 (default: --max-running-requests)")
    p.add_argument("--disable-radix-cache", action="store_true", help="compute every prompt in full")
    p.add_argument("--disable-overlap", action="store_true",
                   help="book each decode pass's tokens before launching the next")
    p.add_argument("--chunked-prefill-size", type=int,
                   help="most prompt tokens one prefill step computes; longer prompts take several (0 or -1: off; "
                   f"default: {CHUNK_SIZES['cuda']} on GPU, {CHUNK_SIZES['cpu']} on CPU)")
    p.add_argument("--tp-size", type=int, default=default.tp_size,
                   help="tensor parallelism: split the model over this many GPUs")
    p.add_argument("--threads", "-t", type=int,
                   help=f"CPU threads torch computes with (default: OMP_NUM_THREADS if set, else {CPU_THREADS}; more "
                   "pay only on a quiet machine with cores to spare)")


def shipped_shape(name: str | None) -> Path | None:
    """The config folder of a shipped shape name (unless a folder of that name exists here), else None."""
    return SHIPPED_CONFIGS / name if name in SHAPES and not Path(name).exists() else None


def resolve_model(name: str | None) -> Path:
    """--model value -> a folder holding config.json, as an absolute path: serve names the model
    after the folder, which `.` or `..` would not (os.path, not resolve(): a symlink keeps its name)."""
    if name is None:
        from nano.default_model import ensure_default_model

        return ensure_default_model()
    if shipped_shape(name):
        raise UsageError(f"{name} is a shape for benchmarks, with no weights or tokenizer: time it with "
                         f"python -m nano.bench_latency --model {name}, or pass a model folder (weights/README.md)")
    path = Path(name)
    if not path.is_dir():
        raise UsageError(f"{name} is a file, not a model folder" if path.exists()
                         else f"model folder {name} does not exist")
    return Path(os.path.abspath(path))


def resolve_model_or_shape(args, default_shape: bool = False) -> Path:
    """--model for commands that also take a shipped shape (the benchmarks, the server): a shape's
    config folder, with dummy weights unless --load-format says otherwise, or a model folder.
    default_shape (the benchmarks): no --model is the shape that suits the device, not an 8B model
    in float32, which would not fit a CPU host's memory."""
    if default_shape and args.model is None:
        args.model = "llama-3-8b" if parse_device(args.device).type == "cuda" else "smollm2-135m"
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
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise UsageError(f"--device {name}: nano runs on cpu or cuda (cuda:N for the N-th GPU)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}, but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}, but there are only {torch.cuda.device_count()} CUDA devices")
    return device


def engine_config(args, **overrides):
    """Flags -> EngineConfig: the device's defaults filled in, every setting checked."""
    import torch

    from nano.engine import CPUS, EngineConfig

    device = parse_device(args.device)
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    if on_gpu and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16; use --dtype float16")
    backend = args.attention_backend or ("triton" if on_gpu else "torch")
    interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    if backend == "triton" and not on_gpu and not interpreted:
        raise UsageError("--attention-backend triton needs a GPU (on CPU, TRITON_INTERPRET=1 runs its kernels "
                         "in Triton's interpreter, slowly)")
    if (on_gpu or backend == "triton") and importlib.util.find_spec("triton") is None:
        raise UsageError("nano's GPU kernels are written in Triton, which is not installed: pip install triton")
    if args.tp_size > 1 and not on_gpu:  # (the engine itself runs it over gloo on CPU, for the tests)
        raise UsageError(f"--tp-size {args.tp_size} splits the model over GPUs, and this run has none "
                         f"(--device {args.device})")
    if args.threads is not None and on_gpu:
        raise UsageError("--threads sets the CPU's threads; this run computes on the GPU")
    if (args.threads or 0) > CPUS:  # torch starts them all: 100000 crash the process
        raise UsageError(f"--threads {args.threads}: this process may run on {CPUS} CPUs at once")
    cuda_graph = on_gpu and backend == "triton" and not args.disable_cuda_graph
    if args.cuda_graph_max_bs is not None and not cuda_graph:
        raise UsageError("--cuda-graph-max-bs: CUDA graphs run only on a GPU, with the triton backend, "
                         "without --disable-cuda-graph")
    # `overrides`: a command's own settings (bench_latency: the whole batch in one prefill)
    config = EngineConfig(**dict(
        device=str(device), dtype=dtype, attention_backend=backend, load_format=args.load_format or "safetensors",
        mem_fraction=args.mem_fraction, max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests, context_length=args.context_length,
        use_mla=not args.disable_mla, cuda_graph=cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
        radix_cache=not args.disable_radix_cache, chunked_prefill_size=args.chunked_prefill_size,
        overlap=not args.disable_overlap, tp_size=args.tp_size, threads=args.threads) | overrides)
    try:
        config.validate()
    except ValueError as e:  # its messages name a setting as its flag, less the dashes
        raise UsageError(f"--{e}") from None
    return config


def build_engine(args, model_dir: Path, **overrides):
    from nano.engine import Engine

    return Engine(model_dir, engine_config(args, **overrides))


def one_line_errors() -> tuple[type[Exception], ...]:
    """What a command reports as one `error: ...` line with exit status 2 (imported here, not at
    the top, so that an interrupt during the heavy imports is caught like any other)."""
    from nano.config import ConfigError
    from nano.cuda_graph_runner import GraphCaptureError
    from nano.default_model import DefaultModelError
    from nano.loader import WeightError
    from nano.memory import NotEnoughMemoryError
    from nano.tokenizer import TokenizerError

    return (UsageError, ConfigError, WeightError, TokenizerError, DefaultModelError, GraphCaptureError,
            NotEnoughMemoryError)


def cli(build_parser, run, argv=None):
    """Parse flags with `build_parser()` and `run(args)`. A known failure ends with one line
    `error: ...` and exit status 2, Ctrl-C with exit status 130, neither with a traceback."""
    if isinstance(sys.stdout, io.TextIOWrapper):  # PYTHONIOENCODING=ascii: write é as \xe9, as stderr does,
        sys.stdout.reconfigure(errors="backslashreplace")  # not a UnicodeEncodeError traceback mid-stream
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


