"""nano's Tokenizer against HF transformers' AutoTokenizer, both reading the default model's folder."""

import json
import random
import shutil
import time

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, processors
from transformers import AutoTokenizer

from nano.tokenizer import REPLACEMENT_CHAR, Detokenizer, StopMatcher, StreamDecoder, Tokenizer, TokenizerError
from tests.helpers import save_byte_fallback_tokenizer

TEXTS = [
    "Hello, world! The year 2024 had 366 days.",
    "Crème brûlée, naïve façade, Ångström, São Paulo",
    "Party time 🎉🥳 family 👩‍👩‍👧 flags 🇫🇷",
    "def add(a, b):\n    return a + b  # {'k': [1, 2]}\n",
    "北京是中国的首都。日本語も少し。",
    "  leading spaces\tand\ttabs\n\n<|im_start|>inline special",
]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode_prompt(text, use_chat_template=False) == hf_tokenizer(text)["input_ids"]


def test_chat_template_matches_hf(tokenizer, hf_tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tokenizer.has_chat_template
    assert tokenizer.apply_chat_template(messages) == text
    assert tokenizer.encode_prompt(QUESTION, use_chat_template=True) == ids


def test_special_token_ids(tokenizer):
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.add_bos_token is False


def test_decode_skips_special_tokens(tokenizer):
    text = tokenizer.decode(tokenizer.encode_prompt(QUESTION, use_chat_template=True))
    assert "<|im_start|>" not in text and "<|im_end|>" not in text
    assert text.startswith("system\n") and text.endswith(f"user\n{QUESTION}\nassistant\n")


def test_stream_decoder_joins_to_full_decode(tokenizer):
    text = "Emoji 🎉🥳 then 中文, façade 👩‍👩‍👧 and 🇫🇷!"
    ids = tokenizer.encode_prompt(text, use_chat_template=False)
    # The test only means something if some character's bytes are split across tokens.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([token_id]) for token_id in ids)
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(token_id) for token_id in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_stream_decoder_after_a_chat_prompt(tokenizer):
    prompt_ids = tokenizer.encode_prompt(QUESTION, use_chat_template=True)
    answer_ids = tokenizer.encode_prompt("The capital of France is Paris 🇫🇷.", use_chat_template=False)
    answer_ids += tokenizer.eos_token_ids
    decoder = StreamDecoder(tokenizer, prompt_ids)
    pieces = [decoder.push(token_id) for token_id in answer_ids]
    assert "".join(pieces) == "The capital of France is Paris 🇫🇷."
    assert pieces[-1] == ""  # EOS is special: it prints nothing


def test_bos_added_once(smollm2_dir, tmp_path):
    """add_bos_token: true adds BOS when tokenizer.json does not, and not again when its
    post-processor already does (as Llama-3's does)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    plain = Tokenizer(tmp_path).encode_prompt("Hi there", use_chat_template=False)
    assert plain[0] == 1 and plain[1] != 1

    hf_json = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    adds_bos = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    hf_json.post_processor = adds_bos
    hf_json.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer(tmp_path).encode_prompt("Hi there", use_chat_template=False) == plain
    del config["add_bos_token"]  # unset: the post-processor alone decides
    config["chat_template"] = "{{ bos_token }}" + config["chat_template"]  # as Llama-3's writes BOS itself
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.encode_prompt("Hi there", use_chat_template=False) == plain
    # a rendered chat is encoded without the post-processor's BOS, as HF's apply_chat_template does
    messages = [{"role": "user", "content": QUESTION}]
    chat = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, add_generation_prompt=True,
                                                                       return_dict=True)["input_ids"]
    assert tokenizer.encode_chat(messages) == chat and chat[:2] == [1, 1]  # the template's BOS, then <|im_start|>


def test_vocab_size_counts_added_tokens(smollm2_dir, tmp_path):
    """Tokens added beside the BPE vocabulary (Llama-3's reserved specials) are ids the tokenizer can
    produce: the server's check against the model's embedding counts them, as HF's len() does."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    hf_json = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf_json.add_special_tokens(["<|reserved_0|>", "<|reserved_1|>"]) == 2
    hf_json.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path)) == 49152 + 2
    assert tokenizer.encode_text("<|reserved_1|>") == [49153]


@pytest.mark.parametrize("eos_token_id", [0, [0, 2]])
def test_generation_config_may_stop_on_token_id_0(smollm2_dir, tmp_path, eos_token_id):
    """Id 0 is a token like any other: SmolLM2's base models end on <|endoftext|>, id 0."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    assert sorted(Tokenizer(tmp_path).eos_token_ids) == [0, 2]  # with the config's <|im_end|>


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("file, content, fragment", [
    ("chat_template.jinja", "caf\xe9".encode("latin-1"), "chat_template.jinja: not UTF-8"),
    ("tokenizer_config.json", {"bos_token": 1}, "a special token must be text, got 1"),
    ("tokenizer_config.json", {"eos_token": ["<|im_end|>"]}, "a special token must be text"),
    ("generation_config.json", {"eos_token_id": "2"}, "eos_token_id must be an id or a list of ids"),
    ("generation_config.json", {"eos_token_id": True}, "eos_token_id must be an id or a list of ids"),
    ("generation_config.json", {"eos_token_id": [2, -1]}, "eos_token_id must be an id or a list of ids"),
    ("tokenizer_config.json", {"add_bos_token": "false"}, "add_bos_token must be true or false, got 'false'"),
    ("tokenizer_config.json", {"chat_template": 5}, "chat_template is not a single template string"),
    ("tokenizer.json", b'{"version": "1.0", "model": ', "tokenizer.json: cannot be read"),  # a cut-off download
])
def test_a_malformed_tokenizer_file_is_one_line(smollm2_dir, tmp_path, file, content, fragment):
    """Each was a traceback (a bytes error, a TypeError), or silently wrong: "2" stopped on nothing, true
    stopped on id 1, and the string "false" added BOS."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    raw = content if isinstance(content, bytes) else json.dumps(config | content if "tokenizer" in file else content)
    (tmp_path / file).write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    if file != "tokenizer_config.json":
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=fragment) as error:
        Tokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_chat_template_that_fails_is_one_line(smollm2_dir, tmp_path):
    """A template's own bug (1 / 0) was a ZeroDivisionError traceback; jinja's errors alone were caught."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "{{ 1 / 0 }}"}))
    with pytest.raises(TokenizerError, match="refused these messages: division by zero"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_chat_templates(smollm2_dir, tmp_path):
    """tokenizer_config.json may hold several named templates (Hermes-2-Pro's "default" and
    "tool_use"); without tools transformers renders "default"."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"},
                               {"name": "default", "template": config["chat_template"]}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": QUESTION}]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=False)
    assert Tokenizer(tmp_path).apply_chat_template(messages) == expected
    # without a "default" HF refuses to guess (tools? RAG?), and nano says so in one line
    config["chat_template"][1]["name"] = "rag"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no default"):
        AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    with pytest.raises(TokenizerError, match=r"names no \"default\" template \(\['rag', 'tool_use'\]\)"):
        Tokenizer(tmp_path)


def test_stream_decoder_after_a_prompt_ending_in_byte_tokens(tmp_path):
    """The prompt's last tokens, the context, may start inside a character spelled in bytes; the
    completion must still read as the whole text's decode continues the prompt's."""
    save_byte_fallback_tokenizer(tmp_path)
    tokenizer, rng = Tokenizer(tmp_path), random.Random(0)
    wide = [chr(rng.randrange(0x1F300, 0x1F650)) for _ in range(20)] + ["中", "é"]  # 4, 3 and 2 bytes
    for _ in range(50):
        prompt_ids = tokenizer.encode_prompt("a " + "".join(rng.choices(wide + ["a"], k=rng.randint(1, 4))), False)
        answer_ids = tokenizer.encode_text("".join(rng.choices(wide + ["a", " b"], k=rng.randint(1, 6))))
        answer_ids = answer_ids[answer_ids[0] == tokenizer._tokenizer.token_to_id("▁") :]  # no space first
        decoder = StreamDecoder(tokenizer, prompt_ids)
        streamed = "".join(decoder.push(t, i == len(answer_ids) - 1) for i, t in enumerate(answer_ids))
        prompt_text = tokenizer.decode(prompt_ids)
        assert prompt_text + streamed == tokenizer.decode(prompt_ids + answer_ids)


def test_a_long_stop_string_costs_little_per_token(tokenizer):
    """A request may send a stop string of megabytes; each token's check for its start at the
    text's end runs in the server's event loop, so it must not cost the stop string's length squared."""
    answer = "The capital of France is Paris, on the Seine."
    ids = tokenizer.encode_text(answer)
    stop = answer[-6:] + "".join(random.Random(0).choices("xyz", k=400_000))  # the answer ends with its start
    detokenizer, sent, started = Detokenizer(tokenizer, [], [stop]), [], time.perf_counter()
    for i, token_id in enumerate(ids):
        sent.append(detokenizer.push(token_id)[0])
        if i == len(ids) - 2:
            assert time.perf_counter() - started < 1, "the stop string's length costs time per token"
    assert "".join(sent) == answer[:-6]  # held back: the stop string may be starting
    assert detokenizer.push(tokenizer.eos_token_ids[0], last=True) == (answer[-6:], None)


def test_an_answer_held_back_whole_costs_little_per_token(tokenizer):
    """An answer that keeps matching the start of a stop string is held back whole. Each token's check
    tried every length of the held text against every stop string, a slice each: the held text's
    length squared per token and stop string (16 of them 50 s of a 2,400-token answer, in the server's
    event loop). Each stop string now reads each new character once: a few looks per character."""
    class CountedStop(str):
        looks = 0

        def __getitem__(self, key):
            CountedStop.looks += 1
            return str.__getitem__(self, key)

    answer = "The cat sat on the mat and looked at the moon. " * 20
    ids = tokenizer.encode_text(answer)
    stops = [CountedStop(s) for s in ("\x01" * 5000, "looked away", "The cat sat on the mat. " * 3, answer + "\x00")]
    detokenizer = Detokenizer(tokenizer, [], stops)
    assert "".join(detokenizer.push(t)[0] for t in ids) == "" and detokenizer.held == answer
    assert CountedStop.looks <= 4 * len(stops) * len(answer), CountedStop.looks
    assert detokenizer.push(tokenizer.eos_token_ids[0], last=True) == (answer, None)


def test_stop_strings_cut_and_hold_back_as_a_search_of_the_whole_text_does(tokenizer):
    """Against the rule written plainly, over all the text so far at every token: the text ends where
    the first stop string to begin begins (of two at one place, the first listed); short of one, what
    is sent is all but the longest end that begins one. Small alphabets: matches overlap and restart."""
    rng = random.Random(0)
    for trial in range(300):
        alphabet = rng.choice(["ab", "abc", "a b"])
        ids = tokenizer.encode_text("".join(rng.choices(alphabet, k=rng.randint(1, 40))))
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        detokenizer, sent = Detokenizer(tokenizer, [], stops), ""
        for i, token_id in enumerate(ids):
            text, stopped = detokenizer.push(token_id)
            sent += text
            so_far = tokenizer.decode(ids[: i + 1])
            cuts = [(so_far.find(s), s) for s in stops if s in so_far]
            if cuts:
                assert (sent, stopped) == (so_far[: min(c for c, _ in cuts)], min(cuts, key=lambda c: c[0])[1])
                break
            held = max((k for s in stops for k in range(1, len(s)) if so_far.endswith(s[:k])), default=0)
            assert stopped is None and sent == so_far[: len(so_far) - held], (trial, so_far, stops)


def test_token_texts_join_up_to_the_text(tmp_path):
    """What logprobs list each token as: a SentencePiece token keeps the space it starts with, as
    it reads inside the completion's text."""
    save_byte_fallback_tokenizer(tmp_path)
    tokenizer, rng = Tokenizer(tmp_path), random.Random(0)
    prompt_ids = tokenizer.encode_prompt("a", use_chat_template=False)
    for _ in range(50):
        words = "".join(rng.choices("ab c  ", k=rng.randint(1, 12)))
        answer_ids = tokenizer.encode_text(words)
        text = tokenizer.decode(prompt_ids + answer_ids)[len(tokenizer.decode(prompt_ids)) :]
        assert "".join(map(tokenizer.token_text, answer_ids)) == text == " " + words


def test_token_bytes_join_up_to_the_texts_bytes(tokenizer, tmp_path):
    """A chat logprob's `bytes`, as OpenAI's: joined over the tokens they are the text's UTF-8, also
    where a character takes several tokens that read U+FFFD alone (byte-level BPE as SmolLM2's, and
    SentencePiece's byte fallback, whose normalizer starts the text with a space)."""
    save_byte_fallback_tokenizer(tmp_path)
    rng = random.Random(0)
    wide = [chr(rng.randrange(0x1F300, 0x1F650)) for _ in range(20)] + ["中", "é", "Ε", "日本", "\ufffd"]
    for tok, lead in ((tokenizer, ""), (Tokenizer(tmp_path), " ")):
        split = 0
        for _ in range(40):
            text = "".join(rng.choices(wide + ["a", " b"], k=rng.randint(1, 8)))
            ids = tok.encode_text(text)
            split += sum(REPLACEMENT_CHAR in tok.token_text(t) for t in ids)
            assert b"".join(map(tok.token_bytes, ids)) == (lead + text).encode(), text
        assert split > 0  # the case in question came up


def test_token_bytes_of_each_byte_token_as_gpt2s_byte_alphabet(tokenizer):
    """Each of byte-level BPE's 256 one-byte tokens gives its byte back, as GPT-2's alphabet (HF's
    bytes_to_unicode) spells it: also those that read U+FFFD alone (0x80-0xFF, `¡`-`¬` among them)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ids = {byte: tokenizer._tokenizer.token_to_id(char) for byte, char in bytes_to_unicode().items()}
    ids = {byte: token_id for byte, token_id in ids.items() if token_id is not None}  # never in UTF-8: 0xC0, 0xF5...
    assert len(ids) > 200 and all(tokenizer.token_bytes(token_id) == bytes([byte]) for byte, token_id in ids.items())


def test_stream_decoder_after_a_one_token_prompt(tmp_path):
    """A prompt shorter than the context window is context as a whole: after a one-token prompt a
    SentencePiece "▁b" reads " b", as the whole text's decode continues the prompt's."""
    save_byte_fallback_tokenizer(tmp_path)
    tokenizer, rng = Tokenizer(tmp_path), random.Random(0)
    for _ in range(20):
        prompt_ids = tokenizer.encode_text(rng.choice(["a", "b"]))
        answer_ids = tokenizer.encode_text("".join(rng.choices("ab  ", k=rng.randint(1, 8))))
        decoder = StreamDecoder(tokenizer, prompt_ids)
        pieces = [decoder.push(t, last=i == len(answer_ids) - 1) for i, t in enumerate(answer_ids)]
        full = tokenizer.decode(prompt_ids + answer_ids)
        assert len(prompt_ids) == 1 and "".join(pieces) == full[len(tokenizer.decode(prompt_ids)) :]


def test_stream_decoder_after_invalid_byte_tokens_prints_what_is_new(tmp_path):
    """A run of byte tokens that turns out not to be UTF-8 (a lone lead byte) decodes, in a byte-fallback
    decoder, as U+FFFD for each of its bytes, those of a character already printed too: the stream then
    printed one U+FFFD per byte of that character again, beside it. Now: the character, then U+FFFD."""
    save_byte_fallback_tokenizer(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    byte, a = lambda b: tokenizer._tokenizer.token_to_id(f"<0x{b:02X}>"), tokenizer._tokenizer.token_to_id("▁a")
    for ids, expected in (([byte(0xC3), byte(0xA9), byte(0xE4), a], "é\ufffd a"),  # é, a lone lead byte, " a"
                          ([byte(0xE4), byte(0xB8), byte(0x96), byte(0xE7)], "世\ufffd")):  # cut off after a lead
        decoder = StreamDecoder(tokenizer, [])
        assert "".join(decoder.push(t, last=i == len(ids) - 1) for i, t in enumerate(ids)) == expected


def test_of_two_stop_strings_in_one_push_the_first_to_begin_wins(tokenizer):
    """"one" is held (it ends in "e", which may start "e t"); " two" then completes both stop strings in
    one push: the text ends where the first of them begins, whichever the request listed first."""
    detokenizer, sent = Detokenizer(tokenizer, [], ["two", "e t"]), []
    for token_id in tokenizer.encode_text("one two three"):
        text, stop = detokenizer.push(token_id)
        sent.append(text)
        if stop is not None:
            break
    assert ("".join(sent), stop) == ("on", "e t")


def test_stream_decoder_re_decodes_a_window_not_the_whole_text(tokenizer, monkeypatch):
    """Each token re-decodes the last printed tokens as context, a few, never all the text so far:
    a 4,000-token answer would decode 8 million ids, in the server's event loop."""
    text = "The capital of France is Paris. " * 40
    ids, lengths, decode = tokenizer.encode_text(text), [], tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, *args: (lengths.append(len(ids)), decode(ids, *args))[1])
    decoder = StreamDecoder(tokenizer)
    assert "".join(decoder.push(t) for t in ids) == text and len(ids) > 200
    assert max(lengths) <= StreamDecoder.CONTEXT_TOKENS + 2, max(lengths)


def test_stream_decoder_keeps_the_space_after_a_special_token(tmp_path):
    """A special token prints nothing (an EOS mid-stream under ignore_eos): the window of printed tokens
    keeps the text before it as context, so a SentencePiece "▁b" after it still reads " b" (alone: "b")."""
    save_byte_fallback_tokenizer(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    piece = tokenizer._tokenizer.token_to_id
    prompt_ids, answer_ids = tokenizer.encode_prompt("a", False), [piece("▁a"), piece("</s>"), piece("▁b")]
    decoder = StreamDecoder(tokenizer, prompt_ids)
    assert [decoder.push(t) for t in answer_ids] == [" a", "", " b"]
    assert tokenizer.decode(prompt_ids + answer_ids) == "a a b"


def test_a_run_of_special_tokens_does_not_widen_the_window(tokenizer, monkeypatch):
    """A special token prints nothing, so it never moved the window on: after 2,000 EOS tokens (a model
    made to go on past EOS) every token re-decoded 2,000 ids, twice. Its text is the whole decode's."""
    ids = tokenizer.encode_text("The sea is calm. ")
    ids = ids + tokenizer.eos_token_ids[:1] * 2000 + tokenizer.encode_text("Gulls fly.") + [ids[0]] * 3
    lengths, decode = [], tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: (lengths.append(len(ids)), decode(ids, **kw))[1])
    decoder = StreamDecoder(tokenizer)
    streamed = "".join(decoder.push(t, last=i == len(ids) - 1) for i, t in enumerate(ids))
    assert streamed == decode(ids) and max(lengths) <= StreamDecoder.CONTEXT_TOKENS + 2, max(lengths)


def test_a_tokens_text_is_decoded_once_per_id(smollm2_dir):
    """Logprobs list a token's text for every prompt token, alternative and choice: 21 million of them
    for an echo of 8k tokens with 20 alternatives and 128 choices, each a decode. Once per id now."""
    class CountedDecodes:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def decode(self, *args, **kwargs):
            self.calls += 1
            return self.inner.decode(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    ids = random.Random(0).choices(range(1000, 1100), k=2000)
    tokenizer = Tokenizer(smollm2_dir)
    want = [Tokenizer.token_text(tokenizer, t) for t in ids]  # the method itself, each a decode
    tokenizer._tokenizer = counted = CountedDecodes(tokenizer._tokenizer)
    assert [tokenizer.token_text(t) for t in ids] == want and counted.calls == len(set(ids))


def test_stop_matcher_tracks_the_longest_end_that_begins_its_stop_string():
    """StopMatcher against the rule written plainly: after each character, `matched` is the longest end
    of the text so far that begins the stop string, and read() is true where the text first ends with it.
    Stop strings up to 14 characters of 2-3 letters: borders within borders, so the fallback table's
    recurrence must chain (short stop strings, as the Detokenizer test's, rarely need it)."""
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "aab"])
        stop = "".join(rng.choices(alphabet, k=rng.randint(1, 14)))
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 60)))
        matcher = StopMatcher(stop)
        for i, char in enumerate(text):
            so_far = text[: i + 1]
            hit = matcher.read(char)
            assert hit == so_far.endswith(stop), (stop, so_far)
            if hit:
                break
            assert matcher.matched == max(k for k in range(len(stop)) if so_far.endswith(stop[:k])), (stop, so_far)


def test_a_stop_string_that_the_last_token_completes_still_cuts(tokenizer):
    """The request's last token (max_tokens, EOS) may be the one that completes a stop string: the text
    is cut where it begins and the stop string named, as on any other token; not sent whole."""
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choices("ab c", k=rng.randint(4, 30)))
        ids = tokenizer.encode_text(text)
        so_far = tokenizer.decode(ids)
        last_piece_start = len(tokenizer.decode(ids[:-1]))
        # a stop string that ends within the last token's text and nowhere earlier
        end = rng.randint(last_piece_start + 1, len(so_far))
        stop = so_far[max(0, end - rng.randint(1, 4)) : end]
        if stop in so_far[: end - 1]:
            continue
        detokenizer, sent = Detokenizer(tokenizer, [], [stop]), ""
        for i, token_id in enumerate(ids):
            piece, stopped = detokenizer.push(token_id, last=i == len(ids) - 1)
            sent += piece
        assert (sent, stopped) == (so_far[: so_far.index(stop)], stop), (so_far, stop)


def test_a_token_that_prints_nothing_yet_is_kept_as_context(tmp_path):
    """Only a special token is dropped from the window: a SentencePiece "▁" that opens a chat answer
    (no context) decodes alone to "" (the decoder strips the text's first space), yet with the "▁b"
    after it the text reads " b", as the whole decode does."""
    save_byte_fallback_tokenizer(tmp_path)
    tokenizer, rng = Tokenizer(tmp_path), random.Random(0)
    space = tokenizer._tokenizer.token_to_id("▁")
    seen = 0
    for _ in range(30):
        ids = tokenizer.encode_text(" " * rng.randint(1, 3) + "".join(rng.choices("ab ", k=rng.randint(1, 8))))
        seen += ids[0] == space
        decoder = StreamDecoder(tokenizer, [])
        streamed = "".join(decoder.push(t, last=i == len(ids) - 1) for i, t in enumerate(ids))
        assert streamed == tokenizer.decode(ids), ids
    assert seen > 0  # the case in question came up


def test_token_texts_join_up_to_the_text_without_a_stripping_decoder(tmp_path):
    """A SentencePiece decoder that keeps the first space (no Strip, as Metaspace with prepend_scheme
    "never"): "▁a" reads " a" alone already, so token_text must not add a space of its own."""
    save_byte_fallback_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer, rng = Tokenizer(tmp_path), random.Random(0)
    for _ in range(30):
        ids = tokenizer.encode_text("".join(rng.choices("ab c ", k=rng.randint(1, 12))))
        assert "".join(map(tokenizer.token_text, ids)) == tokenizer.decode(ids), ids


def test_token_bytes_of_a_token_that_ends_a_character_and_goes_on(smollm2_dir, tmp_path):
    """A byte-level token may hold the last bytes of one character and then whole ones (large vocabularies
    have them): alone it reads U+FFFD followed by text, yet its bytes are its own, the character's tail
    included. Here tokens of random such shapes are added to SmolLM2's vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet, rng = bytes_to_unicode(), random.Random(0)
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
    vocab, wanted = spec["model"]["vocab"], {}
    for _ in range(20):
        char = chr(rng.randrange(0x4E00, 0x9FFF)).encode()  # 3 bytes: cut after 1 or 2
        raw = char[rng.randint(1, 2) :] + "".join(rng.choices("abc xyz", k=rng.randint(1, 4))).encode()
        piece = "".join(alphabet[b] for b in raw)
        if piece not in vocab:
            vocab[piece] = wanted[raw] = len(vocab) + 100  # above the added tokens' ids
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            (tmp_path / name).write_text((smollm2_dir / name).read_text())
    tokenizer = Tokenizer(tmp_path)
    for raw, token_id in wanted.items():
        assert tokenizer.token_text(token_id).startswith("\ufffd")
        assert tokenizer.token_bytes(token_id) == raw, (tokenizer.token_text(token_id), raw)
