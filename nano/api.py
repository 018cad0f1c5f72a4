"""The OpenAI API's request bodies, as this server reads them, the checks they pass, and its JSON answers.

A client sends JSON; pydantic turns it into typed objects and names the field of every problem,
which becomes a 400 in OpenAI's error JSON. The schemas are strict: an unknown field is a feature
this server lacks, and silently ignoring it would give a client an answer to a question it did
not ask. Some clients send fields of features nano lacks with every request, in their "off"
value; those are accepted when off (or null) and refused otherwise: one table, `OFF_VALUES`,
read before the schemas. Any other field sent as null takes its default, as OpenAI's API reads
it. The sampling settings are checked once, by `SamplingParams.validate`, the same check
`generate` runs.

A completion's `prompt` may be several (strings or token-id lists), and `n` asks for n samples of
each: choice `prompt * n + j`. With a seed s (any int64), sample j draws with seed s + j (mod
2^63), so the samples differ and a repeated request gets them again. `top_k` -1 is off, as in vLLM
and SGLang. A completion's `max_tokens` 0 with `echo` scores the prompt alone (its logprobs), as
OpenAI's legacy API and vLLM do.
"""

import asyncio
import json
import re
import secrets
from typing import Annotated, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from nano.engine_process import APIError
from nano.sampling import MAX_LOGPROBS, SamplingParams

MAX_BODY_BYTES = 4 << 20  # a context's worth of text or token ids is far less
# a client that sends part of a body, then nothing, would hold its connection for ever, and a stop
# (SIGTERM) waits for every connection to close
BODY_SECONDS = 30
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat runs to the context
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # "\ud800": JSON's only way to a lone surrogate
MAX_CHOICES = 128  # n at most, as OpenAI's API
# Each choice (prompts x n) is a stream set up on the event loop, and each stop string is looked for
# there after every token: 100k one-token prompts, or 300k stop strings, stalled every stream for seconds
MAX_REQUEST_CHOICES, MAX_STOP_STRINGS = 1024, 16
# fields of features nano lacks that clients send anyway, and the values (besides null) that ask for nothing
OFF_VALUES = {"frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
              "min_tokens": (0,), "best_of": (1,), "suffix": ("",), "logit_bias": ({},), "tools": ([],),
              "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "store": (False,),
              "metadata": ({},), "response_format": ({"type": "text"},), "service_tier": ("auto", "default"),
              # vLLM's own fields, in their defaults (nano's text always leaves special tokens out)
              "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "stop_token_ids": ([],),
              "include_stop_str_in_output": (False,), "add_generation_prompt": (True,),
              "continue_final_message": (False,)}

StopString = Annotated[str, Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a feature we lack


class StreamOptions(StrictModel):
    include_usage: bool | None = False  # null: the default, as in OpenAI's and vLLM's schemas
    # vLLM's usage in every chunk, which nano lacks: some clients send it off with every stream (as OFF_VALUES)
    continuous_usage_stats: Literal[False] | None = None


class GenerationRequest(StrictModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    seed: int | None = Field(None, ge=-2**63, lt=2**63)  # any int64, as vLLM takes it
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    user: str | None = None  # an end user's id: nothing to do with it

    def logprob_params(self, sample: int = 0) -> dict:
        """SamplingParams' logprob settings, as this endpoint asks for them of a prompt's `sample`-th choice."""
        raise NotImplementedError

    def sampling_params(self, max_new_tokens: int, sample: int = 0) -> SamplingParams:
        """The settings of each prompt's `sample`-th choice."""
        # s + j, kept in the generators' range [0, 2^63) (a negative seed too)
        seed = None if self.seed is None else (self.seed + sample) % 2**63
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), seed=seed,
                                max_new_tokens=max_new_tokens, ignore_eos=self.ignore_eos,
                                **self.logprob_params(sample))
        try:
            params.validate()
        except ValueError as e:  # its message names the setting first: "top-p must be ..."
            raise APIError(400, str(e), param=str(e).split()[0].replace("-", "_")) from None
        return params


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt or several, as text or token ids
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt and its logprobs alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # how many likeliest alternatives per token
    echo: bool = False  # the prompt first, in the text and (with logprobs) in the logprobs

    @model_validator(mode="before")
    @classmethod
    def _few_enough_choices(cls, data: dict):  # before the fields: validating 1M prompts takes a second
        prompt, n = data.get("prompt"), data.get("n", 1)
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        if prompts * (n if type(n) is int else 1) > MAX_REQUEST_CHOICES:
            raise APIError(400, f"{prompts} prompts x n = {n}: more than {MAX_REQUEST_CHOICES} choices in one request",
                           param="prompt")
        return data

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self):  # as vLLM: one token is computed and left out of the answer
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: must be >= 1 (0 only with echo: true)", param="max_tokens")
        return self

    def logprob_params(self, sample: int = 0) -> dict:
        # the first choice alone computes the prompt's logprobs; the others get a copy (serve.generate)
        return {"logprobs": self.logprobs, "prompt_logprobs": self.echo and self.logprobs is not None and sample == 0}


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None  # a string or text parts ({"type": "text", "text": ...}); null: ""
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nothing_asked_is_absent(cls, data):
        # null is the default here too, and an assistant turn's empty tool_calls and annotations ask for
        # nothing: the openai SDK's message.model_dump() sends "refusal": null, "tool_calls": null, ...
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None and not (key in ("tool_calls", "annotations") and value == [])}

    def as_dict(self, template_has_developer: bool) -> dict:
        """The message as the chat template reads it; `developer` is `system` to a template without it."""
        parts = [self.content] if isinstance(self.content, str) else self.content or []
        for part in parts:
            if not isinstance(part, str) and (part.get("type") != "text" or not isinstance(part.get("text"), str)):
                raise APIError(400, f"messages: a content part of type {part.get('type')!r}; "
                               "this server takes text parts only", param="messages")
        role = "system" if self.role == "developer" and not template_has_developer else self.role
        message = {"role": role, "content": "\n".join(p if isinstance(p, str) else p["text"] for p in parts)}
        # the template reads what it knows (Mistral's pairs a tool result with its call by tool_call_id)
        return message | {key: value for key in ("name", "tool_call_id") if (value := getattr(self, key)) is not None}


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_params(self, sample: int = 0) -> dict:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}


class TokenizeRequest(StrictModel):  # vLLM's /tokenize: a completion's prompt or a chat's messages
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # False: a text prompt's own tokens, no BOS


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


async def check_api_key(http: HTTPRequest):
    api_key, sent = http.app.state.api_key, http.headers.get("authorization", "")
    if api_key is not None and not secrets.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")


async def read_json(http: HTTPRequest) -> dict:
    too_large = APIError(413, f"request body is over {MAX_BODY_BYTES} bytes")
    if int(http.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_SECONDS):
            async for chunk in http.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {BODY_SECONDS} s") from None
    except ClientDisconnect:  # gone mid-body: nobody reads the answer, and it is no server error to log
        raise APIError(499, "the client closed the connection") from None
    try:
        # strictly UTF-8 (RFC 8259; a BOM is skipped): json.loads would take bytes in UTF-16 too, and
        # UTF-8-shaped surrogates (b"\xed\xa0\x80"), text no tokenizer takes
        data = json.loads(body.decode("utf-8-sig"))
        if SURROGATE_ESCAPE.search(body):  # a quick scan first: re-encoding a large body takes milliseconds
            json.dumps(data, ensure_ascii=False).encode()  # raises for a lone surrogate, no text a tokenizer takes
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bytes or escapes that are not UTF-8, deep nesting
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def _where(loc: tuple) -> str:
    """A field's place as "messages.0.content"; a key that is empty or holds a newline quoted, so the
    message stays one line that says which key."""
    return ".".join(part if part.isprintable() and part else json.dumps(part) for part in map(str, loc))


def _is_off(value, off_values: tuple) -> bool:
    return value is None or any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in off_values)


async def parse(http: HTTPRequest, schema: type[StrictModel], model_name: str):
    """The request body as `schema`, or the APIError that says what is wrong with it."""
    data = {key: value for key, value in (await read_json(http)).items() if value is not None}  # null: the default
    for name, off_values in OFF_VALUES.items():
        if not _is_off(data.pop(name, None), off_values):
            shown = " or ".join(json.dumps(v) for v in off_values)
            raise APIError(400, f"{name}: not supported by this server (only {shown} or null)", param=name)
    try:
        body = schema.model_validate(data)
    except ValidationError as e:  # up to three of the problems, each with where it is
        errors = e.errors()
        message = "; ".join(f"{_where(err['loc'])}: " + (
            "not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]) for err in errors[:3])
        raise APIError(400, message, param=str(errors[0]["loc"][0]) if errors[0]["loc"] else None) from None
    if getattr(body, "stream_options", None) and not body.stream:  # as OpenAI's API refuses it
        raise APIError(400, "stream_options: only with stream: true", param="stream_options")
    if body.model not in (None, model_name):
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    return body


def sse(data: dict) -> str:
    """One server-sent event of a stream."""
    return f"data: {to_json(data)}\n\n"


async def json_answer(content) -> Response:
    """A long answer (a 4 MB prompt's token ids, a prompt's logprobs) is serialized off the event loop:
    FastAPI's own encoder visits every element in Python (0.7 s for 800k ids) while all streams wait."""
    text = await asyncio.to_thread(to_json, content, ensure_ascii=False, separators=(",", ":"))
    return Response(text, media_type="application/json")


def to_json(data, **options) -> str:
    """JSON has no NaN or infinity: Python's json would write them anyway, and clients fail to parse
    them. Only the logprobs of a model whose logits overflowed hold one: the request fails, saying so."""
    try:
        return json.dumps(data, allow_nan=False, **options)
    except ValueError:
        raise APIError(500, "the model's logprobs are not finite: its logits overflowed (NaN or infinity); "
                       "a wider --dtype may help") from None


async def error_json(_, e: Exception):
    """Every error as OpenAI's error JSON: ours, Starlette's (unknown paths and methods), and a
    bug's (the client gets one line, the log the traceback)."""
    headers = None
    if isinstance(e, HTTPException):  # its headers too: a 405's Allow names the methods the path takes
        e, headers = APIError(e.status_code, str(e.detail)), e.headers
    elif not isinstance(e, APIError):
        e = APIError(500, f"internal error ({type(e).__name__})")
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
