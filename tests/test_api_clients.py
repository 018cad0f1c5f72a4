"""The clients people already run against an OpenAI-compatible server, unmodified, against nano.serve
on the default model (SmolLM2-135M-Instruct, float32 on CPU): the official openai client's logprobs
(within 1e-3 of HF transformers' log_softmax on the same weights), echo, n, list prompts; lm-eval's
local-completions against its own `--model hf` on small local tasks (generation and multiple
choice); and the request shapes of SGLang's and vLLM's serving benchmarks."""

import json
import random
import urllib.request

import pytest
import torch

from tests.helpers import start_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

NAME = "smol"  # --served-model-name


def post(url, path, body) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    proc, url = start_server(smollm2_dir, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", NAME,
                             "--max-total-tokens", "30000", timeout=180)
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


@pytest.fixture(scope="module")
def hf_token_text(smollm2_dir):
    """token id -> its text, as HF's tokenizer decodes it alone."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    return lambda token: tokenizer.decode([token])


def assert_top_matches(top: list[tuple[str, float]], row: torch.Tensor, token_text):
    """The k alternatives (text, logprob), likeliest first, are HF's k likeliest tokens at that position,
    each with its own logprob (a few more of HF's are looked up: a near-tie may swap the k-th)."""
    values, ids = row.topk(len(top) + 3)
    expected = {token_text(i): v for i, v in zip(ids.tolist(), values.tolist())}
    logprobs = [logprob for _, logprob in top]
    assert logprobs == sorted(logprobs, reverse=True)
    assert logprobs == pytest.approx(values[: len(top)].tolist(), abs=1e-3)
    assert all(text in expected and logprob == pytest.approx(expected[text], abs=1e-3) for text, logprob in top), top


def test_openai_chat_logprobs_match_hf(server, hf_logprobs, hf_token_text):
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
        assert_top_matches([(alt.token, alt.logprob) for alt in entry.top_logprobs], row, hf_token_text)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the likeliest
        assert entry.bytes == list(entry.token.encode())


def test_openai_completion_logprobs_and_echo_match_hf(server, hf_logprobs, hf_token_text):
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
            top = sorted(logprobs.top_logprobs[i - first].items(), key=lambda item: -item[1])  # the 5 likeliest, and
            assert_top_matches(top[:5], ref[i - 1], hf_token_text)  # the token's own if not among them (logprobs + 1)


def test_openai_chat_logprob_bytes_spell_the_message(server):
    """OpenAI's `bytes`: "characters represented by multiple tokens" have their tokens' bytes "combined
    to generate the correct text": an emoji or a kana takes several tokens, each U+FFFD as a token alone."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    split = 0
    for ask in ["Reply with three fruit emoji.", "Translate 'good morning' to Japanese."]:
        reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ask}], max_tokens=16,
                                               temperature=0, logprobs=True, top_logprobs=2)
        entries = reply.choices[0].logprobs.content
        split += sum("\ufffd" in e.token for e in entries)
        # a character cut short by max_tokens ends the text as U+FFFD, as the bytes decode
        assert bytes(sum((e.bytes for e in entries), [])).decode(errors="replace") == reply.choices[0].message.content
    assert split > 0  # the case in question came up


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


def test_openai_stream_helper_takes_n_choices(server):
    """openai's stream helper numbers a stream's choices in the order they first appear (an IndexError
    when choice 1 came before choice 0); vLLM sends every choice's first chunk in index order, and so
    must nano, whose first tokens of all choices come together. The helper's choices are the ones the
    same request gets without streaming."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    seed = random.randrange(2**31)
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=3, n=4, seed=seed)
    for attempt in range(3):  # first chunks in a random order would pass by chance 1 time in 24
        with client.chat.completions.stream(**ask) as stream:
            for _ in stream:  # (get_final_completion refuses a finish_reason of "length")
                pass
            streamed = stream.current_completion_snapshot
        reply = client.chat.completions.create(**ask)
        assert [c.message.content for c in streamed.choices] == [c.message.content for c in reply.choices]
    # the completions stream too: each choice's first chunk in index order
    body = dict(model=NAME, prompt=["Once upon a time", "The sea"], max_tokens=2, n=3, seed=seed, stream=True)
    chunks = [chunk.choices[0].index for chunk in client.completions.create(**body)]
    assert list(dict.fromkeys(chunks)) == list(range(6)), chunks


def test_openai_stream_helper_lists_each_tokens_logprobs_once(server):
    """A chat stream opens each choice with a chunk of its role and no token, as OpenAI's and vLLM's do:
    openai's stream helper builds choice i > 0 from its first chunk and then adds that chunk's
    logprobs again, so a token sent with the role would be listed twice."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=4, n=3,
               seed=random.randrange(2**31), logprobs=True, top_logprobs=2)
    with client.chat.completions.stream(**ask) as stream:
        for _ in stream:  # (get_final_completion refuses a finish_reason of "length")
            pass
        streamed = stream.current_completion_snapshot
    reply = client.chat.completions.create(**ask)
    for got, want in zip(streamed.choices, reply.choices, strict=True):
        assert [e.token for e in got.logprobs.content] == [e.token for e in want.logprobs.content]
        assert len(want.logprobs.content) == len(want.token_ids)
        assert [e.logprob for e in got.logprobs.content] == pytest.approx([e.logprob for e in want.logprobs.content],
                                                                          abs=1e-3)


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


# ---- lm-eval: local-completions against its own HF model on the same weights ----------------------
GSM_TASK = """task: tiny_gsm
dataset_path: json
dataset_kwargs:
  data_files: {{train: {data}/gsm_train.jsonl, test: {data}/gsm_test.jsonl}}
output_type: generate_until
fewshot_split: train
test_split: test
num_fewshot: 1
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 24
filter_list:
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
"""
CHOICE_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}/choice_test.jsonl}}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""
GSM_DOCS = [("What is 2 plus 3?", "2 + 3 = 5\n#### 5"), ("Tom has 4 apples and eats 1. How many are left?", "4 - 1 = 3\n#### 3"),
            ("What is 10 times 2?", "10 * 2 = 20\n#### 20"), ("A box holds 6 eggs. How many eggs are in 2 boxes?", "6 * 2 = 12\n#### 12"),
            ("What is 9 minus 4?", "9 - 4 = 5\n#### 5")]
CHOICE_DOCS = [("What is the capital of France?", [" Paris", " Berlin", " a banana"], 0),
               ("Which animal barks?", [" a cat", " a dog", " a fish"], 1),
               ("What colour is the sky on a clear day?", [" green", " red", " blue"], 2),
               ("How many legs does a spider have?", [" eight", " three", " one hundred"], 0)]


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    pytest.importorskip("lm_eval")
    folder = tmp_path_factory.mktemp("tasks")
    lines = [json.dumps({"question": q, "answer": a}) for q, a in GSM_DOCS]
    (folder / "gsm_train.jsonl").write_text(lines[0] + "\n")
    (folder / "gsm_test.jsonl").write_text("\n".join(lines[1:]) + "\n")
    (folder / "choice_test.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "label": label}) + "\n"
                                                      for q, c, label in CHOICE_DOCS))
    (folder / "tiny_gsm.yaml").write_text(GSM_TASK.format(data=folder))
    (folder / "tiny_choice.yaml").write_text(CHOICE_TASK.format(data=folder))
    return folder


def lm_eval_run(tasks_dir, model: str, model_args: str, batch_size: int = 1) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_gsm", "tiny_choice"],
                                   batch_size=batch_size, device="cpu", log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks_dir)))


def test_lm_eval_local_completions_agrees_with_lm_eval_hf(server, smollm2_dir, lm_eval_tasks):
    reference = lm_eval_run(lm_eval_tasks, "hf", f"pretrained={smollm2_dir},dtype=float32")
    base = f"model={NAME},base_url={server}/v1/completions,max_retries=1"
    for args, batch_size in [(base + ",tokenized_requests=False", 1), (base, 1), (base + ",tokenized_requests=False", 4)]:
        got = lm_eval_run(lm_eval_tasks, "local-completions", args, batch_size)
        for task, metric in [("tiny_gsm", "exact_match,flexible-extract"), ("tiny_choice", "acc,none")]:
            assert got["results"][task][metric] == reference["results"][task][metric], (args, batch_size, task)
        # the generated answers, and each choice's summed logprob and is-greedy flag
        answers = [[s["filtered_resps"], s["resps"]] for s in got["samples"]["tiny_gsm"]]
        assert answers == [[s["filtered_resps"], s["resps"]] for s in reference["samples"]["tiny_gsm"]], args
        choices = [[r[0] for r in sample["resps"]] for sample in got["samples"]["tiny_choice"]]
        ref_choices = [[r[0] for r in sample["resps"]] for sample in reference["samples"]["tiny_choice"]]
        assert [len(c) for c in choices] == [len(c) for c in ref_choices] == [3] * len(CHOICE_DOCS)
        for (logprob, greedy), (ref_logprob, ref_greedy) in zip(sum(choices, []), sum(ref_choices, [])):
            assert abs(float(logprob) - float(ref_logprob)) < 1e-3 and greedy == ref_greedy, args


# ---- the serving benchmarks' request shapes -----------------------------------------------------
BENCHMARK_REQUESTS = [  # (path, body) as SGLang's bench_serving and vLLM's benchmark_serving send them
    ("/v1/completions", {"model": NAME, "prompt": "Hello there", "temperature": 0.0, "best_of": 1, "max_tokens": 4,
                         "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}),  # sglang-oai
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hello there"}],
                              "temperature": 0.0, "max_completion_tokens": 4, "stream": True, "ignore_eos": True,
                              "stream_options": {"include_usage": True}}),  # sglang-oai-chat
    ("/v1/completions", {"model": NAME, "prompt": "Hello there", "temperature": 0.0, "repetition_penalty": 1.0,
                         "max_tokens": 4, "logprobs": None, "stream": True, "ignore_eos": True,
                         "stream_options": {"include_usage": True}}),  # vllm openai-completions
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                              "temperature": 0.0, "max_completion_tokens": 4, "stream": True, "ignore_eos": True,
                              "stream_options": {"include_usage": True}}),  # vllm openai-chat
]


@pytest.mark.parametrize("path, body", BENCHMARK_REQUESTS)
def test_serving_benchmark_request_shapes(server, path, body):
    req = urllib.request.Request(server + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [line[6:].strip() for line in resp if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    *chunks, usage = [json.loads(e) for e in events[:-1]]
    if "chat" in path:  # the role alone first, as OpenAI's and vLLM's: the benchmarks skip a chunk of no content
        role, *chunks = chunks
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 4 and usage["usage"]["completion_tokens"] == 4
