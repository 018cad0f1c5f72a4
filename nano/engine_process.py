"""The engine in a process of its own, and the handle the HTTP server holds on it.

A server runs two loops, each in its own process (serve.py says why):
- the engine loop (`run_engine`) never waits on the network: between steps it takes new requests
  and aborts from its inbox, runs one step, and sends the step's new tokens back in one message;
- the HTTP side's `EngineClient` forwards requests to that inbox, and a reader thread hands each
  step's tokens to the asyncio event loop (`loop.call_soon_threadsafe`), where a `Stream` per
  request receives them.
What crosses between them is a handful of typed messages (below), pickled through
multiprocessing queues. Every request gets an answer: a request the engine refuses gets a 400, a
step that raises fails the requests it was running with a 500 and the loop goes on (split over
GPUs, a pass that fails on rank 0 ends the engine: tp.py), and if the engine process dies every
open stream gets a 500. While it works, the loop logs a line of statistics on stderr every 10
seconds.
"""

import asyncio
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from tqdm import tqdm

from nano.cli import one_line_errors
from nano.sampling import SamplingParams


class APIError(Exception):
    """An error as the client gets it, in OpenAI's error JSON (a refused request's 400, a failed step's 500)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message, param, code)  # the arguments again: how an exception is pickled
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---- the messages ---------------------------------------------------------------------------------
@dataclass
class AddRequest:  # HTTP side -> engine
    sid: int  # the stream's id in these messages
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]


@dataclass
class Abort:  # HTTP side -> engine: the client went away, or a stop string matched
    sid: int


class Shutdown:  # HTTP side -> engine, and the engine's answer: stop
    pass


@dataclass
class Ready:  # engine -> HTTP side, once: the facts the HTTP side needs
    vocab_size: int
    eos_token_ids: list[int]
    context_length: int
    state: dict


@dataclass
class StartFailed:  # engine -> HTTP side, instead of Ready: the engine could not be built
    message: str


@dataclass
class Token:  # one generated token of one stream
    id: int
    finish_reason: str | None  # "stop" or "length" on the stream's last token
    # when the request asks (SamplingParams.logprobs): the token's logprob, its k likeliest (id, logprob)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list | None = None  # with the first token: the prompt's (prompt_logprobs), as sampling.Logprobs
    stop_reason: str | None = None  # vLLM's: the stop string that ended it (set by the HTTP side; EOS, length: None)


@dataclass
class StepOutput:  # engine -> HTTP side, after each round of messages and each step
    events: list[tuple[int, Token | APIError]]  # (stream id, what happened to it)
    state: dict  # engine_state(), for /health


# ---- the engine's side ----------------------------------------------------------------------------
def engine_state(engine) -> dict:
    """What /health shows: KV slots free, or holding cached prefixes (evictable unless a running
    request locks them); requests; the engine's counters (seconds and tokens of prefill and decode,
    retractions and the tokens they recomputed)."""
    cache, scheduler = engine.prefix_cache, engine.scheduler
    admitted = len(scheduler.running) + (scheduler.chunked is not None)  # a prompt part-way runs too (vLLM counts it)
    return {"total_slots": engine.kv_pool.capacity, "free_slots": engine.slots.available,
            "cached_slots": cache.size if cache else 0, "locked_slots": cache.locked_size if cache else 0,
            "running": admitted, "waiting": len(scheduler.waiting), "engine": dict(engine.stats)}


def run_engine(engine, inbox, outbox):
    """The engine loop: Ready first, then rounds of inbox messages and steps, each answered with a
    StepOutput, until Shutdown. It sleeps in the inbox while idle."""
    outbox.put(Ready(engine.cfg.vocab_size, engine.cfg.eos_token_ids, engine.context_length, engine_state(engine)))
    requests = {}  # stream id -> the engine's request, while the engine holds it
    log = StatsLog(engine)
    while True:
        messages = [] if engine.has_work() else [log.wait(inbox)]
        while True:  # and whatever else has arrived since the last step
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        events = []
        for message in messages:
            if isinstance(message, Shutdown):
                outbox.put(message)
                return
            if isinstance(message, AddRequest):
                try:
                    requests[message.sid] = engine.add_request(message.prompt_ids, message.params, message.stop_ids)
                except ValueError as e:
                    events.append((message.sid, APIError(400, str(e))))
            elif message.sid in requests:  # an abort of a request that is not done yet
                engine.abort(requests.pop(message.sid))
        if engine.has_work():
            events += _step(engine, requests)
        outbox.put(StepOutput(events, engine_state(engine)))
        log.maybe_print()


class StatsLog:
    """A line on stderr every `every` seconds while the engine works, as SGLang logs one: requests
    running and waiting, decode tokens per second of the time since the last line that the engine
    was not idle, the KV cache in use."""

    def __init__(self, engine, every: float = 10.0):
        self.engine, self.every = engine, every
        self.last, self.decoded, self.idle = time.monotonic(), 0, 0.0

    def wait(self, inbox):
        """The next message, for an idle engine: the wait is left out of the rate (counted in, a burst
        after an hour idle read 0.0 tok/s, and a server's first line divided by the time since start)."""
        started = time.monotonic()
        message = inbox.get()
        self.idle += time.monotonic() - started
        return message

    def maybe_print(self):
        now, stats = time.monotonic(), self.engine.stats
        busy = now - self.last - self.idle
        if busy < self.every or stats["decode_tokens"] == self.decoded:
            return
        state = engine_state(self.engine)
        used = 1 - (state["free_slots"] + state["cached_slots"] - state["locked_slots"]) / state["total_slots"]
        print(f"engine: {state['running']} running, {state['waiting']} waiting, decode "
              f"{(stats['decode_tokens'] - self.decoded) / busy:,.1f} tok/s, KV cache {used:.0%} in use, "
              f"{stats['retractions']} retractions so far", file=sys.stderr, flush=True)
        self.last, self.decoded, self.idle = now, stats["decode_tokens"], 0.0


def _step(engine, requests: dict) -> list:
    by_rid = {req.rid: sid for sid, req in requests.items()}
    streamed = {sid: len(req.output_ids) for sid, req in requests.items()}
    try:
        out = engine.step()
    except Exception as e:  # a bug or a device error: fail what the step ran, keep serving
        traceback.print_exc()
        # the step ended the requests it ran (engine.step), and one it booked a token for (finishing it,
        # or retracting it to the queue) would lose that token; the others waiting stay queued
        failed = [sid for sid, req in requests.items() if req.finished or len(req.output_ids) > streamed[sid]]
        error = APIError(500, f"the engine failed on this request ({type(e).__name__}); see the server log")
        for sid in failed:
            engine.abort(requests.pop(sid))
        return [(sid, error) for sid in failed]
    events = []
    # a step may hand out two tokens of one request (a pass booked before a retraction, and the pass
    # launched after it): a finished request's last token is its last in `out`
    last = {req.rid: i for i, (req, _) in enumerate(out)}
    for i, (req, token) in enumerate(out):
        sid = by_rid[req.rid]
        done = req.finished and last[req.rid] == i
        reason = None if not done else "stop" if token in req.stop_ids else "length"
        event = Token(token, reason)
        if req.params.logprobs is not None:  # the engine computed them with the token
            computed = engine.logprobs[req.rid]
            event.logprob, event.top_logprobs = computed.tokens.popleft()
            event.prompt_logprobs, computed.prompt = computed.prompt, None  # once, with the first token
        if done:
            del requests[sid]
            engine.logprobs.pop(req.rid, None)
        events.append((sid, event))
    return events


def _engine_process(build_engine, inbox, outbox):
    """The engine process: build the engine (a failure goes back as one line), then run its loop."""
    # Ctrl-C reaches every process of the terminal's group, and a service manager's SIGTERM every process of
    # the service (systemd's default): the server decides, and stops this loop once its requests are done.
    # SIGTERM gets a no-op handler, not SIG_IGN, which the tensor-parallel workers would inherit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()  # never outlive it
    tqdm.set_lock(threading.RLock())  # the loading bar's; tqdm's own is a multiprocessing lock, left behind at exit
    try:
        engine = build_engine()
    except one_line_errors() as e:
        outbox.put(StartFailed(str(e)))
        return
    try:
        run_engine(engine, inbox, outbox)
    finally:  # its tensor-parallel workers outlive SIGTERM: multiprocessing's exit would wait for them forever
        engine.close()


# ---- the HTTP side's handle on it -------------------------------------------------------------------
@dataclass
class Stream:
    """One request as the HTTP side follows it: `events` receives one Token per token, the last
    with its finish_reason, or one APIError (refused, or a step failed on it)."""
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sid: int = -1  # its id in the engine loop's messages


async def first_events(streams: list[Stream]) -> list:
    """Each stream's first event, or [the APIError] as soon as one stream gets one: a refused prompt or a
    failed step is answered at once, not once the request's other prompts have waited their turn and run."""
    gets = [asyncio.ensure_future(stream.events.get()) for stream in streams]
    try:
        for get in asyncio.as_completed(gets):
            if isinstance(event := await get, APIError):
                return [event]
        return [get.result() for get in gets]
    finally:  # the reads still waiting (the caller aborts their streams), also when the caller is cancelled
        for get in gets:
            get.cancel()


async def merged(sources: list):
    """(i, item) from several async iterators, each item as it comes; an error in one raises. A task per
    source feeds one queue: a task per item took 16-19 ms of the event loop a step at 1,024 choices, this 4-6."""
    if len(sources) == 1:  # the common case, without a task
        async for item in sources[0]:
            yield 0, item
        return
    ready = asyncio.Queue()

    async def feed(i, source):  # (i, (item,)) per item, then (i, None), or (i, the error it raised)
        try:
            async for item in source:
                ready.put_nowait((i, (item,)))
            ready.put_nowait((i, None))
        except Exception as e:  # a failed step's APIError
            ready.put_nowait((i, e))

    feeders, left = [asyncio.ensure_future(feed(i, source)) for i, source in enumerate(sources)], len(sources)
    try:
        while left:
            arrived = [await ready.get()]
            while not ready.empty():
                arrived.append(ready.get_nowait())
            # by index, each source's own order kept: openai's stream helper wants choice i's first before i + 1's
            for i, entry in sorted(arrived, key=lambda arrival: arrival[0]):
                if isinstance(entry, tuple):
                    yield i, entry[0]
                elif entry is None:  # the source's end
                    left -= 1
                else:
                    raise entry
    finally:  # the others' reads, which would wait for ever on streams nobody feeds any more
        for feeder in feeders:
            feeder.cancel()


class EngineClient:
    def __init__(self, inbox, outbox, worker):
        """inbox, outbox: run_engine's; worker: the process (or, in tests, thread) that runs it.
        Waits for the engine's Ready; raises ValueError with its one-line error if it failed."""
        self.inbox, self.outbox, self.worker = inbox, outbox, worker
        ready = self._next_message()
        if ready is None:
            raise ValueError("the engine process died while starting (its error is above)")
        if isinstance(ready, StartFailed):
            raise ValueError(ready.message)
        self.vocab_size, self.eos_token_ids = ready.vocab_size, ready.eos_token_ids
        self.context_length, self.state = ready.context_length, ready.state
        self.streams: dict[int, Stream] = {}  # by stream id, until their last event (event loop only)
        self.next_sid = 0

    def start(self, loop: asyncio.AbstractEventLoop):
        """Deliver the engine's events on `loop` from now on."""
        self.loop = loop
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self.reader.start()

    def health(self) -> tuple[dict, int]:
        """/health's body and status: the engine's state as of its last message (engine_state), and 503 once
        its process has died: nothing will be answered again, and a load balancer should know."""
        alive = self.worker.is_alive()
        return {"status": "ok" if alive else "engine process exited", **self.state}, 200 if alive else 503

    def submit(self, stream: Stream):
        if not self.worker.is_alive():
            raise APIError(503, "the engine has stopped; see the server log")
        stream.sid, self.next_sid = self.next_sid, self.next_sid + 1
        self.streams[stream.sid] = stream
        self.inbox.put(AddRequest(stream.sid, stream.prompt_ids, stream.params, stream.stop_ids))

    def abort(self, *streams: Stream):
        for stream in streams:
            self.streams.pop(stream.sid, None)  # its events stop here (the engine sends none for an abort)
            self.inbox.put(Abort(stream.sid))  # a no-op for a request that is done already

    def stop(self):
        self.inbox.put(Shutdown())
        self.reader.join()
        self.worker.join()
        self._drop_inbox()

    def _drop_inbox(self):
        """Nobody will read the inbox again: at exit, do not wait to write what is left in it into a pipe
        that may be full (multiprocessing joins a queue's feeder thread; a thread's queue has none)."""
        if hasattr(self.inbox, "cancel_join_thread"):
            self.inbox.cancel_join_thread()

    def _next_message(self):
        """The engine's next message, or None once its process has died."""
        while True:
            try:
                return self.outbox.get(timeout=1)
            except queue.Empty:
                if not self.worker.is_alive():
                    return None
            except (EOFError, OSError):  # it died halfway through writing a message
                return None

    def _read(self):
        while (message := self._next_message()) is not None:
            if isinstance(message, Shutdown):
                return
            self.state = message.state
            self.loop.call_soon_threadsafe(self._deliver, message.events)
        # it crashed (a stop sends Shutdown first): fail what is left; submit() refuses from now on
        self._drop_inbox()
        print(f"error: the engine process exited (exit code {getattr(self.worker, 'exitcode', None)}); "
              "every request fails from now on", file=sys.stderr, flush=True)
        error = APIError(500, "the engine process exited; see the server log")
        # which streams to fail is read on the loop, where submit adds them: none slips in between
        self.loop.call_soon_threadsafe(lambda: self._deliver([(sid, error) for sid in self.streams]))

    def _deliver(self, events: list):
        for sid, event in events:
            last = isinstance(event, APIError) or event.finish_reason is not None
            stream = self.streams.pop(sid, None) if last else self.streams.get(sid)
            if stream is not None:
                stream.events.put_nowait(event)


def start_engine_process(build_engine) -> EngineClient:
    """Run `build_engine()` (picklable: a partial of a module-level function) and its loop in a
    fresh process -> the client."""
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA cannot cross a fork
    inbox, outbox = spawn.Queue(), spawn.Queue()
    process = spawn.Process(target=_engine_process, args=(build_engine, inbox, outbox), name="nano-engine")
    process.start()
    # The server only reads the outbox. Its copy of the write end would keep the pipe open after the engine
    # dies, and a message the engine was killed halfway through writing would then be waited for for ever.
    outbox._writer.close()
    try:
        return EngineClient(inbox, outbox, process)
    except BaseException:  # its one-line error, or Ctrl-C while it loads: it will not be needed
        process.kill()  # it ignores SIGTERM
        raise
