"""The clients people already run against an OpenAI-compatible server, unmodified, against nano.serve
on the default model (SmolLM2-135M-Instruct, float32 on CPU): the official openai client's logprobs
(within 1e-3 of HF transformers' log_softmax on the same weights), echo, n, list prompts; lm-eval's
local-completions against its own `--model hf` on small local tasks (generation and multiple
choice); and the request shapes of SGLang's and vLLM's serving benchmarks."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

NAME = "smol"  # --served-model-name
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def post(url, path, body) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "nano.serve", "--model", str(smollm2_dir), "--port", str(port),
                             "--served-model-name", NAME, "--max-total-tokens", "30000"],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=SERVER_ENV)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        assert proc.poll() is None and time.time() < deadline, log_path.read_text()
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.3)
    yield url
    proc.terminate()
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def hf_logprobs(smollm2_dir):
    """token ids -> HF's log_softmax at each position, float32: [len, vocab]; row i predicts token i + 1."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def assert_top_matches(top_logprobs: list[float], row: torch.Tensor):
    """The k alternatives' logprobs, likeliest first, are HF's k largest at that position."""
    expected = row.topk(len(top_logprobs)).values.tolist()
    assert sorted(top_logprobs, reverse=True) == pytest.approx(expected, abs=1e-3)


def test_openai_chat_logprobs_match_hf(server, hf_logprobs):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=5)
    choice = reply.choices[0]
    prompt = post(server, "/tokenize", {"model": NAME, "messages": messages})["tokens"]
    ref = hf_logprobs(prompt + choice.token_ids)
    assert len(choice.logprobs.content) == len(choice.token_ids) > 0
    for k, (entry, token) in enumerate(zip(choice.logprobs.content, choice.token_ids)):
        row = ref[len(prompt) - 1 + k]
        assert abs(entry.logprob - row[token].item()) < 1e-3 and len(entry.top_logprobs) == 5
        assert_top_matches([alt.logprob for alt in entry.top_logprobs], row)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the likeliest
        assert entry.bytes == list(entry.token.encode())


def test_openai_completion_logprobs_and_echo_match_hf(server, hf_logprobs):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    prompt_text = "The capital of France is"
    prompt = post(server, "/tokenize", {"prompt": prompt_text})["tokens"]
    for echo in (False, True):
        choice = client.completions.create(model=NAME, prompt=prompt_text, max_tokens=6, temperature=0, logprobs=5,
                                           echo=echo).choices[0]
        ids = prompt + choice.token_ids
        ref, logprobs = hf_logprobs(ids), choice.logprobs
        first = 0 if echo else len(prompt)  # the first token listed
        assert len(logprobs.tokens) == len(ids) - first and "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
        if echo:  # nothing comes before the first prompt token
            assert choice.text.startswith(prompt_text) and logprobs.token_logprobs[0] is logprobs.top_logprobs[0] is None
        for i in range(max(first, 1), len(ids)):
            assert abs(logprobs.token_logprobs[i - first] - ref[i - 1, ids[i]].item()) < 1e-3, i
            assert_top_matches(list(logprobs.top_logprobs[i - first].values()), ref[i - 1])


def test_openai_n_samples_with_a_seed_differ_and_repeat(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    ask = dict(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=7)
    first, again = (client.completions.create(**ask) for _ in range(2))
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in again.choices] == texts
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)
    # choice j is sample j of the same prompt: with seed s + j, alone, it is the same text
    alone = client.completions.create(**{**ask, "n": 1, "seed": 8})
    assert alone.choices[0].text == texts[1]


def test_openai_list_prompts_and_models_retrieve(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    prompts = ["The capital of France is", "One, two, three,"]
    singles = [client.completions.create(model=NAME, prompt=p, max_tokens=5, temperature=0).choices[0].text
               for p in prompts]
    batched = client.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert [c.text for c in batched.choices] == [singles[0], singles[0], singles[1], singles[1]]
    ids = [post(server, "/tokenize", {"prompt": p})["tokens"] for p in prompts]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == singles
    stream = client.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, stream=True)
    streamed = ["", ""]
    for chunk in stream:
        assert len(chunk.choices) == 1  # each event carries the one choice it concerns
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == singles
