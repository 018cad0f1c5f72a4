"""The engine: requests in, tokens out, with continuous batching over one shared KV pool.

Life of a request:
1. `add_request` checks it and puts it in the waiting queue.
2. The scheduler admits waiting requests while the pool has room for their prompt *and* all the
   tokens they may still generate (so a running request never has to be evicted), and gives each
   a row in `req_to_token`. With the prefix cache (radix_cache.py) the row starts with the slots
   of the longest cached prefix of the prompt, and only the rest is computed. One extend
   (prefill) pass runs over all newly admitted prompts together; each gets its first token.
3. Otherwise it runs one decode pass over every running request: each gets one new slot, the
   model writes that token's K/V and attends over the request's slots, the sampler picks the next
   token. Decode passes go through the CUDA-graph runner when there is one.
4. A request that hits EOS, a stop id or its token budget leaves the batch at once. Its tokens
   and slots go into the prefix cache (or back to the allocator without one), its row back to the
   table; the next step may admit a waiting request into the room it left. `abort` does the same
   at once for a request its caller no longer wants (the server's client went away, or a stop
   string matched), whatever its state.

Room is counted in slots: the pool, less what admitted requests may still need, less cached
slots that running requests lock. Cached slots nobody locks count as free: they are evicted,
least recently used first, when the allocator runs short.

Chunked prefill: one extend pass over a 16k-token prompt takes long, and every running request
waits for it: their streams stall. With a chunk size, a pass computes at most that many prompt
tokens; a longer prompt is cut, and its next chunk is one more extend whose cached prefix is the
chunks before it (it keeps its row in between; only the last chunk samples a token). A step
that leaves a prompt part-way is followed by a decode step, so running streams keep moving, one
chunk's time apart. The trade: the long prompt's first token comes later (it waits for the
decode steps and reads its own prefix once per chunk), and smaller chunks use the GPU less well.

With `tp_size` N > 1 this engine is rank 0 of N processes, one per GPU (tp.py): it launches the
others, which build the same engine around their part of the model and run each forward pass it
sends them. Everything above happens on rank 0 only.

Overlap: between two decode passes the host books the tokens of the first (appends them, retires
finished requests) and builds the second (and with tensor parallelism hands it to the other
ranks), and the GPU would wait for all that. So while no prompt waits, the engine launches pass
N+1 before it reads pass N's tokens: they stay on the device as N+1's input ids, their copy to
the host runs behind them, and the host books them while the GPU runs N+1. A request that N
stops (EOS, a stop id) gets a token computed in N+1 for nothing, dropped when N+1 is booked; its
slot goes back at once. Before a prefill the engine books everything first, so admission sees
the running set as it is, and the tokens of a decode step between chunks go out at once.

`step()` returns the (request, token) pairs it produced, so a caller can stream them: with
overlap, those of the pass before the one it launched.
"""

import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from nano.config import load_config
from nano.forward_batch import ForwardBatch, to_device
from nano.kv_cache import KVPool, ReqToTokenPool, SlotAllocator, kv_bytes_per_token, slots_for_memory
from nano.loader import load_model, model_bytes
from nano.memory import ensure_fits
from nano.radix_cache import Node, RadixCache
from nano.sampling import SamplingParams, sample
from nano.torch_attn import TorchAttnBackend
from nano.tp import TensorParallel, launch, parallelize, shard_config


@dataclass
class DecodePass:
    """A decode pass whose sampled tokens are still on their way to the host."""
    reqs: list["Request"]
    tokens: torch.Tensor  # [B] int64 on the device: the next pass's input ids
    host_tokens: torch.Tensor  # [B] int64 on the host, once `copied` has happened
    copied: torch.cuda.Event | None  # None on CPU, where the copy is done at once

    def __post_init__(self):
        self.rids = {r.rid for r in self.reqs}  # the requests with a token on the device, not yet booked


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # row in req_to_token while running
    finished: bool = False
    generator: torch.Generator | None = None
    prefix_node: Node | None = None  # where its cached prefix ends in the prefix cache (locked)
    cached_len: int = 0  # prompt tokens found in the prefix cache
    prefilled: int = 0  # prompt tokens whose K/V is in the pool (cached or computed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Slots this request may ever hold: its prompt and every token it may still generate
        (the last sampled token is never fed back, so it needs no slot)."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V its row holds (the last sampled token has none yet)."""
        return self.prefilled + max(len(self.output_ids) - 1, 0)


class Engine:
    def __init__(self, model_dir, device="cpu", dtype=torch.float32, attention_backend="torch",
                 load_format="safetensors", mem_fraction=0.85, max_total_tokens=None, max_requests=256,
                 context_length=None, use_mla=True, cuda_graph=False, cuda_graph_max_bs=None,
                 max_prefill_tokens=16384, radix_cache=True, chunked_prefill_size=8192, tp_size=1, seed=0, log=True,
                 overlap=True, tp_group: TensorParallel | None = None):
        # the other tensor-parallel ranks build their engines from these same arguments
        args = {name: value for name, value in locals().items() if name not in ("self", "tp_group")}
        self.device, self.dtype, self.log = torch.device(device), dtype, log
        self.cfg = cfg = load_config(model_dir)
        # rank 0 launches the other ranks; each of them comes here with its own group
        self.tp = tp_group or (launch(cfg, args) if tp_size > 1 else None)
        tp_rank = 0
        if self.tp is not None:
            self.device, tp_rank = self.tp.device, self.tp.rank
        self.use_mla = use_mla and cfg.is_deepseek
        self.context_length = min(context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # Before allocating anything: the weights, the request table, and a KV cache of the size
        # asked for or, failing that, room for one request of the full context.
        shard_cfg = shard_config(cfg, tp_size)  # this rank's heads and KV heads (all of them at tp 1)
        per_token = kv_bytes_per_token(shard_cfg, dtype, self.use_mla)
        ensure_fits(self.device, dtype, {
            f"{str(dtype).removeprefix('torch.')} weights": model_bytes(shard_cfg, dtype, self.use_mla),
            "KV cache": (max_total_tokens or self.context_length) * per_token,
            "request table": max_requests * self.context_length * 4,
        })
        started = time.perf_counter()
        self.model = load_model(cfg, Path(model_dir), self.device, dtype,
                                load_format, self.use_mla, seed, tp_rank, tp_size)
        if self.tp is not None:
            parallelize(self.model, self.tp)
        n_params = sum(p.numel() for p in self.model.parameters())
        self._print(f"loaded {cfg.architecture} ({n_params / 1e9:.2f} B parameters, "
                    f"{dtype}) on {self.device} in {time.perf_counter() - started:.1f} s"
                    + (f"; each of {tp_size} GPUs holds its part" if tp_size > 1 else ""))

        num_slots = max_total_tokens + 1 if max_total_tokens else slots_for_memory(
            shard_cfg, dtype, self.device, self.use_mla, mem_fraction)
        if self.tp is not None:  # every rank's pool must have every slot rank 0 hands out
            num_slots = self.tp.min_over_ranks(num_slots)
        self.kv_pool = KVPool(shard_cfg, num_slots, dtype, self.device, self.use_mla)
        self.context_length = min(self.context_length, num_slots - 1)  # no request holds more than the pool
        self.req_to_token_pool = ReqToTokenPool(max_requests, self.context_length, self.device)
        self.slots = SlotAllocator(num_slots, self.device)
        self.prefix_cache = RadixCache(self.slots) if radix_cache else None
        self.reserved_slots = 0  # slots admitted requests may still need beyond their cached prefix
        self._print(f"KV cache: {num_slots - 1} tokens ({per_token:,} bytes per token, "
                    f"{(num_slots * per_token) / 2**30:.2f} GiB), up to {max_requests} requests "
                    f"of up to {self.context_length} tokens")

        req_to_token = self.req_to_token_pool.req_to_token
        if attention_backend == "triton":
            from nano.triton_attn import TritonAttnBackend

            self.attn = TritonAttnBackend(self.kv_pool, req_to_token, max_requests, shard_cfg.num_heads)
        else:
            self.attn = TorchAttnBackend(self.kv_pool, req_to_token)
        self.graph_runner = None
        if cuda_graph:
            from nano.cuda_graph_runner import CudaGraphRunner

            max_bs = min(cuda_graph_max_bs or max_requests, max_requests)  # default: every batch it can run
            self.graph_runner = CudaGraphRunner(self.model, self.attn, max_bs, self.device, log)

        self.max_prefill_tokens, self.chunked_prefill_size = max_prefill_tokens, chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Request | None = None  # the request whose prompt is part-way through prefill
        self.decode_owed = False  # the last step left a prompt part-way: decode the running ones next
        self.overlap = overlap
        self.in_flight: DecodePass | None = None  # the last decode pass, not yet retired
        self.next_rid = 0
        self.stats = dict(prefill_s=0.0, prefill_steps=0, prefill_tokens=0, cached_tokens=0,
                          decode_s=0.0, decode_steps=0, decode_tokens=0)

    def _print(self, msg):
        if self.log:
            print(msg, file=sys.stderr)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, stop_ids=()) -> Request:
        """Queue a request; raises ValueError (one line) if it can never run."""
        params.validate()
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.context_length} "
                             "(prompt plus at least one new token)")
        # never generate past the context (a copy: the caller's params may serve other requests)
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.context_length - len(prompt_ids)))
        req = Request(self.next_rid, list(prompt_ids), params, set() if params.ignore_eos else set(stop_ids))
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        self.next_rid += 1
        self.waiting.append(req)
        return req

    def abort(self, req: Request):
        """Drop a request between steps, whatever its state (waiting, part-way through a chunked
        prompt, running, or caught in a step that raised), and give back all it holds."""
        if req.finished:
            return
        req.finished = True
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked, self.decode_owed = None, False
        if req.row >= 0:  # admitted: it holds a row, slots and a claim on the pool
            self._release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.in_flight)

    @property
    def unreserved_slots(self) -> int:
        """Slots no admitted request may still claim: free ones and unlocked cached ones."""
        locked = self.prefix_cache.locked_size if self.prefix_cache else 0
        return self.kv_pool.num_slots - 1 - self.reserved_slots - locked  # slot 0 is reserved

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int]]:
        started = time.perf_counter()
        events = []
        if self.in_flight and (self.waiting or self.chunked):  # admission needs the running set settled
            events = self._retire(self.in_flight)  # (only when a prompt arrived since the last step)
        # a step that left a prompt part-way owes the running requests a decode step
        chunks = [] if self.decode_owed and self.running else self._schedule_prefill()
        self.decode_owed = False
        kind, new_events = ("prefill", self._prefill(chunks)) if chunks else ("decode", self._decode())
        events += new_events
        # a step ends when the tokens it hands out are on the host: over many steps the clock
        # reads the GPU's work
        self.stats[kind + "_s"] += time.perf_counter() - started
        self.stats[kind + "_steps"] += 1
        return events

    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, prompt tokens to compute) for the next extend pass: the next chunk of a
        part-way prompt first, then newly admitted requests. With chunking a pass computes at
        most min(chunk size, max_prefill_tokens) tokens, and the last request admitted is cut to
        fit; without, at most max_prefill_tokens, but a longer prompt still runs alone."""
        chunking = self.chunked_prefill_size > 0
        budget = min(self.max_prefill_tokens, self.chunked_prefill_size) if chunking else self.max_prefill_tokens
        chunks = []
        if self.chunked:
            chunks.append((self.chunked, min(len(self.chunked.prompt_ids) - self.chunked.prefilled, budget)))
            budget -= chunks[0][1]
        while self.waiting and budget > 0:
            req = self.waiting[0]
            row = self.req_to_token_pool.alloc()
            if row is None:
                break
            req.row = row
            self._reuse_cached_prefix(req)
            self.reserved_slots += req.max_tokens - req.cached_len
            extend = len(req.prompt_ids) - req.cached_len
            if chunking:
                extend = min(extend, budget)
            if self.unreserved_slots < 0 or (chunks and extend > budget):
                self._release(req)  # undo: it waits for room
                break
            self.waiting.popleft()
            self.stats["prefill_tokens"] += len(req.prompt_ids)
            self.stats["cached_tokens"] += req.cached_len
            chunks.append((req, extend))
            budget -= extend
        return chunks

    def _reuse_cached_prefix(self, req: Request):
        """Start req's row with the slots of the longest cached prefix of its prompt, locked while
        it runs. The last prompt token is always computed: the pass must produce its logits."""
        req.cached_len = 0
        if self.prefix_cache is not None:
            slots, req.prefix_node = self.prefix_cache.match(req.prompt_ids[:-1])
            self.prefix_cache.lock(req.prefix_node)
            self.req_to_token_pool.req_to_token[req.row, : len(slots)] = slots
            req.cached_len = len(slots)
        req.prefilled = req.cached_len

    def _alloc_slots(self, n: int) -> torch.Tensor:
        """n slots; cached ones are evicted when the allocator runs short (admission made sure
        that enough are free or evictable)."""
        if self.prefix_cache is not None and self.slots.available < n:
            self.prefix_cache.evict(n - self.slots.available)
        return self.slots.alloc(n)

    def _prefill(self, chunks: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        reqs, lens = [r for r, _ in chunks], [n for _, n in chunks]
        slots = self._alloc_slots(sum(lens))
        req_to_token = self.req_to_token_pool.req_to_token
        for req, n, req_slots in zip(reqs, lens, slots.split(lens)):
            req_to_token[req.row, req.prefilled : req.prefilled + n] = req_slots
        batch = ForwardBatch.extend(
            [t for r, n in chunks for t in r.prompt_ids[r.prefilled : r.prefilled + n]],
            [r.prefilled for r in reqs], lens, [r.row for r in reqs], slots, self.device,
        )
        logits = self._forward(batch)
        for req, n in chunks:
            req.prefilled += n
        done = [i for i, r in enumerate(reqs) if r.prefilled == len(r.prompt_ids)]
        self.chunked = next((r for r in reqs if r.prefilled < len(r.prompt_ids)), None)
        self.decode_owed = self.chunked is not None
        self.running.extend(reqs[i] for i in done)
        return self._sample_and_retire([reqs[i] for i in done], logits[done]) if done else []

    def _decode(self) -> list[tuple[Request, int]]:
        """Launch a decode pass over the running requests, then book the pass before it, which the
        GPU has finished or nearly (see the lesson: overlap)."""
        prev = self.in_flight
        pending = prev.rids if prev else set()
        # one whose budget the pass in flight uses up sits this one out
        reqs = [r for r in self.running if len(r.output_ids) + (r.rid in pending) < r.params.max_new_tokens]
        self.in_flight = self._launch_decode(reqs, prev, pending) if reqs else None
        events = self._retire(prev) if prev else []
        if self.in_flight and (not self.overlap or self.waiting or self.chunked):  # a prefill is next:
            events += self._retire(self.in_flight)  # hand this pass's tokens out before it
        return events

    def _launch_decode(self, reqs: list[Request], prev: DecodePass | None, pending: set[int]) -> DecodePass:
        """A pass whose input ids are the pass in flight's tokens, still on the device, for the
        requests it holds, `pending` (their new token sits one position further than the host has
        counted)."""
        slots = self._alloc_slots(len(reqs))
        seq_lens = [r.num_tokens + (r.rid in pending) for r in reqs]  # the new token's position is seq_len - 1
        if prev is None:
            input_ids = [r.output_ids[-1] for r in reqs]
        elif len(reqs) == len(prev.reqs):  # the same requests in the same order
            input_ids = prev.tokens
        else:
            kept = {r.rid for r in reqs}
            input_ids = prev.tokens[to_device([i for i, r in enumerate(prev.reqs) if r.rid in kept], torch.int64,
                                              self.device)]
        batch = ForwardBatch.decode(input_ids, seq_lens, [r.row for r in reqs], slots, self.device)
        self.req_to_token_pool.req_to_token[batch.req_pool_indices, batch.positions] = slots
        return self._launch_sampling(reqs, self._forward(batch))

    def _launch_sampling(self, reqs: list[Request], logits: torch.Tensor) -> DecodePass:
        """Sample on the device and start copying the tokens to the host, without waiting for them."""
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        if not tokens.is_cuda:
            return DecodePass(reqs, tokens, tokens, None)
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return DecodePass(reqs, tokens, host_tokens, copied)

    def _retire(self, done: DecodePass) -> list[tuple[Request, int]]:
        """Book a decode pass's tokens: each request gets its token, and those that are done leave."""
        if self.in_flight is done:
            self.in_flight = None
        if done.copied is not None:
            done.copied.synchronize()
        events = self._append_tokens(done.reqs, done.host_tokens.tolist())
        self.stats["decode_tokens"] += len(events)
        return events

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward pass -> logits [B, vocab]: a graph replay when one fits the batch, else the
        backend's per-pass metadata and the model, eagerly (the same two steps a graph recorded)."""
        if self.tp is not None and self.tp.rank == 0:  # the other ranks run the same pass
            self.tp.send_batch(batch, self.req_to_token_pool.req_to_token)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        self.attn.init_forward_metadata(batch)
        return self.model(batch, self.attn)

    def _sample_and_retire(self, reqs: list[Request], logits: torch.Tensor) -> list[tuple[Request, int]]:
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        return self._append_tokens(reqs, tokens)

    def _append_tokens(self, reqs: list[Request], tokens: list[int]) -> list[tuple[Request, int]]:
        events = []
        for req, token in zip(reqs, tokens):
            if req.finished:  # aborted, or stopped by the pass before while this one ran
                continue
            req.output_ids.append(token)
            events.append((req, token))
            if token in req.stop_ids or len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(req)
        return events

    def _finish(self, req: Request):
        req.finished = True
        self.running.remove(req)
        self._release(req)

    def _release(self, req: Request):
        """Give back what an admitted request holds: its K/V into the prefix cache (or its slots
        to the allocator), its lock on the cached prefix, its row, its claim on the pool."""
        kv_slots = self.req_to_token_pool.req_to_token[req.row, : req.kv_len].clone()
        if self.in_flight and req.rid in self.in_flight.rids:  # the pass in flight writes one more token
            self.slots.free(self.req_to_token_pool.req_to_token[req.row, req.kv_len : req.kv_len + 1].clone())
        if self.prefix_cache is not None:
            self.prefix_cache.insert((req.prompt_ids + req.output_ids)[: req.kv_len], kv_slots)
            self.prefix_cache.unlock(req.prefix_node)
        else:
            self.slots.free(kv_slots)
        self.req_to_token_pool.free(req.row)
        self.reserved_slots -= req.max_tokens - req.cached_len
        req.row = -1

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], stop_ids=()):
        """Run prompts to completion; -> list of output token lists, in prompt order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, stop_ids) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return [r.output_ids for r in reqs]

    def close(self):
        """Stop the tensor-parallel workers (a single-GPU engine has nothing to stop)."""
        if self.tp is not None:
            self.graph_runner = None  # release the graphs before the communicator they run
            self.tp.close()
