"""Tensor parallelism: one model split across the GPUs of one host, one process per GPU.

A decode step at small batch reads every weight once, so its time is the weights' bytes over the
memory bandwidth. Split every large matrix across N GPUs and each reads 1/N of the bytes at the
same time: the step can get up to N times faster, minus what the GPUs spend combining their parts.
The split is the Megatron-LM paper's (Shoeybi et al., 2019); gpt-fast's tp.py applies it to a
built model in a page of code, and so does this module.

- Column-parallel linear (the paper writes Y = XA and splits A's columns; our weights are stored
  transposed, [out, in], so it is their rows): each rank computes its slice of the output from the
  whole input. q/k/v are split by heads: attention is per head, so a rank attends with its own
  heads and caches only its own KV heads. gate/up are split along the MLP's width.
- Row-parallel linear: the matrix after (o_proj, down_proj) takes its input split the same way;
  each rank multiplies its slice of the activations by its slice of the columns and holds a partial
  sum of the full output. One all-reduce adds the partial sums.
So each block half (attention, MLP) is column-parallel in, row-parallel out, with one all-reduce
at its end: two per layer (`parallelize` hooks them onto each layer's `self_attn` and `mlp`). Rope,
attention and SiLU run on local heads and columns. The residual stream, the norms and everything
between the halves are replicated: after each all-reduce every rank holds the same hidden states.
A rank builds the model's modules in its smaller shapes (`shard_config`: fewer heads, narrower
MLP) and reads only its block of each checkpoint tensor (`checkpoint_shard`, loader.py).

- KV heads: with fewer KV heads than ranks (one KV head on 2 GPUs), each rank keeps the KV head
  its query heads read, so a KV head is held by several ranks.
- Vocabulary-parallel embedding and lm_head: the largest single matrices (Llama-3: 128256 x 4096
  each). A rank holds a contiguous block of the vocabulary. The embedding looks up the tokens in
  its block and zeros the others; an all-reduce then fills each row from the rank that holds it
  (exact: one vector plus zeros). lm_head gives each rank its block's logits; an all-gather puts
  the blocks side by side, and rank 0 samples from the full row.
- MLA (DeepSeek-V2) is split by heads: q_proj (or q_b_proj), kv_b_proj (per-head matrices) and
  o_proj's columns. The latent c and the rope key k_pe are shared by all heads, and every score is
  a dot product over all 576 of their channels; splitting them would need an all-reduce inside
  attention. So, as SGLang does, kv_a_proj (576 x hidden, small; its rows of the matmul it shares
  with q_proj or q_a_proj) and the latent cache (576 values per token) are replicated: every rank
  computes and stores the same latent and reads it all. The price: splitting over more GPUs does
  not let more tokens fit in the cache.
- MoE: each expert's width is split (its gate/up rows, its down columns), not the experts
  themselves. Every rank routes every token (the router is replicated and sees the same hidden
  states, so all ranks choose alike) and runs the chosen experts on its slice; the routed sum is a
  partial sum like any row-parallel output, added to the shared experts' partial output, and both
  go through the block's one all-reduce. The alternative, expert parallelism (rank r owns E/N whole
  experts), loses at small batch: a token's 6 experts fall unevenly on 2 ranks (the busier holds
  3.9 of them on average) and the step waits for the busier; width-splitting reads exactly half
  of every chosen expert on each rank, and keeps the MoE forms and kernel (deepseek.py) as they
  are. Expert parallelism pays with many GPUs and large batches, where experts sliced N ways get
  too thin to run well.

Processes. Rank 0 is the process that runs the engine (the user's, or nano.serve's engine process):
the scheduler and sampling live there. It starts ranks 1..N-1 itself (`launch`:
torch.multiprocessing, spawn); each builds the same Engine on its own GPU (its weight shards, its
part of the KV cache, its CUDA graphs) and then follows (engine.py's `run_tp_worker`): for every
forward pass rank 0 sends the batch, every rank runs the same pass, and they meet at the same
all-reduces. The batch travels in two parts: its host fields through a pipe (which also lets an idle
worker wait for as long as rank 0 has no work), its tensors packed as bytes into one broadcast, GPU
to GPU, that rank 0's host never waits for. CUDA graphs capture the NCCL all-reduce like any other
kernel; every rank captures the same batch sizes in the same order, and since all get the same batch
from rank 0, all pad it to the same graph.
"""

import atexit
import contextlib
import math
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from dataclasses import fields, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from nano.config import ConfigError, ModelConfig
from nano.forward_batch import ForwardBatch
from nano.model import CausalLM, Linear

# ---- what each rank holds ---------------------------------------------------------------------
# Checkpoint matrices by role (the module name before ".weight"); every other tensor is replicated.
SPLIT_ROWS = {"q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"}
SPLIT_COLUMNS = {"o_proj", "down_proj"}
SPLIT_KV_HEADS = {"k_proj", "v_proj"}


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one of `size` ranks builds: its heads, KV heads, MLP and expert widths, vocabulary."""
    if size == 1:
        return cfg
    for what, n in [("attention head count", cfg.num_heads), ("MLP width", cfg.intermediate_size),
                    ("expert width", cfg.moe_intermediate_size), ("vocabulary size", cfg.vocab_size)]:
        if n % size:
            raise ConfigError(f"cannot split the model over {size} GPUs: its {what} ({n}) is not a multiple of {size}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ConfigError(f"cannot split the model over {size} GPUs: its {cfg.num_kv_heads} KV heads "
                          "and the GPU count must divide one another")
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads // size, 1),
                   intermediate_size=cfg.intermediate_size // size,
                   moe_intermediate_size=cfg.moe_intermediate_size // size, vocab_size=cfg.vocab_size // size)


def checkpoint_shard(name: str, cfg: ModelConfig, rank: int, size: int) -> tuple[int, int, int] | None:
    """The block of checkpoint tensor `name` that `rank` holds: (dim, number of blocks, which
    block), or None when every rank holds all of it."""
    if size == 1:
        return None
    role = name.split(".")[-2]  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
    if role in SPLIT_ROWS:
        return 0, size, rank
    if role in SPLIT_COLUMNS:
        return 1, size, rank
    if role in SPLIT_KV_HEADS:  # fewer KV heads than ranks: consecutive ranks share one
        blocks = min(cfg.num_kv_heads, size)
        return 0, blocks, rank * blocks // size
    return None


# ---- the ranks and what passes between them ---------------------------------------------------
class TensorParallel:
    """This process's place among the ranks, and every collective the model and the engine use.
    Rank 0 also holds the pipes to the workers and the worker processes."""

    def __init__(self, rank: int, size: int, port: int, device: torch.device, pipes=(), workers=(), store=None):
        self.rank, self.size, self.device = rank, size, device
        self.pipes, self.workers, self.closed, self.interrupted = list(pipes), list(workers), False, False
        on_gpu = device.type == "cuda"
        if on_gpu:
            torch.cuda.set_device(device)  # Triton launches and graph capture use the current device
        if rank == 0:  # from before the rendezvous, which waits out the group's timeout (NCCL 10 min, gloo 30)
            threading.Thread(target=self._exit_if_a_worker_dies, daemon=True).start()
        try:
            if store is None:  # a worker: rank 0's store (launch's) listens already
                store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
                store.set(f"rank {rank} is here", "")
            else:  # Ctrl-C while rank 0 waits is raised when the wait ends: before the group connects the ranks,
                # whose teardown would fail the workers' first collective (a traceback each), not after
                store.wait([f"rank {r} is here" for r in range(1, size)])
            dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=size,
                                    device_id=device if on_gpu else None)
            self.group = dist.group.WORLD
            self.all_reduce(torch.zeros(1, device=device))  # connect now, not inside a graph capture
        except BaseException:  # Ctrl-C, say: the workers, which wait for rank 0, would be reported as dead
            if rank == 0:
                self.abandon()
            raise
        if rank == 0:
            atexit.register(self.close)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[B, n] on each rank -> [B, size * n], rank 0's columns first."""
        blocks = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(blocks, x.contiguous(), group=self.group)
        return torch.cat(blocks, dim=-1)

    def min_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def run_pass(self, batch: ForwardBatch, req_to_token: torch.Tensor, run) -> torch.Tensor:
        """Rank 0: hand the workers a forward pass, and run it here too (`run(batch)`) -> its logits."""
        if self.closed:  # after close(): its workers are gone, and a pass sent to them ends this process
            raise RuntimeError("the engine is closed: its tensor-parallel workers have stopped")
        if self.interrupted:
            raise RuntimeError("the engine cannot run again: Ctrl-C interrupted a forward pass on tensor-parallel "
                               "rank 0 alone, and its workers wait in that pass")
        try:
            self.send_batch(batch, req_to_token)
            return run(batch)
        except Exception:  # the workers wait in a collective this rank will never reach
            self.out_of_step()  # ends every rank
        except KeyboardInterrupt:  # At a terminal the workers heard it too, and every rank ends (their watcher
            self.interrupted = True  # below). Caught (a notebook's interrupt), the next pass would wait for ever.
            raise

    def send_batch(self, batch: ForwardBatch, req_to_token: torch.Tensor):
        """Rank 0: hand a forward pass to the workers (see the lesson for the two parts)."""
        host, tensors = {}, {}
        for f in fields(batch):
            value = getattr(batch, f.name)
            (tensors if isinstance(value, torch.Tensor) else host)[f.name] = value
        if not batch.is_decode:  # the requests' rows of req_to_token, with any prefix slots rank 0 put there
            tensors["req_to_token_rows"] = req_to_token[batch.req_pool_indices, : max(batch.seq_lens_cpu)]
        # widest elements first: every tensor then starts at a multiple of its element size
        order = sorted(tensors, key=lambda name: -tensors[name].element_size())
        layout = [(name, tensors[name].dtype, tensors[name].shape) for name in order]
        for pipe in self.pipes:
            pipe.send((host, layout))
        packed = torch.cat([tensors[name].reshape(-1).view(torch.uint8) for name in order])
        dist.broadcast(packed, src=0, group=self.group)

    def receive_batch(self, req_to_token: torch.Tensor) -> ForwardBatch | None:
        """A worker: the next forward pass from rank 0, with the same writes into req_to_token that
        rank 0 made; None when rank 0 stops."""
        try:
            message = self.pipes[0].recv()
        except EOFError:  # rank 0 is gone
            return None
        if message is None:
            return None
        host, layout = message
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in layout]
        packed = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        dist.broadcast(packed, src=0, group=self.group)
        chunks = packed.split(sizes)
        tensors = {name: chunk.view(dtype).view(shape) for (name, dtype, shape), chunk in zip(layout, chunks)}
        rows = tensors.pop("req_to_token_rows", None)
        batch = ForwardBatch(**host, **tensors)
        if rows is None:  # decode: each request's new slot
            req_to_token[batch.req_pool_indices, batch.positions] = batch.out_cache_loc
        else:
            req_to_token[batch.req_pool_indices, : rows.shape[1]] = rows
        return batch

    def close(self):
        """Rank 0: stop the workers. Every rank: leave the process group."""
        if self.closed:
            return
        if self.interrupted:  # its workers wait in a pass: they would never leave the group with this rank
            return self.abandon(leave=True)
        self.closed = True
        for pipe in self.pipes if self.rank == 0 else ():
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                pipe.send(None)
        dist.destroy_process_group()  # on all ranks at once: teardown may wait for the peers
        self.group = None  # the last reference: the group's threads end now, not in the interpreter's exit
        for worker in self.workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()  # not terminate(): it may outlive SIGTERM (_run_worker)

    def out_of_step(self):
        """Rank 0: a forward pass failed here after the workers were handed it. They wait in one of its
        collectives that this rank will never reach, and the next pass's would meet theirs out of order
        (a hang, or another pass's bytes): end every rank, as when a worker dies."""
        traceback.print_exc()
        print("error: a forward pass failed on tensor-parallel rank 0 after the other ranks began it; "
              "they cannot be brought back in step", file=sys.stderr, flush=True)
        self.abandon()
        os._exit(1)

    def abandon(self, leave: bool = False):
        """Rank 0: kill the workers, which wait in a collective this rank will never reach; leave: also the
        process group, which would otherwise refuse the next engine this process builds."""
        self.closed = True  # the watcher below would report the workers killed here as workers that died
        for worker in self.workers:
            worker.kill()
        if leave:
            dist.destroy_process_group()

    def _exit_if_a_worker_dies(self):
        """A rank that died leaves the others waiting in a collective forever: end rank 0 too."""
        ended = multiprocessing.connection.wait([w.sentinel for w in self.workers])
        if not self.closed:  # (a sentinel fires as the process closes its files, before its exit code is there)
            dead = [(i + 1, w.join() or w.exitcode) for i, w in enumerate(self.workers) if w.sentinel in ended]
            for quiet in (2, 130):  # each printed its one-line error, or met Ctrl-C (engine.run_tp_worker)
                if all(code == quiet for _, code in dead):
                    os._exit(quiet)
            died = ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead)
            print(f"error: tensor-parallel worker {died} stopped (what it printed, if anything, is above)",
                  file=sys.stderr)  # a worker the OOM killer ended printed nothing
            os._exit(1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank: rank r runs on cuda:N+r, from the --device cuda:N asked for (N is 0 for `cuda`, as
    SGLang's --base-gpu-id; CUDA_VISIBLE_DEVICES picks which GPUs those are)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def launch(cfg: ModelConfig, size: int, device: torch.device, worker) -> TensorParallel:
    """Rank 0: start ranks 1..size-1, each running `worker(rank, port, pipe)` (engine.py's
    `run_tp_worker`: it builds the same engine and follows), and join them."""
    shard_config(cfg, size)  # a model that cannot be split fails here, before any process starts
    if dist.is_initialized():  # torch's one default group: a second would fail, its workers left waiting
        raise ConfigError("a tensor-parallel engine already runs in this process: close() it first")
    if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
        raise ConfigError(f"tensor parallelism over {size} GPUs from {device}, but {torch.cuda.device_count()} "
                          "are visible")
    # The rendezvous: a key-value store the ranks meet at, on a port the OS picks and rank 0 holds from now on
    # (a port found free, then bound again once the workers start, can be taken by another program between).
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    port = store.port
    context = torch.multiprocessing.get_context("spawn")
    pipes, workers = [], []
    stays = callable(signal.getsignal(signal.SIGTERM))  # rank 0 outlives SIGTERM: see _run_worker
    # Ctrl-C while a worker imported torch was its traceback: it starts deaf to it (SIG_IGN is inherited), then
    # hears it as rank 0 does (_run_worker). (signal() works in the main thread only.)
    hears = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
             and threading.current_thread() is threading.main_thread())
    if hears:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for rank in range(1, size):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_run_worker, args=(stays, hears, worker, rank, port, receiver), daemon=True)
        process.start()
        receiver.close()
        pipes.append(sender)
        workers.append(process)
    if hears:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return TensorParallel(0, size, port, rank_device(device, 0), pipes, workers, store)


def _run_worker(outlives_sigterm: bool, hears_ctrl_c: bool, worker, *args):
    """A worker outlives SIGTERM where rank 0 does: the server's engine process lets its requests finish first
    (engine_process.py), and a service manager's SIGTERM reaches every process of the service. It never outlives
    rank 0 (killed, or ended by os._exit, which stops no child): it would wait in the rendezvous for the group's
    timeout (NCCL's 10 minutes, gloo's 30)."""
    if outlives_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: None)
    if hears_ctrl_c:  # (past the imports: run_tp_worker ends quietly on it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
    tqdm.set_lock(threading.RLock())  # tqdm's own is a multiprocessing lock, which a worker rank 0 kills leaves behind
    worker(*args)


# ---- the model's communication ----------------------------------------------------------------
def parallelize(model: CausalLM, group: TensorParallel):
    """Add the communication to a model built from shard_config's shapes and filled with its shards
    (loader.py), in place: an all-reduce after each block half, vocabulary-parallel embedding and
    lm_head. The model's own code stays the single-GPU code."""
    for module in model.modules():  # the all-reduce would carry a split-K linear's two halves: twice the bytes
        if isinstance(module, Linear):
            module.split_k = False
    for layer in model.layers:
        for half in (layer.self_attn, layer.mlp):
            half.register_forward_hook(lambda _module, _args, partial_sum: group.all_reduce(partial_sum))
    model.embed = partial(_embed_vocab_block, model, group.rank * model.cfg.vocab_size, group)
    model.logits = partial(_gather_logits, model, group)


def _embed_vocab_block(model: CausalLM, first: int, group: TensorParallel, input_ids: torch.Tensor):
    local_ids = input_ids - first
    outside = (local_ids < 0) | (local_ids >= model.embed_tokens.shape[0])
    x = F.embedding(local_ids.masked_fill(outside, 0), model.embed_tokens)
    return group.all_reduce(x.masked_fill_(outside[:, None], 0))


def _gather_logits(model: CausalLM, group: TensorParallel, x: torch.Tensor):
    return group.all_gather_last_dim(CausalLM.logits(model, x))
