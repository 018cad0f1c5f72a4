"""An OpenAI-compatible HTTP server: `python -m nano.serve --model DIR --port 30000`.

Serving puts the engine (engine.py) behind a web API that many clients call at once. Two loops
meet here, each in a process of its own:
- the engine loop (`run_engine`) never waits on the network: between steps it takes new requests
  and aborts from its inbox, runs one step, and sends the step's new tokens back in one message;
- the HTTP side is an asyncio event loop (FastAPI on uvicorn) with one coroutine per request: it
  turns tokens into text, cuts the text where a stop string begins, and answers with one JSON
  body, or with Server-Sent Events (`data: {json}` lines ending with `data: [DONE]`), one event
  per token so a client can time every token.
Why two processes: in one, the two loops would share Python's interpreter lock. Under load the
HTTP side spends tens of microseconds of Python on every token of every stream, thousands of
tokens a second, and each of those the engine would wait for, with the GPU idle between its
steps. Apart, each has a core. `EngineClient` is the HTTP side's handle on the engine: it
forwards requests to the inbox, and a reader thread hands each step's tokens to the event loop
(`loop.call_soon_threadsafe`), where a `Stream` per request receives them.

Every request gets an answer, and no request can take the server down. Bad input is a 400 with
OpenAI's error JSON; a step that raises fails the requests it was running with a 500 and the loop
goes on; a client that goes away aborts its request, so its KV slots return to the pool at once;
SIGINT/SIGTERM stop accepting connections, let in-flight requests finish, and exit 0.

Extensions to OpenAI's API, as SGLang and vLLM have them: `top_k`, `ignore_eos`, and the generated
`token_ids` in every choice, so a server without a tokenizer (a shipped shape with dummy weights)
takes token-id prompts and still says what it generated.
"""

import asyncio
import json
import multiprocessing
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal

import jinja2
import uvicorn
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from tqdm import tqdm

from nano.config import load_config
from nano.generate import (ArgumentParser, UsageError, add_engine_args, cli, engine_from_args, one_line_errors,
                           resolve_model_or_shape)
from nano.sampling import SamplingParams
from nano.tokenizer import StreamDecoder, Tokenizer

MAX_BODY_BYTES = 4 << 20  # a context's worth of text or token ids is far less
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat runs to the context
OFF_ONLY = ("frequency_penalty", "presence_penalty", "logprobs")  # accepted only as 0, false or null
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # "\ud800": JSON's only way to a lone surrogate


class APIError(Exception):
    """An error as the client gets it, in OpenAI's error JSON (the engine loop sends one to a
    request it refuses, 400, and to each request of a step that failed, 500)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message, param, code)  # the arguments again: how an exception is pickled
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---- the engine's side ------------------------------------------------------------------------
def engine_state(engine) -> dict:
    """What /health shows: KV slots free, or holding cached prefixes (evictable unless a running
    request locks them); requests; the engine's seconds and tokens of prefill and decode so far."""
    cache = engine.prefix_cache
    return {"total_slots": engine.kv_pool.num_slots - 1, "free_slots": engine.slots.available,
            "cached_slots": cache.size if cache else 0, "locked_slots": cache.locked_size if cache else 0,
            "running": len(engine.running), "waiting": len(engine.waiting), "engine": dict(engine.stats)}


def run_engine(engine, inbox, outbox):
    """The engine loop. It first sends ("ready", facts the HTTP side needs). Then it takes
    ("add", stream id, prompt ids, params, stop ids), ("abort", stream id) or None (stop) from the
    inbox, and after each round of them, and each step, sends (events, engine_state) with events
    [(stream id, (token, finish_reason or None) or APIError)]. It sleeps in the inbox while idle."""
    outbox.put(("ready", {"vocab_size": engine.cfg.vocab_size, "eos_token_ids": engine.cfg.eos_token_ids,
                          "context_length": engine.context_length, "state": engine_state(engine)}))
    requests = {}  # stream id -> the engine's request, while the engine holds it
    while True:
        messages = [] if engine.has_work() else [inbox.get()]
        while True:  # and whatever else has arrived since the last step
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        events = []
        for message in messages:
            if message is None:
                outbox.put(None)
                return
            kind, sid, *request = message
            if kind == "add":
                try:
                    requests[sid] = engine.add_request(*request)
                except ValueError as e:
                    events.append((sid, APIError(400, str(e))))
            elif sid in requests:  # an abort of a request that is not done yet
                engine.abort(requests.pop(sid))
        if engine.has_work():
            events += _step(engine, requests)
        outbox.put((events, engine_state(engine)))


def _step(engine, requests: dict) -> list:
    by_rid = {req.rid: sid for sid, req in requests.items()}
    try:
        out = engine.step()
    except Exception as e:  # a bug or a device error: fail what the step ran, keep serving
        traceback.print_exc()
        # every admitted request may have been in the failed pass (running ones, a prompt part-way,
        # prompts being prefilled); waiting ones were not touched and stay queued
        failed = [sid for sid, req in requests.items() if req.row >= 0]
        error = APIError(500, f"the engine failed on this request ({type(e).__name__}); see the server log")
        for sid in failed:
            engine.abort(requests.pop(sid))
        return [(sid, error) for sid in failed]
    events = []
    for req, token in out:
        sid = by_rid[req.rid]
        if req.finished:
            del requests[sid]
        reason = None if not req.finished else "stop" if token in req.stop_ids else "length"
        events.append((sid, (token, reason)))
    return events


def _engine_process(args, model_dir, inbox, outbox):
    """The engine process: build the engine (a failure goes back as one line), then run its loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; the server decides
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()  # never outlive it
    tqdm.set_lock(threading.RLock())  # the loading bar's; tqdm's own is a multiprocessing lock, left behind at exit
    try:
        engine = engine_from_args(args, model_dir)
    except one_line_errors() as e:
        outbox.put(("error", str(e)))
        return
    run_engine(engine, inbox, outbox)
    engine.close()


# ---- the HTTP side's handle on it -----------------------------------------------------------------
@dataclass
class Stream:
    """One request as the HTTP side follows it: `events` receives one (token, finish_reason) per
    token, finish_reason None until the last, or one APIError (refused, or a step failed on it)."""
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sid: int = -1  # its id in the engine loop's messages


class EngineClient:
    def __init__(self, inbox, outbox, worker):
        """inbox, outbox: run_engine's; worker: the process (or, in tests, thread) that runs it."""
        self.inbox, self.outbox, self.worker = inbox, outbox, worker
        while True:  # the engine loop's first message, once the engine is built
            try:
                kind, facts = outbox.get(timeout=1)
                break
            except queue.Empty:
                if not worker.is_alive():
                    raise UsageError("the engine process died while starting (its error is above)") from None
        if kind == "error":
            raise UsageError(facts)
        self.vocab_size, self.eos_token_ids = facts["vocab_size"], facts["eos_token_ids"]
        self.context_length, self.state = facts["context_length"], facts["state"]
        self.streams: dict[int, Stream] = {}  # by stream id, until their last event (event loop only)
        self.next_sid = 0

    def start(self, loop: asyncio.AbstractEventLoop):
        """Deliver the engine's events on `loop` from now on."""
        self.loop = loop
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self.reader.start()

    def submit(self, stream: Stream):
        if not self.worker.is_alive():
            raise APIError(503, "the engine has stopped; see the server log")
        stream.sid, self.next_sid = self.next_sid, self.next_sid + 1
        self.streams[stream.sid] = stream
        self.inbox.put(("add", stream.sid, stream.prompt_ids, stream.params, stream.stop_ids))

    def abort(self, stream: Stream):
        self.streams.pop(stream.sid, None)  # its events stop here (the engine sends none for an abort)
        self.inbox.put(("abort", stream.sid))  # a no-op for a request that is done already

    def stop(self):
        self.inbox.put(None)
        self.reader.join()
        self.worker.join()

    def _read(self):
        while True:
            try:
                message = self.outbox.get(timeout=1)
            except queue.Empty:
                if self.worker.is_alive():
                    continue
                # it crashed (a stop sends None first): fail what is left; submit() refuses from now on
                error = APIError(500, "the engine process exited; see the server log")
                self.loop.call_soon_threadsafe(self._deliver, [(sid, error) for sid in list(self.streams)])
                return
            if message is None:
                return
            events, self.state = message
            self.loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list):
        for sid, event in events:
            last = isinstance(event, APIError) or event[1] is not None
            stream = self.streams.pop(sid, None) if last else self.streams.get(sid)
            if stream is not None:
                stream.events.put_nowait(event)


def start_engine_process(args, model_dir) -> EngineClient:
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA cannot cross a fork
    inbox, outbox = spawn.Queue(), spawn.Queue()
    process = spawn.Process(target=_engine_process, args=(args, model_dir, inbox, outbox), name="nano-engine")
    process.start()
    try:
        return EngineClient(inbox, outbox, process)
    except BaseException:  # its one-line error, or Ctrl-C while it loads: it will not be needed
        process.terminate()
        raise


class Detokenizer:
    """One request's tokens to text: StreamDecoder's pieces, held back while they may be the start
    of a stop string, and cut where one begins."""

    def __init__(self, tokenizer: Tokenizer | None, context_ids: list[int], stop: list[str]):
        self.decoder = StreamDecoder(tokenizer, context_ids) if tokenizer else None
        self.stop, self.held = stop, ""

    def push(self, token: int) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string was reached)."""
        if self.decoder is None:
            return "", False
        text = self.held + self.decoder.push(token)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            return text[: min(cuts)], True
        held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - held :]
        return text[: len(text) - held], False


async def _pieces(stream: Stream, event, detokenizer: Detokenizer, engine: EngineClient):
    """-> (text, token, finish_reason) per token, finish_reason set on the last; raises the APIError
    of a failed step."""
    while True:
        if isinstance(event, APIError):
            raise event
        token, reason = event
        text, stopped = detokenizer.push(token)
        if stopped:
            engine.abort(stream)
            yield text, token, "stop"
            return
        if reason:
            yield text + detokenizer.held, token, reason
            return
        yield text, token, None
        event = await stream.events.get()


# ---- the API's request bodies --------------------------------------------------------------
Int64 = Annotated[int, Field(ge=0, le=2**63 - 1)]  # seeds and top-k end up in int64 tensors
StopString = Annotated[str, Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a feature we lack


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationRequest(StrictModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: Int64 = 0  # 0: off
    seed: Int64 | None = None
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    ignore_eos: bool = False
    user: str | None = None
    # features this server lacks, which some clients send with every request, off (`parse` refuses them on)
    frequency_penalty: float = 0
    presence_penalty: float = 0
    logprobs: bool | None = None


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


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


# ---- the app ---------------------------------------------------------------------------------
def build_app(engine: EngineClient, tokenizer: Tokenizer | None, model_name: str, api_key: str | None = None) -> FastAPI:
    stop_ids = set(engine.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())

    @asynccontextmanager
    async def lifespan(app):  # the engine's events need the event loop, which runs from here on
        engine.start(asyncio.get_running_loop())
        yield
        engine.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    @app.exception_handler(HTTPException)  # Starlette's: unknown paths and methods
    @app.exception_handler(Exception)  # a bug: the client gets one line, the log the traceback
    async def error_json(_, e: Exception):
        if isinstance(e, HTTPException):
            e = APIError(e.status_code, str(e.detail))
        elif not isinstance(e, APIError):
            e = APIError(500, f"internal error ({type(e).__name__})")
        return JSONResponse(e.body(), status_code=e.status)

    async def check_api_key(http: HTTPRequest):
        sent = http.headers.get("authorization", "")
        if api_key is not None and not secrets.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    authorized = [Depends(check_api_key)]

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.state}  # as of the engine's last message (engine_state)

    @app.get("/v1/models", dependencies=authorized)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "nano",
                                            "max_model_len": engine.context_length, "vocab_size": engine.vocab_size}]}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(http: HTTPRequest):
        body = await parse(http, CompletionRequest)
        if not body.prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(body.prompt, list):
            if not all(0 <= t < engine.vocab_size for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {engine.vocab_size})", param="prompt")
            prompt_ids = body.prompt
        else:
            prompt_ids = need_tokenizer("a text prompt").encode_prompt(body.prompt, use_chat_template=False)
        return await generate(http, body, prompt_ids, chat=False)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(http: HTTPRequest):
        body = await parse(http, ChatRequest)
        chat_tokenizer = need_tokenizer("chat")
        if not chat_tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions")
        try:
            prompt_ids = chat_tokenizer.encode_chat([m.model_dump() for m in body.messages])
        except jinja2.TemplateError as e:
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        return await generate(http, body, prompt_ids, chat=True)

    async def parse(http: HTTPRequest, schema: type[GenerationRequest]):
        try:
            body = schema.model_validate(await read_json(http))
        except ValidationError as e:  # up to three of the problems, each with where it is
            errors = e.errors()
            message = "; ".join(f"{'.'.join(map(str, err['loc']))}: " + (
                "not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]) for err in errors[:3])
            raise APIError(400, message, param=str(errors[0]["loc"][0]) if errors[0]["loc"] else None) from None
        for name in OFF_ONLY:
            if getattr(body, name):
                raise APIError(400, f"{name}: not supported by this server", param=name)
        if body.stream_options and not body.stream:  # as OpenAI's API refuses it
            raise APIError(400, "stream_options: only with stream: true", param="stream_options")
        if body.model not in (None, model_name):
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if body.stop and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this server has none (see --tokenizer)", param="stop")
        return body

    def need_tokenizer(what: str) -> Tokenizer:
        if tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer; this server has none (see --tokenizer): "
                           "send the prompt as token ids to /v1/completions")
        return tokenizer

    async def generate(http: HTTPRequest, body, prompt_ids: list[int], chat: bool):
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        # OpenAI's API refuses this too (a prompt too long on its own is the engine's to refuse)
        if max_tokens and len(prompt_ids) < engine.context_length < len(prompt_ids) + max_tokens:
            raise APIError(400, f"the context holds {engine.context_length} tokens: {len(prompt_ids)} of prompt "
                           f"and {max_tokens} to generate do not fit", param="max_tokens")
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                max_new_tokens=max_tokens or (engine.context_length if chat else DEFAULT_COMPLETION_TOKENS),
                                ignore_eos=body.ignore_eos)
        stream = Stream(prompt_ids, params, stop_ids)
        engine.submit(stream)
        # the first event decides the status: a refusal is a 400, before any response has started
        first = await until_disconnected(http, stream.events.get())
        if first is None:
            engine.abort(stream)
            return Response(status_code=499)  # nobody is listening (nginx's code for it)
        if isinstance(first, APIError):  # refused: a 400
            raise first
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        # chat output starts a new message; a completion continues its prompt's text
        pieces = _pieces(stream, first, Detokenizer(tokenizer, [] if chat else prompt_ids, stop), engine)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": model_name, "object": "text_completion"}
        if chat:
            head["object"] = "chat.completion.chunk" if body.stream else "chat.completion"

        def choice(text: str, tokens: list[int], reason: str | None, first: bool = False) -> dict:
            if not chat:
                content = {"text": text}
            elif body.stream:
                content = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
            else:
                content = {"message": {"role": "assistant", "content": text}}
            return {"index": 0, **content, "token_ids": tokens, "logprobs": None, "finish_reason": reason}

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        if body.stream:
            async def events():
                n = 0
                try:
                    async for text, token, reason in pieces:
                        n += 1
                        yield _sse({**head, "choices": [choice(text, [token], reason, first=n == 1)]})
                except APIError as e:
                    yield _sse(e.body())
                else:
                    if body.stream_options and body.stream_options.include_usage:
                        yield _sse({**head, "choices": [], "usage": usage(n)})
                yield "data: [DONE]\n\n"

            # runs once the stream ends, also when the client hung up: then it frees the request
            return StreamingResponse(events(), media_type="text/event-stream",
                                     background=BackgroundTask(engine.abort, stream))

        async def collect():
            return [piece async for piece in pieces]

        collected = await until_disconnected(http, collect())  # a failed step's APIError raises through
        if collected is None:
            engine.abort(stream)
            return Response(status_code=499)
        texts, tokens, reasons = zip(*collected)
        return {**head, "choices": [choice("".join(texts), list(tokens), reasons[-1])], "usage": usage(len(tokens))}

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
    engine = start_engine_process(args, model_dir)
    app = build_app(engine, tokenizer, model_dir.name, args.api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
    # uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown), then re-raises the signal into
    # the handlers it found: make those no-ops, so a requested shutdown exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    host = f"[{args.host}]" if ":" in args.host else args.host or "0.0.0.0"  # uvicorn names none for our socket
    print(f"serving on http://{host}:{listener.getsockname()[1]} (Ctrl-C to stop)", file=sys.stderr)
    try:
        server.run(sockets=[listener])  # its shutdown stops the engine loop (lifespan)
    finally:
        engine.worker.terminate()  # a no-op once it has stopped; else (uvicorn failed) it ends here


def main(argv=None):
    cli(build_parser, run, argv)  # one-line errors, exit 2; Ctrl-C while loading exits 130


if __name__ == "__main__":
    main()
