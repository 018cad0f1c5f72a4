"""Where bench_throughput's time goes: its workload (nano-vllm's: 256 prompts of 100..1024 tokens,
outputs of 100..1024, all queued at once), each prefill step timed alone with its flop rate, then
the GPU kernels of the prefill steps and of two windows of decode steps (the first, at the largest
batch and shortest contexts; one in the middle), from the torch profiler.
Usage: python scripts/profile_throughput.py [--model llama-3-8b] [bench_throughput's engine flags]"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from nano.bench_throughput import build_parser, random_requests, run_nano
from nano.cli import build_engine, resolve_model_or_shape
from nano.sampling import SamplingParams


def kernel_table(prof, title, steps):
    """The GPU kernels of a profiled window, by total time, per step."""
    rows = [(e.device_time_total, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0
            and e.device_type.name == "CUDA"]
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    print(f"\n{title}: {total / steps / 1e3:.3f} ms of kernels a step ({steps} steps)")
    for t, n, key in rows[:18]:
        print(f"  {t / steps / 1e3:8.3f} ms {n / steps:6.1f}x  {key[:90]}")


def main():
    args = build_parser().parse_args(sys.argv[1:])
    engine = build_engine(args, resolve_model_or_shape(args, default_shape=True))  # as bench_throughput
    cfg = engine.cfg
    flops_per_token = 2 * sum(p.numel() for n, p in engine.model.named_parameters() if "embed" not in n
                              and "lm_head" not in n)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, cfg.vocab_size, args.seed)
    run_nano(engine, random_requests(4, (args.input_len[0],) * 2, (8, 8), cfg.vocab_size, args.seed + 1))
    for prompt, n_out in requests:
        engine.add_request(prompt, SamplingParams(max_new_tokens=n_out, ignore_eos=True))
    torch.cuda.synchronize()
    reqs, steps = list(engine.scheduler.waiting), 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.scheduler.waiting or engine.scheduler.chunked:  # (between two chunks of a prompt, a decode)
            tokens, started = sum(r.prefilled for r in reqs), time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            seconds, n = time.perf_counter() - started, sum(r.prefilled for r in reqs) - tokens
            print(f"step {steps}: {n} prompt tokens in {seconds * 1e3:.1f} ms, "
                  f"{n * flops_per_token / seconds / 1e12:.0f} TFLOPS in the linears")
            steps += 1
    kernel_table(prof, "until every prompt is in", steps)
    for label, skip in (("decode, steps 2-11", 1), ("decode, steps 501-510", 490)):
        for _ in range(skip):
            engine.step()
        torch.cuda.synchronize()
        batch = len(engine.scheduler.running)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        kernel_table(prof, f"{label} (batch {batch})", 10)


if __name__ == "__main__":
    main()
