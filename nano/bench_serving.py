"""Serving benchmark: many clients against a running server, as SGLang's bench_serving measures it.

    python -m nano.bench_serving --base-url http://127.0.0.1:30000 --num-prompts 1000 --dataset random \\
        --random-input-len 1024 --random-range-ratio 0.125 --random-output-len 512 --random-output-range-ratio 0.25

A batch benchmark (bench_latency) times the engine alone; users see a server: requests arrive
over time, wait for room in the batch, share every decode step with strangers, and get their
tokens through HTTP. This client sends `--num-prompts` streaming completions, arriving as a
Poisson process at `--request-rate` per second (`inf`: all at once), at most `--max-concurrency`
in flight, and times every streamed token. Per request:
- TTFT, time to first token: queueing plus prefill, what a user waits before anything shows;
- TPOT, time per output token after the first: (latency - TTFT) / (output tokens - 1);
- ITL, inter-token latency: the gaps between consecutive tokens, each one a decode step (or a
  stall while the server prefilled someone else's prompt);
- E2E latency: request sent to last token.
Throughput is tokens over the whole run's wall time.

Prompts come from one of three datasets: `random` (token ids, lengths uniform in [len * ratio,
len]: above, inputs of 128-1024 tokens, outputs of 128-512), `shared-prefix` (token ids: one common
prefix, then a unique suffix each: what a prefix cache can save), or a JSONL file with a `prompt`
(token ids, or text for a server with a tokenizer) and optional `output_len` per line. `ignore_eos`
makes every request generate exactly its output length.

Chat traffic does not say how long its answers will be: a chat client sends no `max_tokens`, the
server gives the request the whole context, and the answer ends where the model or the user
decides. `--unknown-output-len` sends such requests: each asks for the whole context left after
its prompt (what the server gives a chat request without `max_tokens`; a completion's default
would be 16), and the client closes its stream once it has read its drawn output length, as a
user who has read enough would. The engine cannot foresee that end, so this measures how its
scheduler bets (scheduler.py); without the flag, the same requests carry their exact length.
"""

import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from nano.cli import ArgumentParser, UsageError, cli


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks with tokens
    read_tokens: int = 0


def make_prompts(args, vocab_size: int) -> list[tuple[str | list[int], int]]:
    """-> (prompt, output length) per request."""
    rng = random.Random(args.seed)

    def length(n: int, ratio: float) -> int:
        return rng.randint(max(int(n * ratio), 1), n)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def output_len() -> int:
        return length(args.random_output_len, args.random_output_range_ratio)

    if args.dataset == "random":
        return [(tokens(length(args.random_input_len, args.random_range_ratio)), output_len())
                for _ in range(args.num_prompts)]
    if args.dataset == "shared-prefix":
        prefix = tokens(args.shared_prefix_len)
        return [(prefix + tokens(args.suffix_len), output_len()) for _ in range(args.num_prompts)]
    try:
        with open(args.dataset, encoding="utf-8-sig") as f:  # UTF-8 whatever the locale; a BOM is no JSON
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [(row["prompt"], row.get("output_len", args.random_output_len)) for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: a line that is no JSON object
        raise UsageError(f"--dataset {args.dataset}: not a JSONL file with a prompt per line ({e!r})") from None
    if not rows:
        raise UsageError(f"--dataset {args.dataset} has no prompts")
    for i, (prompt, output_len) in enumerate(rows, 1):  # else a TypeError deep in the run
        if not (isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(
                type(t) is int for t in prompt)) or type(output_len) is not int:
            raise UsageError(f"--dataset {args.dataset}, prompt {i}: a prompt is text or a list of token ids, "
                             "an output_len an integer")
    if args.unknown_output_len and any(isinstance(prompt, str) for prompt, _ in rows):  # tokens unknown here
        raise UsageError(f"--unknown-output-len asks for the context left after each prompt: --dataset {args.dataset} "
                         "needs token-id prompts")
    return (rows * (args.num_prompts // len(rows) + 1))[: args.num_prompts]  # cycle through the file


async def send(session, url: str, model: str, prompt, output_len: int, context: int | None = None) -> Result:
    """One streaming request; with `context`, it asks for the whole context and hangs up after output_len tokens."""
    max_tokens = output_len if context is None else context - len(prompt)
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    result, started = Result(), time.perf_counter()
    last = started
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:  # one SSE line at a time, timed as it lands
                now = time.perf_counter()
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["token_ids"]:  # ITL: chunk to chunk
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.read_tokens += len(chunk["choices"][0]["token_ids"])
                    if context is not None and result.read_tokens >= output_len:
                        result.prompt_tokens, result.output_tokens = len(prompt), result.read_tokens
                        break  # the user has read enough: closing the connection aborts the request
    except (aiohttp.ClientError, ValueError, LookupError) as e:  # ValueError, LookupError: a line not in this shape
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = last - started
    result.ok = result.output_tokens == output_len
    if not result.ok:
        result.error = f"asked for {output_len} tokens, got {result.output_tokens}"
    return result


async def send_all(session, args, prompts, model: str) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))

    async def one(prompt, output_len):
        async with limit:
            return await send(session, args.base_url, model, prompt, output_len, args.context)

    started, tasks = time.perf_counter(), []
    for i, (prompt, output_len) in enumerate(prompts):
        tasks.append(asyncio.create_task(one(prompt, output_len)))
        if args.request_rate != float("inf") and i < len(prompts) - 1:  # no wait after the last: not in the run
            await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def report(args, results: list[Result], duration: float):
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttft, e2e = ms([r.ttft for r in ok]), ms([r.latency for r in ok])
    tpot = ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = ms([gap for r in ok for gap in r.itl])
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    rows = [
        ("Traffic request rate:", args.request_rate),
        ("Max request concurrency:", args.max_concurrency or "not set"),
        ("Successful requests:", len(ok)),
        ("Failed requests:", len(failed)),
        ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", inputs),
        ("Total generated tokens:", outputs),
        ("Request throughput (req/s):", f"{len(ok) / duration:.2f}"),
        ("Input token throughput (tok/s):", f"{inputs / duration:.2f}"),
        ("Output token throughput (tok/s):", f"{outputs / duration:.2f}"),
        ("Total token throughput (tok/s):", f"{(inputs + outputs) / duration:.2f}"),
        ("Concurrency:", f"{sum(r.latency for r in ok) / duration:.2f}"),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for name, value in rows:
        print(f"{name:<40} {value:<10}")
    for title, name, values in [("End-to-End Latency", "E2E Latency", e2e), ("Time to First Token", "TTFT", ttft),
                                ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
                                ("Inter-Token Latency", "ITL", itl)]:
        print(f"{title:-^50}")
        print(f"{f'Mean {name} (ms):':<40} {statistics.mean(values):<10.2f}")
        print(f"{f'Median {name} (ms):':<40} {statistics.median(values):<10.2f}")
        print(f"{f'P99 {name} (ms):':<40} {np.percentile(values, 99):<10.2f}")  # as vLLM's and SGLang's
    print("=" * 50)
    if any(len(r.itl) != r.output_tokens - 1 for r in ok):
        print("warning: some chunks carried several tokens, so ITL spans them", file=sys.stderr)
    if failed:
        print(f"first failure: {failed[0].error}", file=sys.stderr)


def ms(seconds: list[float]) -> list[float]:
    return [s * 1000 for s in seconds] or [0.0]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m nano.bench_serving", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (python -m nano.serve)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    p.add_argument("--dataset", default="random", help="random, shared-prefix, or a JSONL file of prompts")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt length of the random dataset")
    p.add_argument("--random-output-len", type=int, default=128, help="also the output length of shared-prefix")
    p.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [len * ratio, len]")
    p.add_argument("--random-output-range-ratio", type=float,
                   help="the same for output lengths alone (default: --random-range-ratio)")
    p.add_argument("--shared-prefix-len", type=int, default=2000, help="the common prefix of shared-prefix")
    p.add_argument("--suffix-len", type=int, default=100, help="each shared-prefix prompt's own suffix")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts, lengths and arrival times")
    p.add_argument("--unknown-output-len", action="store_true",
                   help="ask for the whole context and hang up after the drawn output length (chat-shaped)")
    return p


def run(args):
    if args.random_output_range_ratio is None:
        args.random_output_range_ratio = args.random_range_ratio
    counts = [args.num_prompts, args.random_input_len, args.random_output_len, args.suffix_len,
              1 if args.max_concurrency is None else args.max_concurrency]
    if min(counts) < 1 or args.shared_prefix_len < 0 or not args.request_rate > 0 or not (  # NaN fails `> 0`
            0 <= args.random_range_ratio <= 1 and 0 <= args.random_output_range_ratio <= 1):
        raise UsageError("--num-prompts, the lengths, --max-concurrency and --request-rate must be > 0 "
                         "(--shared-prefix-len may be 0), the range ratios in [0, 1]")
    if not (args.api_key or "").isprintable():  # aiohttp refuses it in a header, in a traceback
        raise UsageError("--api-key holds a control character")
    args.base_url = args.base_url.rstrip("/")
    asyncio.run(benchmark(args))


def main(argv=None):
    cli(build_parser, run, argv)  # one-line errors, exit 2; Ctrl-C exits 130


async def benchmark(args):
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # one connection per request in flight: aiohttp's default pool of 100 would queue the rest
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        try:
            async with session.get(args.base_url + "/v1/models") as resp:
                if resp.status != 200:
                    raise UsageError(f"GET /v1/models: HTTP {resp.status}: {await resp.text()}")
                card = (await resp.json())["data"][0]
        except aiohttp.ClientError as e:
            raise UsageError(f"no server answers at {args.base_url} ({e})") from None
        prompts = make_prompts(args, card["vocab_size"])
        args.context = card["max_model_len"] if args.unknown_output_len else None
        # one request first, untimed: the first prefill and decode may compile kernels. Shaped as the first
        # prompt but differing from its first token on, so that no timed prompt finds it in a prefix cache.
        print(f"model {card['id']}: one warm-up request, then {len(prompts)} timed ...", file=sys.stderr)
        prompt, output_len = prompts[0]
        prompt = f"Warm-up. {prompt}" if isinstance(prompt, str) else [(t + 1) % card["vocab_size"] for t in prompt]
        warmup = await send(session, args.base_url, card["id"], prompt, output_len, args.context)
        if not warmup.ok:
            raise UsageError(f"the warm-up request failed: {warmup.error}")
        peak = {"running": 0}
        poller = asyncio.create_task(poll_running(session, args.base_url, peak))
        results, duration = await send_all(session, args, prompts, card["id"])
        poller.cancel()
        counters = {}
        with contextlib.suppress(aiohttp.ClientError):  # the server has gone: the requests' errors say so
            async with session.get(args.base_url + "/health") as resp:
                counters = (await resp.json()).get("engine", {})
    report(args, results, duration)
    print(f"Most requests running at once: {peak['running']}; retractions: {counters.get('retractions')}, "
          f"tokens recomputed: {counters.get('recomputed_tokens')} (the server's counts since it started)")


async def poll_running(session, url: str, peak: dict):
    """Poll /health while the benchmark runs: the most requests the engine ran at once."""
    while True:
        with contextlib.suppress(aiohttp.ClientError):  # a server gone mid-run fails the requests, not the benchmark
            async with session.get(url + "/health") as resp:
                peak["running"] = max(peak["running"], (await resp.json())["running"])
        await asyncio.sleep(0.2)


if __name__ == "__main__":
    main()
