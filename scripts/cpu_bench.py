"""The embedded default on a small CPU machine (BENCHMARKS.md, "A small CPU machine").

    python scripts/cpu_bench.py threads      # decode tok/s, quiet and beside a busy process, by thread count
    python scripts/cpu_bench.py stalls       # a server's worst stall while a long prompt prefills, by chunk size

threads: the default model decodes one prompt (64 tokens) with 1 and 2 threads and one per core
(torch's default), first on a quiet machine, then beside one busy-loop process (another
program that keeps a core busy: a compile, a browser tab).
stalls: `nano.serve` on CPU streams 4 requests; once they run, one 6,000-token prompt arrives.
For each chunk size the script reports the worst gap between two tokens of the running streams
while the long prompt is prefilled, and its time to first token.
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, ".")


def decode_speed(threads: int) -> float:
    from nano.default_model import ensure_default_model
    from nano.engine import Engine, EngineConfig
    from nano.sampling import SamplingParams

    engine = Engine(ensure_default_model(), EngineConfig(log=False, threads=threads))
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    for key in engine.stats:
        engine.stats[key] = 0
    engine.generate([list(range(100, 140))], SamplingParams(max_new_tokens=64, ignore_eos=True))
    return engine.stats["decode_tokens"] / engine.stats["decode_s"]


def threads_part():
    for busy in (False, True):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for threads in sorted({1, 2, os.cpu_count()}):  # torch's own default is one per core
                print(f"{'busy' if busy else 'quiet'}: {threads} thread(s): {decode_speed(threads):.1f} tok/s", flush=True)
        finally:
            if hog:
                hog.kill()


def stream(url: str, body: dict, times: list):
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        for line in response:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())


def stalls_part():
    for chunk in sys.argv[2:] or ["8192", "1024", "512", "256"]:
        port = 30123
        server = subprocess.Popen([sys.executable, "-m", "nano.serve", "--port", str(port), "--device", "cpu",
                                   "--chunked-prefill-size", chunk, "--max-total-tokens", "16000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.5)
            body = dict(prompt="Tell me a long story about the sea.", max_tokens=2000, ignore_eos=True, stream=True)
            times = [[] for _ in range(4)]
            threads = [threading.Thread(target=stream, args=(url, body, t), daemon=True) for t in times]
            for t in threads:
                t.start()
            while min(len(t) for t in times) < 5:
                time.sleep(0.1)
            sent = time.perf_counter()
            long_prompt = dict(prompt=[(i * 7919) % 40000 + 100 for i in range(6000)], max_tokens=1, stream=True)
            first = []
            stream(url, long_prompt, first)
            done = time.perf_counter()
            gaps = [b - a for t in times for a, b in zip(t, t[1:]) if sent <= b <= done + 1]
            print(f"chunk {chunk}: worst stall of the running streams {max(gaps):.1f} s, the long prompt's first "
                  f"token after {first[0] - sent:.1f} s", flush=True)
        finally:  # at once: a graceful stop would let the 2,000-token streams finish first
            server.kill()
            server.wait()


if __name__ == "__main__":
    {"threads": threads_part, "stalls": stalls_part}[sys.argv[1]]()
