"""Published chat templates other than SmolLM2's, rendered by nano's Tokenizer exactly as HF
transformers' AutoTokenizer renders them. The folders borrow SmolLM2's tokenizer.json: it has the
same ChatML tokens (<|im_start|>, <|im_end|>), and the rendering does not depend on the vocabulary.

tests/data/qwen2.5-instruct.chat_template.jinja is the "chat_template" of Qwen/Qwen2.5-7B-Instruct's
tokenizer_config.json (Apache-2.0), byte for byte as ggml-org/llama.cpp keeps it in
models/templates/Qwen-Qwen2.5-7B-Instruct.jinja (taken from the llama-cpp-python 0.3.36 sdist,
which vendors llama.cpp). It equals the JSON string quoted from that tokenizer_config.json in
ShishirPatil/gorilla, berkeley-function-call-leaderboard/bfcl/model_handler/oss_model/qwen.py."""

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nano.api import ChatMessage
from nano.tokenizer import Tokenizer, TokenizerError

DATA = Path(__file__).parent / "data"
QWEN25_TEMPLATE = DATA / "qwen2.5-instruct.chat_template.jinja"
# Qwen2.5-7B-Instruct's tokenizer_config.json, apart from the template: no BOS, <|im_end|> ends a
# turn, <|endoftext|> pads. The class stays SmolLM2's, whose tokenizer.json this is.
QWEN25_TOKENS = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
                 "add_bos_token": False}

CONVERSATIONS = {
    "system and user": [{"role": "system", "content": "You are a terse geography tutor."},
                        {"role": "user", "content": "What is the capital of France?"}],
    # Qwen's template writes its own system prompt ("You are Qwen, created by Alibaba Cloud. ...")
    "user only": [{"role": "user", "content": "What is the capital of France?"}],
    "several turns": [{"role": "user", "content": "Name a river."},
                      {"role": "assistant", "content": "The Seine."},
                      {"role": "system", "content": "Answer in French from now on."},
                      {"role": "user", "content": "Et une montagne ?"}],
    # an assistant turn with tool calls, and two tool results written into one user turn; the
    # arguments go through the template's tojson filter
    "tool calls": [{"role": "user", "content": "Weather in Paris and Lyon?"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}},
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon", "days": [1, 2]}}}]},
                   {"role": "tool", "content": "{\"temp\": 21}"},
                   {"role": "tool", "content": "{\"temp\": 24}"}],
}


@pytest.fixture(scope="module")
def qwen25_folder(smollm2_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen25-template")
    shutil.copy(smollm2_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config.update(QWEN25_TOKENS, chat_template=QWEN25_TEMPLATE.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_qwen25_template_renders_as_hf(qwen25_folder, name):
    messages = CONVERSATIONS[name]
    expected = AutoTokenizer.from_pretrained(qwen25_folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert Tokenizer(qwen25_folder).apply_chat_template(messages) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    if name == "user only":
        assert expected.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                   "assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")


def test_qwen25_folder_tokens(qwen25_folder):
    """The rendered prompt encodes to the same ids, and <|im_end|> is what ends a turn."""
    tokenizer, hf = Tokenizer(qwen25_folder), AutoTokenizer.from_pretrained(qwen25_folder)
    messages = CONVERSATIONS["user only"]
    assert tokenizer.encode_chat(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                     return_dict=True)["input_ids"]
    assert tokenizer.bos_token is None and tokenizer.eos_token_ids == [hf.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("config_says", [None, "<|endoftext|>"])
def test_a_legacy_folder_with_generation_tags_renders_as_hf(smollm2_dir, tmp_path, config_says):
    """BOS and EOS named in special_tokens_map.json (older folders), which HF lets win over what the
    config says, and a template that marks the assistant's turns with `{% generation %}` (training
    templates): rendered as HF renders them, with HF's stop ids (the config's won: another EOS)."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "added_tokens_decoder" not in config
    for key in ("bos_token", "eos_token"):
        del config[key]
        if config_says:
            config[key] = config_says
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    messages = CONVERSATIONS["several turns"]
    hf, tokenizer = AutoTokenizer.from_pretrained(tmp_path), Tokenizer(tmp_path)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected
    assert expected.startswith("<|im_start|>user: ") and "The Seine.<|im_end|>" in expected
    assert tokenizer.eos_token_ids == [hf.convert_tokens_to_ids("<|im_end|>")]


# the tool-result branch of Mistral-7B-Instruct-v0.3's template: it pairs a result with its call by id
TOOL_RESULT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""


def test_a_tool_result_reaches_the_template_with_its_call_id(smollm2_dir, tmp_path):
    """The server's messages, as the template gets them, render as HF renders the same JSON."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TOOL_RESULT_TEMPLATE}))
    call_id = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz0123456789", k=9))
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": call_id}]
    tokenizer = Tokenizer(tmp_path)
    sent = [ChatMessage.model_validate(m).as_dict(tokenizer.template_has_developer) for m in messages]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert tokenizer.apply_chat_template(sent) == expected
    assert f'"call_id": "{call_id}"' in expected


def test_a_template_gets_every_special_token_by_name_as_hf(smollm2_dir, tmp_path):
    """HF gives a template all the special tokens the config names, not only BOS and EOS: the pad and
    unk tokens, and a model's own (`eot_token`), as text or as an AddedToken dict."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    rng = random.Random(0)
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>"]
    pad, unk, eot = rng.sample(names, 3)
    template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eot_token }}{% endfor %}"
                "{{ pad_token }}|{{ unk_token }}|{{ sep_token }}|{{ add_bos_token }}")
    added = [{"__type": "AddedToken", "content": token, "special": True} for token in (pad, eot)]
    config |= {"chat_template": template, "pad_token": added[0], "unk_token": unk, "eot_token": added[1]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = CONVERSATIONS["several turns"]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)
    assert Tokenizer(tmp_path).apply_chat_template(messages) == expected
    assert expected.endswith(f"{eot}{pad}|{unk}||")


def test_a_config_dict_that_is_no_added_token_is_not_a_template_token(smollm2_dir, tmp_path):
    """A `*_token` key whose dict is no AddedToken (no "__type", not a standard name) is some other
    setting: the folder loads, and the template does not get it (HF's special tokens leave it out too)."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config |= {"chat_template": "[{{ image_token }}]{{ messages[0]['content'] }}", "image_token": {"content": 49152}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "[]hi"


def test_a_template_refusing_messages_names_its_reason_as_hf(smollm2_dir, tmp_path):
    """raise_exception's message reaches the client, as HF's apply_chat_template raises it."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TOOL_RESULT_TEMPLATE}))
    call_id = "".join(random.Random(1).choices("abcdefghijklmnopqrstuvwxyz0123456789", k=8))  # not 9: refused
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": call_id}]
    with pytest.raises(Exception) as hf_error:
        AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    with pytest.raises(TokenizerError, match="refused these messages") as error:
        Tokenizer(tmp_path).apply_chat_template(messages)
    assert str(hf_error.value) == "Tool call IDs should be alphanumeric strings with length 9!"
    assert str(hf_error.value) in str(error.value)


def test_a_developer_message_is_system_unless_the_template_knows_developer(smollm2_dir, tmp_path):
    """OpenAI's `developer` role is its newer name for `system`: a template without it (SmolLM2's)
    renders it as HF renders a system message; one that knows it gets it as sent."""
    rng = random.Random(0)
    text = " ".join(rng.choices(["Be", "brief", "terse", "kind", "exact"], k=6))
    sent = [ChatMessage.model_validate({"role": "developer", "content": text}), ChatMessage(role="user", content="hi")]
    as_system = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}{% if m['role'] == 'developer' %}DEV {% endif %}"
                "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    for folder, expected_messages in ((smollm2_dir, as_system), (tmp_path, [m.model_dump(exclude_none=True) for m in sent])):
        tokenizer = Tokenizer(folder)
        expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
            expected_messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template([m.as_dict(tokenizer.template_has_developer) for m in sent]) == expected
    assert expected.startswith(f"DEV developer: {text}\n")


def test_a_config_that_lists_its_added_tokens_wins_over_the_special_tokens_map(smollm2_dir, tmp_path):
    """A newer folder (its config lists `added_tokens_decoder`): transformers reads its config alone,
    so the config's EOS stands where special_tokens_map.json names another."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "special": True, "lstrip": False,
                                            "rstrip": False, "normalized": False, "single_word": False}}
    config["eos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    hf, tokenizer = AutoTokenizer.from_pretrained(tmp_path), Tokenizer(tmp_path)
    assert tokenizer.eos_token_ids == [hf.convert_tokens_to_ids(hf.eos_token)] == [0]


# What HF's apply_chat_template gives a template beyond Jinja's defaults, a feature each.
TEMPLATE_FEATURES = {
    # lstrip_blocks: the indentation before a block tag is not written (templates without "-")
    "lstrip_blocks": ({}, "{% for m in messages %}\n    {% if m['role'] == 'user' %}\nU:{{ m['content'] }}\n"
                          "    {% endif %}\n{% endfor %}"),
    "loop controls": ({}, "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                          "{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] }};{% endfor %}"),
    # tojson with HF's arguments (Llama-3.1's tools: indent=4), no HTML escaping, keys in the order given
    "tojson arguments": ({}, "{{ {'b': [1, 2], 'a': '<é>'} | tojson(indent=4) }}{{ {'z': 1, 'y': 2} | tojson }}"
                             "{{ messages[0]['content'] }}"),
    # strftime_now (Llama-3.2's date line); a year, so that a run across midnight still matches
    "strftime_now": ({}, "{{ strftime_now('%Y') }} {{ messages[0]['content'] }}"),
    # HF passes tools and documents as None: `is not none` is false, where an undefined name's is true
    "tools and documents are none": ({}, "{% if tools is not none %}TOOLS {% endif %}{% if documents is not none %}"
                                         "DOCS {% endif %}{{ messages[0]['content'] }}"),
    # a folder without BOS and EOS: "" in the template, not "None" (HF's undefined also prints "")
    "no bos or eos": ({"bos_token": None, "eos_token": None},
                      "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"),
}


@pytest.mark.parametrize("name", TEMPLATE_FEATURES)
def test_template_features_render_as_hf(smollm2_dir, tmp_path, name):
    tokens, template = TEMPLATE_FEATURES[name]
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text()) | tokens | {"chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    messages = CONVERSATIONS["system and user"]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)
    assert Tokenizer(tmp_path).apply_chat_template(messages) == expected


def test_chat_template_jinja_wins_over_the_config(smollm2_dir, tmp_path):
    """A newer folder keeps its template in chat_template.jinja, which wins over an older one left in
    the config, as in HF."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                                  "{% endfor %}")
    messages = CONVERSATIONS["system and user"]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert Tokenizer(tmp_path).apply_chat_template(messages) == expected
    assert expected.startswith("[system] ")
