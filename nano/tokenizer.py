"""The tokenizer: text to token ids on the way in, ids to printable text on the way out.

A model folder from Hugging Face carries its tokenizer as `tokenizer.json`, a complete description
(normalizer, pre-tokenizer, BPE vocabulary and merges, post-processor, decoder) that the Rust
`tokenizers` library runs as is. Around it `tokenizer_config.json` adds what the engine must know:
which tokens are BOS and EOS, whether a prompt starts with BOS, and the chat template.

Two places need care:
- The prompt. An instruct model was trained on conversations laid out by its chat template, a
  Jinja program; we render it the way HF transformers does (a sandboxed Jinja environment with the
  same options and helpers), so the model sees exactly what it saw in training. The template
  writes any BOS itself, so the rendered text is encoded without adding special tokens again.
  Without a template, BOS follows `add_bos_token`: Llama-3's tokenizer.json adds BOS in its
  post-processor, SmolLM2's adds nothing and its config says not to.
- The output. Tokens arrive one at a time and must be printed as they come, but one token is not
  one piece of text: a character's UTF-8 bytes can be split across tokens (emoji, CJK), and some
  decoders change how a token reads depending on its neighbours (a SentencePiece "▁" is dropped at
  the start of a text). `StreamDecoder` therefore decodes a short window of recent tokens twice,
  with and without the newest ones, prints the difference, and holds text back while it still ends
  in a half-finished character. The server's `Detokenizer` also holds back text that may be the
  start of a stop string, and cuts the text where one begins.
"""

import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from nano.config import read_json

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
# GPT-2's byte-level alphabet, backwards: printable bytes stand for themselves, the others for chr(256 + i)
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_OF_CHAR = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}


class TokenizerError(ValueError):
    """A model folder whose tokenizer we cannot use, or messages its chat template refuses; the
    message is shown to the user as is."""


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json (nano needs a Hugging Face fast tokenizer)")
        try:
            self._tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust library raises a bare Exception for a malformed file
            raise TokenizerError(f"{tokenizer_file}: cannot be read ({e})") from None
        # logprobs list a token's text for each prompt token, alternative and choice (an echo of 8k tokens, 20
        # alternatives, 128 choices: 21 million times): a decode each, or once per token id
        self.token_text = functools.cache(self.token_text)
        # older folders name BOS and EOS in special_tokens_map.json, which wins over the config in HF; a config
        # that lists its added tokens is newer, and HF 5 reads it alone (here the map fills only its gaps)
        config = _read_json(model_dir / "tokenizer_config.json")
        token_map = _read_json(model_dir / "special_tokens_map.json")
        config = token_map | config if "added_tokens_decoder" in config else config | token_map
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        # None: the config does not say, and tokenizer.json's post-processor decides alone.
        self.add_bos_token = config.get("add_bos_token")
        if self.add_bos_token not in (None, True, False):  # the string "false" would read as true
            raise TokenizerError(f"{model_dir}: add_bos_token must be true or false, got {self.add_bos_token!r}")
        self.eos_token_ids = self._eos_token_ids(model_dir)
        # what a chat template reads by name; BOS and EOS as "" when there are none
        self._template_tokens = _template_tokens(config) | {"bos_token": self.bos_token or "",
                                                            "eos_token": self.eos_token or ""}
        self._chat_template = self._compile_chat_template(model_dir, config)

    def _eos_token_ids(self, model_dir: Path) -> list[int]:
        # Instruct models often stop on more than the tokenizer's EOS (Llama-3.1: <|eot_id|> and
        # <|eom_id|> too); generation_config.json lists them all.
        generation_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        listed = [generation_eos] if isinstance(generation_eos, int) else generation_eos or []
        if not all(type(eos_id) is int and eos_id >= 0 for eos_id in listed):  # "2" stops on nothing, true on 1
            raise TokenizerError(f"{model_dir / 'generation_config.json'}: eos_token_id must be an id or a list of ids")
        ids = [self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None, *listed]
        return [eos_id for eos_id in dict.fromkeys(ids) if eos_id is not None]  # each once, in order

    def _compile_chat_template(self, model_dir: Path, config: dict) -> jinja2.Template | None:
        # Newer HF folders keep the template in its own file; older ones in tokenizer_config.json.
        template_file = model_dir / "chat_template.jinja"
        try:  # UTF-8 as HF reads it, whatever the locale
            in_file = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{template_file}: not UTF-8 ({e})") from None
        source = config.get("chat_template") if in_file is None else in_file
        if isinstance(source, list):  # named templates [{"name", "template"}]: HF renders "default" without tools
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise TokenizerError(f"{model_dir}: chat_template names no \"default\" template "
                                     f"({sorted(map(str, named))})")
            source = named["default"]
        self.chat_template_source = source
        if source is None:
            return None
        if not isinstance(source, str):
            raise TokenizerError(f"{model_dir}: chat_template is not a single template string")
        # The same environment as HF transformers' apply_chat_template: templates come from the
        # internet, hence the sandbox; trim/lstrip_blocks decide the exact whitespace.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{model_dir}: chat template does not parse ({e})") from None

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def template_has_developer(self) -> bool:
        """Whether the template knows OpenAI's newer name for the system role."""
        return "developer" in (self.chat_template_source or "")

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The conversation (role/content dicts), followed by the header that asks the assistant to answer."""
        # HF passes tools and documents as None when unused, and templates test `tools is not none`.
        try:
            return self._chat_template.render(messages=messages, **self._template_tokens, add_generation_prompt=True,
                                              tools=None, documents=None)
        except Exception as e:  # raise_exception, a message the template cannot read, or its own bug (1 / 0)
            raise TokenizerError(f"the chat template refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The rendered text already holds every special token the model should see.
        return self._encode(self.apply_chat_template(messages), add_special_tokens=False)

    def encode_prompt(self, prompt: str, use_chat_template: bool) -> list[int]:
        """One prompt: as a single user turn through the chat template, or as raw text."""
        if use_chat_template and self.has_chat_template:
            return self.encode_chat([{"role": "user", "content": prompt}])
        if self.add_bos_token is False:
            return self.encode_text(prompt)
        ids = self._encode(prompt, add_special_tokens=True)  # the post-processor adds what it adds (Llama-3: BOS)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """The text's own tokens, without BOS or any other special token added."""
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch lets go of Python's lock while it works, encode holds it throughout: the server
        # tokenizes in a thread, and a 4 MB prompt's seconds would stall its event loop, every stream
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], special_tokens: bool = False) -> str:
        """The ids' text: without special tokens, as generated text is printed, or with them."""
        # decode_batch lets go of Python's lock as encode_batch does; decode held it (0.2 s for 500k ids)
        return self._tokenizer.decode_batch([ids], skip_special_tokens=not special_tokens)[0]

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (what logprobs list it as)."""
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        # A SentencePiece decoder drops the space ("▁") that starts a text, so alone "▁Paris" would
        # read "Paris"; in its place it reads " Paris" (vLLM puts the space back too).
        piece = self._tokenizer.id_to_token(token_id) or ""
        return " " * (len(piece) - len(piece.lstrip("▁")) - (len(text) - len(text.lstrip(" ")))) + text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's UTF-8 bytes (a chat logprob's `bytes`). A token that holds part of a character
        reads as U+FFFD alone, but its own bytes, joined with its neighbours', spell the character."""
        text, piece = self.token_text(token_id), self._tokenizer.id_to_token(token_id) or ""
        if REPLACEMENT_CHAR not in text:
            return text.encode()
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback (Llama-2, Mistral)
            return bytes([int(piece[3:5], 16)])
        # byte-level BPE (GPT-2, Llama-3, SmolLM2) writes each byte as one of 256 printable characters
        return bytes(_BYTE_OF_CHAR[c] for c in piece) if all(c in _BYTE_OF_CHAR for c in piece) else text.encode()


class StreamDecoder:
    """Turns a stream of token ids into a stream of text pieces that join up to the full decode.

    `prefix_offset:read_offset` is a window of tokens already printed, kept as context so that the
    new tokens decode as they would inside the whole text; `read_offset:` are the tokens not yet
    printed. Give the prompt's ids as context so the first generated token reads right too.
    """

    CONTEXT_TOKENS = 5  # prompt tokens the first token decodes after: enough context for any decoder we know

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        # A window that starts inside a character decodes its first bytes as U+FFFD, and a byte-fallback
        # decoder (Llama-2, Mistral) then garbles the whole run of byte tokens it starts, new ones too:
        # step back (a character has at most 3 more bytes) to the token where the character begins.
        start = max(len(prompt_ids) - self.CONTEXT_TOKENS, 0)
        for _ in range(3):
            if start == 0 or not tokenizer.decode(list(prompt_ids[start:])).startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        self._ids = list(prompt_ids[start:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)

    def push(self, token_id: int, last: bool = False) -> str:
        """Add one token; return the text it completes ("" while a character is still unfinished).
        The stream's `last` token returns all that is left, a character it leaves unfinished as
        U+FFFD, as the whole output decodes."""
        self._ids.append(token_id)
        printed = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if not last and text == printed and self._tokenizer.decode([token_id], special_tokens=True):
            self._ids.pop()  # a special token, which decode skips wherever it stands: a run of them (EOS after EOS,
            return ""  # under ignore_eos) widened the window that every later token decodes
        if not last and (len(text) <= len(printed) or text.endswith(REPLACEMENT_CHAR)):
            return ""
        new_ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not text.startswith(printed):  # bytes that turn out invalid: a byte-fallback decoder garbles their
            return self._tokenizer.decode(new_ids)  # whole run, the printed character too; these alone then
        return text[len(printed) :]


class Detokenizer:
    """One request's tokens to text for the server: StreamDecoder's pieces, held back while they
    may be the start of a stop string, and cut where one begins. Without a tokenizer (a shipped
    shape serving token ids) there is no text."""

    def __init__(self, tokenizer: Tokenizer | None, context_ids: list[int], stop: list[str]):
        self.decoder = StreamDecoder(tokenizer, context_ids) if tokenizer else None
        self.stop, self.held = [StopMatcher(s) for s in stop], ""

    def push(self, token: int, last: bool = False) -> tuple[str, str | None]:
        """-> (text to send now, the stop string reached or None); the request's `last` token
        sends all that is left."""
        if self.decoder is None:
            return "", None
        piece = self.decoder.push(token, last)
        text, cuts = self.held + piece, []
        for stop in self.stop:  # each reads the new characters alone: the held text can be the whole answer
            end = next((i + 1 for i, char in enumerate(piece) if stop.read(char)), None)
            if end is not None:
                cuts.append((len(self.held) + end - len(stop.text), stop.text))
        if cuts:
            cut, stop = min(cuts, key=lambda c: c[0])  # the first to begin (of two there, the first listed)
            return text[:cut], stop
        held = 0 if last else max((stop.matched for stop in self.stop), default=0)  # the longest end that begins one
        self.held = text[len(text) - held :]
        return text[: len(text) - held], None


class StopMatcher:
    """One stop string, read against the text one character at a time (Knuth-Morris-Pratt): `matched`
    is the length of the longest end of the text so far that begins it. On a character that does not
    continue the match, it falls back to the longest shorter match, from a table of the stop string's
    own prefixes, instead of trying every length again: constant work per character, however long the
    held text. The table grows only as far as the matches reach, as a stop string can be megabytes."""

    def __init__(self, text: str):
        self.text, self.matched, self.fallback = text, 0, [0, 0]  # fallback[n]: for a match of length n

    def read(self, char: str) -> bool:
        """-> whether the text now ends with the whole stop string."""
        while self.matched and self.text[self.matched] != char:
            self.matched = self._fallback(self.matched)
        self.matched += self.text[self.matched] == char
        return self.matched == len(self.text)

    def _fallback(self, n: int) -> int:
        """The longest proper prefix of text[:n] that is also its end."""
        while len(self.fallback) <= n:
            length, k = len(self.fallback), self.fallback[-1]  # extend the match of text[:length - 1]
            while k and self.text[k] != self.text[length - 1]:
                k = self.fallback[k]
            self.fallback.append(k + (self.text[k] == self.text[length - 1]))
        return self.fallback[n]


def _read_json(path: Path) -> dict:
    return read_json(path, TokenizerError) if path.is_file() else {}  # the file is optional


def _token_text(token) -> str | None:
    # tokenizer_config.json writes a special token as its text or as an AddedToken dict.
    text = token.get("content") if isinstance(token, dict) else token
    if text is not None and not isinstance(text, str):
        raise TokenizerError(f"tokenizer config: a special token must be text, got {token!r}")
    return text


_STANDARD_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _template_tokens(config: dict) -> dict[str, str]:
    # HF gives a template every special token by name, not only BOS and EOS: pad_token, unk_token, and a
    # model's own (an eot_token, Gemma's image_token); a template that writes one must not get "" for it
    named = {key: value for key, value in config.items() if key.endswith("_token") and (isinstance(value, str) or (
        isinstance(value, dict) and (key in _STANDARD_TOKENS or value.get("__type") == "AddedToken")))}
    return {key: text for key, value in named.items() if isinstance(text := _token_text(value), str)}


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF's templates mark the assistant's text with it for
    training (which tokens to learn); for a prompt it renders its body as is."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)
