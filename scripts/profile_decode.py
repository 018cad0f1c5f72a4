"""Where a decode step's time goes: GPU kernels (torch profiler, CUDA graphs included) and the
host's share of the step. Usage: python scripts/profile_decode.py MODEL_SHAPE [BATCH_SIZE] [TP_SIZE]
(with tensor parallelism the profile is rank 0's). Then the same kernels by the kernel before each:
how long each ran, and the gap between the end of the one before and its start (negative: it
started before that one ended, as programmatic dependent launch lets it). And, on one GPU, a
decode step's GPU time by part, from CUDA events recorded between the parts as the engine runs:
the batch's copies to the device, the copies into the graph's buffers, the replay, sampling and
the copy back, and the wait for the host before the next step. And the longest kernels' launch
shapes: a grid of fewer programs than multiprocessors leaves some idle. Run on a GPU (BENCHMARKS.md,
fifteenth and sixteenth rounds)."""

import collections
import itertools
import json
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from nano.engine import Engine, EngineConfig  # noqa: E402
from nano.cli import SHIPPED_CONFIGS  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402


def main():
    shape, bs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    engine = Engine(SHIPPED_CONFIGS / shape, EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                    load_format="dummy", max_total_tokens=bs * 200 + 1, max_running_requests=max(bs, 8), cuda_graph=True,
                    cuda_graph_max_bs=max(bs, 8), tp_size=tp, log=False))
    g = torch.Generator().manual_seed(0)
    for _ in range(bs):  # distinct prompts, as bench_latency's: one shared prompt would be one cached prefix
        prompt = torch.randint(10, engine.cfg.vocab_size, (128,), generator=g).tolist()  # whose KV sits in L2
        engine.add_request(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))
    engine.step()  # prefill
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()

    # host time of one step, and GPU time of one graph replay alone
    times = []
    for _ in range(10):
        t = time.perf_counter(); engine.step(); times.append(time.perf_counter() - t)
    line = f"{shape} bs={bs} tp={tp}: engine.step median {sorted(times)[5] * 1e3:.3f} ms"
    if tp == 1:  # a replay on one rank alone would wait forever in its all-reduces
        graph = engine.graph_runner.graphs[bs]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record(); torch.cuda.synchronize()
        line += f"; graph replay alone {start.elapsed_time(end) / 20:.3f} ms"
    print(line)
    if tp == 1:
        print_step_parts(engine)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    kernels = trace_kernels(prof)
    print_launches(kernels, steps=5)
    print_gaps(kernels, steps=5)
    engine.close()


def print_step_parts(engine, steps: int = 20):
    """Mean GPU time of each part of a decode step (see the docstring), from events recorded between them."""
    marks, runner = [], engine.graph_runner
    launch, fill, sampling = engine._launch_decode, runner.inputs.fill, engine._launch_sampling

    def mark(name):  # the part that starts here
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event))

    def marked(before, call, after=None):
        def wrapper(*args):
            mark(before)
            out = call(*args)
            if after:
                mark(after)
            return out
        return wrapper

    engine._launch_decode = marked("the batch's copies, the table's row", launch, "waiting for the host")
    runner.inputs.fill = marked("copies into the graph's buffers", fill, "the graph's replay")
    engine._launch_sampling = marked("sampling, the copy back", sampling)
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    engine._launch_decode, runner.inputs.fill, engine._launch_sampling = launch, fill, sampling
    totals, counts = collections.defaultdict(float), collections.Counter()
    for (name, start), (_, end) in itertools.pairwise(marks):  # a part lasts until the next mark
        totals[name] += start.elapsed_time(end)
        counts[name] += 1
    for name, ms in totals.items():
        print(f"{name:40} {ms / counts[name] * 1e3:8.1f} us")


def trace_kernels(prof) -> list[dict]:
    """The profile's kernel events (name, start, duration, launch shape), in stream order."""
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as f:
            events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def print_gaps(kernels: list[dict], steps: int, host_gap_us: float = 50.0):
    """Kernel pairs in stream order (before -> kernel): launches a step, mean duration and mean gap in us.
    Gaps over host_gap_us (the GPU waiting for the host) are listed apart."""
    pairs, long_gaps = collections.defaultdict(list), []  # (before, kernel) -> [(duration, gap)]
    for before, kernel in itertools.pairwise(kernels):
        gap = kernel["ts"] - (before["ts"] + before["dur"])
        if gap < host_gap_us:
            pairs[(before["name"][:45], kernel["name"][:45])].append((kernel["dur"], gap))
        else:
            long_gaps.append(f"{before['name'][:30]} -> {kernel['name'][:30]} {gap:.0f} us")
    print(f"gaps over {host_gap_us:.0f} us, left out below: {len(long_gaps) / steps:.1f} a step: {long_gaps[:8]}")
    print(f"{'kernel before':45} {'kernel':45} {'a step':>7} {'dur us':>7} {'gap us':>7} {'ms a step':>9}")
    for (before, kernel), runs in sorted(pairs.items(), key=lambda item: -sum(d + g for d, g in item[1])):
        duration, gap = (sum(r[i] for r in runs) / len(runs) for i in (0, 1))
        print(f"{before:45} {kernel:45} {len(runs) / steps:7.1f} {duration:7.2f} {gap:7.2f} "
              f"{len(runs) * (duration + gap) / steps / 1e3:9.3f}")


def print_launches(kernels: list[dict], steps: int, top: int = 12):
    """The longest kernels' launch shapes, from the trace: a grid of fewer programs than the GPU has
    multiprocessors ("blocks per SM" under 1, one program a multiprocessor) leaves some of them idle.
    One row per kernel and shape: a kernel launched with two configurations (decode attention's short
    and long requests' tiles) gets two."""
    keys = ("grid", "block", "shared memory", "registers per thread", "blocks per SM", "est. achieved occupancy %")
    by_launch = collections.defaultdict(list)
    for k in kernels:
        args = k.get("args", {})
        by_launch[k["name"], str([args.get(key) for key in keys])].append(k["dur"])
    print(f"{'kernel':60} {'us a step':>9}  grid, block, shared memory, registers, blocks per SM, occupancy")
    for (name, shape), durations in sorted(by_launch.items(), key=lambda item: -sum(item[1]))[:top]:
        print(f"{name[:60]:60} {sum(durations) / steps:9.1f}  {shape}")


if __name__ == "__main__":  # tp > 1 spawns ranks, which import this file
    main()
