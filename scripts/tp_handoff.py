"""Where the host time of a tensor-parallel decode step goes: rank 0 and rank 1 stamp each step's
stages with time.perf_counter() (CLOCK_MONOTONIC: one clock for all processes of a host), and
rank 0 prints the median of each stage, from the start of its step.
Usage: python scripts/tp_handoff.py MODEL_SHAPE [BATCH_SIZE] (needs 2 GPUs)"""

import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
from nano import tp as tp_module  # noqa: E402
from nano.engine import Engine, EngineConfig  # noqa: E402
from nano.cli import SHIPPED_CONFIGS  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402

# Module level, so that the spawned rank, which imports this file as __mp_main__, is patched too.
STAMPS = []  # (stage, time)
STAMP_DIR = os.environ.setdefault("NANO_HANDOFF_DIR", tempfile.mkdtemp())


def stamped(cls, name, before=None, after=None):
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        if before:
            STAMPS.append((before, time.perf_counter()))
        out = original(*args, **kwargs)
        if after:
            STAMPS.append((after, time.perf_counter()))
        return out

    setattr(cls, name, wrapper)


stamped(Engine, "step", "step start", "step end")
stamped(tp_module.TensorParallel, "send_batch", "send start", "send end")
stamped(tp_module.TensorParallel, "receive_batch", None, "rank 1 has the batch")
stamped(Engine, "forward", None, "forward launched")
original_close = Engine.close


def close_and_save(self):
    if self.tp is not None and self.tp.rank > 0:
        with open(os.path.join(STAMP_DIR, "rank1.json"), "w") as f:
            json.dump(STAMPS, f)
    original_close(self)


Engine.close = close_and_save


def main():
    shape, bs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = Engine(SHIPPED_CONFIGS / shape, EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                    load_format="dummy", max_total_tokens=bs * 300 + 1, max_running_requests=max(bs, 8), cuda_graph=True,
                    cuda_graph_max_bs=max(bs, 8), tp_size=2, log=False))
    for _ in range(bs):
        engine.add_request(list(range(10, 138)), SamplingParams(max_new_tokens=120, ignore_eos=True))
    for _ in range(20):  # prefill, warm-up decode steps
        engine.step()
    STAMPS.clear()
    for _ in range(80):
        engine.step()
    engine.close()
    time.sleep(1)
    rank0 = STAMPS
    rank1 = json.load(open(os.path.join(STAMP_DIR, "rank1.json")))
    starts = [t for stage, t in rank0 if stage == "step start"]
    offsets = {}
    for who, stamps in (("rank 0", rank0), ("rank 1", rank1)):
        for stage, t in stamps:
            if stage == "step start" or stage == "rank 1 has the batch" and who == "rank 0":
                continue
            i = max(j for j, s in enumerate(starts) if s <= t) if t >= starts[0] else None
            if i is not None and i + 1 < len(starts) and t < starts[i + 1]:
                offsets.setdefault(f"{who}: {stage}", []).append((t - starts[i]) * 1e3)
    print(f"{shape} batch {bs}, tp 2: median ms from rank 0's step start ({len(starts)} decode steps)")
    for key, values in sorted(offsets.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {statistics.median(values):7.3f}  {key}")


if __name__ == "__main__":
    main()
