"""The routed experts of a mixture of experts, fused: a mat-vec kernel for small decode batches and
a grouped matmul for everything larger.

A MoE layer routes each of T tokens to k of E experts (DeepSeek-V2-Lite: 6 of 64), so its work is
T*k (token, expert) pairs, each a product `w[e] @ x_row`. Two things stand in the way in plain
torch:
- the expert ids come from the router on the device. Asking the host which experts were chosen
  costs a sync (and breaks CUDA graphs), so torch must either copy the chosen weights out of the
  stack by those ids (`w13[ids]`: the copy reads and writes them, then the matmul reads them
  again, about 3x the bytes) or run every expert on every token (E/k times the bytes at small
  batches, E/k times the flops always);
- one pair's product is too small for a matmul kernel to fill the GPU on its own.
A Triton kernel reads the ids itself and points into the stacked weights, so nothing is copied
and the host never looks.

Small decode batches: `expert_matvec`. A handful of tokens give a handful of pairs, each a
matrix of a few megabytes times a single vector, two flops for every two bytes of bf16 weight. No
matrix unit helps there; the time is the time to read the chosen experts' weights, and the goal
is to read each of them once, in place, at the memory's full bandwidth (about 4 TB/s on an H200).
The grid is (T*k pairs, N / BLOCK_N). Program (p, n) computes BLOCK_N outputs of pair p: it walks
along K in BLOCK_K steps, loads a [BLOCK_N, BLOCK_K] tile of its expert's weight rows and the
matching chunk of the input row, multiplies them element by element and adds into a float32
tile, which it sums along K once at the end (a GEMV: `tl.dot` wants at least 16 rows of input,
and decode has one per pair). The pair is the grid's first, fastest-varying axis, so the programs
running side by side are all the pairs at the same few row blocks: pairs that chose the same
expert read the same tile at about the same time, and some of the repeats hit in L2. Only some:
past about as many pairs as experts, the grouped matmul below is cheaper. In the down projection
each program also multiplies its outputs by the pair's routing weight, so a token's MoE output is
the plain sum of its k rows: no separate kernels to cast the weights and weigh the rows.

Sizing for bf16 (hidden 2048, expert width 1408): 8 bf16 values are one 16-byte
load, so a warp covers BLOCK_K = 256 columns of a row; BLOCK_N = 32 rows over 4 warps give each
thread eight such loads (128 bytes) per step, all issued before any is used, and a float32 tile
of 64 registers. At batch 1 the up/gate product (N = 2816) runs 6 * 88 = 528 programs and the
down product (N = 2048) 384, a few per multiprocessor, so all of an H200's 132 keep tens of
kilobytes in flight: what streaming at full bandwidth takes (BENCHMARKS.md has the timings).

Everything larger (decode batches past E/k tokens, prefill): `fused_moe_matmul`, a grouped matmul
in the style of vLLM's and SGLang's fused_moe. With several pairs per expert the work is matrix
multiplication again, expert e's weights times the rows of its pairs, so:
1. `align_pairs_by_expert` sorts the pair ids by expert, on the device, and lays them out in
   blocks of BLOCK_M: each block holds pairs of one expert, and an expert's last block is padded
   with a sentinel id (T*k). It also names each block's expert (-1 for blocks left unused).
2. One launch, grid (blocks, N / BLOCK_N): program (b, n) gathers its block's BLOCK_M input rows
   (row = pair // k when the input has one row per token, as the up/gate projection's does;
   row = pair when it has one per pair, as the down projection's), multiplies them by its
   expert's [K, BLOCK_N] weight tile with `tl.dot` (tensor cores), accumulating in float32, and
   scatters the result to its pairs' rows of out [T*k, N]. The down projection also multiplies
   each row by the pair's routing weight, so a token's output is the plain sum of its k rows.
Experts no pair chose are never read; the others are read once per block of their pairs, and the
flops are the pairs' own plus the padding's. The layout's size depends on the routing, but it
has a bound: an expert with pairs pads at most BLOCK_M - 1 rows, and at most min(E, T*k)
experts have pairs. Buffers and grid take that bound, and unused blocks exit at once.

Block sizes (`fused_moe_config`): an expert's weights are read once per block of its pairs, and
padding rows are wasted work, so BLOCK_M follows an expert's average share of the pairs, T*k / E,
rounded up to a power of two between 16 (the smallest `tl.dot` tile) and 64. For V2-Lite that is
16 for every decode batch up to 168 tokens (at 160, 15 pairs an expert): reading weights is all
that matters there. From 344 tokens on (prefill) blocks have 64 rows: the tensor cores set the pace.
BLOCK_N = 128 by BLOCK_K = 64 weight tiles (16 KB in bf16) keep a few tiles in flight per
program in shared memory, even in float32; a 64-row block takes 8 warps for its larger tile.

Shapes depend only on T, k, N and K, never on the ids, so a CUDA graph can capture both kernels
(and the pairs' alignment), at any batch size.
"""

import torch
import triton
import triton.language as tl

from nano.forward_batch import batch_bucket
from nano.triton_ops import dot_precision

MATVEC_BLOCK_N = 32  # expert_matvec's tiles (the module lesson says why)
MATVEC_BLOCK_K = 256
MATVEC_NUM_WARPS = 4


@triton.jit
def _expert_matvec_kernel(x_ptr, w_ptr, expert_ids_ptr, pair_weights_ptr, out_ptr, x_token_stride, x_slot_stride,
                          N, K, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)  # = token * TOP_K + slot
    token, slot = pair // TOP_K, pair % TOP_K
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    in_rows = rows < N
    w_tile = w_ptr + expert * N * K + rows[:, None] * K + cols[None, :]  # [BLOCK_N, BLOCK_K] pointers
    x_chunk = x_ptr + token.to(tl.int64) * x_token_stride + slot * x_slot_stride + cols  # [BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + cols < K
        x = tl.load(x_chunk + k0, mask=in_k, other=0.0).to(tl.float32)
        w = tl.load(w_tile + k0, mask=in_rows[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if WEIGHTED:
        out *= tl.load(pair_weights_ptr + pair)
    tl.store(out_ptr + pair.to(tl.int64) * N + rows, out.to(out_ptr.dtype.element_ty), mask=in_rows)


def expert_matvec(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor,
                  pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[t, j] = w[expert_ids[t, j]] @ x[t] (x [T, K]: one input row per token, used by all its
    experts, as in the up/gate projection) or @ x[t, j] (x [T, k, K]: one row per chosen expert,
    as in the down projection), times pair_weights[t, j] when given. w [E, N, K] contiguous,
    expert_ids [T, k] integer -> out [T, k, N], in x's dtype, accumulated in float32."""
    num_tokens, top_k = expert_ids.shape
    _, n, k_dim = w.shape
    if x.dim() == 2:
        x = x[:, None, :].expand(num_tokens, top_k, k_dim)  # stride 0 over the slots: nothing copied
    assert x.shape == (num_tokens, top_k, k_dim) and x.stride(-1) == 1 and x.dtype == w.dtype
    assert w.is_contiguous() and expert_ids.is_contiguous()
    assert pair_weights is None or (pair_weights.is_contiguous() and pair_weights.shape == expert_ids.shape)
    out = torch.empty((num_tokens, top_k, n), dtype=x.dtype, device=x.device)  # [T, k, N]
    grid = (num_tokens * top_k, triton.cdiv(n, MATVEC_BLOCK_N))
    _expert_matvec_kernel[grid](x, w, expert_ids, pair_weights, out, x.stride(0), x.stride(1), n, k_dim,
                                TOP_K=top_k, WEIGHTED=pair_weights is not None, BLOCK_N=MATVEC_BLOCK_N,
                                BLOCK_K=MATVEC_BLOCK_K, num_warps=MATVEC_NUM_WARPS)
    return out


def align_pairs_by_expert(expert_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [T, k] -> (sorted_pair_ids [max_blocks * block_m], block_expert [max_blocks]): the
    pair ids (token * k + slot) grouped by expert, each expert's run padded with T*k to whole blocks
    of block_m, then more padding to the bound; the expert of each block, -1 past the last used one.
    Plain torch on the device, with no host sync, in shapes that depend only on T and k."""
    pair_expert = expert_ids.flatten()  # [P], P = T*k pairs
    num_pairs = pair_expert.numel()
    order = pair_expert.argsort(stable=True)  # [P]: pair ids by expert, in pair order within one
    sorted_experts = pair_expert[order]
    experts = torch.arange(num_experts, device=expert_ids.device)
    first = torch.searchsorted(sorted_experts, experts)  # [E]: where each expert's pairs start in `order`
    count = torch.searchsorted(sorted_experts, experts, right=True) - first
    padded = (count + block_m - 1) // block_m * block_m  # [E]: rows of each expert's blocks
    padded_first = padded.cumsum(0) - padded  # [E]: first row of each expert's blocks
    rank = torch.arange(num_pairs, device=expert_ids.device) - first[sorted_experts]  # [P]: place in its expert's run
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pair_ids = pair_expert.new_full((max_blocks * block_m,), num_pairs)
    sorted_pair_ids[padded_first[sorted_experts] + rank] = order
    # A used block starts with a real pair (padding only ends a run), and the sentinel maps to -1.
    expert_or_none = torch.cat([pair_expert, pair_expert.new_full((1,), -1)])  # [P + 1]
    return sorted_pair_ids, expert_or_none[sorted_pair_ids[::block_m]]


def fused_moe_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tile sizes of fused_moe_matmul (the module lesson says why). Chosen from the batch's bucket
    (forward_batch.py), so a batch padded for a CUDA graph tiles like the same batch run eagerly."""
    pairs_per_expert = triton.cdiv(batch_bucket(num_tokens) * top_k, num_experts)
    block_m = min(max(triton.next_power_of_2(pairs_per_expert), 16), 64)
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_warps=4 if block_m <= 32 else 8)


@triton.jit
def _fused_moe_kernel(x_ptr, w_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr, pair_weights_ptr,
                      num_pairs, N, K, x_row_stride, PAIRS_PER_ROW: tl.constexpr, WEIGHTED: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the used blocks: the grid is sized for the worst routing
        return
    pairs = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    is_pair = pairs < num_pairs  # the rest is padding
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = the expert's weight rows
    in_cols = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + (pairs // PAIRS_PER_ROW)[:, None] * x_row_stride + ks[None, :]  # [BLOCK_M, BLOCK_K] pointers
    w_tile = w_ptr + expert * N * K + cols[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N]: w[e, cols, ks]^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + ks < K
        x = tl.load(x_tile + k0, mask=is_pair[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=in_k[:, None] & in_cols[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if WEIGHTED:
        acc *= tl.load(pair_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N] pointers
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & in_cols[None, :])


def fused_moe_matmul(x: torch.Tensor, w: torch.Tensor, sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor,
                     config: dict, pairs_per_row: int = 1, pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[p] = w[expert of p] @ x[p // pairs_per_row] for every pair p = token * k + slot, times
    pair_weights.flatten()[p] when given. x [T, K] with pairs_per_row = k (one row per token, the
    up/gate projection) or [T*k, K] with 1 (one row per pair, the down projection); w [E, N, K]
    contiguous; the pairs laid out by align_pairs_by_expert with config's BLOCK_M -> out [T*k, N],
    in x's dtype, accumulated in float32."""
    num_pairs = x.shape[0] * pairs_per_row
    _, n, k_dim = w.shape
    assert x.stride(-1) == 1 and x.dtype == w.dtype and w.is_contiguous()
    assert sorted_pair_ids.numel() == block_expert.numel() * config["BLOCK_M"]
    assert pair_weights is None or (pair_weights.is_contiguous() and pair_weights.numel() == num_pairs)
    out = torch.empty((num_pairs, n), dtype=x.dtype, device=x.device)  # [T*k, N]
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    precision = dot_precision(x.dtype)
    _fused_moe_kernel[grid](x, w, out, sorted_pair_ids, block_expert, pair_weights, num_pairs, n, k_dim, x.stride(0),
                            PAIRS_PER_ROW=pairs_per_row, WEIGHTED=pair_weights is not None, PRECISION=precision,
                            **config)
    return out
