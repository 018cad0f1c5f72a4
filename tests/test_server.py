"""The OpenAI-compatible server (nano/serve.py) on a tiny random Llama with SmolLM2's tokenizer:
the official openai client gets nano.generate's greedy text; concurrent, disconnecting and
misbehaving clients; stop strings; the API key; SIGTERM with a request in flight; and, in-process,
an engine step that raises."""

import asyncio
import http.client
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager, suppress
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

# the server's own dependencies and the official client; a GPU machine without them skips these
aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from nano.engine import Engine, EngineConfig  # noqa: E402
from nano import engine_process as engine_process_module  # noqa: E402
from nano.api import MAX_BODY_BYTES, ChatRequest, CompletionRequest, read_json  # noqa: E402
from nano.engine_process import APIError, EngineClient, run_engine  # noqa: E402
from nano.serve import build_app  # noqa: E402
from nano.tokenizer import Detokenizer, Tokenizer  # noqa: E402
from tests.helpers import (assert_one_line_error, free_port, run_cli, run_main, save_byte_fallback_tokenizer,  # noqa: E402
                           save_tiny_chat_model, save_tiny_llama, start_server)

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "What is the capital of France?"
SERVER_FLAGS = ("--max-total-tokens", "100000", "--max-running-requests", "64")


def call(url, path, body=None, headers=AUTH, raw: bytes | None = None):
    """-> (status, parsed JSON body)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def read_stream(session, url, path, body) -> list:
    """A streaming request's events, parsed; the last is the string "[DONE]"."""
    async with session.post(url + path, json={**body, "stream": True}, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        data = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
        return [json.loads(d) if d != b"[DONE]" else "[DONE]" for d in data]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_dir):
    # a long context, so a request can be asked for far more tokens than a test waits for
    return save_tiny_chat_model(tmp_path_factory.mktemp("serve") / "tiny", smollm2_dir, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("log") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_model, server_log):
    proc, url = start_server(tiny_model, server_log, *SERVER_FLAGS, "--api-key", API_KEY)
    yield url
    proc.terminate()
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()  # a no-op once it has exited


def wait_until_idle(url, timeout=10) -> dict:
    deadline = time.time() + timeout
    while True:
        _, health = call(url, "/health")
        idle = health["running"] == health["waiting"] == health["locked_slots"] == 0
        if idle and health["free_slots"] + health["cached_slots"] == health["total_slots"]:
            return health
        assert time.time() < deadline, f"requests left behind: {health}"
        time.sleep(0.1)


def test_openai_client_gets_the_text_of_generate(server, tiny_model):
    chat_reference = run_cli("--model", str(tiny_model), "--prompt", PROMPT, "--max-new-tokens", "24")
    raw_reference = run_cli("--model", str(tiny_model), "--prompt", PROMPT, "--max-new-tokens", "24",
                            "--no-chat-template")
    chat_reference, raw_reference = (r.stdout.removesuffix("\n") for r in (chat_reference, raw_reference))
    assert chat_reference and raw_reference and chat_reference != raw_reference

    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]
    chat = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0)
    reply = client.chat.completions.create(**chat)
    assert reply.choices[0].message.content == chat_reference
    assert reply.usage.completion_tokens <= 24 and reply.choices[0].finish_reason in ("stop", "length")
    chunks = client.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_reference

    completion = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert client.completions.create(**completion).choices[0].text == raw_reference
    chunks = client.completions.create(**completion, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == raw_reference


def test_64_concurrent_streams(server):
    async def one(session, i):
        body = dict(prompt=list(range(100, 110 + i)), max_tokens=4 + i % 13, temperature=1.0, seed=i,
                    ignore_eos=True, stream_options={"include_usage": True})
        events = await read_stream(session, server, "/v1/completions", body)
        *chunks, usage, done = events
        assert done == "[DONE]" and usage["usage"]["completion_tokens"] == body["max_tokens"]
        assert usage["usage"]["prompt_tokens"] == 10 + i
        # one event per token, so a client can time each one
        assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1] * body["max_tokens"]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session, i) for i in range(64)))

    asyncio.run(main())
    wait_until_idle(server)


def test_disconnected_clients_leave_no_trace(server, server_log):
    # each asks for thousands of tokens: only an abort frees them within the wait below
    body = dict(prompt=[200, 201, 202], max_tokens=4000, ignore_eos=True)

    async def hang_up_mid_stream(session):
        async with session.post(server + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as resp:
            events = 0
            async for line in resp.content:
                events += line.startswith(b"data: ")
                if events == 3:
                    return  # leaving the block closes the connection

    async def give_up_waiting(session):
        with pytest.raises(asyncio.TimeoutError):
            await session.post(server + "/v1/completions", json=body, headers=AUTH,
                               timeout=aiohttp.ClientTimeout(total=1))

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*[hang_up_mid_stream(session) for _ in range(16)],
                                 *[give_up_waiting(session) for _ in range(2)])

    asyncio.run(main())
    wait_until_idle(server)
    assert call(server, "/v1/completions", dict(prompt="hi", max_tokens=2))[0] == 200
    assert "Traceback" not in server_log.read_text()  # no answer was built for a client gone


TOO_LONG = "word " * 5000
BAD_INPUTS = [  # (path, body or raw bytes, status, param)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"x{i}" for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {"prompt": [[5]] * 9, "n": 128}, 400, "prompt"),  # 1,152 choices
    ("/v1/completions", {"prompt": ["hi"] * 1025}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n"),  # OpenAI's limit, 128, whatever the prompts
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": ["hi", [1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["hi", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [5]}, 400, "stop_token_ids"),  # vLLM's, not its default
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("inf")}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),  # past the context
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 4}, 400, None),  # the prompt alone is too long
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_p": float("nan")}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "caf\udce9"}, 400, None),  # a lone surrogate: no text
    # the same in UTF-8's shape, which json.loads took from bytes (a 500 from the tokenizer, a traceback)
    ("/v1/completions", b'{"prompt": "caf\xed\xb3\xa9"}', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, None),
    ("/tokenize", b'{"prompt": "\xed\xa0\x80"}', 400, None),
    ("/v1/completions", '{"prompt": "hi"}'.encode("utf-16"), 400, None),  # JSON between systems is UTF-8
    ("/v1/completions", {"prompt": "hi", "a\nb": 1}, 400, "a\nb"),  # the message names the key on one line
    ("/tokenize", {"messages": []}, 400, "messages"),  # as a chat's: no messages, no prompt
    ("/v1/completions", {"prompt": "hi", "store": 0}, 400, "store"),  # a number is no bool's off value
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": False}, 400, "frequency_penalty"),  # nor the reverse
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),  # deeper than json can parse
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    # 0 is no budget (`or` would read it as absent and run to the context)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens"),  # past the context: the field sent is the one named
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages"),  # a text part whose text is no string: a 400, not a 500 from joining it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}], "stream": True}, 400, None),
    ("/v1/nowhere", {}, 404, None),
]


def test_off_values_of_missing_features_are_accepted(server):
    """Some clients send these with every request; in their off values they ask for nothing."""
    off = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "best_of": 1, "top_k": -1,
           "min_p": 0, "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
           "store": False, "metadata": {}, "user": "someone", "suffix": None, "skip_special_tokens": True,
           # vLLM's fields in vLLM's defaults, as its clients may send them: a 400 before
           "spaces_between_special_tokens": True, "stop_token_ids": [], "include_stop_str_in_output": False,
           "add_generation_prompt": True, "continue_final_message": False,
           # OpenAI's fields in their other off values, and vLLM's min_tokens
           "parallel_tool_calls": False, "service_tier": "default", "min_tokens": 0}
    got, reply = call(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": False, "logprobs": None, **off})
    assert got == 200 and reply["usage"]["completion_tokens"] == 2, reply
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "name": "ann", "content": "hi"},
                {"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    got, reply = call(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "logprobs": False,
                                                       "top_logprobs": 0, **off,
                                                       "tool_choice": "auto"})  # no tools: auto is none
    assert got == 200, reply
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": messages})):
        for options in ({"include_usage": True, "continuous_usage_stats": False}, {"continuous_usage_stats": None},
                        {"include_usage": None}):  # null: the default (no usage), as OpenAI's and vLLM's schemas
            events = asyncio.run(read_stream_once(server, path, {**body, "max_tokens": 2, "stream_options": options}))
            assert events[-1] == "[DONE]" and ("usage" in events[-2]) == bool(options.get("include_usage")), events


def test_echo_gives_the_prompt_back_as_sent(server):
    """A text prompt comes back verbatim, special tokens too (vLLM's echo), and the listed tokens
    join up to the text; token ids come back as their text with the special tokens in it."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n"
    ids = call(server, "/tokenize", {"prompt": prompt})[1]["tokens"]
    for sent in (prompt, ids):
        status, reply = call(server, "/v1/completions", dict(prompt=sent, max_tokens=2, echo=True, logprobs=0))
        choice = reply["choices"][0]
        assert status == 200 and choice["text"].startswith(prompt), choice["text"]
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    status, reply = call(server, "/v1/completions", dict(prompt=prompt, max_tokens=2, echo=True))  # no logprobs asked
    choice = reply["choices"][0]
    assert status == 200 and choice["text"].startswith(prompt) and choice["logprobs"] is None, reply


def test_a_request_of_as_many_choices_and_stop_strings_as_allowed_runs(server):
    """1,024 choices (prompts x n) and 16 stop strings: each costs the event loop, so one more is a 400."""
    body = dict(prompt=[[5], [6]] * 4, n=128, max_tokens=1, stop=[f"{i}{i}" for i in range(16)])
    status, reply = call(server, "/v1/completions", body)
    assert status == 200 and len(reply["choices"]) == 1024 and reply["usage"]["completion_tokens"] == 1024, reply


def test_a_seed_near_the_top_of_its_range_takes_n_samples(server):
    """Sample j draws with seed s + j, wrapped into [0, 2^63): the last seed's second sample is seed 0's."""
    body = dict(prompt="hi", max_tokens=4, temperature=1.0)
    status, reply = call(server, "/v1/completions", dict(body, seed=2**63 - 1, n=2))
    assert status == 200, reply
    assert reply["choices"][1]["token_ids"] == call(server, "/v1/completions", dict(body, seed=0))[1]["choices"][0]["token_ids"]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_an_error_and_the_server_goes_on(server, path, body, status, param):
    got, reply = call(server, path, raw=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    got, reply = call(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert got == 200 and reply["usage"]["completion_tokens"] <= 2


ODD_VALUES = [None, True, 0, -1, 2**64, 1e30, 0.5, "", "x", [], [0, 1], [[1, 2]], [""], {}, {"a": 1},
              [{"role": "user"}], [{"role": "user", "content": [{"type": "text"}]}], 49152, [49152]]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "stream_options", "logprobs", "top_logprobs", "echo", "seed", "presence_penalty", "logit_bias",
          "user", "suffix", "best_of", "response_format", "tools", "tool_choice", "ignore_eos", "min_tokens", "tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_every_field_set_to_an_odd_value_gets_an_answer_or_an_openai_error(server, path):
    """Each field in turn set to each odd value (null, wrong types, numbers past any range, empty or
    nested lists) in an otherwise good body: a 200 or a 4xx with OpenAI's error body, never a 500."""
    good = {"/v1/completions": {"prompt": "the cat", "max_tokens": 2}, "/tokenize": {"prompt": "the cat"},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2},
            "/detokenize": {"tokens": [1, 2, 3]}}[path]
    for field in FIELDS:
        for value in ODD_VALUES:
            status, reply = call(server, path, {**good, field: value})
            assert status == 200 or (400 <= status < 500 and reply["error"]["message"]), (field, value, status, reply)
    assert call(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})[0] == 200


def test_a_wrong_method_is_a_405_that_names_the_right_one(server):
    """HTTP's rule: a 405 says in `Allow` which methods the path takes; the body is OpenAI's error JSON."""
    conn = http.client.HTTPConnection(server.removeprefix("http://"), timeout=60)
    conn.request("GET", "/v1/completions", headers=AUTH)
    resp = conn.getresponse()
    assert resp.status == 405 and resp.getheader("Allow") == "POST", resp.getheaders()
    assert json.loads(resp.read())["error"]["message"] == "Method Not Allowed"


def test_health_is_200_while_the_engine_lives(server):
    """A load balancer reads the status alone: 200 while the engine serves (503 once it died)."""
    status, health = call(server, "/health", headers={})
    assert status == 200 and health["status"] == "ok" and health["total_slots"] > 0, health


def test_a_body_with_many_problems_names_three(server):
    """Up to three of pydantic's problems, each with its field, as one line."""
    fields = random.Random(0).sample(["temperature", "top_p", "n", "seed", "stream", "echo", "user"], 5)
    got, reply = call(server, "/v1/completions", {"prompt": "hi", **{name: [1] for name in fields}})
    problems = reply["error"]["message"].split("; ")
    assert got == 400 and len(problems) == 3 and all(p.split(":")[0] in fields for p in problems), reply


def test_a_request_that_does_not_say_runs_to_eos():
    """ignore_eos is off unless asked for (vLLM's default), in either API; the other settings
    left out take OpenAI's defaults: temperature 1 and top_p 1 (no top-k, seed or logprobs)."""
    for request in (CompletionRequest(prompt="hi"), ChatRequest(messages=[{"role": "user", "content": "hi"}])):
        params = request.sampling_params(random.randint(1, 99))
        assert params.ignore_eos is False
        assert (params.temperature, params.top_p, params.top_k, params.seed, params.logprobs) == (1, 1, 0, None, None)


def test_a_request_without_max_tokens_gets_its_apis_default_length(tiny_model):
    """Without max_tokens, a completion gets OpenAI's 16 tokens and a chat runs to the context (vLLM's
    defaults), here a 64-token one; ignore_eos keeps either from stopping early."""
    engine = Engine(tiny_model, EngineConfig(context_length=64, log=False))
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, _):
        _, completion = call(url, "/v1/completions", dict(prompt="hi there", ignore_eos=True))
        _, chat = call(url, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], ignore_eos=True))
    assert completion["usage"]["completion_tokens"] == 16
    assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == 64
    assert chat["choices"][0]["finish_reason"] == completion["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_without_top_logprobs_lists_each_chosen_token(server):
    """OpenAI's chat: logprobs true alone gives every token's logprob, with no alternatives (top_logprobs 0)."""
    status, reply = call(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "logprobs": True})
    assert status == 200 and reply["choices"][0]["logprobs"] is not None, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] and all(e["top_logprobs"] == [] for e in content), reply


def test_oversized_body_is_refused_with_413(server):
    # announced, not sent: a client still writing when the 413 comes gets a broken pipe
    conn = http.client.HTTPConnection(server.removeprefix("http://"), timeout=10)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**AUTH, "Content-Type": "application/json", "Content-Length": MAX_BODY_BYTES + 1}.items():
        conn.putheader(name, value)
    conn.endheaders()
    reply = conn.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["message"]
    conn.close()
    assert call(server, "/v1/completions", dict(prompt="hi", max_tokens=2))[0] == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_string_cuts_where_it_begins(server, path, stream):
    body = dict(max_tokens=24, temperature=0, ignore_eos=True,
                **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}))

    def text_of(reply):
        choice = reply["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    unstopped = call(server, path, body)[1]
    full = text_of(unstopped)
    assert unstopped["choices"][0]["finish_reason"] == "length" and unstopped["choices"][0]["stop_reason"] is None
    stop = full[len(full) // 2 : len(full) // 2 + 4]  # a stop string the model is sure to write
    assert len(full) > 8 and len(stop.strip()) > 0
    body["stop"] = ["never written", stop]
    if stream:
        events = asyncio.run(read_stream_once(server, path, body))
        chunks = events[:-1]
        text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "") for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
        stop_reasons = [c["choices"][0]["stop_reason"] for c in chunks]  # vLLM's: the stop string, on the last
        assert stop_reasons[:-1] == [None] * (len(chunks) - 1)
    else:
        reply = call(server, path, body)[1]
        text, reason = text_of(reply), reply["choices"][0]["finish_reason"]
        stop_reasons = [reply["choices"][0]["stop_reason"]]
        assert reply["usage"]["completion_tokens"] < 24
    assert text == full[: full.index(stop)] and reason == "stop" and stop_reasons[-1] == stop
    wait_until_idle(server)


async def read_stream_once(url, path, body):
    async with aiohttp.ClientSession() as session:
        return await read_stream(session, url, path, body)


def test_api_key_is_required_except_for_health(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, reply = call(server, "/v1/models", headers=headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        assert call(server, "/v1/completions", {"prompt": "hi"}, headers=headers)[0] == 401
    assert call(server, "/health", headers={})[0] == 200
    assert call(server, "/v1/models")[0] == 200


@pytest.mark.parametrize("ids", [[-1], [5, -1], [320], [0, 320], [10**6]])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(ids):
    """/detokenize hands its ids to the tokenizer alone (no engine check behind it): without this check
    -1 makes the tokenizers library raise (a 500), and the vocabulary's size decodes to "" (a 200)."""
    from nano.serve import checked_ids

    state = SimpleNamespace(client=SimpleNamespace(vocab_size=320))
    with pytest.raises(APIError) as refused:
        checked_ids(state, ids, "tokens")
    assert (refused.value.status, refused.value.param, refused.value.message) == (400, "tokens",
                                                                                 "token ids must be in [0, 320)")
    assert checked_ids(state, [0, 319, 7], "tokens") == [0, 319, 7]


def test_an_unknown_model_id_is_openais_404(server):
    """GET /v1/models/{id} of a model the server does not serve: OpenAI's 404 with code model_not_found
    (the SDK raises NotFoundError on it); the served one's card otherwise."""
    status, missing = call(server, "/v1/models/gpt-4")
    assert status == 404 and missing["error"]["code"] == "model_not_found" and missing["error"]["param"] == "model"
    name = call(server, "/v1/models")[1]["data"][0]["id"]
    status, card = call(server, "/v1/models/" + name)
    assert status == 200 and card["id"] == name and card["max_model_len"] == 4096


@pytest.mark.parametrize("second_ctrl_c", [False, True], ids=["sigterm", "ctrl-c twice"])
def test_a_stop_finishes_the_request_in_flight_and_a_second_ctrl_c_cuts_it_off(tiny_model, tmp_path, second_ctrl_c):
    """SIGTERM (as a first Ctrl-C) lets the request in flight finish, then the server exits 0. A second
    Ctrl-C ends it at once with exit status 130, its engine too; uvicorn's own "force quit" cancelled
    each request with a traceback, then the engine's, and exited 0."""
    proc, url = start_server(tiny_model, tmp_path / "server.log", *SERVER_FLAGS)
    body = dict(prompt=[300, 301], max_tokens=4000 if second_ctrl_c else 200, ignore_eos=True, stream=True)

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=body) as resp:
                lines, rest = resp.content.__aiter__(), []
                assert (await lines.__anext__()).startswith(b"data: ")
                engine = engine_pid(proc.pid)
                proc.send_signal(signal.SIGINT if second_ctrl_c else signal.SIGTERM)
                if second_ctrl_c:
                    for _ in range(40):  # 20 more events (each and a blank line): the first lets it run on
                        await lines.__anext__()
                    proc.send_signal(signal.SIGINT)
                with suppress(aiohttp.ClientPayloadError):  # the second: the chunked body ends unfinished
                    rest += [line async for line in lines if line.startswith(b"data: ")]
                return engine, rest

    try:
        engine, rest = asyncio.run(main())
        assert proc.wait(timeout=60) == (130 if second_ctrl_c else 0)
        log = (tmp_path / "server.log").read_text()
        assert "Traceback" not in log and "error" not in log.lower(), log
        if second_ctrl_c:
            assert rest[-1:] != [b"data: [DONE]\n"] and len(rest) < 4000 - 21  # cut off
        else:
            assert rest[-1] == b"data: [DONE]\n" and len(rest) == 200  # 199 more tokens, then [DONE]
        time.sleep(1)
        assert not Path(f"/proc/{engine}").exists() or state_and_parent(engine)[0] == "Z"  # not left running
    finally:
        proc.kill()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)


def test_an_engine_that_cannot_start_is_one_line_and_exit_2(tiny_model):
    """The engine is built in a process of its own; what stops it comes back as the usual one line."""
    assert_one_line_error(run_cli("--model", str(tiny_model), "--max-total-tokens", "0", module="nano.serve"),
                          "--max-total-tokens must be > 0")


def state_and_parent(pid: int | str) -> tuple[str, int]:
    """A process's state letter ("Z": exited, not yet reaped) and parent, from /proc; ("Z", 0) once gone."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except OSError:
        return "Z", 0
    return state, int(ppid)


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").glob("[0-9]*"):
        state, parent = state_and_parent(entry.name)
        if parent == pid and state != "Z":
            children.append(int(entry.name))
    return children


def is_running(pid: int) -> bool:
    return state_and_parent(pid)[0] != "Z"


def test_the_engine_process_ends_with_the_server(tiny_model, tmp_path):
    """Killed outright, with no shutdown to run, the server leaves no process behind holding the
    model and the KV cache."""
    proc, _ = start_server(tiny_model, tmp_path / "server.log", *SERVER_FLAGS)
    children = child_pids(proc.pid)
    assert children  # the engine's process (and multiprocessing's helper)
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    while any(is_running(pid) for pid in children):
        assert time.time() < deadline, "a process outlived the server"
        time.sleep(0.1)


def test_engine_exception_fails_its_requests_with_500_and_serving_goes_on(tiny_model, monkeypatch):
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=8, log=False))
    passes = {"done": 0, "fail_at": None}
    real_model = engine.model

    def model(batch, attn):  # the injected fault: forward pass number `fail_at` raises
        passes["done"] += 1
        if passes["done"] == passes["fail_at"]:
            raise RuntimeError("injected fault")
        return real_model(batch, attn)

    monkeypatch.setattr(engine, "model", model)
    body = dict(prompt=[5, 6, 7], max_tokens=10, ignore_eos=True)
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, client):
        passes["fail_at"] = passes["done"] + 1  # the prefill
        status, reply = call(url, "/v1/completions", body)
        assert status == 500 and reply["error"]["type"] == "server_error"
        assert "RuntimeError" in reply["error"]["message"] and "injected" not in reply["error"]["message"]

        # a decode pass: two tokens out (the prefill's, and the first decode pass's, handed out by the
        # step that launches the second while the GPU would run it), then the error of the third
        passes["fail_at"] = passes["done"] + 4
        events = asyncio.run(read_stream_once(url, "/v1/completions", body))
        assert [len(e["choices"]) for e in events[:2]] == [1, 1]
        assert events[2]["error"]["type"] == "server_error" and events[3:] == ["[DONE]"]

        _, health = call(url, "/health")
        assert health["running"] == health["waiting"] == 0
        status, reply = call(url, "/v1/completions", body)
        assert status == 200 and reply["usage"]["completion_tokens"] == 10

        # a client that hangs up mid-stream: its stream is forgotten at once, not kept waiting
        # for events that will never come
        connection = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        connection.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 4000, "stream": True}),
                           {"Content-Type": "application/json"})
        connection.getresponse().readline()
        connection.close()
        deadline = time.time() + 10
        while client.streams or call(url, "/health")[1]["running"]:
            assert time.time() < deadline, f"left behind: {client.streams}"
            time.sleep(0.05)


def test_a_request_that_a_failed_step_finished_still_gets_an_answer(tiny_model, capsys):
    """Overlap: a step books the decode pass in flight (here request 0's last token), then runs a prefill
    for a new prompt. When that prefill raises, request 0 gets the 500 too, not silence."""
    from nano.engine_process import _step
    from nano.sampling import SamplingParams

    engine = Engine(tiny_model, EngineConfig(max_total_tokens=2000, log=False))
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=1)
    requests = {0: engine.add_request([1, 2, 3], params)}
    assert len(_step(engine, requests)) == 1 and _step(engine, requests) == []  # the last token is in flight

    def broken(batch, attn):
        raise RuntimeError("injected fault")

    engine.model = broken
    requests[1] = engine.add_request([4, 5, 6], params)
    events = dict(_step(engine, requests))  # books request 0's last token, then request 1's prefill raises
    assert set(events) == {0, 1} and all(e.status == 500 for e in events.values())
    assert not requests and not engine.logprobs and not engine.has_work()
    # the 500 says "see the server log": the traceback is there, the fault named
    assert "Traceback" in (err := capsys.readouterr().err) and "RuntimeError: injected fault" in err


def test_a_failed_step_leaves_the_requests_it_did_not_run_queued(tiny_model, capsys):
    """A step that raises fails what it ran. A request still queued for room (one runs at a time here)
    held nothing the step touched: it stays queued, and runs in full once the model works again."""
    from nano.engine_process import _step
    from nano.sampling import SamplingParams

    engine = Engine(tiny_model, EngineConfig(max_total_tokens=2000, max_running_requests=1, log=False))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    requests = {0: engine.add_request([1, 2, 3], params)}
    assert len(_step(engine, requests)) == 1  # request 0 prefilled and running
    requests[1] = engine.add_request([4, 5, 6], params)
    real_model = engine.model

    def broken(batch, attn):
        raise RuntimeError("injected fault")

    engine.model = broken
    events = dict(_step(engine, requests))  # request 0's next decode pass raises
    assert set(events) == {0} and events[0].status == 500 and set(requests) == {1}
    assert "RuntimeError: injected fault" in capsys.readouterr().err
    engine.model = real_model
    tokens = []
    while engine.has_work():
        tokens += [event for sid, event in _step(engine, requests) if sid == 1]
    assert [t.finish_reason for t in tokens] == [None, None, None, "length"] and not requests


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the planted death
def test_an_engine_that_dies_fails_what_it_held_and_what_comes_later(tiny_model, monkeypatch):
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=8, log=False))

    def step():
        raise SystemExit  # the loop itself ends, as if the engine's process were killed

    monkeypatch.setattr(engine, "step", step)
    body = dict(prompt=[5, 6, 7], max_tokens=10)
    with in_process_server(engine, None) as (url, _):
        assert call(url, "/health")[0] == 200
        status, reply = call(url, "/v1/completions", body)  # the engine died with it
        assert status == 500 and "engine process exited" in reply["error"]["message"]
        status, reply = call(url, "/v1/completions", body)
        assert status == 503 and reply["error"]["type"] == "server_error"
        status, reply = call(url, "/health")  # a load balancer polls it: nothing will be answered again
        assert status == 503 and reply["status"] == "engine process exited", reply


def test_a_body_that_stops_coming_is_a_408_and_one_cut_off_no_traceback(tiny_model, monkeypatch, capfd):
    """A client that sends part of its body, then nothing, held its connection for ever, and a stop
    (SIGTERM) waited on it without end; one that hangs up mid-body logged a traceback."""
    import socket

    from nano import api

    monkeypatch.setattr(api, "BODY_SECONDS", 0.5)
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=256, log=False))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with in_process_server(engine, None) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(head + b'{"prompt": [1,')
            answer = http.client.HTTPResponse(slow)  # reads the whole answer: head and body may come apart
            answer.begin()
            body = answer.read()
        assert answer.status == 408 and b"did not arrive within 0.5 s" in body, body
        with socket.create_connection(("127.0.0.1", port), timeout=10) as gone:
            gone.sendall(head + b'{"prompt": [1,')
        time.sleep(0.3)
        assert call(url, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=2))[0] == 200
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_submitted_as_the_engine_dies_gets_the_500_too(capsys):
    """The reader thread finds the engine's process dead between submit's check that it is alive and
    its stream's entry (here the reader's whole run happens there): the streams to fail are read on
    the event loop, where submit runs, after it. Read on the reader thread, that one waited for ever."""
    from nano.engine_process import Ready, Stream
    from nano.sampling import SamplingParams

    class Worker:  # the engine's process: alive at submit's check, dead by the time the reader looks
        exitcode, checks = 1, 0

        def is_alive(self):
            self.checks += 1
            if self.checks > 1:  # the reader's look
                return False
            client._read()  # submit's check: the reader runs to its end in it
            return True

    outbox, callbacks = queue.Queue(), []
    outbox.put(Ready(vocab_size=100, eos_token_ids=[0], context_length=64, state={}))
    client = EngineClient(queue.Queue(), outbox, Worker())
    client.loop = type("Loop", (), {"call_soon_threadsafe": lambda self, *call: callbacks.append(call)})()
    stream = Stream([5, 6, 7], SamplingParams(max_new_tokens=2), set())
    client.submit(stream)
    for callback, *args in callbacks:  # the event loop's turn, after submit
        callback(*args)
    assert stream.events.get_nowait().status == 500 and not client.streams
    assert "the engine process exited" in capsys.readouterr().err


@contextmanager
def stream_holding_the_only_row(url):
    """A streamed request of 4,000 tokens, running: it holds an engine's only row for far longer
    than a test waits."""
    hog = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    hog.request("POST", "/v1/completions", json.dumps(dict(prompt=[1, 2, 3], max_tokens=4000, ignore_eos=True,
                                                           stream=True)), {"Content-Type": "application/json"})
    hogging = hog.getresponse()
    hogging.readline()
    try:
        yield
    finally:
        hogging.close()
        hog.close()


def wait_until_none_waiting(url, client, timeout=10):
    deadline = time.time() + timeout
    while call(url, "/health")[1]["waiting"]:
        assert time.time() < deadline, client.streams
        time.sleep(0.05)


def test_a_refused_prompt_is_answered_without_waiting_for_the_requests_other_prompts(tiny_model):
    """One prompt of a list is refused (too long) while the others queue behind a long request for the
    only row: the 400 comes at once, as vLLM's, and the others leave the queue."""
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=1, log=False))
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, client):
        with stream_holding_the_only_row(url):
            body = json.dumps(dict(prompt=["hi", TOO_LONG])).encode()
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 400, refused.value.read()
            wait_until_none_waiting(url, client)  # "hi" is aborted, not left to run for nobody


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_while_queued_leaves_nothing_behind(tiny_model, capfd, stream):
    """A request waits for the only row and its client gives up before its first token: the request
    leaves the queue, and the server logs no traceback for the answer nobody reads."""
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=1, log=False))
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, client):
        with stream_holding_the_only_row(url):
            body = json.dumps(dict(prompt=[4, 5], stream=stream)).encode()
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with pytest.raises(TimeoutError):
                urllib.request.urlopen(request, timeout=1)
            wait_until_none_waiting(url, client)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_with_logprobs_is_built_off_the_event_loop(tiny_model, monkeypatch, stream):
    """An echo of a long prompt with logprobs and many choices is millions of entries to build (21
    million for 128 choices of 8k tokens with 20 alternatives): built on the event loop, every other
    stream waited it out. A whole answer's choices, and a stream's first event of each choice (the one
    that carries the prompt's logprobs), are built where no event loop runs, checked by watching where."""
    from nano import serve

    def on_a_loop() -> bool:
        try:
            return asyncio.get_running_loop() is not None
        except RuntimeError:  # none runs in this thread
            return False

    built, choice = [], serve.Answer.choice  # (on a loop, the choice's first part)

    def watched(*args):
        built.append((on_a_loop(), args[5] if len(args) > 5 else True))
        return choice(*args)

    monkeypatch.setattr(serve.Answer, "choice", watched)
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, log=False))
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        sent = dict(model="tiny", prompt=[5, 9, 11], max_tokens=2, n=3, echo=True, logprobs=2, stream=stream)
        reply = client.completions.create(**sent)
        parts = list(reply) if stream else [reply]
    firsts = [part for part in parts for c in part.choices if c.logprobs and len(c.logprobs.tokens) > 1]
    assert len(firsts) == 3 and {c.index for part in firsts for c in part.choices} == {0, 1, 2}  # the echoes
    assert sorted(built) == [(False, True)] * 3 + [(True, False)] * (3 if stream else 0), built


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_with_n_choices_computes_its_prompt_logprobs_once(tiny_model, stream):
    """n choices of one prompt share its logprobs: the first choice alone asks the engine for them
    (a vocabulary-wide log-softmax per prompt token, and a prefill that skips the prefix cache), the
    others find the prompt in the prefix cache. Every choice still echoes them, equal to n = 1's."""
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, log=False))
    asked, add_request = [], engine.add_request
    engine.add_request = lambda ids, params, stop_ids: (asked.append(params.prompt_logprobs),
                                                        add_request(ids, params, stop_ids))[1]
    prompt = random.Random(0).choices(range(4, 200), k=50)  # longer than the scheduler's shared head
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        sent = dict(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=2, temperature=1.0, stream=stream)
        alone = client.completions.create(**sent)
        asked.clear()
        reply = client.completions.create(**sent, n=4)
        firsts = [c for part in (reply if stream else [reply]) for c in part.choices if c.logprobs
                  and len(c.logprobs.tokens) > 2]
        alone = next(c for part in (alone if stream else [alone]) for c in part.choices)
    assert asked == [True, False, False, False], asked
    assert sorted(c.index for c in firsts) == [0, 1, 2, 3]
    for choice in firsts:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert getattr(choice.logprobs, name)[:len(prompt)] == getattr(alone.logprobs, name)[:len(prompt)], name
    assert engine.stats["cached_tokens"] >= 3 * (len(prompt) - 1)  # the others skipped the prompt's prefill


def test_a_bug_in_a_route_is_an_openai_style_500_and_serving_goes_on(tiny_model, monkeypatch):
    """An exception no route expected (a bug, planted here) reaches the client as OpenAI's error JSON
    with a 500 that names its kind, not Starlette's plain text; the next request is answered."""
    from nano import serve

    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=8, log=False))
    usage, planted = serve.Answer.usage, {"on": True}

    def buggy_usage(self, n):
        if planted["on"]:
            raise RuntimeError("planted bug")
        return usage(self, n)

    monkeypatch.setattr(serve.Answer, "usage", buggy_usage)
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, _):
        status, reply = call(url, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=2))
        assert status == 500 and reply["error"]["message"] == "internal error (RuntimeError)", reply
        planted["on"] = False
        assert call(url, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=2))[0] == 200


def test_a_failed_step_leaves_no_choice_of_a_request_waiting(tiny_model):
    """A non-streamed request's choices: one is retracted to the queue, then a step fails the ones
    running. The 500 goes out, and the read of the retracted choice ends too, not left pending forever
    (asyncio's gather leaves the rest running when one raises)."""
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=48, max_running_requests=8, log=False))
    real_model, retract, passes, retracted = engine.model, engine.scheduler.retract, [], []
    engine.scheduler.retract = lambda req: (retracted.append(len(passes)), retract(req))

    def model(batch, attn):  # the second pass after the first retraction raises
        passes.append(batch)
        if retracted and len(passes) == retracted[0] + 2:
            raise RuntimeError("injected fault")
        return real_model(batch, attn)

    engine.model = model
    body = dict(prompt=[[5, 6, 7, 8], [9, 10, 11, 12]], n=2, max_tokens=30, ignore_eos=True)

    async def readers():
        return [t for t in asyncio.all_tasks() if "_collect" in repr(t) or "_pieces" in repr(t)]

    with in_process_server(engine, Tokenizer(tiny_model)) as (url, client):
        assert call(url, "/v1/completions", body)[0] == 500 and retracted
        time.sleep(0.2)
        assert asyncio.run_coroutine_threadsafe(readers(), client.loop).result(timeout=10) == []
        assert not client.streams and call(url, "/health")[1]["waiting"] == 0


def test_logprobs_of_overflowed_logits_fail_the_request_saying_so(tiny_model):
    """JSON has no NaN: a model whose logits overflowed (float16, say) gave a whole answer an unexplained
    500 and a stream `NaN` that clients cannot parse. Both get the reason now, as an error; a request
    that asks for no logprobs still gets its tokens, and the server goes on."""
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=8, log=False))
    real_model, overflow = engine.model, {"on": True}
    engine.model = lambda batch, attn: real_model(batch, attn) * (float("nan") if overflow["on"] else 1.0)
    body = dict(prompt=[5, 6, 7], max_tokens=3, logprobs=1)
    with in_process_server(engine, Tokenizer(tiny_model)) as (url, _):
        status, reply = call(url, "/v1/completions", body)
        assert status == 500 and "not finite" in reply["error"]["message"], reply
        events = asyncio.run(read_stream_once(url, "/v1/completions", body))
        assert "not finite" in events[-2]["error"]["message"] and events[-1] == "[DONE]", events
        assert call(url, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=3))[0] == 200
        overflow["on"] = False
        assert call(url, "/v1/completions", body)[0] == 200


def test_a_server_without_a_tokenizer_serves_token_ids_and_refuses_text(tiny_model):
    """A shipped shape has no tokenizer: token ids in, token ids out (vLLM's "token_id:N" for their
    text), and what needs text is a 400 that says why."""
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, max_running_requests=8, log=False))
    with in_process_server(engine, None) as (url, _):
        status, reply = call(url, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=3, logprobs=1, echo=True))
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 3
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in [5, 6, 7] + choice["token_ids"]]
        for path, body, param in [("/v1/completions", dict(prompt="hi"), None),
                                  ("/v1/completions", dict(prompt=[5, 6], stop=["x"]), "stop"),
                                  ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}]), None),
                                  ("/tokenize", dict(prompt="hi"), None), ("/detokenize", dict(tokens=[5]), None),
                                  ("/tokenizer_info", None, None)]:
            status, reply = call(url, path, body)
            assert status == 400 and "tokenizer" in reply["error"]["message"], (path, reply)
            assert reply["error"]["param"] == param, (path, reply)


@pytest.mark.parametrize("template, refusal", [
    (None, ("no chat template: use /v1/completions", None)),
    ("{{ raise_exception('roles must alternate') }}", ("the chat template refused these messages: roles must alternate",
                                                        "messages"))])
def test_a_chat_the_tokenizer_cannot_render_is_a_400(tiny_model, tmp_path, template, refusal):
    """A tokenizer without a chat template, or a template that raises (Mistral's, for roles out of
    turn): the chat is refused in a line that says why; completions still run."""
    folder = tmp_path / "template"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    engine = Engine(folder, EngineConfig(max_total_tokens=10000, max_running_requests=8, log=False))
    with in_process_server(engine, Tokenizer(folder)) as (url, _):
        status, reply = call(url, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}]))
        assert status == 400 and refusal[0] in reply["error"]["message"], reply
        assert reply["error"]["param"] == refusal[1], reply
        assert call(url, "/v1/completions", dict(prompt="hi", max_tokens=2))[0] == 200


@contextmanager
def in_process_server(engine, tokenizer):
    """The server in this process, its engine loop on a thread (`nano.serve` runs it in a process
    of its own), so a test can plant a fault in the engine -> (url, the EngineClient)."""
    inbox, outbox = queue.Queue(), queue.Queue()
    worker = threading.Thread(target=run_engine, args=(engine, inbox, outbox))
    worker.start()
    client, port = EngineClient(inbox, outbox, worker), free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(client, tokenizer, "tiny"), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    while not server.started:
        assert thread.is_alive(), f"the in-process server did not start (port {port} taken in between?)"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", client
    finally:
        server.should_exit = True
        thread.join()


def test_bench_serving_counts_every_token(server, tmp_path, capsys):
    from nano import bench_serving

    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text('{"prompt": "Hello there", "output_len": 5}\n{"prompt": [7, 8, 9]}\n')
    hello_tokens = call(server, "/v1/completions", dict(prompt="Hello there", max_tokens=1))[1]["usage"]["prompt_tokens"]
    # --unknown-output-len: each asks for the whole context and hangs up after 4 tokens (chat-shaped)
    for dataset, input_tokens, output_tokens, flags in [
            ("random", 6 * 32, 6 * 4, []), ("shared-prefix", 6 * (40 + 4), 6 * 4, []),
            (str(prompt_file), 3 * hello_tokens + 3 * 3, 3 * 5 + 3 * 4, []), ("random", 6 * 32, 6 * 4, ["--unknown-output-len"])]:
        bench_serving.main(["--base-url", server, "--api-key", API_KEY, "--num-prompts", "6", "--dataset", dataset,
                            "--random-input-len", "32", "--random-output-len", "4", "--shared-prefix-len", "40",
                            "--suffix-len", "4", "--request-rate", "50", "--max-concurrency", "4", *flags])
        captured = capsys.readouterr()
        rows = dict(line.split(":", 1) for line in captured.out.splitlines() if ":" in line)
        assert int(rows["Successful requests"]) == 6 and int(rows["Failed requests"]) == 0
        assert int(rows["Total input tokens"]) == input_tokens
        assert int(rows["Total generated tokens"]) == output_tokens
        assert float(rows["Median ITL (ms)"]) > 0 and "warning" not in captured.err
        assert int(rows["Most requests running at once"].split(";")[0]) <= 4  # sampled every 0.2 s
    wait_until_idle(server)  # the hung-up requests were aborted, not left running to the context


def test_bench_serving_warms_up_with_a_request_shaped_as_the_timed_ones(server, monkeypatch, capsys):
    """--unknown-output-len: the warm-up asks for the whole context too (and hangs up), as every timed
    request does; asking for its exact length instead, it warmed up another path than the one timed.
    And none of the timed prompts finds the warm-up's in the prefix cache: it sent the first timed
    prompt itself, which was then timed as a cache hit."""
    from nano import bench_serving

    real_send, contexts = bench_serving.send, []

    async def send(session, url, model, prompt, output_len, context=None):
        contexts.append(context)
        return await real_send(session, url, model, prompt, output_len, context)

    monkeypatch.setattr(bench_serving, "send", send)
    cached_before = wait_until_idle(server)["engine"]["cached_tokens"]
    bench_serving.main(["--base-url", server, "--api-key", API_KEY, "--num-prompts", "2", "--random-input-len", "8",
                        "--random-output-len", "3", "--unknown-output-len", "--seed", "11"])
    rows = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines() if ":" in line)
    assert int(rows["Successful requests"]) == 2 and int(rows["Failed requests"]) == 0
    assert contexts == [4096] * 3  # the warm-up, then the two timed
    assert wait_until_idle(server)["engine"]["cached_tokens"] == cached_before


def test_bench_serving_times_no_wait_after_the_last_request(monkeypatch):
    """At a finite rate, the wait drawn after the last request's start was counted in the run's duration
    (1.4 s here, for one request that takes none), and so in every throughput figure."""
    import asyncio
    import types

    from nano import bench_serving

    async def send(*args):
        return bench_serving.Result()

    monkeypatch.setattr(bench_serving, "send", send)
    args = types.SimpleNamespace(seed=1, max_concurrency=None, request_rate=0.1, base_url="", context=None)
    results, duration = asyncio.run(bench_serving.send_all(None, args, [([1, 2], 3)], "model"))
    assert len(results) == 1 and duration < 0.5


@pytest.mark.parametrize("flags", [["--request-rate", "0"], ["--request-rate", "nan"], ["--num-prompts", "0"],
                                   ["--max-concurrency", "0"], ["--shared-prefix-len", "-1"],
                                   ["--random-range-ratio", "1.5"], ["--random-output-range-ratio", "-0.1"]])
def test_bench_serving_bad_flags_are_one_line(flags):
    """Refused before any request goes out (a rate of 0 would fail mid-run, in the arrivals' draw)."""
    assert_one_line_error(run_main(*flags, module="nano.bench_serving"), "must be > 0")


def test_bench_serving_flags_reach_the_run_as_their_help_says(monkeypatch):
    """--random-output-range-ratio defaults to --random-range-ratio, and --shared-prefix-len may be 0."""
    from nano import bench_serving

    runs = []

    async def benchmark(args):
        runs.append(args)

    monkeypatch.setattr(bench_serving, "benchmark", benchmark)
    bench_serving.main(["--dataset", "shared-prefix", "--random-range-ratio", "0.5", "--shared-prefix-len", "0"])
    assert runs[0].random_output_range_ratio == 0.5 and runs[0].shared_prefix_len == 0


@pytest.mark.parametrize("max_concurrency", [None, 3])
def test_bench_serving_holds_as_many_requests_in_flight_as_asked(monkeypatch, max_concurrency):
    """All of them at once by default (a rate of inf is a burst), else at most --max-concurrency."""
    from nano import bench_serving

    in_flight, most = [0], [0]

    async def send(*args):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        return bench_serving.Result()

    monkeypatch.setattr(bench_serving, "send", send)
    args = SimpleNamespace(seed=1, max_concurrency=max_concurrency, request_rate=float("inf"), base_url="",
                           context=None)
    results, _ = asyncio.run(bench_serving.send_all(None, args, [([1, 2], 3)] * 8, "model"))
    assert len(results) == 8 and most[0] == (max_concurrency or 8)


def test_stats_line_leaves_out_the_time_the_engine_sat_idle(tmp_path, monkeypatch, capsys):
    """Two bursts of one request, an hour idle between them, one step a second (a fake clock): every
    stats line reads about 1 decode token a second. Counting the idle hour, the line after it read 0.0."""
    import types

    from nano import engine_process
    from nano.engine_process import AddRequest, Shutdown
    from nano.sampling import SamplingParams
    from tests.helpers import LLAMA_TINY, save_tiny_llama

    save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, max_running_requests=4, log=False))
    clock = [0.0]
    monkeypatch.setattr(engine_process, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (clock.__setitem__(0, clock[0] + 1.0), step())[1])
    prompt = random.Random(0).choices(range(LLAMA_TINY["vocab_size"]), k=8)
    messages = [AddRequest(i, prompt, SamplingParams(max_new_tokens=35, ignore_eos=True), set()) for i in range(2)]

    class Inbox:  # the engine waits here only when idle: an hour passes before each message
        def get(self):
            clock[0] += 3600.0
            return messages.pop(0) if messages else Shutdown()

        def get_nowait(self):
            raise queue.Empty

    run_engine(engine, Inbox(), queue.Queue())
    rates = [float(line.split("decode ")[1].split(" tok/s")[0]) for line in capsys.readouterr().err.splitlines()
             if line.startswith("engine:")]
    assert len(rates) >= 4 and all(0.5 <= rate <= 1.0 for rate in rates), rates


def test_bench_serving_report_figures(capsys):
    """The report's every figure, from three finished requests (one of a single token, which has no
    time per output token) and a failed one, over 2 s; computed here by hand."""
    import argparse

    from nano.bench_serving import Result, report

    results = [Result(True, "", 4, 1, ttft=0.1, latency=0.1),
               Result(True, "", 10, 3, ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
               Result(False, "asked for 5 tokens, got 2", 7, 2, ttft=0.1, latency=0.4),  # counted nowhere
               Result(True, "", 20, 5, ttft=0.3, latency=1.3, itl=[0.25] * 4)]
    report(argparse.Namespace(request_rate=float("inf"), max_concurrency=None), results, 2.0)
    captured = capsys.readouterr()
    rows = {name.strip(): value.strip() for name, value in (line.split(":", 1) for line in captured.out.splitlines()
                                                            if ":" in line)}
    assert rows == {
        "Traffic request rate": "inf", "Max request concurrency": "not set", "Successful requests": "3",
        "Failed requests": "1", "Benchmark duration (s)": "2.00", "Total input tokens": "34",
        "Total generated tokens": "9", "Request throughput (req/s)": "1.50", "Input token throughput (tok/s)": "17.00",
        "Output token throughput (tok/s)": "4.50", "Total token throughput (tok/s)": "21.50",
        "Concurrency": "0.95",  # the requests' latencies summed over the duration
        "Mean E2E Latency (ms)": "633.33", "Median E2E Latency (ms)": "500.00", "P99 E2E Latency (ms)": "1284.00",
        "Mean TTFT (ms)": "166.67", "Median TTFT (ms)": "100.00", "P99 TTFT (ms)": "296.00",
        "Mean TPOT (ms)": "225.00", "Median TPOT (ms)": "225.00", "P99 TPOT (ms)": "249.50",  # 400 / 2, 1000 / 4 ms
        "Mean ITL (ms)": "233.33", "Median ITL (ms)": "250.00", "P99 ITL (ms)": "250.00"}
    assert captured.err == "first failure: asked for 5 tokens, got 2\n"
    results[3].itl.pop()  # a chunk that carried two tokens
    report(argparse.Namespace(request_rate=4.0, max_concurrency=8), results[1:2] + results[3:], 1.0)
    assert "warning: some chunks carried several tokens" in capsys.readouterr().err


def test_bench_serving_prompt_lengths_cover_their_ranges():
    """--random-range-ratio 0.5: input lengths uniform in [len / 2, len], output lengths by a ratio of
    their own; shared-prefix prompts all open with one prefix."""
    from nano.bench_serving import build_parser, make_prompts

    args = build_parser().parse_args(["--num-prompts", "300", "--random-input-len", "8", "--random-output-len", "4",
                                      "--random-range-ratio", "0.5", "--random-output-range-ratio", "0.25"])
    prompts = make_prompts(args, vocab_size=50)
    assert {len(p) for p, _ in prompts} == set(range(4, 9)) and {n for _, n in prompts} == {1, 2, 3, 4}
    assert all(0 <= t < 50 for p, _ in prompts for t in p) and len({t for p, _ in prompts for t in p}) == 50
    args = build_parser().parse_args(["--num-prompts", "3", "--dataset", "shared-prefix", "--shared-prefix-len", "6",
                                      "--suffix-len", "2", "--random-output-len", "5", "--random-output-range-ratio", "1"])
    prompts = make_prompts(args, vocab_size=1000)
    assert [len(p) for p, _ in prompts] == [8] * 3 and [n for _, n in prompts] == [5] * 3
    assert prompts[0][0][:6] == prompts[1][0][:6] == prompts[2][0][:6] and prompts[0][0][6:] != prompts[1][0][6:]


def test_bench_serving_reports_when_the_server_goes_away(tiny_model, tmp_path, monkeypatch, capsys):
    """The server stops after the warm-up: every timed request fails, and the report still comes,
    without a traceback from the /health calls around them."""
    from nano import bench_serving

    proc, url = start_server(tiny_model, tmp_path / "server.log", *SERVER_FLAGS)
    send_all = bench_serving.send_all

    async def stop_then_send(*args):
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        return await send_all(*args)

    monkeypatch.setattr(bench_serving, "send_all", stop_then_send)
    try:
        bench_serving.main(["--base-url", url, "--num-prompts", "3", "--random-input-len", "8",
                            "--random-output-len", "2", "--request-rate", "20"])
    finally:
        proc.kill()  # a no-op once it has exited
    captured = capsys.readouterr()
    rows = dict(line.split(":", 1) for line in captured.out.splitlines() if ":" in line)
    assert int(rows["Successful requests"]) == 0 and int(rows["Failed requests"]) == 3
    assert "first failure: ClientConnectorError" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("dataset, fragment", [("missing.jsonl", "not a JSONL file"), ("no-prompt.jsonl", "not a JSONL file"),
                                               ("not-json.jsonl", "not a JSONL file"), ("empty.jsonl", "has no prompts"),
                                               # a TypeError traceback mid-run
                                               ("int-prompt.jsonl", "prompt 2: a prompt is text or a list of token ids"),
                                               ("bad-length.jsonl", "prompt 1: a prompt is text")])
def test_bench_serving_bad_dataset_is_one_line(server, tmp_path, dataset, fragment):
    for name, text in [("no-prompt.jsonl", '{"output_len": 3}\n'), ("not-json.jsonl", "Hello\n"), ("empty.jsonl", "\n"),
                       ("int-prompt.jsonl", '{"prompt": "hi"}\n{"prompt": 5}\n'),
                       ("bad-length.jsonl", '{"prompt": [1, 2], "output_len": null}\n')]:
        (tmp_path / name).write_text(text)
    result = run_cli("--base-url", server, "--api-key", API_KEY, "--dataset", str(tmp_path / dataset),
                     module="nano.bench_serving")
    assert_one_line_error(result, fragment)


def test_bench_serving_dataset_is_utf8_whatever_the_locale(tmp_path):
    """A JSONL dataset is UTF-8 (a BOM, as Windows tools write it, is not JSON), as generate's
    prompt file is: under LC_ALL=C without UTF-8 mode, open()'s locale default read it as ASCII."""
    rng = random.Random(3)
    rows = [("".join(rng.choices("aéß€中😀 ", k=rng.randint(1, 30))), rng.randint(1, 9)) for _ in range(5)]
    path = tmp_path / "prompts.jsonl"
    lines = "".join(json.dumps({"prompt": p, "output_len": n}, ensure_ascii=False) + "\n" for p, n in rows)
    path.write_bytes(b"\xef\xbb\xbf" + lines.encode())  # UTF-8 with a BOM, as Notepad or PowerShell write it
    code = ("import argparse, json; from nano.bench_serving import make_prompts; "
            f"args = argparse.Namespace(dataset={str(path)!r}, seed=1, num_prompts=5, random_output_len=128, "
            "unknown_output_len=False); print(json.dumps(make_prompts(args, 100)))")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    assert [tuple(row) for row in json.loads(result.stdout)] == rows


def test_bench_serving_cycles_through_a_dataset_to_the_number_of_prompts(tmp_path):
    """--num-prompts requests whatever the file holds: fewer lines are used again in order (cut at
    whole copies, 7 prompts of 3 lines ran 6)."""
    import argparse

    from nano.bench_serving import make_prompts

    rows = [([5, 6, 7], 2), ("hi", 3), ([9], 1)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_len": n}) + "\n" for p, n in rows))
    for num_prompts in (2, 3, 7):
        args = argparse.Namespace(dataset=str(path), seed=1, num_prompts=num_prompts, random_output_len=128,
                                  unknown_output_len=False)
        assert make_prompts(args, 100) == (rows * 3)[:num_prompts]


def test_bench_serving_text_prompts_of_unknown_output_length_are_one_line(server, tmp_path):
    """The request asks for the context left after its prompt, which a text prompt's characters do not tell."""
    (tmp_path / "text.jsonl").write_text('{"prompt": "Hello there"}\n')
    result = run_cli("--base-url", server, "--api-key", API_KEY, "--dataset", str(tmp_path / "text.jsonl"),
                     "--unknown-output-len", module="nano.bench_serving")
    assert_one_line_error(result, "needs token-id prompts")


@pytest.mark.parametrize("flags, fragment", [(["--api-key", ""], "--api-key is empty"),
                                             (["--api-key", "a\nb"], "holds a control character"),
                                             (["--served-model-name", " "], "--served-model-name is empty")])
def test_flags_no_request_could_meet_are_refused_at_start(flags, fragment):
    assert_one_line_error(run_main(*flags, module="nano.serve"), fragment)


def test_bench_serving_refuses_an_api_key_no_header_can_carry(server):
    result = run_cli("--base-url", server, "--api-key", "a\nb", module="nano.bench_serving")
    assert_one_line_error(result, "--api-key holds a control character")  # aiohttp's traceback


def test_bench_serving_without_a_server_is_one_line():
    result = run_cli("--base-url", f"http://127.0.0.1:{free_port()}", module="nano.bench_serving")
    assert_one_line_error(result, "no server answers at")


def test_text_held_in_a_split_character_is_sent_when_the_request_ends(smollm2_dir):
    """A request that ends (here by max_tokens) part-way through a character's UTF-8 bytes still
    sends what its tokens decode to, as its token_ids say: the text held back is flushed."""
    from nano.engine_process import Stream, Token
    from nano.sampling import SamplingParams
    from nano.serve import _collect, _pieces
    from nano.tokenizer import Detokenizer

    tokenizer = Tokenizer(smollm2_dir)
    ids = tokenizer.encode_text("Hi 🎉")[:-1]  # " \xf0\x9f" and "\x8e" of 🎉, without its last byte
    tokens = [Token(t, None) for t in ids[:-1]] + [Token(ids[-1], "length")]

    async def pieces():
        stream = Stream(prompt_ids=[1], params=SamplingParams(), stop_ids=set())
        for token in tokens[1:]:
            stream.events.put_nowait(token)
        return (await _collect([_pieces(stream, tokens[0], Detokenizer(tokenizer, [], ["never"]), client=None)]))[0]

    collected = asyncio.run(pieces())
    assert "".join(text for text, _, _ in collected) == tokenizer.decode(ids) == "Hi \ufffd"
    assert collected[-1][2] == "length"


def test_a_step_that_hands_out_two_tokens_of_a_request_ends_its_stream_on_the_second(tiny_model):
    """Overlap: when the pool runs short the engine books the pass in flight, launches the next
    over the requests left after a retraction, and books that one too (the victim waits to be
    prefilled again): one step hands out two tokens of each running request. A request whose
    budget ends with the second gets finish_reason on that one only, and the engine loop goes on."""
    from nano.engine_process import _step
    from nano.sampling import SamplingParams
    from tests.helpers import random_prompts

    prompts = random_prompts([20] * 4, 49152, seed=6)

    def run(budgets):
        engine = Engine(tiny_model, EngineConfig(max_total_tokens=320, log=False))
        requests = {i: engine.add_request(p, SamplingParams(max_new_tokens=b, ignore_eos=True))
                    for i, (p, b) in enumerate(zip(prompts, budgets))}
        events, doubled = {i: [] for i in requests}, []
        while engine.has_work():
            engine.scheduler.new_token_ratio = 0.05  # admit all four at once: they outgrow the pool
            step = _step(engine, requests)
            for sid, event in step:
                events[sid].append(event)
            if len(step) > len({sid for sid, _ in step}):
                doubled.append((step[-1][0], len(events[step[-1][0]])))  # a request with two, its tokens
        return engine, events, doubled

    _, _, doubled = run([200] * 4)
    assert doubled
    sid, tokens = doubled[0]
    budgets = [tokens if i == sid else 200 for i in range(4)]  # its budget ends with that step's second token
    _, events, _ = run(budgets)
    for sid, budget in enumerate(budgets):
        assert [e.finish_reason for e in events[sid]] == [None] * (budget - 1) + ["length"], sid
def test_null_takes_the_default(server):
    """OpenAI's API marks these fields nullable and vLLM reads null as the default; clients send them."""
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, seed=None, stop=None, user=None)
    status, reply = call(server, "/v1/completions", dict(prompt="hi", max_tokens=None, echo=None, logprobs=None, **nulls))
    assert status == 200 and len(reply["choices"]) == 1 and reply["usage"]["completion_tokens"] <= 16, reply
    status, reply = call(server, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                             logprobs=None, top_logprobs=None, **nulls))
    assert status == 200 and reply["usage"]["completion_tokens"] <= 2, reply


def test_a_reply_kept_as_the_openai_sdk_dumps_it_is_taken_back(server):
    """A client that keeps the conversation as the openai SDK's message.model_dump() sends the reply's
    unused fields as null ("refusal", "tool_calls", ...; OpenAI's own replies: "annotations": []);
    the next turn takes them as absent, as vLLM does, and the prompt is the plain messages'."""
    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY)
    question = " ".join(random.Random(3).choices(["river", "France", "name", "capital", "a", "the"], k=6))
    first = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=3, temperature=0)
    dumped = reply.choices[0].message.model_dump()
    assert dumped["tool_calls"] is None and dumped["refusal"] is None
    plain = [*first, {"role": "assistant", "content": dumped["content"]}, {"role": "user", "content": "And?"}]
    for sent in (dumped, {**dumped, "annotations": [], "tool_calls": []}):
        messages = [*first, sent, {"role": "user", "content": "And?"}]
        status, tokens = call(server, "/tokenize", {"messages": messages})
        assert status == 200 and tokens["tokens"] == call(server, "/tokenize", {"messages": plain})[1]["tokens"], tokens
        assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).usage.completion_tokens
    status, reply = call(server, "/v1/chat/completions", {"messages": [*first, {**dumped, "tool_calls": [{}]}]})
    assert status == 400 and reply["error"]["param"] == "messages", reply  # a tool call is still a feature nano lacks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_long_prompt_is_tokenized_off_the_event_loop(server, path):
    """Tokenizing a prompt near the body's 4 MB limit takes seconds; on the event loop, every other
    request and stream waited them out (vLLM tokenizes off its event loop too). So did encoding
    /tokenize's answer of 800k ids through FastAPI's encoder (1 s of 3.7 s on a 2-core CPU), and
    /detokenize's 520k ids: checked in a Python loop over app.state (0.4 s) and decoded under Python's
    lock (0.2 s). Now the loop waits for a body's JSON parse alone (0.06 s)."""
    rng = random.Random(0)
    text = " ".join(rng.choice(["sea", "wave", "salt", "tide", "foam", "gull"]) for _ in range(MAX_BODY_BYTES // 5))
    body = {"prompt": text} if path == "/tokenize" else {"prompt": text, "max_tokens": 1}
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    if path == "/detokenize":
        body = {"tokens": [rng.randrange(10_000, 40_000) for _ in range(MAX_BODY_BYTES // 8)]}
    done = {}

    def send():  # /detokenize three times: once, it now takes too little time to measure a wait against
        started = time.perf_counter()
        for _ in range(3 if path == "/detokenize" else 1):
            done["status"] = call(server, path, body)[0]
        done["took"] = time.perf_counter() - started

    for attempt in range(3):  # a loop that blocks does so every time; a loaded machine's one stall need not
        sender = threading.Thread(target=send)
        sender.start()
        waits = []
        while sender.is_alive():  # /health, again and again while the prompt is sent and tokenized
            started = time.perf_counter()
            assert call(server, "/health")[0] == 200
            waits.append(time.perf_counter() - started)
        sender.join()
        if max(waits) < done["took"] / 6:
            break
    assert done["status"] == (200 if path in ("/tokenize", "/detokenize") else 400)  # too long for the context
    assert max(waits) < done["took"] / 6, (max(waits), done["took"])


def test_a_prompt_and_max_tokens_that_fill_the_context_exactly_run(server):
    """The context (4,096 tokens here) holds prompt + max_tokens: exactly full runs, a token more is
    a 400 naming max_tokens (OpenAI's and vLLM's rule)."""
    prompt = [5] * 4090
    status, reply = call(server, "/v1/completions", dict(prompt=prompt, max_tokens=6, ignore_eos=True))
    assert status == 200 and reply["usage"]["completion_tokens"] == 6, reply
    status, reply = call(server, "/v1/completions", dict(prompt=prompt, max_tokens=7))
    assert status == 400 and reply["error"]["param"] == "max_tokens" and "4096" in reply["error"]["message"], reply


def test_an_engine_context_shorter_than_the_models_is_the_one_stated_and_checked(tiny_model):
    """A KV pool of 256 tokens holds less than the model's 4,096: /v1/models states the engine's context,
    and a prompt plus max_tokens past it is a 400, not an answer cut short with finish_reason "length"."""
    with in_process_server(Engine(tiny_model, EngineConfig(max_total_tokens=256, log=False)), None) as (url, _):
        status, reply = call(url, "/v1/models")
        assert status == 200 and reply["data"][0]["max_model_len"] == 256, reply
        status, reply = call(url, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=300, ignore_eos=True))
        assert status == 400 and reply["error"]["param"] == "max_tokens", reply


def test_tokenize_takes_an_empty_prompt_and_gives_token_ids_back(server, tiny_model):
    """vLLM's /tokenize: "" is no tokens, or BOS alone where the tokenizer adds one (a completion
    refuses it); token ids come back as sent, whatever add_special_tokens says."""
    bos = Tokenizer(tiny_model).encode_prompt("", use_chat_template=False)
    for prompt, add_special_tokens, want in (("", True, bos), ("", False, []), ([], True, []), ([5, 6], False, [5, 6])):
        status, reply = call(server, "/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens})
        assert status == 200 and reply["tokens"] == want and reply["count"] == len(want), reply


def test_detokenize_gives_back_what_tokenize_took(server):
    """vLLM's /detokenize keeps special tokens (lm-eval decodes token ids through it and sends the text back)."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n"
    ids = call(server, "/tokenize", {"prompt": prompt})[1]["tokens"]
    status, reply = call(server, "/detokenize", {"tokens": ids})
    assert status == 200 and reply["prompt"] == prompt


@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_generation(server, stream):
    """max_tokens 0 with echo: the prompt and its logprobs only, as OpenAI's legacy API and vLLM answer it."""
    ids = call(server, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    body = dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    if stream:
        events = asyncio.run(read_stream_once(server, "/v1/completions", dict(body, stream_options={"include_usage": True})))
        (chunk,), usage, done = events[:-2], events[-2]["usage"], events[-1]
        assert done == "[DONE]"
        choice = chunk["choices"][0]
    else:
        status, reply = call(server, "/v1/completions", body)
        assert status == 200, reply
        choice, usage = reply["choices"][0], reply["usage"]
    assert choice["text"] == PROMPT and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    one = call(server, "/v1/completions", dict(body, max_tokens=1, temperature=0))[1]["choices"][0]["logprobs"]
    assert one["token_logprobs"][: len(ids)] == choice["logprobs"]["token_logprobs"]
    status, reply = call(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=0))  # without echo: nothing to answer
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply


def test_any_int64_seed_is_taken(server):
    """vLLM takes any int64 seed, negative ones too; a repeated request gets the same samples."""
    body = dict(prompt="hi", max_tokens=4, temperature=1.0, n=2)
    for seed in (-1, -2**63, 2**63 - 1):
        status, reply = call(server, "/v1/completions", dict(body, seed=seed))
        assert status == 200, reply
        assert reply == {**call(server, "/v1/completions", dict(body, seed=seed))[1], "id": reply["id"], "created": reply["created"]}
    assert call(server, "/v1/completions", dict(body, seed=2**63))[0] == 400


@pytest.mark.parametrize("k", [0, 2])
def test_completion_top_logprobs_hold_the_chosen_token(server, k):
    """OpenAI's legacy logprobs: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements"; vLLM's do the same, prompt tokens' (echo) too."""
    reply = call(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=6, logprobs=k, echo=True, seed=0))[1]
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"][0] is None
    for token, logprob, top in list(zip(*(logprobs[key] for key in ("tokens", "token_logprobs", "top_logprobs"))))[1:]:
        assert top[token] == logprob and len(top) <= k + 1
def test_a_request_that_a_failed_step_retracted_gets_no_gap_in_its_stream(tmp_path):
    """A decode step books the pass in flight (a token for every running request), retracts one of
    them to make room, then its own pass raises. The retracted request is queued again, but the token
    booked for it was never sent: it must fail too, not stream on with a token missing."""
    from nano.engine_process import Token, _step
    from nano.sampling import SamplingParams
    from tests.helpers import save_tiny_llama

    save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=32, log=False))
    real_model, retract, retracted, faults = engine.model, engine.scheduler.retract, [], []
    engine.scheduler.retract = lambda req: (retracted.append(req), retract(req))

    def model(batch, attn):  # the first pass after the first retraction raises
        if retracted and not faults:
            faults.append(batch)
            raise RuntimeError("injected fault")
        return real_model(batch, attn)

    engine.model = model
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    requests = {sid: engine.add_request(prompt, params) for sid, prompt in enumerate([[5, 6, 7, 8], [9, 10, 11, 12]])}
    reqs, streamed = dict(requests), {0: [], 1: []}
    while requests:
        engine.scheduler.new_token_ratio = 0.1  # admit both: together they outgrow the pool of 32
        for sid, event in _step(engine, requests):
            streamed[sid].append(event.id if isinstance(event, Token) else "error")
    assert faults and retracted[0] in reqs.values()
    for sid, req in reqs.items():  # each stream: every token its request got, or a prefix of them and an error
        tokens, error = (streamed[sid][:-1], True) if streamed[sid][-1:] == ["error"] else (streamed[sid], False)
        assert tokens == req.output_ids[: len(tokens)] and (error or tokens == req.output_ids), sid


def engine_pid(server_pid: int) -> int:
    """The engine's process among the server's children (multiprocessing's resource tracker is the other)."""
    return next(pid for pid in child_pids(server_pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_to_every_process_of_the_server_finishes_its_requests(tiny_model, tmp_path, sig):
    """systemd stops a service (KillMode=control-group, its default) with SIGTERM to every process in it,
    the engine's too, and Ctrl-C sends SIGINT to every process of the terminal's group; as with SIGTERM to
    the server alone, the request streaming and the one waiting for the only row finish, and the server
    exits 0."""
    proc, url = start_server(tiny_model, tmp_path / "server.log", "--max-total-tokens", "100000",
                             "--max-running-requests", "1")

    async def read(session, body):
        async with session.post(url + "/v1/completions", json=body) as resp:
            return [line async for line in resp.content if line.startswith(b"data: ")]

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = dict(prompt=[300, 301], max_tokens=200, ignore_eos=True, stream=True)
            async with session.post(url + "/v1/completions", json=body) as resp:
                lines = resp.content.__aiter__()
                assert (await lines.__anext__()).startswith(b"data: ")
                queued = asyncio.ensure_future(read(session, {**body, "prompt": [302, 303]}))
                await asyncio.sleep(0.5)
                for pid in [proc.pid, *child_pids(proc.pid)]:
                    os.kill(pid, sig)
                rest = [line async for line in lines if line.startswith(b"data: ")]
            return rest, await queued

    try:
        rest, queued = asyncio.run(main())
        assert rest[-1] == b"data: [DONE]\n" and len(rest) == 200, rest[-2:]  # 199 more tokens, then [DONE]
        assert queued[-1] == b"data: [DONE]\n" and len(queued) == 201, queued[-2:]
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
    finally:
        proc.kill()


def ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_server_listens_on_an_ipv6_address(tiny_model, tmp_path):
    """--host ::1 opens an IPv6 socket (an IPv4 one cannot take that address) and serves there."""
    proc, url = start_server(tiny_model, tmp_path / "server.log", *SERVER_FLAGS, host="::1")
    try:
        assert url.startswith("http://[::1]:") and call(url, "/health")[0] == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_a_server_whose_engine_died_with_requests_unread_still_exits(tiny_model, tmp_path):
    """The engine is killed (the OOM killer, say) while more requests than a pipe holds (64 KiB) wait in
    its inbox, unread: they get a 500, and SIGTERM still ends the server, instead of its exit waiting
    forever to write them into a pipe nobody reads."""
    proc, url = start_server(tiny_model, tmp_path / "server.log", *SERVER_FLAGS)
    engine = engine_pid(proc.pid)
    os.kill(engine, signal.SIGSTOP)  # busy with a long step: it reads its inbox between steps

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def one(i):
                async with session.post(url + "/v1/completions", json=dict(prompt=[1000 + i] * 4000, max_tokens=5)) as r:
                    return r.status
            replies = [asyncio.ensure_future(one(i)) for i in range(12)]  # 12 x 4000 ids: about 150 kB pickled
            await asyncio.sleep(2)
            os.kill(engine, signal.SIGKILL)
            return await asyncio.gather(*replies)

    try:
        assert set(asyncio.run(main())) <= {500, 503}  # 503: one that reached the server after the engine died
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "server.log").read_text()
    finally:
        proc.kill()


def test_an_engine_killed_halfway_through_a_message_fails_the_stream_and_the_server_exits(tiny_model, tmp_path):
    """The engine is killed while a step's message (16 choices with 20 logprobs each: over the 4 KiB a pipe
    writes whole) is half in the outbox: the reader waited for the rest for ever, the stream never got its
    500 and SIGTERM never ended the server. The server stops while the engine fills the pipe, so the kill
    lands mid-message."""
    proc, url = start_server(tiny_model, tmp_path / "server.log", *SERVER_FLAGS)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(dict(prompt=[1, 2, 3], max_tokens=4000, ignore_eos=True,
                                                                stream=True, n=16, logprobs=20)),
                     {"Content-Type": "application/json", **AUTH})
        reply = conn.getresponse()
        reply.readline()
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1)
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        events = [line for line in reply.read().splitlines() if line.startswith(b"data: {")]
        assert b"engine process exited" in events[-1], events[-1][:200]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "server.log").read_text()
    finally:
        proc.kill()


def test_an_error_names_a_field_by_its_place_on_one_line():
    from nano.api import _where

    assert _where(("messages", 0, "content")) == "messages.0.content"
    assert _where(("logit_bias", "")) == 'logit_bias.""' and _where(("a\nb",)) == '"a\\nb"'


def test_bench_serving_lengths_at_a_range_ratio_of_0_are_at_least_1():
    from nano.bench_serving import build_parser, make_prompts

    args = build_parser().parse_args(["--num-prompts", "200", "--random-input-len", "2", "--random-output-len", "2",
                                      "--random-range-ratio", "0", "--random-output-range-ratio", "0"])
    prompts = make_prompts(args, vocab_size=50)
    assert {len(p) for p, _ in prompts} == {1, 2} and {n for _, n in prompts} == {1, 2}


@contextmanager
def _fake_completions_server(num_tokens: int, usage_delay: float = 0.0):
    """An aiohttp server in a thread whose /v1/completions streams num_tokens one-token chunks at once,
    then, after usage_delay seconds, the usage chunk and [DONE]: what bench_serving.send reads -> its URL."""
    from aiohttp import web

    async def completions(request):
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(num_tokens):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [i + 5], "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(usage_delay)
        usage = {"prompt_tokens": 3, "completion_tokens": num_tokens, "total_tokens": 3 + num_tokens}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop, started = asyncio.new_event_loop(), threading.Event()
    runner = web.AppRunner(app)
    port = free_port()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _bench_send(url: str, output_len: int):
    from nano import bench_serving

    async def send():
        async with aiohttp.ClientSession() as session:
            return await bench_serving.send(session, url, "model", [1, 2, 3], output_len)

    return asyncio.run(send())


def test_bench_serving_counts_an_answer_longer_than_asked_for_as_failed():
    """A request asks for exactly its output length (max_tokens, ignore_eos): a server that streams
    more tokens than that is wrong, and its answer is a failure, not a success that inflates the
    throughput figures."""
    with _fake_completions_server(4) as url:
        longer, exact = _bench_send(url, 3), _bench_send(url, 4)
    assert not longer.ok and longer.error == "asked for 3 tokens, got 4"
    assert exact.ok and exact.output_tokens == 4 and exact.read_tokens == 4


def test_bench_serving_e2e_latency_ends_at_the_last_token():
    """E2E latency is request sent to last token (as vLLM's benchmark_serving: the trailing usage
    chunk carries no token): a server slow to send its usage chunk after the last token does not
    lengthen it, nor TPOT, which is computed from it."""
    with _fake_completions_server(3, usage_delay=1.0) as url:
        result = _bench_send(url, 3)
    assert result.ok and len(result.itl) == 2
    assert result.latency < 0.5, result.latency  # the tokens come at once; the usage chunk a second later
    assert result.latency >= result.ttft + sum(result.itl) - 1e-6


def body_request(body: bytes, chunked: bool = True):
    """A POST whose body arrives in 64 KiB messages, announced as chunked or by its Content-Length
    -> (the request, the messages its server has not handed over yet)."""
    from starlette.requests import Request as HTTPRequest

    pieces = [body[i : i + (64 << 10)] for i in range(0, len(body), 64 << 10)]
    messages = [{"type": "http.request", "body": p, "more_body": True} for p in pieces]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive():
        return messages.pop(0)

    length = (b"transfer-encoding", b"chunked") if chunked else (b"content-length", str(len(body)).encode())
    headers = [(b"content-type", b"application/json"), length]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    return HTTPRequest(scope, receive), messages


def test_a_chunked_body_over_the_limit_is_refused_with_413():
    """A body sent with Transfer-Encoding: chunked announces no Content-Length: the limit holds for
    what arrives, and the read stops once it is passed (a body of exactly the limit is read)."""
    fits = b'{"prompt": "hi"}'.ljust(MAX_BODY_BYTES)  # JSON may end in spaces
    request, _ = body_request(fits)
    assert asyncio.run(read_json(request)) == {"prompt": "hi"}
    request, unread = body_request(fits + b" " * (1 << 20))
    with pytest.raises(APIError) as refused:
        asyncio.run(read_json(request))
    assert refused.value.status == 413 and str(MAX_BODY_BYTES) in refused.value.message
    assert len(unread) > 1  # refused as it passed the limit, not after reading the whole body


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_a_413():
    """The same limit for a body that announces its Content-Length: exactly the limit is read."""
    fits = b'{"prompt": "hi"}'.ljust(MAX_BODY_BYTES)
    assert asyncio.run(read_json(body_request(fits, chunked=False)[0])) == {"prompt": "hi"}
    with pytest.raises(APIError) as refused:
        asyncio.run(read_json(body_request(fits + b" ", chunked=False)[0]))
    assert refused.value.status == 413


def test_a_body_that_opens_with_a_utf8_bom_is_read():
    """RFC 8259 lets a parser skip a UTF-8 byte order mark, and Python's json and FastAPI's body reader
    do: a client on Windows that writes one gets its answer, not a 400."""
    body = '{"prompt": "café"}'.encode("utf-8-sig")
    assert body.startswith(b"\xef\xbb\xbf")
    assert asyncio.run(read_json(body_request(body)[0])) == {"prompt": "café"}


def test_only_an_echo_asks_the_engine_for_the_prompts_logprobs():
    """A prompt's logprobs cost a log-softmax over the vocabulary per prompt token, and only an echo shows
    them: a completion with logprobs but no echo, and any chat, must not ask for them."""
    def asks(body):
        return body.sampling_params(4).prompt_logprobs

    assert asks(CompletionRequest(prompt="hi", logprobs=2, echo=True))
    assert not asks(CompletionRequest(prompt="hi", logprobs=2)) and not asks(CompletionRequest(prompt="hi", echo=True))
    assert not asks(ChatRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2))


def test_a_finished_requests_logprobs_leave_the_engine_and_its_prompts_come_once(tiny_model):
    """_step sends the prompt's logprobs with a request's first token only (not re-sent, pickled,
    every step), and drops the engine's logprobs of a request once its last token is out."""
    from nano.engine_process import _step
    from nano.sampling import SamplingParams

    engine = Engine(tiny_model, EngineConfig(max_total_tokens=2000, log=False))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=True)
    requests, events = {0: engine.add_request([1, 2, 3, 4], params)}, []
    while engine.has_work():
        events += [event for _, event in _step(engine, requests)]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert len(events[0].prompt_logprobs) == 3 and [e.prompt_logprobs for e in events[1:]] == [None, None]
    assert not requests and not engine.logprobs


def test_a_stream_leaves_the_client_with_its_last_event_or_its_abort():
    """EngineClient.streams holds a stream until its finish_reason, its error or its abort: a server
    that kept them would grow by every request it ever answered, and fail them all again when the engine died."""
    from nano.engine_process import APIError, Ready, Stream, Token
    from nano.sampling import SamplingParams

    class Worker:
        def is_alive(self):
            return True

    outbox = queue.Queue()
    outbox.put(Ready(vocab_size=100, eos_token_ids=[0], context_length=64, state={}))
    client = EngineClient(queue.Queue(), outbox, Worker())
    streams = [Stream([5, 6], SamplingParams(max_new_tokens=2), set()) for _ in range(3)]
    for stream in streams:
        client.submit(stream)
    client._deliver([(0, Token(7, None)), (0, Token(8, "length")), (1, APIError(500, "failed")), (2, Token(9, None))])
    assert list(client.streams) == [2] and [s.events.qsize() for s in streams] == [2, 1, 1]
    client.abort(streams[2])
    client._deliver([(2, Token(10, None))])  # a token the engine sent before it read the abort
    assert not client.streams and streams[2].events.qsize() == 1


def test_a_stop_ends_the_reader_without_failing_anything(capsys):
    """Shutdown is the engine's last message on a stop: the reader ends there. Reading on, it waited for
    the process to exit, then logged that the engine died and failed every open stream with a 500."""
    from nano.engine_process import Ready, Shutdown, StepOutput, Token

    class Worker:  # the engine's process, gone once it has sent Shutdown
        def is_alive(self):
            return False

    outbox, callbacks = queue.Queue(), []
    for message in (Ready(vocab_size=100, eos_token_ids=[0], context_length=64, state={}),
                    StepOutput([(0, Token(7, "length"))], {"running": 0}), Shutdown()):
        outbox.put(message)
    client = EngineClient(queue.Queue(), outbox, Worker())
    client.loop = type("Loop", (), {"call_soon_threadsafe": lambda self, *call: callbacks.append(call)})()
    client._read()
    assert len(callbacks) == 1 and client.state == {"running": 0}  # the step's events, nothing after
    assert "error" not in capsys.readouterr().err


def test_an_aborted_request_leaves_the_engine_loops_table(tiny_model):
    """run_engine forgets a request it aborts: a step that fails later fails what it ran, and sends no
    500 for a stream whose client has gone (kept, every aborted request stayed in the table for ever)."""
    from nano.engine_process import Abort, AddRequest, APIError, Shutdown, run_engine
    from nano.sampling import SamplingParams

    engine = Engine(tiny_model, EngineConfig(max_total_tokens=2000, log=False))
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)

    def broken(batch, attn):
        raise RuntimeError("injected fault")

    def second_request():
        engine.model = broken  # its prefill raises
        return AddRequest(1, [4, 5, 6], params, set())

    class Inbox:  # while idle the loop waits in get(); between steps it reads what has come (get_nowait)
        script = [("wait", lambda: AddRequest(0, [1, 2, 3], params, set())), ("now", lambda: Abort(0)),
                  ("wait", second_request), ("wait", Shutdown)]
        fresh = False

        def get(self):
            self.fresh = True
            return self.script.pop(0)[1]()

        def get_nowait(self):
            if self.fresh or not self.script or self.script[0][0] != "now":
                self.fresh = False
                raise queue.Empty
            return self.script.pop(0)[1]()

    outbox = queue.Queue()
    run_engine(engine, Inbox(), outbox)
    outputs = [outbox.get_nowait() for _ in range(outbox.qsize())]
    errors = [(sid, event.status) for out in outputs[1:-1] for sid, event in out.events if isinstance(event, APIError)]
    assert errors == [(1, 500)] and not engine.has_work()


def test_an_idle_engine_loop_waits_in_its_inbox(tiny_model):
    """With no work the loop blocks in inbox.get(), and between steps it only polls (get_nowait): an
    idle server that polled would spin a core and flood the HTTP side with empty StepOutputs."""
    from nano.engine_process import AddRequest, Shutdown, run_engine
    from nano.sampling import SamplingParams

    engine = Engine(tiny_model, EngineConfig(max_total_tokens=2000, log=False))

    class Inbox:
        waits, polls = 0, 0

        def get(self):
            self.waits += 1
            return AddRequest(0, [1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True), set()) \
                if self.waits == 1 else Shutdown()

        def get_nowait(self):
            self.polls += 1
            if self.polls == 100:  # a loop that never waits: end it
                return Shutdown()
            raise queue.Empty

    inbox, outbox = Inbox(), queue.Queue()
    run_engine(engine, inbox, outbox)
    assert inbox.waits == 2 and inbox.polls < 10, (inbox.waits, inbox.polls)
    tokens = [event for _ in range(outbox.qsize()) if hasattr(out := outbox.get_nowait(), "events")
              for _, event in out.events]
    assert [t.finish_reason for t in tokens] == [None, None, "length"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_ignore_eos_runs_past_an_eos_to_max_tokens(tiny_model, path):
    """The greedy continuation's third token made an EOS id (the tokenizer's): without ignore_eos the
    answer ends before it with finish_reason "stop"; with it, the answer is the whole greedy continuation."""
    prompt = random.Random(2).choices(range(1000, 2000), k=7)
    body = dict(max_tokens=8, temperature=0, **({"prompt": prompt} if "chat" not in path else
                                                 {"messages": [{"role": "user", "content": "Name a colour."}]}))
    tokenizer = Tokenizer(tiny_model)
    engine = Engine(tiny_model, EngineConfig(max_total_tokens=10000, log=False))
    with in_process_server(engine, tokenizer) as (url, _):
        status, reply = call(url, path, dict(body, ignore_eos=True))
        greedy = reply["choices"][0]["token_ids"]
    assert status == 200 and len(greedy) == 8 and greedy[2] not in greedy[:2], greedy
    tokenizer.eos_token_ids = [greedy[2]]  # read once, when the app is built
    with in_process_server(Engine(tiny_model, EngineConfig(max_total_tokens=10000, log=False)), tokenizer) as (url, _):
        stopped = call(url, path, body)[1]["choices"][0]
        ignored = call(url, path, dict(body, ignore_eos=True))[1]
    assert stopped["token_ids"] == greedy[:3] and stopped["finish_reason"] == "stop"
    assert ignored["choices"][0]["token_ids"] == greedy and ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 8


def a_or_b_model(folder, chat_template: str | None = None) -> tuple[Tokenizer, int, int]:
    """A tiny Llama with the SentencePiece tokenizer, made to answer "▁a" or "▁b" at every step
    -> (its tokenizer, the id of "▁a", the id of "▁b")."""
    save_tiny_llama(folder, "gqa")
    save_byte_fallback_tokenizer(folder)
    if chat_template:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    tokenizer = Tokenizer(folder)
    a, b = tokenizer.encode_text("a")[-1], tokenizer.encode_text("b")[-1]  # "▁a", "▁b"
    weights = load_file(folder / "model.safetensors")
    head = torch.zeros_like(weights["lm_head.weight"])
    head[a] = torch.randn(head.shape[1])
    head[b] = -head[a]  # one of the two wins every step
    save_file({**weights, "lm_head.weight": head}, folder / "model.safetensors")
    return tokenizer, a, b


def test_a_completion_continues_its_prompts_text_under_a_sentencepiece_tokenizer(tmp_path):
    """A SentencePiece "▁b" reads " b" after a prompt, as the whole text decodes, but "b" at the start
    of a text (the decoder strips the first space): a completion's tokens are decoded with its prompt's
    as context. The model is made to answer "▁a" or "▁b" at every step."""
    folder = tmp_path / "model"
    tokenizer, a, b = a_or_b_model(folder)
    with in_process_server(Engine(folder, EngineConfig(log=False)), tokenizer) as (url, _):
        status, reply = call(url, "/v1/completions", dict(prompt="a", max_tokens=4, temperature=0))
        tokenized = call(url, "/tokenize", {"prompt": "a"})[1]  # vLLM's default: with BOS, as a completion reads it
    assert status == 200, reply
    prompt_ids, choice = tokenizer.encode_prompt("a", use_chat_template=False), reply["choices"][0]
    assert tokenized["tokens"] == prompt_ids and prompt_ids[0] == 1, tokenized  # 1: <s>
    assert set(choice["token_ids"]) <= {a, b} and len(choice["token_ids"]) == 4
    whole = tokenizer.decode(prompt_ids + choice["token_ids"])
    assert choice["text"] == whole[len(tokenizer.decode(prompt_ids)):] and choice["text"].startswith(" ")


def test_a_chat_answer_starts_a_new_text_under_a_sentencepiece_tokenizer(tmp_path):
    """A chat answer is a message of its own, not a continuation of the rendered prompt: its first
    "▁a" or "▁b" reads "a" or "b" (the decoder strips a text's first space, as transformers' decode of
    the new tokens alone does), where a completion's would read " a" or " b"."""
    folder = tmp_path / "model"
    tokenizer, a, b = a_or_b_model(folder, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    body = dict(messages=[{"role": "user", "content": "a"}], max_tokens=4, temperature=0)
    with in_process_server(Engine(folder, EngineConfig(log=False)), tokenizer) as (url, _):
        status, reply = call(url, "/v1/chat/completions", body)
        events = asyncio.run(read_stream_once(url, "/v1/chat/completions", body))
    assert status == 200, reply
    choice = reply["choices"][0]
    assert set(choice["token_ids"]) <= {a, b} and len(choice["token_ids"]) == 4
    text = tokenizer.decode(choice["token_ids"])
    assert choice["message"]["content"] == text and text[0] in "ab" and text.count(" ") == 3
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]" and e["choices"])
    assert streamed == text


@pytest.mark.parametrize("num_prompts", [1, 2, 5, 7])
def test_a_dataset_file_is_cycled_to_exactly_num_prompts(tmp_path, num_prompts):
    """Fewer prompts asked than the file holds: its first ones; more: the file again from its start."""
    from nano.bench_serving import build_parser, make_prompts

    rng = random.Random(num_prompts)
    rows = [{"prompt": rng.choices(range(100), k=rng.randint(1, 6)), "output_len": rng.randint(1, 9)} for _ in range(3)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = build_parser().parse_args(["--num-prompts", str(num_prompts), "--dataset", str(dataset)])
    expected = [(rows[i % 3]["prompt"], rows[i % 3]["output_len"]) for i in range(num_prompts)]
    assert make_prompts(args, vocab_size=100) == expected


def test_the_peak_of_running_requests_is_the_most_any_poll_saw():
    """poll_running keeps the largest `running` that /health reported, not the last one."""
    from nano.bench_serving import poll_running

    answers = [3, 7, aiohttp.ClientError("gone a moment"), 2, 0]

    class Response:
        def __init__(self, running):
            self.running = running

        async def __aenter__(self):
            if isinstance(self.running, Exception):
                raise self.running
            return self

        async def __aexit__(self, *exc):
            return False

        async def json(self):
            return {"running": self.running}

    class Session:
        def get(self, url):
            assert url == "http://server/health"
            if not answers:
                raise asyncio.CancelledError  # the benchmark is over: its poller is cancelled
            return Response(answers.pop(0))

    peak = {"running": 0}
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(poll_running(Session(), "http://server", peak))
    assert peak == {"running": 7} and answers == []


# ---- the answer's shapes, in process: Answer and _pieces from hand-made tokens ----

def _sse_events(answer, choices) -> list:
    async def read():
        return [event async for event in answer.events(choices)]
    return [json.loads(e[6:]) if e != "data: [DONE]\n\n" else "[DONE]" for e in asyncio.run(read())]


def _tokens(rng, k, first_with_prompt=None):
    from nano.engine_process import Token
    ids = rng.choices(range(1000, 1100), k=k)
    return [Token(t, "length" if i == k - 1 else None, logprob=-rng.random(),
                  top_logprobs=[(rng.randrange(1000, 1100), -rng.random())],
                  prompt_logprobs=first_with_prompt if i == 0 else None) for i, t in enumerate(ids)]


def test_a_streamed_completion_with_echo_n_and_several_prompts_adds_up(smollm2_dir):
    """Streamed, each choice's events join up as the whole answer: its own prompt echoed once (choice i
    is sample i % n of prompt i // n), its tokens' texts spell its text, text_offset counts on from event
    to event, and the usage counts each prompt once and every token."""
    from nano.serve import Answer

    tokenizer, rng = Tokenizer(smollm2_dir), random.Random(0)
    prompts = [rng.choices(range(1000, 1100), k=rng.randint(2, 6)) for _ in range(3)]
    n = 2
    body = CompletionRequest(prompt=prompts, n=n, echo=True, logprobs=1, max_tokens=5, stream=True,
                             stream_options={"include_usage": True})
    answer = Answer(SimpleNamespace(tokenizer=tokenizer, model_name="m"), body, False, prompts)
    generated = []
    for i in range(len(prompts) * n):
        prompt = prompts[i // n]
        plp = [(-rng.random(), [(rng.randrange(1000, 1100), -rng.random())]) for _ in prompt[1:]]
        generated.append(_tokens(rng, rng.randint(1, 5), plp))

    async def pieces(tokens):
        for token in tokens:
            yield tokenizer.token_text(token.id), token, token.finish_reason

    events = _sse_events(answer, [pieces(t) for t in generated])
    *chunks, usage, done = events
    assert done == "[DONE]"
    assert usage["usage"] == {"prompt_tokens": sum(map(len, prompts)),
                              "completion_tokens": sum(map(len, generated)),
                              "total_tokens": sum(map(len, prompts)) + sum(map(len, generated))}
    for i, tokens in enumerate(generated):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        text = "".join(c["text"] for c in mine)
        listed = sum((c["logprobs"]["tokens"] for c in mine), [])
        offsets = sum((c["logprobs"]["text_offset"] for c in mine), [])
        prompt = prompts[i // n]
        echoed = tokenizer.decode(prompt, special_tokens=True)
        assert text == echoed + "".join(tokenizer.token_text(t.id) for t in tokens)
        assert "".join(listed) == text and len(listed) == len(prompt) + len(tokens)
        assert offsets == [sum(map(len, listed[:k])) for k in range(len(listed))]
        assert sum((c["token_ids"] for c in mine), []) == [t.id for t in tokens]
        assert [c["finish_reason"] for c in mine][-1] == "length"


def test_a_choice_that_reaches_a_stop_string_is_aborted_at_once(smollm2_dir):
    """A stop string ends its choice there: _pieces aborts its stream in the engine at once (its KV slots
    free), not when the request's other choices are done; the last piece names the stop string."""
    from nano.engine_process import Stream, Token
    from nano.sampling import SamplingParams
    from nano.serve import _collect, _pieces

    tokenizer, rng = Tokenizer(smollm2_dir), random.Random(0)
    words = ["sun", "sea", "sky", "and", "the", "blue"]
    text = " ".join(rng.choices(words, k=30))
    ids = tokenizer.encode_text(text)
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    tokens = [Token(t, "length" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]

    class Client:
        aborted = []

        def abort(self, *streams):
            self.aborted += streams

    async def pieces():
        stream = Stream(prompt_ids=[1], params=SamplingParams(), stop_ids=set())
        for token in tokens[1:]:
            stream.events.put_nowait(token)
        got = (await _collect([_pieces(stream, tokens[0], Detokenizer(tokenizer, [], [stop]), Client())]))[0]
        return stream, got

    stream, collected = asyncio.run(pieces())
    assert "".join(t for t, _, _ in collected) == text[: text.index(stop)]
    assert collected[-1][2] == "stop" and collected[-1][1].stop_reason == stop and len(collected) < len(ids)
    assert Client.aborted == [stream]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_a_response_names_its_object_and_id_as_openai_does(chat, stream):
    """OpenAI's shapes: a chat answer is a "chat.completion" (each streamed event a "chat.completion.chunk")
    with an id "chatcmpl-..."; a completion, streamed or not, is a "text_completion" with an id "cmpl-..."."""
    messages = [{"role": "user", "content": "hi"}]
    body = ChatRequest(messages=messages, stream=stream) if chat else CompletionRequest(prompt=[5, 6], stream=stream)
    from nano.serve import Answer

    answer = Answer(SimpleNamespace(tokenizer=None, model_name="m"), body, chat, [[5, 6]])
    expected = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    assert answer.head["object"] == expected and answer.head["model"] == "m"
    prefix, _, hex_id = answer.head["id"].partition("-")
    assert prefix == ("chatcmpl" if chat else "cmpl") and len(hex_id) == 32


def test_an_echo_that_leaves_max_tokens_to_the_default_keeps_its_generated_tokens(smollm2_dir):
    """Only max_tokens 0 makes an echo the prompt alone: left out (the default, 16 tokens), the choice
    holds the prompt's text and then the generated tokens, listed and counted in usage."""
    from nano.serve import Answer

    tokenizer, rng = Tokenizer(smollm2_dir), random.Random(1)
    prompt = rng.choices(range(1000, 1100), k=5)
    body = CompletionRequest(prompt=prompt, echo=True, logprobs=1)
    answer = Answer(SimpleNamespace(tokenizer=tokenizer, model_name="m"), body, False, [prompt])
    plp = [(-rng.random(), [(rng.randrange(1000, 1100), -rng.random())]) for _ in prompt[1:]]
    tokens = _tokens(rng, 4, plp)
    texts = [tokenizer.token_text(t.id) for t in tokens]
    choice = answer.choice(0, texts, tokens, [t.finish_reason for t in tokens])
    assert choice["text"] == tokenizer.decode(prompt, special_tokens=True) + "".join(texts)
    assert choice["token_ids"] == [t.id for t in tokens] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None] + [lp for lp, _ in plp] + [t.logprob for t in tokens]
    assert answer.usage(len(tokens)) == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_a_choice_that_fails_leaves_no_read_of_the_others_pending():
    """merged over several choices: when one raises (a failed step), the others' reads, which would wait
    forever on streams nobody feeds any more, are cancelled, not left behind as tasks holding their streams."""
    from nano.engine_process import merged

    async def failing():
        await asyncio.sleep(0)
        raise RuntimeError("a failed step")
        yield  # an async generator

    async def waiting(started):
        started.append(1)
        await asyncio.Event().wait()
        yield "never"

    async def main():
        started = []
        with pytest.raises(RuntimeError, match="a failed step"):
            async for _ in merged([waiting(started), failing(), waiting(started)]):
                pass
        await asyncio.sleep(0)  # a cancelled task ends on the loop's next turn
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return started, left

    started, left = asyncio.run(main())
    assert started == [1, 1] and left == []


def test_items_that_arrive_together_come_out_by_choice_index():
    """openai's stream helper wants choice i's first chunk before choice i + 1's: of items that arrive in
    one turn of the event loop, choice 0's goes out first even when choice 1 put its item in first."""
    from nano.engine_process import merged

    async def late(item):
        await asyncio.sleep(0)  # its feeder puts its item after the other's, in the same turn
        yield item

    async def early(item):
        yield item

    async def main():
        return [pair async for pair in merged([late("a"), early("b")])]

    assert asyncio.run(main()) == [(0, "a"), (1, "b")]


# ---- the engine loop's stats line, on a fake engine and a fake clock ----

def fake_engine(free, cached, locked, total=1000, decode_tokens=0):
    scheduler = SimpleNamespace(running=[object()] * 2, waiting=[object()] * 3, chunked=None)
    return SimpleNamespace(
        prefix_cache=SimpleNamespace(size=cached, locked_size=locked), scheduler=scheduler,
        kv_pool=SimpleNamespace(capacity=total), slots=SimpleNamespace(available=free),
        stats={"decode_tokens": decode_tokens, "retractions": 0})


def test_stats_line_counts_locked_cached_slots_as_in_use(monkeypatch, capsys):
    """KV cache in use: all but the free slots and the cached ones a request could evict (unlocked)."""
    clock = [100.0]
    monkeypatch.setattr(engine_process_module.time, "monotonic", lambda: clock[0])
    engine = fake_engine(free=500, cached=300, locked=200)  # evictable: 100; in use: 1 - 600/1000
    log = engine_process_module.StatsLog(engine, every=10.0)
    engine.stats["decode_tokens"] = 250
    clock[0] += 10.0
    log.maybe_print()
    line = capsys.readouterr().err
    assert line.strip() == ("engine: 2 running, 3 waiting, decode 25.0 tok/s, KV cache 40% in use, "
                            "0 retractions so far"), line


def test_no_stats_line_without_decode_tokens(monkeypatch, capsys):
    """Busy past the interval but no token decoded since the last line (a long prefill): no line of 0.0 tok/s."""
    clock = [100.0]
    monkeypatch.setattr(engine_process_module.time, "monotonic", lambda: clock[0])
    engine = fake_engine(free=500, cached=0, locked=0)
    log = engine_process_module.StatsLog(engine, every=10.0)
    clock[0] += 30.0
    log.maybe_print()
    assert capsys.readouterr().err == ""
    engine.stats["decode_tokens"] = 30
    log.maybe_print()  # 30 tokens over the 30 busy seconds
    assert "decode 1.0 tok/s" in capsys.readouterr().err
