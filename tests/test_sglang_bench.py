"""SGLang's serving benchmark (sglang.benchmark.serving, behind `python -m sglang.bench_serving`),
unmodified, against nano.serve on the default model (SmolLM2-135M-Instruct on CPU).

Installing sglang would pull in its GPU runtime and a pinned torch, so the test takes only the
benchmark's own modules out of the sglang wheel (downloaded once with `pip download --no-deps`)
and gives it stand-ins for the three runtime names it imports (STUBS below). It runs the
benchmark's random dataset, which samples its prompts from a ShareGPT-format file written here,
with the backends sglang-oai (/v1/completions) and sglang-oai-chat (/v1/chat/completions). Every
request must succeed, and each streamed text must be what nano answers, unstreamed, to one of the
prompts the dataset can have made."""

import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.helpers import start_server

pytest.importorskip("fastapi")
for module in ("aiohttp", "msgspec", "orjson", "pybase64", "PIL", "datasets", "requests", "transformers"):
    pytest.importorskip(module)  # the benchmark's imports (tests/requirements.txt)

SGLANG = "sglang==0.5.23"
# The wheels are per CPython version and platform, but the benchmark is plain Python: always fetch
# the same one, whatever runs the test.
WHEEL_FLAGS = ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.11", "--abi", "cp311",
               "--platform", "manylinux_2_34_x86_64"]
WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nano" / "test-wheels"
# What serving.py imports from sglang's runtime, as the runtime defines it
# (sglang/srt/disaggregation/utils.py and sglang/srt/utils/network.py in the same wheel).
STUBS = {
    "sglang/__init__.py": "",  # the real one imports the whole runtime
    "sglang/srt/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/disaggregation/utils.py": 'FAKE_BOOTSTRAP_HOST = "2.2.2.2"\n',
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/utils/network.py": '''
def _host_port(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets


def resolve_base_url(base_url, host, port):
    """--base-url if given, else http://host:port."""
    return base_url or f"http://{_host_port(host, port)}"


def resolve_host_port(base_url, host, port):
    """--base-url if given, else host:port (gRPC's form)."""
    return base_url or _host_port(host, port)
''',
}
SHAREGPT = [  # the dataset keeps each conversation's first two turns; the first is the prompt
    ("What is the capital of France, and what is it known for?", "Paris, known for the Eiffel Tower."),
    ("Write a short poem about the sea at night.", "The waves are dark, the moon is high."),
    ("Explain in one paragraph how a bicycle stays upright while it moves.", "Mostly steering and trail."),
    ("List three ways to keep bread fresh for longer.", "Freeze it, wrap it, keep it dry."),
]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 24, 8


def sglang_wheel() -> Path:
    found = sorted(WHEEL_CACHE.glob(f"sglang-{SGLANG.split('==')[1]}-*.whl"))
    if found:
        return found[0]
    result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                             *WHEEL_FLAGS, SGLANG, "-d", str(WHEEL_CACHE)], capture_output=True, text=True)
    found = sorted(WHEEL_CACHE.glob(f"sglang-{SGLANG.split('==')[1]}-*.whl"))
    if result.returncode != 0 or not found:
        reason = f"could not download {SGLANG} from PyPI: {(result.stderr.strip().splitlines() or ['?'])[-1]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found[0]


@pytest.fixture(scope="module")
def bench_path(tmp_path_factory) -> Path:
    """A folder for PYTHONPATH: the wheel's sglang/benchmark/ and sglang/bench_serving.py, and STUBS."""
    root = tmp_path_factory.mktemp("sglang")
    with zipfile.ZipFile(sglang_wheel()) as wheel:
        members = [n for n in wheel.namelist() if n.startswith("sglang/benchmark/") or n == "sglang/bench_serving.py"]
        wheel.extractall(root, members)
    for name, text in STUBS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    """nano.serve under the name SGLang would give the model: its path, which the benchmark reads
    from /v1/models and loads its tokenizer from."""
    proc, url = start_server(smollm2_dir, tmp_path_factory.mktemp("log") / "server.log",
                             "--served-model-name", str(smollm2_dir), timeout=180)
    yield int(url.rsplit(":", 1)[1])
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def post(port, path, body) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def dataset_prompts(tokenizer, prompt_len: int) -> list[str]:
    """The prompts of prompt_len tokens the random dataset can make from SHAREGPT: a first turn's
    tokens, repeated to length and cut there, as text."""
    prompts = []
    for first, _ in SHAREGPT:
        ids = tokenizer.encode(first)
        prompts.append(tokenizer.decode((ids * (prompt_len // len(ids) + 1))[:prompt_len]))
    return prompts


def nano_answer(port, backend, prompt: str, output_len: int, model: str) -> str:
    """What nano answers, unstreamed, to the request the benchmark makes of this prompt."""
    if backend == "sglang-oai":
        reply = post(port, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": output_len,
                                               "temperature": 0.0, "ignore_eos": True})
        text = reply["choices"][0]["text"]
    else:
        reply = post(port, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                                    "max_completion_tokens": output_len, "temperature": 0.0,
                                                    "ignore_eos": True})
        text = reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] == output_len
    return text


@pytest.mark.parametrize("backend", ["sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving_against_nano(bench_path, server, smollm2_dir, tmp_path, backend):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                   for i, (q, a) in enumerate(SHAREGPT)]))
    output = tmp_path / "result.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "API_KEY")}
    env.update(PYTHONPATH=os.pathsep.join([str(bench_path), env.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--backend", backend,
                             "--host", "127.0.0.1", "--port", str(server),
                             "--dataset-name", "random", "--dataset-path", str(dataset), "--num-prompts", str(NUM_PROMPTS),
                             "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                             "--output-file", str(output), "--output-details"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    successful = [line for line in result.stdout.splitlines() if line.startswith("Successful requests:")]
    assert successful and int(successful[0].split()[-1]) == NUM_PROMPTS, result.stdout[-3000:]
    report = json.loads(output.read_text().splitlines()[-1])
    assert report["completed"] == NUM_PROMPTS and report["errors"] == [""] * NUM_PROMPTS, report["errors"]
    assert report["server_info"] is None  # nano has no /server_info; the benchmark goes on without it

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = str(smollm2_dir)
    for prompt_len, output_len, text in zip(report["input_lens"], report["output_lens"], report["generated_texts"]):
        assert 1 <= prompt_len <= INPUT_LEN and 1 <= output_len <= OUTPUT_LEN and text
        answers = [nano_answer(server, backend, p, output_len, model) for p in dataset_prompts(tokenizer, prompt_len)]
        assert text in answers, (text, answers)
