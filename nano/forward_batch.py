"""ForwardBatch: everything one forward pass needs to know about the requests in it.

An engine runs many requests in one pass by packing their tokens into one flat list of T tokens
(no padding between requests). Two kinds of pass exist:
- extend (prefill): each request brings `extend_len` new tokens after `prefix_len` tokens that are
  already in the KV cache (0 unless the prefix cache or earlier chunks hold some);
- decode: each of the B requests brings exactly one new token, so T == B.
Each token carries its position (for rope) and the pool slot its K/V goes to (`out_cache_loc`);
each request carries its row in `req_to_token` and its length after this pass (`seq_lens`).

Tensors live on the device. The `*_cpu` lists are host copies for code that needs Python ints
(the torch reference attention, the extend kernel's grid); the Triton decode path never reads
them, so a CUDA graph can replay it.

This module also holds the contract between a decode pass and the CUDA-graph runner
(cuda_graph_runner.py), which records a decode pass once per batch bucket and replays it:
- `AttentionBackend`: what the model asks of attention, and what a graph needs from it;
- `batch_bucket`: the sizes graphs are captured at. A real batch of B requests is padded to
  `batch_bucket(B)` rows before replay. Every choice nano makes from the batch size (how many
  splits decode attention uses, which MoE form runs) is made from the bucket, so a padded batch
  chooses as the same batch run eagerly; only cuBLAS picks its kernels by row count, and those may
  round differently (BENCHMARKS.md, "Tensor parallelism").
"""

from dataclasses import dataclass
from typing import Protocol

import torch


def batch_bucket(bs: int) -> int:
    """bs rounded up to a power of two up to 8, then to a multiple of 8: 1, 2, 4, 8, 16, 24, ...
    Rounding a bucket again changes nothing, which is what keeps graph and eager runs choosing alike."""
    return 1 << (bs - 1).bit_length() if bs <= 8 else -(-bs // 8) * 8


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a tensor on `device`, without making the host wait for the GPU. torch copies
    from ordinary (pageable) host memory only after all work queued on the GPU is done, so the
    host could not build the next decode pass while the GPU runs this one (engine.py, overlap);
    a copy from pinned (page-locked) memory is queued behind that work instead, like a kernel."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int32: pool slot of each new token
    req_pool_indices: torch.Tensor  # [B] int32: row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int32: tokens of each request after this pass
    seq_lens_cpu: list[int] | None = None  # None in a CUDA graph's batch, whose lengths the host never reads
    # extend only
    prefix_lens: torch.Tensor | None = None  # [B] int32
    extend_lens: torch.Tensor | None = None  # [B] int32
    extend_start_loc: torch.Tensor | None = None  # [B] int32: first of each request's tokens in [T]
    extend_lens_cpu: list[int] | None = None
    # the token rows whose logits the pass returns: None, each request's last (all sampling needs);
    # prompt logprobs need every row of the requests that ask
    logit_rows: torch.Tensor | None = None  # [R] int64

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]  # a shape, known on the host: no sync

    @classmethod
    def extend(cls, input_ids: list[int], prefix_lens: list[int], extend_lens: list[int],
               req_pool_indices: list[int], out_cache_loc: torch.Tensor, device) -> "ForwardBatch":
        """input_ids: the new tokens of all requests, concatenated."""
        starts, positions = [], []
        for prefix, n in zip(prefix_lens, extend_lens):
            starts.append(len(positions))
            positions.extend(range(prefix, prefix + n))
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]

        def dev(x, dtype=torch.int32):
            return to_device(x, dtype, device)

        return cls(
            is_decode=False,
            input_ids=dev(input_ids, torch.int64),
            positions=dev(positions, torch.int64),
            out_cache_loc=out_cache_loc,
            req_pool_indices=dev(req_pool_indices),
            seq_lens=dev(seq_lens),
            seq_lens_cpu=seq_lens,
            prefix_lens=dev(prefix_lens),
            extend_lens=dev(extend_lens),
            extend_start_loc=dev(starts),
            extend_lens_cpu=list(extend_lens),
        )

    @classmethod
    def decode(cls, input_ids: list[int] | torch.Tensor, seq_lens: list[int], req_pool_indices: list[int],
               out_cache_loc: torch.Tensor, device) -> "ForwardBatch":
        """input_ids may already be on the device (the tokens the pass before sampled there);
        seq_lens include the new token, whose position is seq_len - 1."""
        return cls(
            is_decode=True,
            input_ids=input_ids if isinstance(input_ids, torch.Tensor) else to_device(input_ids, torch.int64, device),
            positions=to_device([n - 1 for n in seq_lens], torch.int64, device),
            out_cache_loc=out_cache_loc,
            req_pool_indices=to_device(req_pool_indices, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(Protocol):
    """Attention over the KV pool, as the model uses it (torch_attn.py, triton_attn.py).

    For CUDA graphs a backend promises: `init_forward_metadata` of a decode batch works on the
    device only (no host reads; its temporaries come from the graph's memory pool), so the graph
    runner captures it together with the model; every buffer it writes is allocated once, at the
    largest batch size; and any choice it makes from the batch size goes through `batch_bucket`."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Per-pass state shared by every layer (e.g. decode split counts). Called once per pass."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layer_id: int,
                batch: ForwardBatch, scale: float, v_proj: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new tokens' k/v in the pool, attend -> [T, H, v_dim]; with v_proj [H, P, v_dim],
        multiply each head's output by its own matrix -> [T, H, P] (MLA's W_UV, deepseek.py)."""
