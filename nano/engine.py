"""The engine: requests in, tokens out, with continuous batching over one shared KV pool.

Life of a request:
1. `add_request` checks it and hands it to the scheduler (scheduler.py), which queues it.
2. Each `step()` the scheduler picks what runs. A prefill (extend) pass computes the prompts of
   newly admitted requests together (with the prefix cache, radix_cache.py, only the part no
   earlier request computed); each whose prompt is now complete gets its first token. Otherwise
   one decode pass runs over every running request: each gets one new slot, the model writes that
   token's K/V and attends over the request's slots, the sampler picks the next token. Decode
   passes go through the CUDA-graph runner when there is one.
3. A request that hits a stop id (its caller lists EOS among them) or its token budget leaves the
   batch at once; its tokens and slots go into the prefix cache, its row back to the table, and
   the next step may admit a waiting request into the room it left. `abort` does the same at once
   for a request its caller no longer wants (the server's client went away, or a stop string
   matched), whatever its state.
Which requests run, and when one must give its room back, is the scheduler's: this module runs
the passes it asks for.

With `tp_size` N > 1 this engine is rank 0 of N processes, one per GPU (tp.py): it launches the
others, which build the same engine around their part of the model and run each forward pass it
sends them (`run_tp_worker`). Everything above happens on rank 0 only.

Overlap: between two decode passes the host books the tokens of the first (appends them, retires
finished requests) and builds the second (and with tensor parallelism hands it to the other
ranks), and the GPU would wait for all that. So while no prompt waits, the engine launches pass
N+1 before it reads pass N's tokens: they stay on the device as N+1's input ids, their copy to
the host runs behind them, and the host books them while the GPU runs N+1. A request that N
stops (EOS, a stop id) gets a token computed in N+1 for nothing, dropped when N+1 is booked; its
slot goes back at once. Before a prefill, and before a retraction, the engine books everything
first, so the scheduler sees the running set as it is, and the tokens of a decode step between
chunks go out at once.

`step()` returns the (request, token) pairs it produced, so a caller can stream them: with
overlap, those of the pass before the one it launched.
"""

import itertools
import os
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from nano.config import ConfigError, load_config
from nano.cuda_graph_runner import CudaGraphRunner, GraphCaptureError
from nano.forward_batch import ForwardBatch, to_device
from nano.kv_cache import (CPU_KV_CACHE_MAX_BYTES, KVPool, ReqToTokenPool, SlotAllocator, kv_bytes_per_token,
                           kv_shapes, tokens_for_memory)
from nano.loader import WeightError, build_model, load_model, model_bytes
from nano.memory import NotEnoughMemoryError, ensure_fits
from nano.radix_cache import RadixCache
from nano.sampling import Logprobs, SamplingParams, integral, logprob_entries, sample, token_logprobs
from nano.scheduler import Request, Scheduler, Status, check_request
from nano.torch_attn import TorchAttnBackend
from nano.tp import TensorParallel, launch, parallelize, rank_device, shard_config


# Prompt tokens one prefill step computes at most, by device. A step holds up every running stream
# for its whole length; a GPU computes 8k tokens in a fraction of a second, a CPU in over a minute,
# so on CPU shorter chunks keep streams moving (BENCHMARKS.md: the CPU server's worst stall).
CHUNK_SIZES = {"cuda": 8192, "cpu": 256}
# torch's CPU threads: half the cores. torch's own default, a thread per core, waits at every op
# for its slowest thread, and when another process takes a core the whole step waits for the
# thread that lost it (BENCHMARKS.md: decode beside a busy process fell to a quarter of its speed).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2  # (macOS: no affinity)
CPU_THREADS = max(1, CPUS // 2)  # of the cores this process may use (taskset's, a container's cpuset), not the host's


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs a model: every setting and its default, in one place. Each command
    builds one from its flags (cli.py); the other tensor-parallel ranks get the same one."""
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: torch.dtype = torch.float32
    attention_backend: str = "torch"  # torch (the reference) or triton
    load_format: str = "safetensors"  # or dummy: random weights in the real shapes
    dummy_weight_seed: int = 0  # the random weights' seed, the same on every rank
    mem_fraction: float = 0.85  # of the memory free after the weights, for the KV cache
    max_total_tokens: int | None = None  # KV cache size in tokens (instead of mem_fraction)
    max_running_requests: int = 256  # rows of the request table: requests decoded together at most
    context_length: int | None = None  # per request; default the model's (or the pool's, if smaller)
    use_mla: bool = True  # DeepSeek: absorbed latent attention (False: expanded K/V)
    cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # default: max_running_requests
    radix_cache: bool = True
    # prompt tokens one extend pass computes at most (chunking off: a longer prompt runs alone)
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # 0 or -1: off; None: the device's (CHUNK_SIZES)
    threads: int | None = None  # CPU: torch's threads; None: OMP_NUM_THREADS if set, else CPU_THREADS
    overlap: bool = True
    tp_size: int = 1
    log: bool = True

    def validate(self):
        """Raise ValueError with a one-line message for a setting that makes no sense."""
        for name in ("max_total_tokens", "max_running_requests", "context_length", "cuda_graph_max_bs", "tp_size",
                     "max_prefill_tokens", "threads"):
            value = getattr(self, name)
            if value is not None and (not integral(value) or value <= 0):  # 1.5 or NaN would fail deep inside
                raise ValueError(f"{name.replace('_', '-')} must be > 0 (an integer), got {value}")
        for name, known in (("attention_backend", ("torch", "triton")), ("load_format", ("safetensors", "dummy")),
                            ("dtype", (torch.float32, torch.float16, torch.bfloat16))):  # not a silent fallback
            if getattr(self, name) not in known:
                raise ValueError(f"{name.replace('_', '-')} must be one of {known}, got {getattr(self, name)!r}")
        if (self.chunked_prefill_size or 0) < -1:
            raise ValueError(f"chunked-prefill-size must be > 0, or 0 or -1 for off; got {self.chunked_prefill_size}")
        if str(self.device).partition(":")[0] not in CHUNK_SIZES:  # meta or mps: no kernels or chunk size for them
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 < self.mem_fraction < 1:  # NaN fails this too
            raise ValueError(f"mem-fraction must be between 0 and 1, got {self.mem_fraction}")
        if self.cuda_graph and not (str(self.device).startswith("cuda") and self.attention_backend == "triton"):
            raise ValueError("cuda-graph needs a cuda device and the triton backend (the torch one reads the host)")


@dataclass
class DecodePass:
    """A decode pass whose sampled tokens are still on their way to the host."""
    reqs: list[Request]
    tokens: torch.Tensor  # [B] int64 on the device: the next pass's input ids
    host_tokens: torch.Tensor  # [B] int64 on the host, once `copied` has happened
    copied: torch.cuda.Event | None  # None on CPU, where the copy is done at once
    asked: list[int]  # the rows whose requests ask for logprobs
    logprobs: tuple[torch.Tensor, ...]  # token_logprobs of those rows, copied with the tokens


class Engine:
    def __init__(self, model_dir, config: EngineConfig = EngineConfig(), tp_group: TensorParallel | None = None):
        config.validate()
        self.config, self.log = config, config.log
        self.device, self.dtype = rank_device(torch.device(config.device), getattr(tp_group, "rank", 0)), config.dtype
        if self.device.type == "cuda":  # Triton launches, events and graph capture run on the current device
            torch.cuda.set_device(self.device)
        elif config.threads or not os.environ.get("OMP_NUM_THREADS"):  # (torch has taken OMP_NUM_THREADS, if set)
            torch.set_num_threads(config.threads or CPU_THREADS)
        self.cfg = cfg = load_config(model_dir)  # the model's config (self.config: the engine's)
        if tp_group is None and config.tp_size > 1:  # rank 0 starts the others, which come here with their group
            tp_group = launch(cfg, config.tp_size, self.device, partial(run_tp_worker, model_dir, config))
        self.tp = tp_group
        try:
            self._build(model_dir)
        except BaseException:  # on rank 0 alone (its GPU short of memory, say): the workers wait in a collective
            if self.tp is not None and self.tp.rank == 0 and all(w.is_alive() for w in self.tp.workers):
                self.tp.abandon(leave=True)  # it will never reach; a worker that failed itself is the watcher's
            raise
        self.stats = dict(prefill_s=0.0, prefill_steps=0, prefill_tokens=0, cached_tokens=0, decode_s=0.0,
                          decode_steps=0, decode_tokens=0, retractions=0, recomputed_tokens=0)
        chunk = CHUNK_SIZES[self.device.type] if config.chunked_prefill_size is None else config.chunked_prefill_size
        self.scheduler = Scheduler(self.req_to_token_pool, self.slots, self.prefix_cache, config.max_prefill_tokens,
                                   chunk, self.stats)
        self.in_flight: DecodePass | None = None  # the last decode pass, not yet booked
        self.rids = itertools.count()  # request ids
        self.logprobs: dict[int, Logprobs] = {}  # by request id, for requests that ask, until the caller takes them

    def _build(self, model_dir):
        """The model, the KV cache, the attention backend and the graphs of this rank."""
        config, cfg = self.config, self.cfg
        self.use_mla = config.use_mla and cfg.is_deepseek
        shard_cfg = shard_config(cfg, config.tp_size)  # this rank's heads and KV heads (all of them at tp 1)
        if config.attention_backend == "triton":  # heads its kernels cannot run: refused before the weights load
            from nano.triton_attn import MAX_GROUP, MIN_HEAD_WIDTH, TritonAttnBackend  # a CPU run never imports triton
            (kv_heads, k_dim), (_, v_dim) = kv_shapes(shard_cfg, self.use_mla)
            if min(k_dim, v_dim) < MIN_HEAD_WIDTH or shard_cfg.num_heads // kv_heads > MAX_GROUP:
                raise ConfigError(f"the Triton attention kernels need heads at least {MIN_HEAD_WIDTH} wide, at most "
                                  f"{MAX_GROUP} per KV head; this model's are {k_dim}/{v_dim} wide, "
                                  f"{shard_cfg.num_heads // kv_heads} per KV head: use --attention-backend torch")
        self._load_model(model_dir, shard_cfg)
        self._build_kv_cache(shard_cfg)
        req_to_token = self.req_to_token_pool.req_to_token
        if config.attention_backend == "triton":  # (imported above)
            self.attn = TritonAttnBackend(self.kv_pool, req_to_token, config.max_running_requests, shard_cfg.num_heads)
        else:
            self.attn = TorchAttnBackend(self.kv_pool, req_to_token)
        max_bs = min(config.cuda_graph_max_bs or config.max_running_requests, config.max_running_requests)
        self.graph_runner = (CudaGraphRunner(self.model, self.attn, max_bs, self.device, self.log) if config.cuda_graph
                             else None)

    def _load_model(self, model_dir, shard_cfg):
        """Check that the weights, the request table and a KV cache of the size asked for (or, failing
        that, room for one request of the full context; on CPU, at most the pool's cap, to which the
        context then shrinks) fit, then build and fill the model."""
        config, cfg = self.config, self.cfg
        self.context_length = config.context_length or cfg.max_position_embeddings
        if self.context_length > cfg.max_position_embeddings:  # positions it never learnt (vLLM refuses them too)
            raise ConfigError(f"context length {self.context_length}: this model's is {cfg.max_position_embeddings}")
        self.kv_bytes_per_token = kv_bytes_per_token(shard_cfg, self.dtype, self.use_mla)
        kv_bytes = (config.max_total_tokens or self.context_length) * self.kv_bytes_per_token
        if self.device.type == "cpu" and not config.max_total_tokens:
            kv_bytes = min(kv_bytes, CPU_KV_CACHE_MAX_BYTES)
        table_context = min(self.context_length, kv_bytes // self.kv_bytes_per_token)  # no row outgrows the pool
        ensure_fits(self.device, self.dtype, {
            f"{str(self.dtype).removeprefix('torch.')} weights": model_bytes(shard_cfg, self.dtype, self.use_mla),
            "KV cache": kv_bytes, "request table": config.max_running_requests * table_context * 4,
        })
        started = time.perf_counter()
        self.model = load_model(cfg, Path(model_dir), self.device, self.dtype, config.load_format, self.use_mla,
                                config.dummy_weight_seed, self.tp.rank if self.tp else 0, config.tp_size)
        if self.tp is not None:
            parallelize(self.model, self.tp)
        whole = build_model(cfg, self.use_mla, "meta", self.dtype) if self.tp else self.model  # not one rank's part
        n_params = sum(p.numel() for p in whole.parameters())
        split = f"; split over {config.tp_size} ranks" if self.tp else ""
        if self.log:
            print(f"loaded {cfg.architecture} ({n_params / 1e9:.2f} B parameters, {self.dtype}) on {self.device} "
                  f"in {time.perf_counter() - started:.1f} s{split}", file=sys.stderr)

    def _build_kv_cache(self, shard_cfg):
        config, per_token = self.config, self.kv_bytes_per_token
        capacity = config.max_total_tokens or tokens_for_memory(shard_cfg, self.dtype, self.device, self.use_mla,
                                                               config.mem_fraction)
        if self.tp is not None:  # every rank's pool must have every slot rank 0 hands out
            capacity = self.tp.min_over_ranks(capacity)
        self.kv_pool = KVPool(shard_cfg, capacity, self.dtype, self.device, self.use_mla)
        self.context_length = min(self.context_length, capacity)  # no request holds more than the pool
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, self.context_length, self.device)
        self.slots = SlotAllocator(capacity, self.device)
        self.prefix_cache = RadixCache(self.slots) if config.radix_cache else None
        if self.log:
            print(f"KV cache: {capacity} tokens ({per_token:,} bytes per token, {(capacity * per_token) / 2**30:.2f} "
                  f"GiB), up to {config.max_running_requests} requests of up to {self.context_length} tokens",
                  file=sys.stderr)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, stop_ids=()) -> Request:
        """Queue a request (ValueError, one line, if it can never run); ignore_eos drops the model's EOS ids."""
        self.scheduler.queue(req := self._request(prompt_ids, params, stop_ids))
        return req

    def _request(self, prompt_ids: list[int], params: SamplingParams, stop_ids) -> Request:
        check_request(prompt_ids, params, self.cfg.vocab_size, self.context_length)
        # never generate past the context (a copy: the caller's params may serve other requests)
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.context_length - len(prompt_ids)))
        eos = set(self.cfg.eos_token_ids if params.ignore_eos else ())  # the caller's other stop ids still stop it
        return Request(next(self.rids), list(prompt_ids), params, set(stop_ids) - eos,
                       generator=None if params.seed is None else torch.Generator(self.device).manual_seed(params.seed))

    def abort(self, req: Request):
        """Drop a request between steps, whatever its state, and give back all it holds."""
        self.scheduler.finish(req)
        self.logprobs.pop(req.rid, None)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.scheduler.chunked or self.in_flight)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int]]:
        started, events, chunks = time.perf_counter(), [], []
        try:
            if self.in_flight and self.scheduler.wants_prefill():  # admission needs the running set settled
                events = self._book(self.in_flight)  # (whenever a prompt waits, even one with no room yet)
            events += self._prefill(chunks) if (chunks := self.scheduler.schedule_prefill()) else self._decode()
        except BaseException:  # the pass's requests end here: left half-stepped, a prompt kept its row for ever
            self.scheduler.finish(*self.scheduler.running, *(r for r, _ in chunks))  # and a caller who stepped on spun
            raise
        kind = "prefill" if chunks else "decode"
        # a step ends when the tokens it hands out are on the host: over many steps the clock reads the GPU's work
        self.stats[kind + "_s"] += time.perf_counter() - started
        self.stats[kind + "_steps"] += 1
        return events

    def _prefill(self, chunks: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        reqs, lens = [r for r, _ in chunks], [n for _, n in chunks]
        # step() ends these requests, and a release gives back what they held before this pass
        with self.scheduler.new_slots(sum(lens)) as slots:  # (and these, if it raises)
            for req, n, req_slots in zip(reqs, lens, slots.split(lens)):
                self.req_to_token_pool.req_to_token[req.row, req.prefilled : req.prefilled + n] = req_slots
            batch = ForwardBatch.extend([t for r, n in chunks for t in r.fill_ids[r.prefilled : r.prefilled + n]],
                                        [r.prefilled for r in reqs], lens, [r.row for r in reqs], slots, self.device)
            logit_rows, ends = self._logit_rows(chunks)
            if len(logit_rows) > len(chunks):
                batch.logit_rows = to_device(logit_rows, torch.int64, self.device)
            logits = self.forward(batch)
            self._prompt_logprobs(chunks, logits, ends)
        if not (done := self.scheduler.book_prefill(chunks)):
            return []
        logits = logits[[ends[i] - 1 for i, r in enumerate(reqs) if r in done]]  # each request's last token
        tokens, asked, logprobs = self._sample(done, logits)
        return self._append_tokens(done, tokens.tolist(), asked, logprobs)

    @staticmethod
    def _logit_rows(chunks: list[tuple[Request, int]]) -> tuple[list[int], list[int]]:
        """The rows of an extend pass whose logits the engine reads: each request's last, and every row of
        a request that asks for its prompt's logprobs (on its first admission: a recompute after a
        retraction has them already) -> (the rows, where each request's rows end in the logits)."""
        rows, ends, start = [], [], 0
        for req, n in chunks:
            rows += range(start, start + n) if req.wants_prompt_logprobs else [start + n - 1]
            ends.append(len(rows))
            start += n
        return rows, ends

    def _prompt_logprobs(self, chunks: list[tuple[Request, int]], logits: torch.Tensor, ends: list[int]):
        """Each prompt token's logprob, from the logits of the position before it, for the requests whose
        rows the pass kept (chunk by chunk; the last row predicts the sampled token, booked with it)."""
        for (req, n), end in zip(chunks, ends):
            if not req.wants_prompt_logprobs:
                continue
            first = req.prefilled  # rows first..first+n-1 predict tokens first+1..first+n
            count = min(n, len(req.prompt_ids) - 1 - first)
            targets = to_device(req.prompt_ids[first + 1 : first + 1 + count], torch.int64, self.device)
            tensors = token_logprobs(logits[end - n : end - n + count], targets, req.params.logprobs)
            entries = logprob_entries(*tensors, [req.params.logprobs] * count)
            self.logprobs.setdefault(req.rid, Logprobs()).prompt[first:] = entries  # (a retracted prompt's again)

    def _decode(self) -> list[tuple[Request, int]]:
        """Launch a decode pass over the running requests, then book the pass before it, which the
        GPU has finished or nearly (see the lesson: overlap)."""
        prev, events = self.in_flight, []
        if prev and self.scheduler.free_room < len(self.scheduler.running):  # room may run short: a
            events, prev = self._book(prev), None  # retraction needs every token booked first
        reqs = self.scheduler.schedule_decode()
        self.in_flight = self._launch_decode(reqs, prev) if reqs else None
        events += self._book(prev) if prev else []
        if self.in_flight and (not self.config.overlap or self.scheduler.wants_prefill()):  # a prompt waits:
            events += self._book(self.in_flight)  # the next step's admission needs this pass booked
        return events

    def _launch_decode(self, reqs: list[Request], prev: DecodePass | None) -> DecodePass:
        """A pass whose input ids are the pass in flight's tokens, still on the device, for the
        requests it holds (their new token sits one position further than the host has counted)."""
        with self.scheduler.new_slots(len(reqs)) as slots:  # given back if the batch cannot be built
            seq_lens = [r.num_tokens + r.in_flight for r in reqs]  # the new token's position is seq_len - 1
            if prev is None:
                input_ids = [r.output_ids[-1] for r in reqs]
            elif len(reqs) == len(prev.reqs):  # the same requests in the same order
                input_ids = prev.tokens
            else:
                kept = set(reqs)
                rows = [i for i, r in enumerate(prev.reqs) if r in kept]
                input_ids = prev.tokens[to_device(rows, torch.int64, self.device)]
            batch = ForwardBatch.decode(input_ids, seq_lens, [r.row for r in reqs], slots, self.device)
            self.req_to_token_pool.req_to_token[batch.req_pool_indices, batch.positions] = slots
        for req in reqs:  # from here a release gives these slots back
            req.in_flight += 1
        return self._launch_sampling(reqs, self.forward(batch))

    def _launch_sampling(self, reqs: list[Request], logits: torch.Tensor) -> DecodePass:
        """Sample on the device, and the logprobs of the requests that ask, and start copying them to
        the host, without waiting for them."""
        tokens, asked, logprobs = self._sample(reqs, logits)
        if not tokens.is_cuda:
            return DecodePass(reqs, tokens, tokens, None, asked, logprobs)
        host_tokens, *host_logprobs = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                       for t in (tokens, *logprobs))
        copied = torch.cuda.current_stream().record_event()
        return DecodePass(reqs, tokens, host_tokens, copied, asked, tuple(host_logprobs))

    @staticmethod
    def _sample(reqs: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, list[int], tuple]:
        """Each request's next token, on the device -> (the tokens, the rows whose requests ask for
        logprobs, token_logprobs of those rows); a batch where none asks computes no logprobs."""
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        asked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not asked:
            return tokens, [], ()
        rows = to_device(asked, torch.int64, logits.device)
        return tokens, asked, token_logprobs(logits[rows], tokens[rows], max(reqs[i].params.logprobs for i in asked))

    def _book(self, done: DecodePass) -> list[tuple[Request, int]]:
        """Book a decode pass's tokens: each request gets its token, and those that are done leave."""
        if self.in_flight is done:
            self.in_flight = None
        if done.copied is not None:
            done.copied.synchronize()
        for req in done.reqs:
            req.in_flight -= 1
        return self._append_tokens(done.reqs, done.host_tokens.tolist(), done.asked, done.logprobs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward pass -> logits [B, vocab] (or [R, vocab]: batch.logit_rows): a graph replay when
        one fits the batch, else the model, eagerly (the same pass a graph recorded)."""
        if self.tp is None or self.tp.rank != 0:
            return self._run(batch)
        return self.tp.run_pass(batch, self.req_to_token_pool.req_to_token, self._run)  # on every rank

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        return self.model(batch, self.attn)

    def _append_tokens(self, reqs: list[Request], tokens: list[int], asked: list[int],
                       logprobs: tuple) -> list[tuple[Request, int]]:
        """asked, logprobs: as _sample gives them (their entries are kept in self.logprobs for the caller)."""
        ks = [reqs[i].params.logprobs for i in asked]
        entries = dict(zip(asked, logprob_entries(*logprobs, ks))) if asked else {}  # by row
        events = []
        for row, (req, token) in enumerate(zip(reqs, tokens)):
            if req.status is not Status.RUNNING:  # aborted, or stopped by the pass before while this one ran
                continue
            req.output_ids.append(token)
            events.append((req, token))
            self.stats["decode_tokens"] += len(req.output_ids) > 1  # also one a prefill after a retraction samples
            if row in entries:
                self.logprobs.setdefault(req.rid, Logprobs()).tokens.append(entries[row])
            if token in req.stop_ids or len(req.output_ids) >= req.params.max_new_tokens:
                self.scheduler.finish(req)
        return events

    def stream(self):
        """Step until every request is done, yielding each (request, token) as it comes."""
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], stop_ids=()):
        """Run prompts to completion; -> list of output token lists, in prompt order."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):  # zip would drop the prompts past the shorter list
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params: give one, or one per prompt")
        stop_ids = set(stop_ids)  # an iterator would reach the first prompt alone
        # all checked before any is queued: a bad one must not leave the others to run with the next call
        self.scheduler.queue(*(reqs := [self._request(p, sp, stop_ids) for p, sp in zip(prompts, params)]))
        try:
            for _ in self.stream():
                pass
        finally:  # the tokens alone go back (logprobs they asked for would stay here for ever); after a step
            for req in reqs:  # that raised, or Ctrl-C, none is left holding room, to run (or spin) with the next call
                self.abort(req)
        return [r.output_ids for r in reqs]

    def close(self):
        """Stop the tensor-parallel workers (a single-GPU engine has nothing to stop)."""
        if self.tp is not None:
            self.graph_runner = None  # release the graphs before the communicator they run
            self.tp.close()


def run_tp_worker(model_dir, config: EngineConfig, rank: int, port: int, pipe):
    """A tensor-parallel worker's life (tp.py): build the engine's rank `rank`, then run every
    forward pass rank 0 sends, a graph replay when one fits, as on rank 0. A one-line error while
    it builds (a weight missing, a GPU without room) ends it as it ends a command: that line, status 2."""
    try:
        group = TensorParallel(rank, config.tp_size, port, rank_device(torch.device(config.device), rank), pipes=[pipe])
        engine = Engine(model_dir, replace(config, log=False), tp_group=group)
        while (batch := group.receive_batch(engine.req_to_token_pool.req_to_token)) is not None:
            engine.forward(batch)
    except (ConfigError, WeightError, NotEnoughMemoryError, GraphCaptureError) as e:  # cli's that a rank meets
        print(f"error: tensor-parallel rank {rank}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: rank 0 reports it
        sys.exit(130)
    engine.close()
