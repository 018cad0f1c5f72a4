"""What logprobs cost a decode step (BENCHMARKS.md, "Logprobs"): Llama-3-8B's shape, dummy weights,
CUDA graphs, a batch of requests decoding together, first with logprobs off, then with the sampled
token's logprob and its 5 likeliest alternatives on every request. The log-softmax and top-k run
outside the graph, on the rows that ask, so a batch that asks for none runs the graph alone.

    python scripts/logprobs_bench.py [--model llama-3-8b] [--batch-size 1 64]
"""

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from nano.cli import SHIPPED_CONFIGS  # noqa: E402
from nano.engine import Engine, EngineConfig  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402


def step_ms(engine, bs: int, logprobs: int | None, input_len=128, output_len=64) -> float:
    """Mean decode step (ms) of bs requests, each generating output_len tokens."""
    g = torch.Generator().manual_seed(bs)
    for _ in range(bs):
        prompt = torch.randint(10, engine.cfg.vocab_size, (input_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=output_len, ignore_eos=True, logprobs=logprobs))
    while engine.scheduler.waiting:  # the prefill, untimed
        engine.step()
    torch.cuda.synchronize()
    steps, started = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    engine.logprobs.clear()
    return (time.perf_counter() - started) / steps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    args = p.parse_args()
    max_bs = max(args.batch_size)
    engine = Engine(SHIPPED_CONFIGS / args.model, EngineConfig(
        device="cuda", dtype=torch.bfloat16, attention_backend="triton", load_format="dummy", cuda_graph=True,
        max_running_requests=max_bs, cuda_graph_max_bs=max_bs, max_total_tokens=max_bs * 200, log=False))
    for bs in args.batch_size:
        step_ms(engine, bs, None)  # warm-up
        off, on = step_ms(engine, bs, None), step_ms(engine, bs, 5)
        print(f"{args.model} batch {bs}: logprobs off {off:.3f} ms/step, top 5 on every request {on:.3f} ms/step "
              f"(+{(on / off - 1) * 100:.1f}%)", flush=True)


if __name__ == "__main__":
    main()
