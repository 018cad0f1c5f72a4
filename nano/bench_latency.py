"""Latency benchmark: one prefill, then decode steps, per batch size (SGLang's bench_one_batch format).

    python -m nano.bench_latency --model llama-3-8b --batch-size 1 8 32 --input-len 128 --output-len 8

For each batch size it runs `batch_size` requests of `input_len` random tokens through one prefill
and `output_len - 1` decode steps (after a warm-up round that compiles kernels), and prints the
prefill latency and the median decode-step latency, each with its throughput. `--model` takes a
model folder or the name of a shape shipped in nano/configs, which runs with random weights (no
download); without it, the shape that suits the device: llama-3-8b on a GPU, smollm2-135m on CPU.

Decode at small batch is memory-bound: each step must read every weight once (for a
mixture-of-experts model, only the experts the batch routes to) and each request's KV cache.
Dividing those bytes by the step time gives the achieved bandwidth; its fraction of the device's
copy bandwidth, measured at start (or given with --peak-bandwidth), says how close the step is
to the hardware's floor. With --tp-size N the bytes are one GPU's share (tp.py): the N GPUs read
their shares at the same time, so the floor is that share over one GPU's bandwidth.

torch is imported inside the functions, not at the top: see cli.py.
"""

import math
import statistics
import time

from nano.cli import (SHAPES, ArgumentParser, UsageError, add_engine_args, build_engine, cli, engine_config,
                      resolve_model_or_shape)
from nano.config import load_config
from nano.forward_batch import batch_bucket

EXAMPLES = """examples:
  python -m nano.bench_latency                          # smollm2-135m on CPU, llama-3-8b on GPU
  python -m nano.bench_latency --model llama-3-8b --batch-size 1 8 32     # GPU: 16 GB of weights
  python -m nano.bench_latency --model weights/Llama-3.1-8B-Instruct --output-len 32
"""


def measure_copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written: the practical peak
    that every memory-bound kernel is measured against. Median of 20 copies of 1 GiB."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_step(model, batch_size: int) -> float:
    """Bytes of weights one decode step reads: all but the embedding table (unless it doubles as
    lm_head); of a MoE layer's routed experts, the expected number a batch touches."""
    from nano.deepseek import MoE

    total = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if name != "embed_tokens" or model.cfg.tie_word_embeddings)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        # each token picks k of E experts; a batch of b touches E (1 - (1 - k/E)^b) of them on average
        untouched = (1 - moe.top_k / moe.num_experts) ** batch_size
        routed = moe.num_experts / (moe.num_experts + moe.num_shared)  # the stacks' share of routed experts
        total -= untouched * routed * (moe.w13.numel() + moe.w2.numel()) * moe.w13.element_size()
    return total


def run_once(engine, batch_size: int, input_len: int, output_len: int, seed: int) -> tuple[float, list[float]]:
    """-> (the prefill step's seconds, the seconds of the middle decode steps). With overlap a step
    launches one pass and books the one before, so the first decode step only launches: left out;
    without overlap every step runs a whole pass. The last step lets the whole batch go: left out."""
    import torch

    from nano.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    for _ in range(batch_size):
        prompt = torch.randint(10, engine.cfg.vocab_size, (input_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=output_len, ignore_eos=True))
    step_times = []
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    while engine.has_work():  # no sync between steps: it would keep decode passes from overlapping
        started = time.perf_counter()
        engine.step()  # returns once the tokens it hands out are on the host
        step_times.append(time.perf_counter() - started)
    return step_times[0], step_times[2 if engine.config.overlap else 1 : -1]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m nano.bench_latency", epilog=EXAMPLES,
                       description="Time one prefill and the decode steps after it, per batch size,\n"
                       "and compare the bytes a decode step reads with the device's bandwidth.")
    p.add_argument("--model", help=f"a model folder, or a shipped shape ({', '.join(SHAPES)}) with random "
                   "weights; default: llama-3-8b on a GPU, smollm2-135m on CPU")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="batch sizes to time, one run each")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=8,
                   help="tokens per request: the first from prefill, one decode step for each of the others")
    p.add_argument("--peak-bandwidth", type=float,
                   help="GB/s to compute the floor from (default: measure a device copy at start)")
    add_engine_args(p)
    return p


def run(args):
    import torch

    if min(args.batch_size) < 1 or args.input_len < 1 or args.output_len < 3:
        raise UsageError("--batch-size and --input-len must be >= 1, --output-len >= 3 (the first and last decode "
                         "steps are not timed)")
    if args.peak_bandwidth is not None and not 0 < args.peak_bandwidth < math.inf:
        raise UsageError(f"--peak-bandwidth must be a positive number of GB/s, got {args.peak_bandwidth}")
    engine_config(args)  # the engine's flags checked as every command checks them, before they are read here
    if args.chunked_prefill_size is not None:  # (it would be set aside below without a word)
        raise UsageError("--chunked-prefill-size: bench_latency prefills each batch in one pass, unchunked")
    model_dir = resolve_model_or_shape(args, default_shape=True)
    per_request, max_bs = args.input_len + args.output_len, max(args.batch_size)
    # longer than the model's context: refused before the weights load and a KV cache of that size fills memory
    if per_request > (context := args.context_length or load_config(model_dir).max_position_embeddings):
        raise UsageError(f"{args.input_len} + {args.output_len} tokens per request do not fit: the context "
                         f"holds {context} tokens")
    # graphs are of buckets (12 runs in 16's): else the largest batch ran eagerly under "CUDA graphs on"
    graph_bs = batch_bucket(max_bs)
    args.max_running_requests = max(args.max_running_requests, graph_bs)
    if args.cuda_graph_max_bs is not None:
        args.cuda_graph_max_bs = max(args.cuda_graph_max_bs, graph_bs)
    if args.max_total_tokens is None:
        args.max_total_tokens = max_bs * per_request
    # the whole batch in the one prefill step this reports, every prompt token computed (the batch
    # sizes' prompts come from the same seeds: a prefix cache would find them)
    engine = build_engine(args, model_dir, max_prefill_tokens=max_bs * args.input_len, chunked_prefill_size=0,
                          radix_cache=False)
    # the whole batch at once (each request's length is checked above): else the timings are of something else
    if max_bs * per_request > engine.kv_pool.capacity:
        raise UsageError(f"batch {max_bs} of {args.input_len} + {args.output_len} tokens does not fit: the context "
                         f"holds {engine.context_length} tokens, the KV cache {engine.kv_pool.capacity}")
    graphs = "on" if engine.graph_runner is not None else "off"
    ranks = f" (rank 0 of {engine.tp.size})" if engine.tp else ""
    print(f"{args.model}: {engine.cfg.architecture}, {engine.dtype}, {engine.device}{ranks}, CUDA graphs {graphs}, "
          f"attention {type(engine.attn).__name__}")
    peak = None  # bytes/s of the floor: given, or measured now
    if args.peak_bandwidth:
        peak = args.peak_bandwidth * 1e9
        print(f"peak bandwidth {args.peak_bandwidth:.0f} GB/s (given)")
    elif engine.device.type == "cuda":
        peak = measure_copy_bandwidth(engine.device)
        device = torch.cuda.get_device_name(engine.device)
        print(f"{device}: device-to-device copy {peak / 1e9:.0f} GB/s (measured now)")
    for bs in args.batch_size:
        time_batch(engine, args, bs, peak)


def time_batch(engine, args, bs: int, peak: float | None):
    """One batch size: a warm-up run, then the timed one, printed with the bytes a decode step reads."""
    run_once(engine, bs, args.input_len, args.output_len, seed=0)  # warm-up
    prefill_s, decode_s = run_once(engine, bs, args.input_len, args.output_len, seed=1)
    step_s = statistics.median(decode_s)
    print(f"batch size {bs}")
    print(f"Prefill. latency: {prefill_s:.5f} s, throughput: {bs * args.input_len / prefill_s:9.2f} token/s")
    print(f"Decode.  median latency: {step_s:.5f} s, median throughput: {bs / step_s:9.2f} token/s")
    weights = weight_bytes_per_step(engine.model, bs)
    # the KV read by a middle decode step: every request holds about input_len + output_len / 2 tokens
    kv = bs * (args.input_len + args.output_len // 2) * engine.kv_bytes_per_token
    achieved = (weights + kv) / step_s
    per_rank = f" by each of {engine.tp.size} ranks" if engine.tp else ""
    line = (f"Bytes read per decode step{per_rank}: {weights / 1e9:.2f} GB weights + {kv / 1e9:.3f} GB KV; "
            f"achieved {achieved / 1e9:.0f} GB/s")
    if peak:
        line += f" = {achieved / peak:.0%} of the copy bandwidth (floor {(weights + kv) / peak * 1e3:.2f} ms)"
    print(line)


def main(argv=None):
    cli(build_parser, run, argv)


if __name__ == "__main__":
    main()
