"""The engine: requests in, tokens out, with continuous batching over one shared KV pool.

Life of a request:
1. `add_request` checks it and puts it in the waiting queue.
2. The scheduler admits waiting requests while the pool has room for their prompt *and* all the
   tokens they may still generate (so a running request never has to be evicted), gives each a
   row in `req_to_token` and slots for its prompt, and runs one extend (prefill) pass over all
   newly admitted prompts together. Each gets its first token.
3. Otherwise it runs one decode pass over every running request: each gets one new slot, the
   model writes that token's K/V and attends over the request's slots, the sampler picks the next
   token. Decode passes go through the CUDA-graph runner when there is one.
4. A request that hits EOS, a stop id or its token budget leaves the batch at once and gives its
   slots and row back; the next step may admit a waiting request into the room it left.

With `tp_size` N > 1 this engine is rank 0 of N processes, one per GPU (tp.py): it launches the
others, which build the same engine around their part of the model and run each forward pass it
sends them. Everything above happens on rank 0 only.

`step()` returns the (request, token) pairs it produced, so a caller can stream them.
"""

import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from nano.config import load_config
from nano.forward_batch import ForwardBatch
from nano.kv_cache import KVPool, ReqToTokenPool, SlotAllocator, kv_bytes_per_token, slots_for_memory
from nano.loader import load_model
from nano.sampling import SamplingParams, sample
from nano.torch_attn import TorchAttnBackend
from nano.tp import TensorParallel, launch, parallelize


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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Slots this request may ever hold: its prompt and every token it may still generate
        (the last sampled token is never fed back, so it needs no slot)."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1


class Engine:
    def __init__(self, model_dir, device="cpu", dtype=torch.float32, attention_backend="torch",
                 load_format="safetensors", mem_fraction=0.85, max_total_tokens=None, max_requests=256,
                 context_length=None, use_mla=True, cuda_graph=False, cuda_graph_max_bs=160,
                 max_prefill_tokens=16384, tp_size=1, seed=0, log=True, tp_group: TensorParallel | None = None):
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
        started = time.perf_counter()
        self.model = load_model(cfg, Path(model_dir), self.device, dtype,
                                load_format, self.use_mla, seed, tp_rank, tp_size)
        if self.tp is not None:
            parallelize(self.model, self.tp)
        self._print(f"loaded {cfg.architecture} ({_count_params(self.model) / 1e9:.2f} B parameters, "
                    f"{dtype}) on {self.device} in {time.perf_counter() - started:.1f} s"
                    + (f"; each of {tp_size} GPUs holds its part" if tp_size > 1 else ""))

        shard_cfg = self.model.cfg  # this rank's heads and KV heads (all of them without tensor parallelism)
        num_slots = max_total_tokens + 1 if max_total_tokens else slots_for_memory(
            shard_cfg, dtype, self.device, self.use_mla, mem_fraction)
        if self.tp is not None:  # every rank's pool must have every slot rank 0 hands out
            num_slots = self.tp.min_over_ranks(num_slots)
        self.kv_pool = KVPool(shard_cfg, num_slots, dtype, self.device, self.use_mla)
        self.req_to_token_pool = ReqToTokenPool(max_requests, self.context_length, self.device)
        self.slots = SlotAllocator(num_slots, self.device)
        self.unreserved_slots = num_slots - 1  # slot 0 is reserved
        per_token = kv_bytes_per_token(shard_cfg, dtype, self.use_mla)
        self._print(f"KV cache: {num_slots - 1} tokens ({per_token:,} bytes per token, "
                    f"{(num_slots * per_token) / 2**30:.2f} GiB), up to {max_requests} requests")

        req_to_token = self.req_to_token_pool.req_to_token
        if attention_backend == "triton":
            from nano.triton_attn import TritonAttnBackend

            self.attn = TritonAttnBackend(self.kv_pool, req_to_token, max_requests, shard_cfg.num_heads)
        else:
            self.attn = TorchAttnBackend(self.kv_pool, req_to_token)
        self.graph_runner = None
        if cuda_graph:
            from nano.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self.model, self.attn, min(cuda_graph_max_bs, max_requests),
                                                self.device, log)

        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.next_rid = 0
        self.stats = dict(prefill_s=0.0, prefill_tokens=0, decode_s=0.0, decode_tokens=0)

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
        if req.max_tokens > self.kv_pool.num_slots - 1:
            raise ValueError(f"request needs {req.max_tokens} KV slots (prompt + max-new-tokens); "
                             f"the whole pool has {self.kv_pool.num_slots - 1}")
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        self.next_rid += 1
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int]]:
        started = time.perf_counter()
        admitted = self._admit()
        kind, events = ("prefill", self._prefill(admitted)) if admitted else ("decode", self._decode())
        # sampling ended with a host copy of the tokens, so the clock reads finished GPU work
        self.stats[kind + "_s"] += time.perf_counter() - started
        self.stats[kind + "_tokens"] += sum(len(r.prompt_ids) for r in admitted) if admitted else len(events)
        return events

    def _admit(self) -> list[Request]:
        admitted, num_tokens = [], 0
        while self.waiting:
            req = self.waiting[0]
            if req.max_tokens > self.unreserved_slots or (
                admitted and num_tokens + len(req.prompt_ids) > self.max_prefill_tokens
            ):
                break
            row = self.req_to_token_pool.alloc()
            if row is None:
                break
            self.waiting.popleft()
            req.row = row
            self.unreserved_slots -= req.max_tokens
            num_tokens += len(req.prompt_ids)
            admitted.append(req)
        return admitted

    def _prefill(self, reqs: list[Request]) -> list[tuple[Request, int]]:
        lens = [len(r.prompt_ids) for r in reqs]
        slots = self.slots.alloc(sum(lens))
        req_to_token = self.req_to_token_pool.req_to_token
        for req, req_slots in zip(reqs, slots.split(lens)):
            req_to_token[req.row, : len(req.prompt_ids)] = req_slots
        batch = ForwardBatch.extend(
            [t for r in reqs for t in r.prompt_ids], [0] * len(reqs), lens, [r.row for r in reqs], slots, self.device
        )
        logits = self._forward(batch)
        self.running.extend(reqs)
        return self._sample_and_retire(reqs, logits)

    def _decode(self) -> list[tuple[Request, int]]:
        reqs = self.running
        if not reqs:
            return []
        slots = self.slots.alloc(len(reqs))
        seq_lens = [r.num_tokens for r in reqs]  # the new token's position is num_tokens - 1
        batch = ForwardBatch.decode([r.output_ids[-1] for r in reqs], seq_lens, [r.row for r in reqs], slots,
                                    self.device)
        self.req_to_token_pool.req_to_token[batch.req_pool_indices, batch.positions] = slots
        return self._sample_and_retire(list(reqs), self._forward(batch))

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
        for req, token in zip(reqs, tokens):
            req.output_ids.append(token)
            if token in req.stop_ids or len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(req)
        return list(zip(reqs, tokens))

    def _finish(self, req: Request):
        req.finished = True
        self.running.remove(req)
        cached = req.num_tokens - 1  # the last sampled token was never written to the cache
        self.slots.free(self.req_to_token_pool.req_to_token[req.row, :cached].clone())
        self.req_to_token_pool.free(req.row)
        self.unreserved_slots += req.max_tokens

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


def _count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
