"""The reference attention backend: plain torch, one request at a time, easy to check by eye.

Every attention backend does the same two things in each layer:
1. store the new tokens' K/V into their pool slots (`out_cache_loc`);
2. for each request, let its new queries attend to all of its cached tokens, found through
   `req_to_token`, with a causal mask among the new tokens.
Extend (prefill) and decode are the same computation here: a request's queries sit at positions
prefix_len .. seq_len-1, and query i sees keys 0 .. prefix_len + i. Decode is prefix_len = seq_len-1.

This backend loops over requests on the host and computes in float32, so it is slow, runs on CPU
and GPU alike, and is the truth the Triton kernels (triton_attn.py) are tested against. Grouped
query attention (several query heads sharing one KV head) and MLA (one latent KV head shared by
all heads, key and value of different widths) need nothing special: KV heads are repeated.
"""

from itertools import accumulate

import torch

from nano.forward_batch import ForwardBatch
from nano.kv_cache import KVPool


class TorchAttnBackend:
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor):
        self.kv_pool, self.req_to_token = kv_pool, req_to_token

    def init_forward_metadata(self, batch: ForwardBatch):
        pass  # everything this backend needs is in the batch already

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float, v_proj=None) -> torch.Tensor:
        """q [T, H, k_dim], k [T, Hkv, k_dim], v [T, Hkv, v_dim] -> [T, H, v_dim]; with v_proj
        [H, P, v_dim] (MLA's W_UV), each head's output times its own matrix -> [T, H, P]."""
        self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        group = q.shape[1] // k_cache.shape[1]  # query heads per KV head
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
        rows = batch.req_pool_indices.tolist()
        extend_lens = [1] * len(rows) if batch.is_decode else batch.extend_lens_cpu  # each request's new tokens
        starts = accumulate(extend_lens, initial=0)  # where they begin in q
        for row, seq_len, n, start in zip(rows, batch.seq_lens_cpu, extend_lens, starts):
            slots = self.req_to_token[row, :seq_len].long()
            keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [S, H, k_dim]
            values = v_cache[slots].float().repeat_interleave(group, dim=1)  # [S, H, v_dim]
            queries = q[start : start + n].float()  # [n, H, k_dim]
            scores = torch.einsum("nhd,shd->hns", queries, keys) * scale  # [H, n, S]
            # query i (position seq_len - n + i) may see keys at positions <= its own
            query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            key_pos = torch.arange(seq_len, device=q.device)
            scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start : start + n] = torch.einsum("hns,shd->nhd", probs, values).to(q.dtype)
        return out if v_proj is None else project_values(out, v_proj)


def project_values(out: torch.Tensor, v_proj: torch.Tensor) -> torch.Tensor:
    """out [T, H, v_dim], v_proj [H, P, v_dim] -> [T, H, P]: head by head, one batched matmul."""
    projected = out.new_empty(out.shape[0], out.shape[1], v_proj.shape[1])
    torch.bmm(out.transpose(0, 1), v_proj.mT, out=projected.transpose(0, 1))  # straight into the [T, H, P] rows
    return projected
