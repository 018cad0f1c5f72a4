"""The scheduler: which requests the next step runs, and which KV slots each of them holds.

Every step the engine asks it one question: prefill (admit waiting requests, or the next chunk of
a long prompt) or decode (one token for every running request)? A request moves through explicit
states: WAITING in the queue -> PREFILLING until its prompt is computed (between steps, only a
chunked prompt is part-way) -> RUNNING, one token per decode step -> FINISHED (a stop id such as EOS,
its budget, or an abort). A RETRACTED request was admitted and gave its room back; it waits at the
front of the queue with its tokens kept.

Admission is a bet. A request's output length is unknown until it stops, and most stop long
before their budget (a chat request without `max_tokens` may run to the whole context). Reserving
every request's budget is safe but, for chat traffic, lets only a few requests run. So, as SGLang
does, a request is admitted when the pool holds its prompt plus an *estimate* of what it and the
running requests will still need: `new_token_ratio` x min(remaining budget, 4096) each. The clip
keeps one huge budget from counting as a pool's worth (it changes the estimate, never when a
request stops). The ratio starts at 0.7 and decays with every decode step toward 0.1: while no
retraction says the bet was too bold, the scheduler admits more.

A lost bet is paid by a retraction. When a decode step cannot give every running request its next
slot, requests are taken out of the batch until it can. Which: the one with the fewest generated
tokens, among those the one with the longest prompt (SGLang's rule): it has the least decoding to
lose and frees the most room. A retracted request keeps its prompt, its tokens and its seeded
generator; its K/V goes into the prefix cache, so when it is admitted again it recomputes only
what other requests evicted in between, in a prefill over prompt + tokens (vLLM's "preemption
by recompute", made cheaper by the cache). It goes to the front of the queue, so it cannot
starve, and the ratio backs off (+0.3): the bet was too bold. The last running request is never
retracted (no request's context exceeds the pool): a prompt part-way through prefill is instead.

Room is counted in slots: free ones plus cached ones that no running request locks (those are
evicted, least recently used first, when the allocator runs short). A prompt goes into the prefix
cache as soon as it is prefilled, locked while its request runs, so a request admitted later that
starts the same way computes only the rest; one that arrives with it (`n` samples of one prompt)
waits a step for that.

Chunked prefill: a prompt longer than the chunk budget is cut; each further chunk is an extend
whose cached prefix is the chunks before it. A step that leaves a prompt part-way owes the running
requests a decode step, so their streams keep moving one chunk's time apart.
"""

import math
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

import torch

from nano.kv_cache import ReqToTokenPool, SlotAllocator
from nano.radix_cache import Node, RadixCache
from nano.sampling import SamplingParams

ESTIMATE_CLIP = 4096  # most remaining tokens a request is expected to need
SHARED_HEAD = 32  # prompt tokens that, computed by another request in the same pass, are worth a step's wait
INITIAL_RATIO, MIN_RATIO, RATIO_DECAY, RETRACT_BACKOFF = 0.7, 0.1, 0.001, 0.3


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, context_length: int):
    """Raise ValueError (one line) for a request that can never run."""
    params.validate()
    if not prompt_ids:
        raise ValueError("empty prompt")
    if not all(0 <= t < vocab_size for t in prompt_ids):  # an embedding lookup past its table
        raise ValueError(f"token ids must be in [0, {vocab_size}): the model's vocabulary")
    if len(prompt_ids) >= context_length:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {context_length} "
                         "(prompt plus at least one new token)")


class Status(Enum):
    WAITING = "waiting"  # queued, holding nothing
    PREFILLING = "prefilling"  # admitted, its prompt not yet all computed (a chunked one: between steps)
    RUNNING = "running"  # decoding, one token per decode step
    RETRACTED = "retracted"  # queued again to make room, its tokens kept
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself, never equal to another: the queue finds it by identity
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    generator: torch.Generator | None = None  # its own, so a retraction does not change its samples
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1  # its row in req_to_token while admitted
    prefix_node: Node | None = None  # where its cached prefix ends in the prefix cache (locked)
    cached_len: int = 0  # tokens of its row that the prefix cache holds (found at admission, or its own prompt)
    prefilled: int = 0  # tokens of `fill_ids` whose K/V its row holds
    in_flight: int = 0  # decode passes launched for it whose tokens the host has not booked yet

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        """What an admission computes before it samples: the prompt, and after a retraction the
        tokens generated so far (the next token is sampled from the last one's logits)."""
        return self.prompt_ids + self.output_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its next admission computes every prompt token for their logprobs: only the first
        (after a retraction it has them already, and finds its prompt in the prefix cache)."""
        return self.params.prompt_logprobs and not self.output_ids

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V its row holds, as the host has booked them: what was prefilled, then
        one more per decode step (the last sampled token has none yet). Between its prefill and its
        first token (a sampler that raised there) it holds what was prefilled: all of it goes back."""
        return max(self.num_tokens - 1, self.prefilled) if self.status is Status.RUNNING else self.prefilled

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_new_tokens - len(self.output_ids)


class Scheduler:
    def __init__(self, req_to_token_pool: ReqToTokenPool, slots: SlotAllocator, prefix_cache: RadixCache | None,
                 max_prefill_tokens: int, chunked_prefill_size: int, stats: dict):
        self.req_to_token_pool, self.slots, self.prefix_cache = req_to_token_pool, slots, prefix_cache
        self.chunking = chunked_prefill_size > 0
        self.prefill_budget = min(max_prefill_tokens, chunked_prefill_size) if self.chunking else max_prefill_tokens
        self.waiting: OrderedDict[Request, None] = OrderedDict()  # a queue an abort leaves at once, from anywhere
        self.running: list[Request] = []
        self.chunked: Request | None = None  # the request whose prompt is part-way through prefill
        self.decode_owed = False  # the last step left a prompt part-way: decode the running ones next
        self.new_token_ratio = INITIAL_RATIO
        self.stats = stats

    @property
    def free_room(self) -> int:
        """Slots the allocator can hand out now: free ones and cached ones no request locks."""
        return self.slots.available + (self.prefix_cache.evictable_size if self.prefix_cache else 0)

    def expected_need(self, req: Request) -> int:
        """Slots req is expected to take from now on: what it has still to fill, and its share of
        the tokens it may generate."""
        unfilled = 0 if req.status is Status.RUNNING else req.num_tokens - req.prefilled
        return unfilled + math.ceil(self.new_token_ratio * min(req.remaining, ESTIMATE_CLIP))

    def queue(self, *reqs: Request):
        self.waiting.update(dict.fromkeys(reqs))

    def wants_prefill(self) -> bool:
        return bool(self.waiting or self.chunked) and not (self.decode_owed and self.running)

    # ---- prefill: admission on an estimate --------------------------------------------------
    def schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, tokens to compute) for the next extend pass: the part-way prompt's next chunk
        first, then waiting requests while the estimate says they fit. With chunking a pass computes
        at most the chunk budget, and the last request admitted is cut to fit; without, a prompt
        longer than the budget still runs alone. [] means: decode instead."""
        if not self.wants_prefill():
            return []
        budget, chunks = self.prefill_budget, []
        if self.chunked:  # the running requests' own growth may have taken its room: then it waits
            n = min(self.chunked.num_tokens - self.chunked.prefilled, budget, self.free_room)
            chunks = [(self.chunked, n)] if n > 0 else []
            budget -= n
        committed = sum(self.expected_need(r) for r in self.running + [r for r, _ in chunks])
        try:
            return self._admit_waiting(chunks, budget, committed)
        except BaseException:  # a fault mid-admission (a bug, a device write): the caller never learns who
            # was admitted so far, so they end here with the head of the queue, not left unanswered holding rows
            self.finish(*(r for r, _ in chunks), *list(self.waiting)[:1])
            raise

    def _admit_waiting(self, chunks: list[tuple[Request, int]], budget: int, committed: int):
        while self.waiting and budget > 0:
            req = next(iter(self.waiting))
            again = req.status is Status.RETRACTED  # running, or a prompt part-way, before
            if self._computed_in(chunks, req) or not self._admit(req):
                break
            extend = req.num_tokens - req.cached_len
            if self.chunking:
                extend = min(extend, budget)
            need = self.expected_need(req)
            if committed + need > self.free_room or (chunks and extend > budget):
                self._release(req)  # undo: it waits for room, holding nothing
                req.status, req.prefilled = Status.RETRACTED if again else Status.WAITING, 0
                break
            self.waiting.popitem(last=False)
            if again:  # admitted again after a retraction: what it computes again
                self.stats["recomputed_tokens"] += req.num_tokens - req.cached_len
            else:
                self.stats["prefill_tokens"] += req.num_tokens
                self.stats["cached_tokens"] += req.cached_len
            chunks.append((req, extend))
            committed += need
            budget -= extend
        return chunks

    def _computed_in(self, chunks: list[tuple[Request, int]], req: Request) -> bool:
        """Whether this pass computes the start of req's prompt for another request (n samples of one
        prompt arrive together): then req waits a step and finds it in the prefix cache."""
        head = req.fill_ids[:SHARED_HEAD]
        return (self.prefix_cache is not None and len(head) == SHARED_HEAD and not req.wants_prompt_logprobs
                and any(r.cached_len < SHARED_HEAD and r.fill_ids[:SHARED_HEAD] == head for r, _ in chunks))

    def _admit(self, req: Request) -> bool:
        """Give req a row that starts with the slots of the longest cached prefix of what it fills,
        locked while it runs. The last token is always computed: the pass must produce its logits;
        a request that asks for its prompt's logprobs computes every token (an empty match) the first time."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        # prefilled too: what a release gives back, should the match below fail (a row with none of its K/V)
        req.row, req.cached_len, req.prefilled, req.status = row, 0, 0, Status.PREFILLING
        if self.prefix_cache is not None:
            req.prefix_node = self.prefix_cache.root  # held from here on: what a release of req unlocks
            slots, node = self.prefix_cache.match(req.fill_ids[: 0 if req.wants_prompt_logprobs else -1])
            self.prefix_cache.lock(node)
            req.prefix_node = node
            self.req_to_token_pool.req_to_token[row, : len(slots)] = slots
            req.cached_len = len(slots)
        req.prefilled = req.cached_len
        return True

    def book_prefill(self, chunks: list[tuple[Request, int]]) -> list[Request]:
        """Book an extend pass: -> the requests whose prompt is now complete (they sample a token
        and run); a prompt still part-way stays chunked and owes the running requests a decode."""
        for req, n in chunks:
            req.prefilled += n
        done = [r for r, _ in chunks if r.prefilled == r.num_tokens]
        self.chunked = next((r for r, _ in chunks if r.prefilled < r.num_tokens), None)
        self.decode_owed = self.chunked is not None
        for req in done:
            req.status = Status.RUNNING
            if self.prefix_cache is not None:
                self._cache_prompt(req)
        self.running.extend(done)
        return done

    def _cache_prompt(self, req: Request):
        """Put what a request has just prefilled into the prefix cache now, not when it finishes, so
        that requests admitted while it runs (n samples of one prompt, the next turn of a chat)
        compute only what follows. Not when the tree already holds more of it than the request
        found there (another request computed it meanwhile): the row keeps its own copy till the end."""
        tokens = req.fill_ids[: req.prefilled]
        if len(self.prefix_cache.match(tokens)[0]) != req.cached_len:
            return
        node = self.prefix_cache.insert(tokens, self.req_to_token_pool.req_to_token[req.row, : req.prefilled].clone())
        self.prefix_cache.lock(node)
        self.prefix_cache.unlock(req.prefix_node)
        req.prefix_node, req.cached_len = node, req.prefilled

    # ---- decode: retraction when the bet was lost -------------------------------------------
    def schedule_decode(self) -> list[Request]:
        """The running requests that get a decode pass: each needs one new slot. While the pool
        cannot give them all one, retract (only with no pass in flight: the engine books it first)."""
        self.decode_owed = False  # this step pays what a prompt left part-way owed
        self.new_token_ratio = max(MIN_RATIO, self.new_token_ratio - RATIO_DECAY)
        # one whose budget a pass in flight uses up sits this one out
        reqs = [r for r in self.running if r.in_flight < r.remaining]
        while self.free_room < len(reqs):
            if len(reqs) > 1:
                victim = min(reqs, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            else:  # alone it fits, unless a prompt part-way through prefill holds the rest
                victim = self.chunked
            self.retract(victim)
            reqs = [r for r in reqs if r is not victim]
        return reqs

    def retract(self, req: Request):
        """Take an admitted request out to free its room; its tokens stay, its K/V goes to the cache."""
        assert req.in_flight == 0, "book the pass in flight before retracting"
        self._release(req)
        req.status, req.prefilled = Status.RETRACTED, 0
        self.queue(req)
        self.waiting.move_to_end(req, last=False)  # first in line
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_BACKOFF)
        self.stats["retractions"] += 1

    # ---- leaving ------------------------------------------------------------------------------
    def finish(self, *reqs: Request):
        """Requests leave, whatever their state (EOS, a stop id, the budget, or an abort; also those
        of a step that raised), and give back all they hold."""
        for req in reqs:
            self.waiting.pop(req, None)
            if req.row >= 0:
                self._release(req)
            req.status = Status.FINISHED

    def _release(self, req: Request):
        """Take an admitted request out of the batch and give back what it holds: its K/V into the
        prefix cache (or its slots to the allocator), its lock on the cached prefix, its row, and the
        slots of passes in flight."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked, self.decode_owed = None, False
        req_to_token = self.req_to_token_pool.req_to_token
        kv_slots = req_to_token[req.row, : req.kv_len].clone()
        if req.in_flight:  # passes in flight write further tokens, which nobody will read
            self.slots.free(req_to_token[req.row, req.kv_len : req.kv_len + req.in_flight].clone())
        if self.prefix_cache is not None:
            self.prefix_cache.insert(req.fill_ids[: req.kv_len], kv_slots)
            self.prefix_cache.unlock(req.prefix_node)
        else:
            self.slots.free(kv_slots)
        self.req_to_token_pool.free(req.row)
        req.row = -1

    @contextmanager
    def new_slots(self, n: int):
        """n slots for a pass, given back if it raises before its requests count them as theirs (in
        prefilled or in_flight, which a release gives back). Cached ones are evicted when the allocator
        runs short (the scheduler made sure that enough are free or evictable)."""
        if self.prefix_cache is not None and self.slots.available < n:
            self.prefix_cache.evict(n - self.slots.available)
        slots = self.slots.alloc(n)
        try:
            yield slots
        except BaseException:
            self.slots.free(slots)
            raise
