"""The event loop's time per step to merge a request's choices (engine_process.merged), against the
form it replaced, which ran a task per item (`asyncio.wait` over one `anext` task per choice).

    python scripts/merge_bench.py

N choices, each an async generator over its own queue, as a Stream's events are read; a step puts
one token into every queue at once, as the engine reader delivers a step, and lets the loop turn
until the merge has handed them all on. Printed per N: the median of 5 runs of 40 steps, in ms a
step, and that each choice's first item came out in index order. CPU only."""

import asyncio
import statistics
import time

from nano.engine_process import merged


async def task_per_item(sources: list):  # the replaced form, kept here as the baseline
    pending = {asyncio.ensure_future(anext(source)): i for i, source in enumerate(sources)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(sources[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()


async def choice(queue: asyncio.Queue):
    while (item := await queue.get()) is not None:
        yield item


async def ms_a_step(merge, n: int, steps: int = 40) -> float:
    queues = [asyncio.Queue() for _ in range(n)]

    async def consume():
        return [i async for i, _ in merge([choice(q) for q in queues])]

    consumer = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    for step in range(steps):
        for q in queues:
            q.put_nowait(step)
        for _ in range(6):  # the loop's turns a step takes to pass through
            await asyncio.sleep(0)
    for q in queues:
        q.put_nowait(None)
    order = await consumer
    elapsed = time.perf_counter() - start
    firsts = list(dict.fromkeys(order))
    assert len(order) == n * steps and firsts == sorted(firsts), "every item, each choice's first in index order"
    return elapsed / steps * 1e3


for n in (1024, 256, 64):
    runs = {name: [] for name in ("task per item", "merged")}
    for _ in range(5):
        for name, merge in (("task per item", task_per_item), ("merged", merged)):
            runs[name].append(asyncio.run(ms_a_step(merge, n)))
    print(f"{n:5d} choices: " + ", ".join(f"{name} {statistics.median(v):.2f} ms a step" for name, v in runs.items()))
