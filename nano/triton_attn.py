"""The Triton attention backend: extend (prefill) attention and split-KV ("flash decoding") decode.

Attention in an inference engine is not the square, fixed-length attention of training. Each layer
sees a batch of requests of different lengths whose keys and values sit scattered in a pool of
token slots (kv_cache.py); a request finds its own through `req_to_token[row, position]`. Two
kinds of pass need two kinds of kernel:

- Extend (prefill): a request brings `extend_len` new tokens after `prefix_len` tokens already
  cached. Its queries are many, so the work is matrix multiplication: one program takes a block
  of one request's queries for one head and streams keys past them in tiles, first the cached
  prefix (every new token may see all of it, no mask), then the new tokens (causal mask). An
  "online softmax" keeps a running max `m`, running sum `l` and unnormalised output `acc` per
  query, rescaling them when the max grows, so the scores never need to exist all at once.

- Decode: each request brings one query per head and reads its whole history. That is pure memory
  traffic (every cached byte read once, two flops per byte), so the only goal is to keep every
  streaming multiprocessor busy pulling bytes. A batch of 1 request with 8 KV heads gives only 8
  programs if each reads a whole request: far too few for a GPU with 132 multiprocessors. Flash
  decoding splits each request's tokens into `num_kv_splits` contiguous chunks, runs one program
  per chunk (stage 1), each writing a partial output and the log-sum-exp (LSE) of its scores, and
  merges the chunks in a second small kernel (stage 2): with M = max_s lse_s,
      out = sum_s e^(lse_s - M) o_s / sum_s e^(lse_s - M),
  which is exact, because a split's softmax weights times e^lse_s are its share of the full sum.
  A batch that fills the GPU unsplit (its split cap, below, is 1) skips stage 2: each program
  writes its request's output itself. Stage 1 serves all query heads that share a KV head in one
  program (grouped-query attention, and MLA where 16 heads share one 576-wide latent head): each
  KV tile is loaded once and used by a `tl.dot` of [heads, dim] x [dim, tokens], padded to 16
  rows since tensor cores need it.

Decode also runs inside a CUDA graph (cuda_graph_runner.py), which replays a fixed sequence of
kernel launches with fixed arguments. So the decode path never asks the host about tensor values:
the grid is (batch, KV heads, the batch size's split cap), programs whose split is empty exit at
once, the split counts are computed on the device from `seq_lens`, and the buffers for partial
results are allocated once at the largest batch size and sliced. The cap matters: a grid of 64
splits for each of 160 requests launches 80,000 programs, nearly all empty, and scheduling them
cost more than the attention itself. Nor can the tile follow the lengths: a batch that fills the
GPU launches stage 1 twice (heads up to 128 wide), and a request's length picks the launch that serves it.

Before either, one small kernel copies the new tokens' K/V into their pool slots (`out_cache_loc`).

Keys may be wider than values and carry a separate rope part (DeepSeek: 192 = 128 + 64 keys with
128-wide values; MLA: 576 = 512 + 64 with values = the first 512 channels of the same row). The
kernels split the score dot into a power-of-two main part and the rest, so no lane is wasted on
padding 192 to 256 or 576 to 1024. Softmax runs in base 2 (`tl.exp2` is one instruction):
log2(e) is folded into the scale, and the stored LSE is in base 2 too.

Every `tl.dot` takes its input precision from the dtype (`dot_precision`, triton_ops.py): full
float32 for float32 inputs, where Triton's default (TF32) would make the two backends pick
different greedy tokens with `--dtype float32`; tensor cores for 16-bit inputs.
"""

import torch
import triton
import triton.language as tl

from nano.forward_batch import ForwardBatch, batch_bucket
from nano.kv_cache import KVPool
from nano.torch_attn import project_values
from nano.triton_ops import PDL, dot_precision, launch_dependents, wait_for_inputs

# The most chunks one request's tokens are split into, and so the size of the partial-result
# buffers: max_batch_size * heads * 64 * v_dim floats (Llama-3-8B at 160 requests: 168 MB; MLA:
# 336 MB). One long request needs many splits to keep every multiprocessor reading.
MAX_KV_SPLITS = 64
# One program of decode stage 1 serves all query heads of a KV head, padded to one 16-row tile. And
# tl.dot's tiles are 16 wide at least: a narrower head fails to compile on a GPU. (engine.py checks both.)
MAX_GROUP, MIN_HEAD_WIDTH = 16, 16
LOG2E = 1.4426950408889634
# A per-head value projection (MLA's W_UV) rides in the merge at batch 1: a merge program loads its
# PROJECTION_ROWS rows of the head's matrix before the wait, one launch for the merge and a batched
# matmul that cannot start early. From 2 requests the matmul pays (an H200: BENCHMARKS.md).
PROJECT_IN_MERGE_MAX_BATCH, PROJECTION_ROWS = 1, 16
# In a batch that fills the GPU, requests of up to SHORT_CONTEXT tokens get SHORT_TILE (tokens, warps, stages):
# many such programs (13 KB of shared memory each) share a multiprocessor, where 128-token tiles fit three.
SHORT_CONTEXT, SHORT_TILE = 256, (16, 2, 3)


class TritonAttnBackend:
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, max_batch_size: int, num_heads: int):
        self.kv_pool, self.req_to_token, self.num_heads = kv_pool, req_to_token, num_heads
        (_, self.num_kv_heads, self.k_dim), self.v_dim = kv_pool.k_buffers[0].shape, kv_pool.v_buffers[0].shape[-1]
        self.group = num_heads // self.num_kv_heads  # query heads per KV head
        assert self.group * self.num_kv_heads == num_heads and self.group <= MAX_GROUP

        device = req_to_token.device  # the interpreter behaves as an H200, so CPU tests split as the GPU does
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        # A split reads at most one tile of tokens and more than half of one: a sliver costs more
        # in writing and merging its partial output than it gains.
        self.min_split_tokens, _, _, programs_per_sm = _decode_config(self.k_dim)
        self.target_programs = programs_per_sm * num_sms
        # Decode buffers, allocated once at their largest and sliced per batch (CUDA-graph safe).
        self.num_kv_splits = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.partial_out = torch.empty(max_batch_size, num_heads, MAX_KV_SPLITS, self.v_dim, **f32)
        self.partial_lse = torch.empty(max_batch_size, num_heads, MAX_KV_SPLITS, **f32)
        self.max_extend_len = 0  # host int: the extend grid needs it

    def init_forward_metadata(self, batch: ForwardBatch):
        """Decode: split counts per request, on the device. Extend: the longest extend, on the host."""
        if not batch.is_decode:
            self.max_extend_len = max(batch.extend_lens_cpu)
            return
        # Within the cap, a request gets one split per min_split_tokens tokens, rounded up: short
        # requests are not chopped into slivers.
        wanted = torch.div(batch.seq_lens + (self.min_split_tokens - 1), self.min_split_tokens, rounding_mode="floor")
        torch.clamp(wanted, 1, self.split_cap(len(wanted)), out=self.num_kv_splits[:len(wanted)])

    def split_cap(self, bs: int) -> int:
        """The most splits a request of a batch of bs gets: splits are worth it while the batch alone
        does not fill the GPU. It depends only on the batch's bucket (forward_batch.py), so a
        captured graph stays valid, a padded batch splits exactly like the same batch run eagerly,
        and the decode grid, sized by the cap, launches no programs that could never have work."""
        return max(1, min(MAX_KV_SPLITS, self.target_programs // (batch_bucket(bs) * self.num_kv_heads)))

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float, v_proj=None) -> torch.Tensor:
        """q [T, H, k_dim], k [T, Hkv, k_dim], v [T, Hkv, v_dim] -> [T, H, v_dim]; with v_proj
        [H, P, v_dim], each head's output times its own matrix -> [T, H, P] (in the merge, or after)."""
        k_cache, v_cache = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        num_tokens = q.shape[0]  # in decode, the batch size
        in_merge = (v_proj is not None and batch.is_decode and self.split_cap(num_tokens) > 1
                    and batch_bucket(num_tokens) <= PROJECT_IN_MERGE_MAX_BATCH)
        out = q.new_empty(num_tokens, self.num_heads, v_proj.shape[1] if in_merge else self.v_dim)
        for t in (q, k, v, k_cache, v_cache, out, *([v_proj] if in_merge else [])):
            assert t.stride(-1) == 1, "kernels assume the channel dimension is contiguous"
        self._store_kv(k, v, k_cache, v_cache, batch.out_cache_loc)
        if batch.is_decode:
            self._decode(q, k_cache, v_cache, out, batch, scale, v_proj if in_merge else None)
        else:
            self._extend(q, k, v, k_cache, v_cache, out, batch, scale)
        return out if v_proj is None or in_merge else project_values(out, v_proj)

    def _store_kv(self, k, v, k_cache, v_cache, out_cache_loc):
        """The new tokens' K (and V) into their pool slots, in one launch (torch's indexed copies: four)."""
        _store_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, out_cache_loc,
            *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2],
            # MLA: the cached value is part of the key row, stored with it
            NUM_KV_HEADS=k.shape[1], K_DIM=self.k_dim, V_DIM=self.v_dim, HAS_V=not self.kv_pool.use_mla,
            BLOCK_H=triton.next_power_of_2(k.shape[1]), BLOCK_K=triton.next_power_of_2(self.k_dim),
            BLOCK_V=triton.next_power_of_2(self.v_dim), launch_pdl=PDL,
        )

    def _extend(self, q, k, v, k_cache, v_cache, out, batch: ForwardBatch, scale: float):
        block_m, block_n, num_warps, num_stages = _extend_config(self.k_dim)
        _extend_kernel[(batch.seq_lens.shape[0], self.num_heads, triton.cdiv(self.max_extend_len, block_m))](
            q, k, v, k_cache, v_cache, out,
            self.req_to_token, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.extend_start_loc,
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2],
            *out.stride()[:2], self.req_to_token.stride(0), scale * LOG2E,
            GROUP=self.group, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
            **_head_dim_blocks(self.k_dim, self.v_dim),
            num_warps=num_warps, num_stages=num_stages, launch_pdl=PDL,
        )

    def _decode(self, q, k_cache, v_cache, out, batch: ForwardBatch, scale: float, v_proj=None):
        bs, max_splits = q.shape[0], self.split_cap(q.shape[0])
        dims = _head_dim_blocks(self.k_dim, self.v_dim)
        one_split = max_splits == 1
        short_apart = one_split and self.k_dim <= 128  # short requests in a launch of their own
        launches = [(_decode_config(self.k_dim)[:3], SHORT_CONTEXT if short_apart else 0, 2**31 - 1),
                    *([(SHORT_TILE, 0, SHORT_CONTEXT)] if short_apart else [])]
        for (block_n, num_warps, num_stages), longer_than, up_to in launches:  # serving lengths (longer_than, up_to]
            _decode_split_kernel[(bs, self.num_kv_heads, max_splits)](
                q, k_cache, v_cache, self.partial_out, self.partial_lse, out,
                self.req_to_token, batch.req_pool_indices, batch.seq_lens, self.num_kv_splits, longer_than, up_to,
                *q.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2], *self.partial_out.stride()[:3],
                *self.partial_lse.stride()[:2], *out.stride()[:2], self.req_to_token.stride(0), scale * LOG2E,
                GROUP=self.group, BLOCK_H=max(16, triton.next_power_of_2(self.group)), BLOCK_N=block_n,
                DOT_PRECISION=dot_precision(q.dtype), ONE_SPLIT=one_split, **dims,
                num_warps=num_warps, num_stages=num_stages, launch_pdl=PDL,
            )
        if one_split:
            return
        merge_block = triton.next_power_of_2(max_splits)  # the merge loads all splits as one block
        proj_rows = 0 if v_proj is None else v_proj.shape[1]
        _decode_merge_kernel[(bs, self.num_heads, max(1, triton.cdiv(proj_rows, PROJECTION_ROWS)))](
            self.partial_out, self.partial_lse, batch.seq_lens, self.num_kv_splits, out,
            out if v_proj is None else v_proj, *self.partial_out.stride()[:3], *self.partial_lse.stride()[:2],
            out.stride(0), out.stride(1), *(v_proj.stride()[:2] if proj_rows else (0, 0)), proj_rows, V_DIM=self.v_dim,
            BLOCK_DV=dims["BLOCK_DV"], MAX_SPLITS=merge_block, PROJECT=proj_rows > 0, BLOCK_P=PROJECTION_ROWS,
            # enough warps that the [MAX_SPLITS, BLOCK_DV] fp32 tile is at most 64 registers a thread
            num_warps=min(16, max(4, merge_block * dims["BLOCK_DV"] // (32 * 64))), launch_pdl=PDL,
        )


def _head_dim_blocks(k_dim: int, v_dim: int) -> dict:
    """Key width = a power-of-two main part (128 of 192, 512 of 576) + a rope rest, padded to 16+."""
    k_main = 1 << (k_dim.bit_length() - 1)
    k_rope = k_dim - k_main
    return dict(K_MAIN=k_main, K_ROPE=k_rope, BLOCK_DR=max(16, triton.next_power_of_2(k_rope)) if k_rope else 0,
                V_DIM=v_dim, BLOCK_DV=triton.next_power_of_2(v_dim))


def _extend_config(k_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the extend kernel: usual flash-attention tiles
    for Hopper, checked on an H200 but not tuned there (prefill is a small share of a run)."""
    if k_dim <= 128:
        return 128, 64, 4 if k_dim <= 64 else 8, 3
    if k_dim <= 256:
        return 64, 64, 8, 2
    return 32, 32, 8, 2  # MLA's 576-wide keys: a [32, 512] fp32 accumulator is already large


def _decode_config(k_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, programs per multiprocessor) for decode stage 1: the
    fastest of those tried on an H200 (scripts/bench_attention.py, scripts/tune_mla_decode.py,
    scripts/tune_gqa_decode.py)."""
    # Shared memory (about 227 KB a multiprocessor) holds the pipelined K and V tiles: as Triton
    # compiles them, 128 tokens of 128-wide heads take 74 KB a program, and MLA's 32 tokens of
    # 576-wide rows 89 KB (16 or 64 tokens measured slower); 192-wide keys run 64-token tiles.
    # The last number sizes the split cap (`split_cap`): the batch's programs should fill the GPU.
    # A program streams its tokens tile after dependent tile (slot, then K, then V), so 128-wide
    # heads aim at 8 programs per multiprocessor: several waves, where a partial last wave costs
    # little. MLA's programs are fewer and longer; two run on a multiprocessor at a time, and the
    # split count fills exactly one wave of them: a partial second wave would take as long as a
    # full one (BENCHMARKS.md has the measurements).
    if k_dim <= 128:
        return 128, 4, 3, 8
    if k_dim <= 256:
        return 64, 4, 3, 8
    return 32, 4, 3, 2


# ---- storing new K/V ----
@triton.jit
def _store_kv_kernel(
    k, v, k_cache, v_cache, out_cache_loc,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr, HAS_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid (tokens,): copy one new token's K [Hkv, K_DIM] (and V) into its slot."""
    launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_cache_loc + t).to(tl.int64)  # the batch's own metadata: readable before the wait
    wait_for_inputs()
    h = tl.arange(0, BLOCK_H)[:, None]
    dk = tl.arange(0, BLOCK_K)[None, :]
    k_mask = (h < NUM_KV_HEADS) & (dk < K_DIM)
    k_row = tl.load(k + t * stride_kt + h * stride_kh + dk, mask=k_mask)
    tl.store(k_cache + slot * stride_kcs + h * stride_kch + dk, k_row, mask=k_mask)
    if HAS_V:
        dv = tl.arange(0, BLOCK_V)[None, :]
        v_mask = (h < NUM_KV_HEADS) & (dv < V_DIM)
        v_row = tl.load(v + t * stride_vt + h * stride_vh + dv, mask=v_mask)
        tl.store(v_cache + slot * stride_vcs + h * stride_vch + dv, v_row, mask=v_mask)


# ---- shared pieces: loading queries, online softmax over a tile / over cached positions, splits ----
@triton.jit
def _load_queries(q_rows, row_mask, K_MAIN: tl.constexpr, K_ROPE: tl.constexpr, BLOCK_DR: tl.constexpr):
    """Queries at pointers q_rows [R] -> main part [R, K_MAIN] and rope part [R, BLOCK_DR]."""
    d = tl.arange(0, K_MAIN)
    q = tl.load(q_rows[:, None] + d[None, :], mask=row_mask[:, None], other=0.0)
    q_rope = q  # unused when there is no rope part
    if BLOCK_DR > 0:
        dr = tl.arange(0, BLOCK_DR)
        q_rope = tl.load(q_rows[:, None] + K_MAIN + dr[None, :], mask=row_mask[:, None] & (dr[None, :] < K_ROPE),
                         other=0.0)
    return q, q_rope


@triton.jit
def _attend_tile(acc, m, l, q, q_rope, k_base, v_base, k_rows, v_rows, key_mask, score_mask, scale_log2,
                 K_MAIN: tl.constexpr, K_ROPE: tl.constexpr, BLOCK_DR: tl.constexpr,
                 V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One step of online softmax: fold the keys/values at offsets k_rows/v_rows [N] into the
    running output acc [R, BLOCK_DV], max m [R] and sum l [R] of R queries (base-2 logits)."""
    # Masked lanes load zeros, never whatever an out-of-range slot holds: a NaN there would
    # survive multiplication by a zero probability.
    d = tl.arange(0, K_MAIN)
    k = tl.load(k_base + k_rows[None, :] + d[:, None], mask=key_mask[None, :], other=0.0)  # [K_MAIN, N]
    scores = tl.dot(q, k, input_precision=DOT_PRECISION)  # [R, N], fp32
    if BLOCK_DR > 0:
        dr = tl.arange(0, BLOCK_DR)
        k_rope = tl.load(k_base + k_rows[None, :] + K_MAIN + dr[:, None],
                         mask=key_mask[None, :] & (dr[:, None] < K_ROPE), other=0.0)  # [BLOCK_DR, N]
        scores = tl.dot(q_rope, k_rope, scores, input_precision=DOT_PRECISION)
    scores = tl.where(score_mask, scores * scale_log2, float("-inf"))

    # Every caller's first tile has a visible key for every row, so m is finite from then on.
    m_new = tl.maximum(m, tl.max(scores, 1))
    rescale = tl.exp2(m - m_new)  # shrinks what was summed under the old, smaller max
    p = tl.exp2(scores - m_new[:, None])
    # MLA's value is the first V_DIM channels of the key row just loaded: loading it again hits
    # the cache, and measured faster on an H200 than reusing the key tile through tl.trans.
    dv = tl.arange(0, BLOCK_DV)
    v = tl.load(v_base + v_rows[:, None] + dv[None, :], mask=key_mask[:, None] & (dv[None, :] < V_DIM),
                other=0.0)  # [N, BLOCK_DV]
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l = l * rescale + tl.sum(p, 1)
    return acc, m_new, l


@triton.jit
def _attend_cached(acc, m, l, q, q_rope, token_slots, start, end, k_base, v_base, stride_ks, stride_vs, scale_log2,
                   BLOCK_N: tl.constexpr, K_MAIN: tl.constexpr, K_ROPE: tl.constexpr, BLOCK_DR: tl.constexpr,
                   V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over a request's cached positions [start, end), all visible to every query:
    token_slots points at the request's row of req_to_token, which names each position's slot."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        visible = pos < end
        slots = tl.load(token_slots + pos, mask=visible, other=0).to(tl.int64)
        acc, m, l = _attend_tile(acc, m, l, q, q_rope, k_base, v_base, slots * stride_ks, slots * stride_vs,
                                 visible, visible[None, :], scale_log2, K_MAIN, K_ROPE, BLOCK_DR, V_DIM, BLOCK_DV,
                                 DOT_PRECISION)
    return acc, m, l


@triton.jit
def _split_range(seq_len, num_splits, split):
    """Token range [start, end) of split `split` of a request; empty when start >= end."""
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len
    return start, tl.minimum(start + split_len, seq_len)


# ---- extend ----
@triton.jit
def _extend_kernel(
    q, k_new, v_new, k_cache, v_cache, out,
    req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_ot, stride_oh, stride_req,
    scale_log2,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_MAIN: tl.constexpr, K_ROPE: tl.constexpr, BLOCK_DR: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (batch, heads, query blocks): BLOCK_M new tokens of one request attend for one head."""
    launch_dependents()
    wait_for_inputs()
    b, h, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    extend_len = tl.load(extend_lens + b)
    first = m_block * BLOCK_M
    if first < extend_len:  # the grid is sized for the longest request; shorter ones stop early
        prefix_len = tl.load(prefix_lens + b)
        token_start = tl.load(extend_start_loc + b)
        kv_head = h // GROUP
        m_idx = first + tl.arange(0, BLOCK_M)  # index of each query among the request's new tokens
        q_rows = q + (token_start + m_idx).to(tl.int64) * stride_qt + h * stride_qh
        query, query_rope = _load_queries(q_rows, m_idx < extend_len, K_MAIN, K_ROPE, BLOCK_DR)

        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)

        # Phase 1: the cached prefix, gathered slot by slot; every new token sees all of it.
        token_slots = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_req
        acc, m, l = _attend_cached(
            acc, m, l, query, query_rope, token_slots, 0, prefix_len, k_cache + kv_head * stride_kch,
            v_cache + kv_head * stride_vch, stride_kcs, stride_vcs, scale_log2,
            BLOCK_N, K_MAIN, K_ROPE, BLOCK_DR, V_DIM, BLOCK_DV, DOT_PRECISION,
        )

        # Phase 2: the new tokens themselves, contiguous in k_new/v_new; query i sees keys 0..i,
        # so keys past this block's last query are never loaded.
        for n0 in range(0, tl.minimum(first + BLOCK_M, extend_len), BLOCK_N):
            n_idx = n0 + tl.arange(0, BLOCK_N)
            present = n_idx < extend_len
            rows = (token_start + n_idx).to(tl.int64)
            acc, m, l = _attend_tile(
                acc, m, l, query, query_rope, k_new + kv_head * stride_knh, v_new + kv_head * stride_vnh,
                rows * stride_knt, rows * stride_vnt, present, present[None, :] & (n_idx[None, :] <= m_idx[:, None]),
                scale_log2, K_MAIN, K_ROPE, BLOCK_DR, V_DIM, BLOCK_DV, DOT_PRECISION,
            )

        dv = tl.arange(0, BLOCK_DV)
        out_ptrs = out + (token_start + m_idx).to(tl.int64)[:, None] * stride_ot + h * stride_oh + dv[None, :]
        tl.store(out_ptrs, (acc / l[:, None]).to(out.dtype.element_ty),
                 mask=(m_idx < extend_len)[:, None] & (dv[None, :] < V_DIM))


# ---- decode, stage 1: one program per (request, KV head, split) serves the KV head's query heads ----
@triton.jit
def _decode_split_kernel(
    q, k_cache, v_cache, partial_out, partial_lse, out,
    req_to_token, req_pool_indices, seq_lens, num_kv_splits, longer_than, up_to,
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, stride_req,
    scale_log2,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    K_MAIN: tl.constexpr, K_ROPE: tl.constexpr, BLOCK_DR: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ONE_SPLIT: tl.constexpr,
):
    launch_dependents()
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    start, end = _split_range(seq_len, tl.load(num_kv_splits + b), split)
    token_slots = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_req
    wait_for_inputs()
    # splits past this request's count are empty, and so is a request another launch serves
    if (start < end) & (seq_len > longer_than) & (seq_len <= up_to):
        h_idx = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + h_idx  # [BLOCK_H]; rows past GROUP only pad the dot
        real_head = h_idx < GROUP
        query, query_rope = _load_queries(q + b * stride_qb + heads * stride_qh, real_head, K_MAIN, K_ROPE, BLOCK_DR)

        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc, m, l = _attend_cached(
            acc, m, l, query, query_rope, token_slots, start, end, k_cache + kv_head * stride_kch,
            v_cache + kv_head * stride_vch, stride_kcs, stride_vcs, scale_log2,
            BLOCK_N, K_MAIN, K_ROPE, BLOCK_DR, V_DIM, BLOCK_DV, DOT_PRECISION,
        )

        dv = tl.arange(0, BLOCK_DV)
        out_mask = real_head[:, None] & (dv[None, :] < V_DIM)
        if ONE_SPLIT:  # the whole request: the output itself
            out_ptrs = out + b * stride_ob + heads[:, None] * stride_oh + dv[None, :]
            tl.store(out_ptrs, (acc / l[:, None]).to(out.dtype.element_ty), mask=out_mask)
        else:
            out_ptrs = partial_out + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + dv[None, :]
            tl.store(out_ptrs, acc / l[:, None], mask=out_mask)
            tl.store(partial_lse + b * stride_plb + heads * stride_plh + split, m + tl.log2(l), mask=real_head)


# ---- decode, stage 2: one program per (request, query head) merges the splits (and projects them) ----
@triton.jit
def _decode_merge_kernel(
    partial_out, partial_lse, seq_lens, num_kv_splits, out, v_proj,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, stride_vph, stride_vpr,
    proj_rows, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, MAX_SPLITS: tl.constexpr, PROJECT: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid (batch, heads, blocks of projection rows, or 1): merge the request's splits for one head,
    and with PROJECT store its block of the projected row instead."""
    launch_dependents()
    b, h = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, MAX_SPLITS)
    start, end = _split_range(tl.load(seq_lens + b), tl.load(num_kv_splits + b), splits)
    written = start < end  # only these splits' partial results exist
    dv = tl.arange(0, BLOCK_DV)
    rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    if PROJECT:  # this program's rows of the head's projection: a weight, so before the wait
        proj = tl.load(v_proj + h * stride_vph + rows[:, None] * stride_vpr + dv[None, :],
                       mask=(rows < proj_rows)[:, None] & (dv < V_DIM)[None, :], other=0.0)  # [BLOCK_P, BLOCK_DV]
    wait_for_inputs()
    lse = tl.load(partial_lse + b * stride_plb + h * stride_plh + splits, mask=written, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # [MAX_SPLITS], 0 for unwritten splits
    partial = tl.load(partial_out + b * stride_pob + h * stride_poh + splits[:, None] * stride_pos + dv[None, :],
                      mask=written[:, None] & (dv[None, :] < V_DIM), other=0.0)  # [MAX_SPLITS, BLOCK_DV]
    merged = (tl.sum(weight[:, None] * partial, 0) / tl.sum(weight, 0)).to(out.dtype.element_ty)
    if PROJECT:  # the merged row as the unfused path stores it, times each row, in float32
        projected = tl.sum(proj.to(tl.float32) * merged.to(tl.float32)[None, :], 1)
        tl.store(out + b * stride_ob + h * stride_oh + rows, projected.to(out.dtype.element_ty), mask=rows < proj_rows)
    else:
        tl.store(out + b * stride_ob + h * stride_oh + dv, merged, mask=dv < V_DIM)
