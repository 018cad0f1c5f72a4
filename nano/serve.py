"""An OpenAI-compatible HTTP server: `python -m nano.serve --model DIR --port 30000`.

Serving puts the engine (engine.py) behind a web API that many clients call at once. Two loops
meet here, each in a process of its own (engine_process.py):
- the engine loop never waits on the network: it takes new requests between steps and sends each
  step's tokens back in one message;
- the HTTP side is an asyncio event loop (FastAPI on uvicorn) with one coroutine per request: it
  turns tokens into text, cuts the text where a stop string begins, and answers with one JSON
  body, or with Server-Sent Events (`data: {json}` lines ending with `data: [DONE]`), one event
  per token so a client can time every token.
Why two processes: in one, the two loops would share Python's interpreter lock. Under load the
HTTP side spends tens of microseconds of Python on every token of every stream, thousands of
tokens a second, and each of those the engine would wait for, with the GPU idle between its
steps. Apart, each has a core.

Every request gets an answer, and no request can take the server down. Bad input is a 400 with
OpenAI's error JSON (api.py reads the bodies); a client that goes away aborts its request, so its
KV slots return to the pool at once; SIGINT/SIGTERM stop accepting connections, let in-flight
requests finish, and exit 0. The routes below find the engine's client, the tokenizer and the
model's name on `app.state`.

Extensions to OpenAI's API, as SGLang and vLLM have them: `top_k`, `ignore_eos`, and the generated
`token_ids` in every choice, so a server without a tokenizer (a shipped shape with dummy weights)
takes token-id prompts and still says what it generated.
"""

import asyncio
import json
import secrets
import signal
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial

import jinja2
import uvicorn
from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from nano.api import DEFAULT_COMPLETION_TOKENS, ChatRequest, CompletionRequest, parse
from nano.cli import ArgumentParser, UsageError, add_engine_args, build_engine, cli, resolve_model_or_shape
from nano.config import load_config
from nano.engine_process import APIError, EngineClient, Stream, start_engine_process
from nano.tokenizer import Detokenizer, Tokenizer


async def check_api_key(http: HTTPRequest):
    api_key, sent = http.app.state.api_key, http.headers.get("authorization", "")
    if api_key is not None and not secrets.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")


router = APIRouter()


@router.get("/health")
async def health(http: HTTPRequest):
    return {"status": "ok", **http.app.state.client.state}  # as of the engine's last message (engine_state)


@router.get("/v1/models", dependencies=[Depends(check_api_key)])
async def models(http: HTTPRequest):
    state = http.app.state
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "nano",
                                        "max_model_len": state.client.context_length,
                                        "vocab_size": state.client.vocab_size}]}


@router.post("/v1/completions", dependencies=[Depends(check_api_key)])
async def completions(http: HTTPRequest):
    state = http.app.state
    body = await parse(http, CompletionRequest, state.model_name)
    if not body.prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(body.prompt, list):
        if not all(0 <= t < state.client.vocab_size for t in body.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {state.client.vocab_size})", param="prompt")
        prompt_ids = body.prompt
    else:
        prompt_ids = need_tokenizer(state, "a text prompt").encode_prompt(body.prompt, use_chat_template=False)
    return await generate(http, body, prompt_ids, chat=False)


@router.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
async def chat_completions(http: HTTPRequest):
    body = await parse(http, ChatRequest, http.app.state.model_name)
    tokenizer = need_tokenizer(http.app.state, "chat")
    if not tokenizer.has_chat_template:
        raise APIError(400, "this model has no chat template: use /v1/completions")
    try:
        prompt_ids = tokenizer.encode_chat([m.model_dump() for m in body.messages])
    except jinja2.TemplateError as e:
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
    return await generate(http, body, prompt_ids, chat=True)


def need_tokenizer(state, what: str) -> Tokenizer:
    if state.tokenizer is None:
        raise APIError(400, f"{what} needs a tokenizer; this server has none (see --tokenizer): "
                       "send the prompt as token ids to /v1/completions")
    return state.tokenizer


async def generate(http: HTTPRequest, body, prompt_ids: list[int], chat: bool):
    """Run one request on the engine and answer it: streamed, or as one JSON body."""
    state = http.app.state
    client, context = state.client, state.client.context_length
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    # OpenAI's API refuses this too (a prompt too long on its own is the engine's to refuse)
    if max_tokens and len(prompt_ids) < context < len(prompt_ids) + max_tokens:
        raise APIError(400, f"the context holds {context} tokens: {len(prompt_ids)} of prompt "
                       f"and {max_tokens} to generate do not fit", param="max_tokens")
    if body.stop and state.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer; this server has none (see --tokenizer)", param="stop")
    params = body.sampling_params(max_tokens or (context if chat else DEFAULT_COMPLETION_TOKENS))
    stream = Stream(prompt_ids, params, state.stop_ids)
    client.submit(stream)
    # the first event decides the status: a refusal is a 400, before any response has started
    first = await until_disconnected(http, stream.events.get())
    if first is None:
        client.abort(stream)
        return Response(status_code=499)  # nobody is listening (nginx's code for it)
    if isinstance(first, APIError):  # refused: a 400
        raise first
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    # chat output starts a new message; a completion continues its prompt's text
    pieces = _pieces(stream, first, Detokenizer(state.tokenizer, [] if chat else prompt_ids, stop), client)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_name, "object": "text_completion"}
    if chat:
        head["object"] = "chat.completion.chunk" if body.stream else "chat.completion"
    answer = Answer(head, body, chat, len(prompt_ids))
    if body.stream:  # the background task runs once the stream ends, also when the client hung up: it frees the request
        return StreamingResponse(answer.events(pieces), media_type="text/event-stream",
                                 background=BackgroundTask(client.abort, stream))
    collected = await until_disconnected(http, _collect(pieces))  # a failed step's APIError raises through
    if collected is None:
        client.abort(stream)
        return Response(status_code=499)
    texts, tokens, reasons = zip(*collected)
    return {**head, "choices": [answer.choice("".join(texts), list(tokens), reasons[-1])],
            "usage": answer.usage(len(tokens))}


async def _pieces(stream: Stream, event, detokenizer: Detokenizer, client: EngineClient):
    """-> (text, token, finish_reason) per token, finish_reason set on the last; raises the APIError
    of a failed step."""
    while True:
        if isinstance(event, APIError):
            raise event
        text, stopped = detokenizer.push(event.id)
        if stopped:
            client.abort(stream)
            yield text, event.id, "stop"
            return
        if event.finish_reason:
            yield text + detokenizer.held, event.id, event.finish_reason
            return
        yield text, event.id, None
        event = await stream.events.get()


async def _collect(pieces):
    return [piece async for piece in pieces]


class Answer:
    """The response's shapes for one request: choices, usage, and the stream of SSE events."""

    def __init__(self, head: dict, body, chat: bool, prompt_tokens: int):
        self.head, self.body, self.chat, self.prompt_tokens = head, body, chat, prompt_tokens

    def choice(self, text: str, tokens: list[int], reason: str | None, first: bool = False) -> dict:
        if not self.chat:
            content = {"text": text}
        elif self.body.stream:
            content = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        else:
            content = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **content, "token_ids": tokens, "logprobs": None, "finish_reason": reason}

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    async def events(self, pieces):
        n = 0
        try:
            async for text, token, reason in pieces:
                n += 1
                yield _sse({**self.head, "choices": [self.choice(text, [token], reason, first=n == 1)]})
        except APIError as e:
            yield _sse(e.body())
        else:
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield _sse({**self.head, "choices": [], "usage": self.usage(n)})
        yield "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def until_disconnected(http: HTTPRequest, awaitable):
    """Await `awaitable`; None if the client disconnects first (after its body was read, the next
    ASGI message is the disconnect)."""
    async def disconnected():
        while (await http.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    return None


async def error_json(_, e: Exception):
    """Every error as OpenAI's error JSON: ours, Starlette's (unknown paths and methods), and a
    bug's (the client gets one line, the log the traceback)."""
    if isinstance(e, HTTPException):
        e = APIError(e.status_code, str(e.detail))
    elif not isinstance(e, APIError):
        e = APIError(500, f"internal error ({type(e).__name__})")
    return JSONResponse(e.body(), status_code=e.status)


def build_app(client: EngineClient, tokenizer: Tokenizer | None, model_name: str, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):  # the engine's events need the event loop, which runs from here on
        client.start(asyncio.get_running_loop())
        yield
        client.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client, app.state.tokenizer, app.state.model_name, app.state.api_key = client, tokenizer, model_name, api_key
    app.state.stop_ids = set(client.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    for kind in (APIError, HTTPException, Exception):
        app.add_exception_handler(kind, error_json)
    app.include_router(router)
    return app


# ---- the command line ------------------------------------------------------------------------
def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m nano.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model folder, or a shipped shape name with --load-format dummy")
    p.add_argument("--tokenizer", help="folder whose tokenizer to use (default: the model's, if it has one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health")
    add_engine_args(p)
    return p


def run(args):
    if args.api_key == "":
        raise UsageError("--api-key is empty: no request could send it")
    model_dir = resolve_model_or_shape(args)
    vocab_size = load_config(model_dir).vocab_size
    tokenizer_dir = args.tokenizer or model_dir
    tokenizer = Tokenizer(tokenizer_dir) if args.tokenizer or (model_dir / "tokenizer.json").is_file() else None
    if tokenizer is None:
        print("no tokenizer: /v1/completions takes token-id prompts only (see --tokenizer)", file=sys.stderr)
    elif tokenizer.vocab_size > vocab_size:
        raise UsageError(f"the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} tokens; "
                         f"the model's vocabulary only {vocab_size}")
    try:  # before the model loads: a port in use fails at once
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        listener = socket.create_server((args.host, args.port), family=family)
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        raise UsageError(f"cannot listen on {args.host} port {args.port}: {e}") from None
    try:
        client = start_engine_process(partial(build_engine, args, model_dir))
    except ValueError as e:
        raise UsageError(str(e)) from None
    server = uvicorn.Server(uvicorn.Config(build_app(client, tokenizer, model_dir.name, args.api_key), log_level="info"))
    # uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown), then re-raises the signal into
    # the handlers it found: make those no-ops, so a requested shutdown exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    host = f"[{args.host}]" if ":" in args.host else args.host or "0.0.0.0"  # uvicorn names none for our socket
    print(f"serving on http://{host}:{listener.getsockname()[1]} (Ctrl-C to stop)", file=sys.stderr)
    try:
        server.run(sockets=[listener])  # its shutdown stops the engine loop (lifespan)
    finally:
        client.worker.terminate()  # a no-op once it has stopped; else (uvicorn failed) it ends here


def main(argv=None):
    cli(build_parser, run, argv)  # one-line errors, exit 2; Ctrl-C while loading exits 130


if __name__ == "__main__":
    main()
