"""The OpenAI API's request bodies, as this server reads them, and the checks they pass.

A client sends JSON; pydantic turns it into typed objects and names the field of every problem,
which becomes a 400 in OpenAI's error JSON. The schemas are strict: an unknown field is a feature
this server lacks, and silently ignoring it would give a client an answer to a question it did
not ask. Some clients send fields of features nano lacks with every request, in their "off"
value; those are accepted when off and refused otherwise (`OFF_VALUES`). The sampling settings
are checked once, by `SamplingParams.validate`, the same check `generate` runs.
"""

import json
import re
from typing import Annotated, Literal

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nano.engine_process import APIError
from nano.sampling import SamplingParams

MAX_BODY_BYTES = 4 << 20  # a context's worth of text or token ids is far less
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat runs to the context
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # "\ud800": JSON's only way to a lone surrogate
OFF_VALUES = {"frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (None, False)}  # accepted only so

StopString = Annotated[str, Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a feature we lack


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationRequest(StrictModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    ignore_eos: bool = False
    user: str | None = None
    frequency_penalty: float = 0
    presence_penalty: float = 0
    logprobs: bool | None = None

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                max_new_tokens=max_new_tokens, ignore_eos=self.ignore_eos)
        try:
            params.validate()
        except ValueError as e:  # its message names the setting first: "top-p must be ..."
            raise APIError(400, str(e), param=str(e).split()[0].replace("-", "_")) from None
        return params


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


async def read_json(http: HTTPRequest) -> dict:
    too_large = APIError(413, f"request body is over {MAX_BODY_BYTES} bytes")
    if int(http.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        data = json.loads(body)
        if SURROGATE_ESCAPE.search(body):  # a quick scan first: re-encoding a large body takes milliseconds
            json.dumps(data, ensure_ascii=False).encode()  # raises for a lone surrogate, no text a tokenizer takes
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bytes or escapes that are not UTF-8, deep nesting
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


async def parse(http: HTTPRequest, schema: type[GenerationRequest], model_name: str):
    """The request body as `schema`, or the APIError that says what is wrong with it."""
    try:
        body = schema.model_validate(await read_json(http))
    except ValidationError as e:  # up to three of the problems, each with where it is
        errors = e.errors()
        message = "; ".join(f"{'.'.join(map(str, err['loc']))}: " + (
            "not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]) for err in errors[:3])
        raise APIError(400, message, param=str(errors[0]["loc"][0]) if errors[0]["loc"] else None) from None
    for name, off in OFF_VALUES.items():
        if getattr(body, name) not in off:
            raise APIError(400, f"{name}: not supported by this server", param=name)
    if body.stream_options and not body.stream:  # as OpenAI's API refuses it
        raise APIError(400, "stream_options: only with stream: true", param="stream_options")
    if body.model not in (None, model_name):
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    return body
