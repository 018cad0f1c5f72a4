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
requests finish, and exit 0 (a second Ctrl-C cuts them off and exits 130). The routes below find
the engine's client, the tokenizer and the model's name on `app.state`.

A request with several choices (several prompts, or `n`) submits them all at once, so they prefill
together (`n` samples of a prompt of 32+ tokens: one computes it, the rest find it cached a step later);
a stream carries each choice's tokens as they come, one choice per event, named by its index (a chat
choice opens with its role alone, as OpenAI's). Logprobs come from the engine with each token (sampling.py).

Extensions to OpenAI's API, as SGLang and vLLM have them: `top_k`, `ignore_eos`, and the generated
`token_ids` in every choice, so a server without a tokenizer (a shipped shape with dummy weights)
takes token-id prompts and still says what it generated; vLLM's `/tokenize`, `/detokenize` and
`/tokenizer_info`, through which lm-eval tokenizes as the server does; vLLM's choice `stop_reason`.
"""

import asyncio
import copy
import os
import signal
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial

try:  # Ctrl-C while these import torch (seconds; nano.cli's `cli` is not running yet): exit 130, no traceback
    import uvicorn
    from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException

    from nano.api import (DEFAULT_COMPLETION_TOKENS, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                          check_api_key, error_json, json_answer, parse, sse)
    from nano.cli import ArgumentParser, UsageError, add_engine_args, build_engine, cli, resolve_model_or_shape
    from nano.config import load_config
    from nano.engine_process import APIError, EngineClient, Stream, Token, first_events, merged, start_engine_process
    from nano.tokenizer import Detokenizer, Tokenizer, TokenizerError
except KeyboardInterrupt:
    sys.exit(130)


router = APIRouter()


@router.get("/health")
async def health(http: HTTPRequest):
    return JSONResponse(*http.app.state.client.health())


@router.get("/v1/models", dependencies=[Depends(check_api_key)])
async def models(http: HTTPRequest):
    return {"object": "list", "data": [model_card(http.app.state)]}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(check_api_key)])
async def model(http: HTTPRequest, model_id: str):
    if model_id != http.app.state.model_name:
        raise APIError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
    return model_card(http.app.state)


def model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "nano",
            "max_model_len": state.client.context_length, "vocab_size": state.client.vocab_size}


@router.post("/v1/completions", dependencies=[Depends(check_api_key)])
async def completions(http: HTTPRequest):
    body = await parse(http, CompletionRequest, http.app.state.model_name)
    return await generate(http, body, await asyncio.to_thread(prompt_ids, http.app.state, body.prompt), chat=False)


@router.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
async def chat_completions(http: HTTPRequest):
    body = await parse(http, ChatRequest, http.app.state.model_name)
    return await generate(http, body, [await asyncio.to_thread(chat_ids, http.app.state, body.messages)], chat=True)


@router.post("/tokenize", dependencies=[Depends(check_api_key)])
async def tokenize(http: HTTPRequest):
    """vLLM's: a completion's prompt, or a chat's messages through the template, as the model gets it."""
    state = http.app.state
    body = await parse(http, TokenizeRequest, state.model_name)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if body.messages is not None:
        ids = await asyncio.to_thread(chat_ids, state, body.messages)
    elif isinstance(body.prompt, str) and not body.add_special_tokens:
        ids = await asyncio.to_thread(need_tokenizer(state, "a text prompt").encode_text, body.prompt)
    else:
        ids = (await asyncio.to_thread(prompt_ids, state, [body.prompt], True))[0]  # "": no tokens or BOS (vLLM's)
    return await json_answer({"count": len(ids), "max_model_len": state.client.context_length, "tokens": ids})


@router.post("/detokenize", dependencies=[Depends(check_api_key)])
async def detokenize(http: HTTPRequest):
    state = http.app.state
    body = await parse(http, DetokenizeRequest, state.model_name)
    ids = checked_ids(state, body.tokens, "tokens")  # decoded as vLLM's: special tokens too, what /tokenize took
    text = await asyncio.to_thread(need_tokenizer(state, "detokenize").decode, ids, special_tokens=True)  # 4 MB: 0.2 s
    return await json_answer({"prompt": text})


@router.get("/tokenizer_info", dependencies=[Depends(check_api_key)])
async def tokenizer_info(http: HTTPRequest):
    """What lm-eval reads before it tokenizes through /tokenize and /detokenize (as vLLM's)."""
    state = http.app.state
    tokenizer = need_tokenizer(state, "tokenizer_info")
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "chat_template": tokenizer.chat_template_source,
            "model_max_length": state.client.context_length}


def prompt_list(prompt) -> list:
    """A completion's `prompt` (a string, token ids, or a list of either) -> a list of prompts."""
    return [prompt] if isinstance(prompt, str) or prompt and isinstance(prompt[0], int) else prompt


def prompt_ids(state, prompt, empty_ok: bool = False) -> list[list[int]]:
    """A completion's `prompt` -> token ids per prompt; seconds for 4 MB, so routes run it off the event loop."""
    prompts = prompt_list(prompt)
    if not prompts or not (empty_ok or all(prompts)):
        raise APIError(400, "prompt is empty", param="prompt")
    return [checked_ids(state, p) if isinstance(p, list) else
            need_tokenizer(state, "a text prompt").encode_prompt(p, use_chat_template=False) for p in prompts]


def checked_ids(state, ids: list[int], param: str = "prompt") -> list[int]:
    if ids and not 0 <= min(ids) <= max(ids) < state.client.vocab_size:  # in C: a generator took 0.4 s for 500k
        raise APIError(400, f"token ids must be in [0, {state.client.vocab_size})", param=param)
    return ids


def chat_ids(state, messages) -> list[int]:
    tokenizer = need_tokenizer(state, "chat")
    if not tokenizer.has_chat_template:
        raise APIError(400, "this model has no chat template: use /v1/completions")
    try:
        return tokenizer.encode_chat([m.as_dict(tokenizer.template_has_developer) for m in messages])
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from None


def need_tokenizer(state, what: str) -> Tokenizer:
    if state.tokenizer is None:
        raise APIError(400, f"{what} needs a tokenizer; this server has none (see --tokenizer): "
                       "send the prompt as token ids to /v1/completions")
    return state.tokenizer


async def generate(http: HTTPRequest, body, prompts: list[list[int]], chat: bool):
    """Run a request's choices (n per prompt, all submitted at once) on the engine and answer them:
    streamed, or as one JSON body."""
    state = http.app.state
    client, context = state.client, state.client.context_length
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"  # chat's newer
    max_tokens = getattr(body, field)
    for ids in prompts:  # OpenAI's API refuses this too (a prompt too long on its own is the engine's to refuse)
        if max_tokens and len(ids) < context < len(ids) + max_tokens:
            raise APIError(400, f"the context holds {context} tokens: {len(ids)} of prompt "
                           f"and {max_tokens} to generate do not fit", param=field)
    if body.stop and state.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer; this server has none (see --tokenizer)", param="stop")
    max_new_tokens = 1 if max_tokens == 0 else max_tokens or (context if chat else DEFAULT_COMPLETION_TOKENS)
    streams = [Stream(ids, body.sampling_params(max_new_tokens, j), set() if body.ignore_eos else state.stop_ids)
               for ids in prompts for j in range(body.n)]  # state.stop_ids: the EOS ids, which ignore_eos drops
    for stream in streams:
        client.submit(stream)
    abort = partial(client.abort, *streams)
    # the first events decide the status: a refusal is a 400, before any response has started
    firsts = await until_disconnected(http, first_events(streams))
    if firsts is None or isinstance(firsts[0], APIError):  # first_events gives [the error] alone
        abort()
        if firsts is None:
            return Response(status_code=499)  # nobody is listening (nginx's code for it)
        raise firsts[0]
    for i, first in enumerate(firsts):  # an echo's prompt logprobs, computed by each prompt's first choice alone
        first.prompt_logprobs = firsts[i - i % body.n].prompt_logprobs
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    # chat output starts a new message; a completion continues its prompt's text
    choices = [_pieces(s, first, Detokenizer(state.tokenizer, [] if chat else s.prompt_ids, stop), client)
               for s, first in zip(streams, firsts)]
    answer = Answer(state, body, chat, prompts)
    if body.stream:  # the background task runs once the stream ends, also when the client hung up: it frees them
        return StreamingResponse(answer.events(choices), media_type="text/event-stream",
                                 background=BackgroundTask(abort))
    try:
        collected = await until_disconnected(http, _collect(choices))
    finally:  # a failed step (the other choices are of no use) or a client gone; a no-op for those done
        abort()
    if collected is None:
        return Response(status_code=499)
    answered = await asyncio.to_thread(  # an echo's logprobs may be millions of entries: off the event loop
        lambda: [answer.choice(i, *map(list, zip(*pieces))) for i, pieces in enumerate(collected)])
    return await json_answer({**answer.head, "usage": answer.usage(sum(map(len, collected))), "choices": answered})


async def _pieces(stream: Stream, event, detokenizer: Detokenizer, client: EngineClient):
    """-> (text, Token, finish_reason) per token, finish_reason set on the last; raises the APIError
    of a failed step."""
    while True:
        if isinstance(event, APIError):
            raise event
        text, stopped = detokenizer.push(event.id, last=event.finish_reason is not None)
        if stopped:
            client.abort(stream)
            event.stop_reason, event.finish_reason = stopped, "stop"
        yield text, event, event.finish_reason
        if event.finish_reason:
            return
        event = await stream.events.get()


async def _collect(choices: list) -> list[list]:  # through merged: a choice that fails cancels the others' reads
    collected = [[] for _ in choices]
    async for i, piece in merged(choices):
        collected[i].append(piece)
    return collected


class Answer:
    """The response's shapes for one request: choices with their logprobs, usage, and the stream of
    SSE events (one per token of one choice, naming its index)."""

    def __init__(self, state, body, chat: bool, prompts: list[list[int]]):
        self.tokenizer, self.body, self.chat, self.prompts = state.tokenizer, body, chat, prompts
        kind = ("chat.completion.chunk" if body.stream else "chat.completion") if chat else "text_completion"
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": state.model_name, "object": kind}
        self.echo = not chat and body.echo
        self.prompt_only = self.echo and body.max_tokens == 0  # echo alone: the one token computed is left out
        if self.echo:  # a text prompt as sent (as vLLM echoes it); token ids as their text, special tokens too
            self.echoed = [p if isinstance(p, str) else self.tokenizer.decode(p, special_tokens=True)
                           if self.tokenizer else "" for p in prompt_list(body.prompt)]
        self.logprobs = body.logprob_params()["logprobs"] is not None
        self.offsets = [0] * len(prompts) * body.n  # each choice's text so far, for text_offset

    def choice(self, index: int, texts: list[str], tokens: list[Token], reasons: list, first: bool = True) -> dict:
        """Choice `index` of the response, or its part in one event (`first`: the choice's first)."""
        prompt_logprobs = tokens[0].prompt_logprobs if tokens else None
        texts, tokens, reasons = ([], [], ["length"]) if self.prompt_only else (texts, tokens, reasons)
        text, prompt = "".join(texts), self.prompts[index // self.body.n]
        if self.echo and first:
            text = self.echoed[index // self.body.n] + text
        if not self.chat:
            content = {"text": text}
        elif self.body.stream:  # the role in an event of no token: openai's stream helper reads its logprobs twice
            content = {"delta": {"content": text} if tokens else {"role": "assistant", "content": text}}
        else:
            content = {"message": {"role": "assistant", "content": text}}
        logprobs = None
        if self.logprobs:
            entries = [(t.id, t.logprob, t.top_logprobs) for t in tokens]
            if self.echo and first:  # the first prompt token has no logprob: nothing comes before it
                echoed = [(t, *entry) for t, entry in zip(prompt[1:], prompt_logprobs)]
                entries = [(prompt[0], None, None)] + echoed + entries
            logprobs = self.chat_logprobs(entries) if self.chat else self.completion_logprobs(index, entries)
        return {"index": index, **content, "token_ids": [t.id for t in tokens], "logprobs": logprobs,
                "finish_reason": reasons[-1], "stop_reason": tokens[-1].stop_reason if tokens else None}

    def completion_logprobs(self, index: int, entries: list) -> dict:
        texts, offsets = [self.token_text(t) for t, _, _ in entries], []
        for text in texts:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        # OpenAI's and vLLM's list the chosen token too: up to logprobs + 1 entries
        tops = [None if top is None else {self.token_text(token): logprob, **{self.token_text(t): v for t, v in top}}
                for token, logprob, top in entries]
        return {"tokens": texts, "token_logprobs": [logprob for _, logprob, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def chat_logprobs(self, entries: list) -> dict:
        def item(token, logprob):  # bytes: a character's part too (no text of its own), as OpenAI's
            text, raw = self.token_text(token), self.tokenizer.token_bytes(token) if self.tokenizer else b""
            return {"token": text, "logprob": logprob, "bytes": list(raw or text.encode())}

        return {"content": [{**item(t, logprob), "top_logprobs": [item(*alt) for alt in top]}
                            for t, logprob, top in entries]}

    def token_text(self, token: int) -> str:
        return self.tokenizer.token_text(token) if self.tokenizer else f"token_id:{token}"  # vLLM's form

    def usage(self, n: int) -> dict:
        n = 0 if self.prompt_only else n
        prompt_tokens = sum(map(len, self.prompts))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

    async def events(self, choices: list):
        counts = [0] * len(choices)
        try:
            for i in range(len(choices) if self.chat else 0):  # a chat choice opens with its role, as OpenAI's
                yield self.event(i, [], [], [None])
            async for i, (text, token, reason) in merged(choices):
                counts[i] += 1
                args = (i, [text], [token], [reason], counts[i] == 1)  # an echo's first: the prompt's logprobs
                yield await asyncio.to_thread(self.event, *args) if self.echo and counts[i] == 1 else self.event(*args)
        except APIError as e:
            yield sse(e.body())
        else:
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield sse({**self.head, "choices": [], "usage": self.usage(sum(counts))})
        yield "data: [DONE]\n\n"

    def event(self, *choice) -> str:
        return sse({**self.head, "choices": [self.choice(*choice)]})


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
    await asyncio.gather(work, return_exceptions=True)  # -> None; its CancelledError taken, not logged as lost


def build_app(client: EngineClient, tokenizer: Tokenizer | None, model_name: str,
              api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):  # the engine's events need the event loop, which runs from here on
        client.start(asyncio.get_running_loop())
        yield
        client.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client, app.state.tokenizer = client, tokenizer
    app.state.model_name, app.state.api_key = model_name, api_key
    app.state.stop_ids = set(client.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    for kind in (APIError, HTTPException, Exception):
        app.add_exception_handler(kind, error_json)
    app.include_router(router)
    return app


# ---- the command line ------------------------------------------------------------------------
def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m nano.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a model folder, or a shipped shape (dummy weights, no tokenizer); default: the "
                   "embedded SmolLM2-135M-Instruct, fetched on first use")
    p.add_argument("--tokenizer", help="folder whose tokenizer to use (default: the model's, if it has one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health")
    p.add_argument("--served-model-name", help="the model's name in the API (default: its folder's name)")
    add_engine_args(p)
    return p


def run(args):
    if args.api_key is not None and (args.api_key == "" or not args.api_key.isprintable()):
        raise UsageError("--api-key is empty or holds a control character: no request could send it")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name is empty: a request could not name the model")
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
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # every log line on stderr, the access log too
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    app = build_app(client, tokenizer, args.served_model_name or model_dir.name, args.api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", log_config=log_config))

    def handle_exit(sig, frame):  # a second Ctrl-C: kill the engine and quit at once (uvicorn's own
        if server.should_exit and sig == signal.SIGINT:  # "force quit" cancels each request with a traceback)
            client.worker.kill()
            os._exit(130)
        uvicorn.Server.handle_exit(server, sig, frame)
    server.handle_exit = handle_exit
    # uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown), then re-raises the signal into
    # the handlers it found: make those no-ops, so a requested shutdown exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    host = f"[{args.host}]" if ":" in args.host else args.host or "0.0.0.0"  # uvicorn names none for our socket
    print(f"serving on http://{host}:{listener.getsockname()[1]} (Ctrl-C to stop)", file=sys.stderr)
    try:
        server.run(sockets=[listener])  # its shutdown stops the engine loop (lifespan)
    finally:
        client.worker.kill()  # a no-op once it has stopped; else (uvicorn failed) it ends here (it ignores SIGTERM)


def main(argv=None):
    cli(build_parser, run, argv)  # one-line errors, exit 2; Ctrl-C while loading exits 130


if __name__ == "__main__":
    main()
