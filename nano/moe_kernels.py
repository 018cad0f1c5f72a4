"""The experts of a mixture of experts, fused: mat-vec kernels for small decode batches and a
grouped matmul for everything larger.

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

The router runs first, in two launches (`route`; torch takes about ten: the float32 cast, the
matmul, softmax, a sort and a gather for topk, the rescale, the appends): a grid of (4 tokens, 128
hidden channels) computes partial float32 logits, so even one token's router weight is read by
many programs; then one program per token adds its partials up in a fixed order, takes the
softmax and the top k, and appends the shared experts.

The experts a token runs are its k routed ones and the S shared ones (deepseek.py): the router
appends the shared experts to every token's choice with weight 1, so all kernels here see `slots` =
k + S (expert, weight) pairs per token and no special case. The weights are stacked for that:
`gate_up` [2, E + S, I, K] (every expert's gate rows, then every expert's up rows) and `down`
[E + S, N, I] (a strided view: every expert's down matrix side by side). Both are views that
kernels index with their strides.

Small batches (decode, or a few prompt tokens): `gate_up_matvec` and `down_matvec`. A handful of
tokens give a handful of pairs, each a matrix of a few megabytes times a single vector, two flops
for every two bytes of bf16 weight. No matrix unit helps there; the time is the time to read the
chosen experts' weights, and the goal is to read each of them once, in place, at the memory's full
bandwidth (about 4 TB/s on an H200), in as few launches as possible: at batch 1 a launch costs about
what reading a megabyte does. So each product does the elementwise work around it in its own
epilogue:
- `gate_up_matvec`, grid (T * slots pairs, I / BLOCK_N): program (p, n) computes BLOCK_N rows of
  pair p's gate and the same rows of its up projection. It walks along K in BLOCK_K steps, loads a
  [BLOCK_N, BLOCK_K] tile of each and the matching chunk of the input row, multiplies element by
  element into two float32 tiles, sums them along K once at the end (a GEMV: `tl.dot` wants at
  least 16 rows of input, and decode has one per pair) and stores silu(gate) * up: the SiLU-and-mul
  kernel and the [T, slots, 2I] round trip through memory are gone. The pair is the grid's first,
  fastest-varying axis, so the programs running side by side are all the pairs at the same few row
  blocks: pairs that chose the same expert (the shared ones, for every token) read the same tile at
  about the same time, and the repeats mostly hit in L2.
- `down_matvec`, grid (T, N / BLOCK_N): program (t, n) computes BLOCK_N outputs of token t for all
  its slots at once, a [slots, BLOCK_N, BLOCK_K] tile per step, then weighs each slot's rows by its
  routing weight and sums them: the token's MoE output, shared experts included, in one launch,
  summed in float32 in a fixed order (atomic adds would land in a different order each run, and the
  next step's routing can flip on that). Loading every slot's tile in one step keeps as many bytes
  in flight as the per-pair grid would.

Sizing for bf16 (hidden 2048, expert width 1408, 8 slots), from scripts/tune_fused_moe.py on an
H200: 8 bf16 values are one 16-byte load, so a warp covers 256 columns of a row. gate_up: BLOCK_N
= 16 rows of gate and of up by BLOCK_K = 512 over 4 warps give each thread 16 such loads per step
and two float32 tiles of 64 registers; at batch 1 it runs 8 * 88 = 704 programs. down: 8 slots by
BLOCK_N = 16 rows by BLOCK_K = 128 is 16 loads a thread per step into a float32 tile of 128
registers. A single token would get only 128 such programs, about one a multiprocessor, so it
takes 8 rows by 256 columns on 8 warps: twice the programs, each thread 8 such loads a step
(on an H200, 14.8 against 16.2 us a layer; at 4 tokens the 16-row tile is faster, 33.5 against
39.5). Either way all of an H200's 132 multiprocessors keep tens of kilobytes in flight: what
streaming at full bandwidth takes. Both products of one layer at batch 1 take about 41 us, 3.4
TB/s (BENCHMARKS.md).

Everything larger (batches with more pairs than half the experts, most prefills): `fused_moe_matmul`,
a grouped matmul in the style of vLLM's and SGLang's fused_moe. With several pairs per expert the
work is matrix multiplication again, expert e's weights times the rows of its pairs, so:
1. `align_pairs_by_expert` sorts the pair ids by expert, on the device, and lays them out in
   blocks of BLOCK_M: each block holds pairs of one expert, and an expert's last block is padded
   with a sentinel id (T * slots). It also names each block's expert (-1 for blocks left unused).
   It is a counting sort, one program per expert: count every expert's pairs (`tl.histogram`,
   1,024 pairs a step), so the expert's run starts after the padded runs before it, then place
   its own pairs in pair order. Every program walks all the pairs twice: on an H200 that is 3 us
   a layer up to 128 tokens and 4 us at 160, where torch's argsort, searchsorted, gathers and
   scatter take about 15 launches and 40-70 us; a prefill of 20,480 tokens takes 0.26 ms a layer
   (torch: 0.13), about 1% of that prefill (BENCHMARKS.md).
2. One launch, grid (blocks, N / BLOCK_N): program (b, n) gathers its block's BLOCK_M input rows
   (row = pair // slots when the input has one row per token, as the up/gate projection's does;
   row = pair when it has one per pair, as the down projection's), multiplies them by its
   expert's [K, BLOCK_N] weight tile with `tl.dot` (tensor cores), accumulating in float32, and
   scatters the result to its pairs' rows of out [T * slots, N]. The down projection also
   multiplies each row by the pair's routing weight, so a token's output is the plain sum of its
   rows.
Experts no pair chose are never read; the others are read once per block of their pairs, and the
flops are the pairs' own plus the padding's. The layout's size depends on the routing, but it
has a bound: an expert with pairs pads at most BLOCK_M - 1 rows, and at most min(E + S, T * slots)
experts have pairs. Buffers and grid take that bound, and unused blocks exit at once.

Block sizes (`fused_moe_config`): an expert's weights are read once per block of its pairs, and
padding rows are wasted work, so BLOCK_M follows a routed expert's average share of the pairs,
T*k / E, rounded up to a power of two between 16 (the smallest `tl.dot` tile) and 64. Without shared experts that is
16 up to 168 tokens (at 160, 15 pairs a routed expert) and 64 from 337 on (bucket 344), where
the tensor cores set the pace. A shared expert, though, has a pair for every token, so 16-row
blocks read its weights T/16 times; the blocks that read the same tile run side by side, so the
repeats mostly hit in L2, but not all. From 128 tokens that costs more than padding the routed
experts' blocks: with shared experts, blocks have 64 rows from 121 tokens on (bucket 128; H200: 6%
faster a layer at 128 and 160 tokens; at 64 tokens 16 rows stay faster: scripts/tune_fused_moe.py).
BLOCK_N = 128 by BLOCK_K = 64 weight tiles (16 KB in bf16) keep a few tiles in flight per
program in shared memory, even in float32; a 64-row block takes 8 warps for its larger tile.

Shapes depend only on T, slots, N and K, never on the ids, so a CUDA graph can capture both kernels
(and the pairs' alignment), at any batch size.
"""

import torch
import triton
import triton.language as tl

from nano.forward_batch import batch_bucket
from nano.triton_ops import PDL, dot_precision, launch_dependents, wait_for_inputs

# The router's logits in float32: a program per chunk of 128 hidden channels and block of 4 tokens,
# so at batch 1 the 0.5 MB float32 weight (DeepSeek-V2-Lite) is read by 16 programs at once instead
# of one. A program walks its tokens one after another: 4 rather than 16 took DeepSeek's router
# from 14.6 to 9.9 us a layer at 160 tokens (scripts/moe_bookkeeping_probe.py). _route_kernel adds
# the chunks up.
ROUTER_BLOCK_T, ROUTER_BLOCK_H = 4, 128


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, partial_ptr, num_tokens, num_experts, hidden, x_row_stride,
                          BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr):
    launch_dependents()
    first_token, chunk = tl.program_id(0).to(tl.int64) * BLOCK_T, tl.program_id(1)
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    experts = tl.arange(0, BLOCK_E)
    in_cols, in_experts = cols < hidden, experts < num_experts
    w = tl.load(w_ptr + experts[:, None] * hidden + cols[None, :],
                mask=in_experts[:, None] & in_cols[None, :], other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_H]
    wait_for_inputs()
    for token in range(first_token, tl.minimum(first_token + BLOCK_T, num_tokens)):  # the tile stays in registers
        x = tl.load(x_ptr + token * x_row_stride + cols, mask=in_cols, other=0.0).to(tl.float32)
        partial = tl.sum(w * x[None, :], axis=1)  # [BLOCK_E]: float32 products, summed in a fixed order
        tl.store(partial_ptr + (chunk * num_tokens + token) * num_experts + experts, partial,
                 mask=in_experts)  # partial logits [chunks, T, E]


@triton.jit
def _route_kernel(partial_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, num_chunks, routed_scaling,
                  TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    experts, chunks = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_C)
    partial = tl.load(partial_ptr + (chunks[:, None] * num_tokens + token) * num_experts + experts[None, :],
                      mask=(chunks[:, None] < num_chunks) & (experts[None, :] < num_experts), other=0.0)
    logits = tl.where(experts < num_experts, tl.sum(partial, 0), float("-inf"))  # [BLOCK_E], in a fixed order
    scores = tl.exp(logits - tl.max(logits, 0))
    scores = scores / tl.sum(scores, 0)  # softmax [BLOCK_E]; padding lanes are 0
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for slot in tl.static_range(TOP_K):  # the k best, one pass each: highest score, lowest id on ties
        best = tl.max(scores, 0)
        # (a NaN row matches no lane: the last expert then, not a lane past the weight stacks)
        best_id = tl.minimum(tl.min(tl.where(scores == best, experts, BLOCK_E), 0), num_experts - 1)
        weights = tl.where(slots == slot, best, weights)
        ids = tl.where(slots == slot, best_id, ids)
        scores = tl.where(experts == best_id, -1.0, scores)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    else:
        weights = weights * routed_scaling
    is_shared = slots >= TOP_K  # experts E, E+1, ... of weight 1
    weights = tl.where(is_shared, 1.0, weights)
    ids = tl.where(is_shared, num_experts + slots - TOP_K, ids)
    row = token * (TOP_K + NUM_SHARED) + slots
    tl.store(weights_ptr + row, weights, mask=slots < TOP_K + NUM_SHARED)
    tl.store(ids_ptr + row, ids, mask=slots < TOP_K + NUM_SHARED)


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, routed_scaling: float,
          num_shared: int = 0):
    """The MoE router in two launches (the lesson above says how): x [T, hidden], gate_weight
    [E, hidden] -> (weights [T, k + num_shared] float32, expert ids [T, k + num_shared] int64), best
    first, then the shared experts. See ops.route for the rule."""
    (num_tokens, hidden), num_experts = x.shape, gate_weight.shape[0]
    assert x.stride(-1) == 1 and gate_weight.is_contiguous() and gate_weight.shape[1] == hidden
    num_chunks, slots = triton.cdiv(hidden, ROUTER_BLOCK_H), top_k + num_shared
    block_e = max(16, triton.next_power_of_2(num_experts))
    partial = torch.empty((num_chunks, num_tokens, num_experts), dtype=torch.float32, device=x.device)
    _router_logits_kernel[(triton.cdiv(num_tokens, ROUTER_BLOCK_T), num_chunks)](
        x, gate_weight, partial, num_tokens, num_experts, hidden, x.stride(0),
        BLOCK_T=ROUTER_BLOCK_T, BLOCK_H=ROUTER_BLOCK_H, BLOCK_E=block_e, num_warps=4, launch_pdl=PDL)
    weights = torch.empty((num_tokens, slots), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, slots), dtype=torch.int64, device=x.device)
    _route_kernel[(num_tokens,)](partial, weights, ids, num_tokens, num_experts, num_chunks, routed_scaling,
                                 TOP_K=top_k, NUM_SHARED=num_shared, RENORMALIZE=renormalize,
                                 BLOCK_C=triton.next_power_of_2(num_chunks), BLOCK_E=block_e,
                                 BLOCK_K=triton.next_power_of_2(slots), num_warps=1, launch_pdl=PDL)
    return weights, ids


GATE_UP_BLOCK_N, GATE_UP_BLOCK_K = 16, 512  # the mat-vec kernels' tiles (the module lesson says why)
DOWN_TILE, ONE_TOKEN_DOWN_TILE = (16, 128, 4), (8, 256, 8)  # the down product's (BLOCK_N, BLOCK_K, warps)


@triton.jit
def _gate_up_matvec_kernel(x_ptr, w_ptr, expert_ids_ptr, out_ptr, x_stride, half_stride, expert_stride, row_stride,
                           N, K, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    launch_dependents()
    wait_for_inputs()  # the expert ids come from the router: no weight tile is known before they are
    pair = tl.program_id(0)  # = token * SLOTS + slot
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    in_rows = rows < N
    gate_tile = w_ptr + expert * expert_stride + rows[:, None] * row_stride + cols[None, :]  # [BLOCK_N, BLOCK_K]
    up_tile = gate_tile + half_stride
    x_chunk = x_ptr + (pair // SLOTS).to(tl.int64) * x_stride + cols  # [BLOCK_K] of the token's row
    gate_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + cols < K
        x = tl.load(x_chunk + k0, mask=in_k, other=0.0).to(tl.float32)[None, :]
        mask = in_rows[:, None] & in_k[None, :]
        gate_acc += tl.load(gate_tile + k0, mask=mask, other=0.0).to(tl.float32) * x
        up_acc += tl.load(up_tile + k0, mask=mask, other=0.0).to(tl.float32) * x
    gate, up = tl.sum(gate_acc, axis=1), tl.sum(up_acc, axis=1)  # [BLOCK_N]
    out = gate * tl.sigmoid(gate) * up  # silu(gate) * up
    tl.store(out_ptr + pair.to(tl.int64) * N + rows, out.to(out_ptr.dtype.element_ty), mask=in_rows)


def gate_up_matvec(x: torch.Tensor, gate_up: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """out[t, j] = silu(gate[e] @ x[t]) * (up[e] @ x[t]) with e = expert_ids[t, j]: x [T, K],
    gate_up [2, E, I, K] (gate, up; rows contiguous), expert_ids [T, slots] -> out [T, slots, I] in
    x's dtype, accumulated in float32."""
    num_tokens, slots = expert_ids.shape
    _, _, n, k_dim = gate_up.shape
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and x.dtype == gate_up.dtype and expert_ids.is_contiguous()
    out = torch.empty((num_tokens, slots, n), dtype=x.dtype, device=x.device)  # [T, slots, I]
    grid = (num_tokens * slots, triton.cdiv(n, GATE_UP_BLOCK_N))
    _gate_up_matvec_kernel[grid](x, gate_up, expert_ids, out, x.stride(0), *gate_up.stride()[:3], n, k_dim,
                                 SLOTS=slots, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=GATE_UP_BLOCK_K, num_warps=4,
                                 launch_pdl=PDL)
    return out


@triton.jit
def _down_matvec_kernel(h_ptr, w_ptr, expert_ids_ptr, pair_weights_ptr, out_ptr, expert_stride, row_stride, N, K,
                        SLOTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_S)
    in_slots = slots < SLOTS
    pairs = token * SLOTS + slots  # [BLOCK_S]
    experts = tl.load(expert_ids_ptr + pairs, mask=in_slots, other=0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    in_rows = rows < N
    # [BLOCK_S, BLOCK_N, BLOCK_K] pointers: each slot's expert's tile of the same rows
    w_tile = w_ptr + experts[:, None, None] * expert_stride + rows[None, :, None] * row_stride + cols[None, None, :]
    h_chunk = h_ptr + pairs[:, None] * K + cols[None, :]  # [BLOCK_S, BLOCK_K]: each slot's input row
    acc = tl.zeros([BLOCK_S, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + cols < K
        h = tl.load(h_chunk + k0, mask=in_slots[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        w_mask = in_slots[:, None, None] & in_rows[None, :, None] & in_k[None, None, :]
        acc += tl.load(w_tile + k0, mask=w_mask, other=0.0).to(tl.float32) * h[:, None, :]
    weights = tl.load(pair_weights_ptr + pairs, mask=in_slots, other=0.0)  # [BLOCK_S]
    out = tl.sum(tl.sum(acc, axis=2) * weights[:, None], axis=0)  # [BLOCK_N]: the weighted sum over slots
    tl.store(out_ptr + token * N + rows, out.to(out_ptr.dtype.element_ty), mask=in_rows)


def down_matvec(h: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                pair_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j pair_weights[t, j] * down[expert_ids[t, j]] @ h[t, j]: h [T, slots, K]
    contiguous, down [E, N, K] (rows contiguous), expert_ids and pair_weights (float32) [T, slots]
    -> out [T, N] in h's dtype, accumulated in float32."""
    num_tokens, slots = expert_ids.shape
    _, n, k_dim = down.shape
    assert h.is_contiguous() and h.shape == (num_tokens, slots, k_dim) and h.dtype == down.dtype
    assert down.stride(-1) == 1 and expert_ids.is_contiguous() and pair_weights.is_contiguous()
    out = torch.empty((num_tokens, n), dtype=h.dtype, device=h.device)  # [T, N]
    block_n, block_k, warps = ONE_TOKEN_DOWN_TILE if num_tokens == 1 else DOWN_TILE
    _down_matvec_kernel[(num_tokens, triton.cdiv(n, block_n))](
        h, down, expert_ids, pair_weights, out, down.stride(0), down.stride(1), n, k_dim,
        SLOTS=slots, BLOCK_S=triton.next_power_of_2(slots), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        launch_pdl=PDL)
    return out


# The pairs the alignment walks a step: 1,024 ids are 4 a thread of its 8 warps.
ALIGN_BLOCK_P = 1024


@triton.jit
def _align_kernel(ids_ptr, sorted_pair_ids_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    expert = tl.program_id(0)
    experts, offs = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_P)
    # Every expert's pair count: each program counts them all, as its run starts after the others'.
    # Past the last pair, ids read as num_experts: a bin after every expert's (BLOCK_E > num_experts).
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + p0 + offs, mask=p0 + offs < num_pairs, other=num_experts)
        counts += tl.histogram(ids.to(tl.int32), BLOCK_E)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M  # [BLOCK_E]: rows of each expert's blocks
    mine = experts == expert
    start = tl.sum(tl.where(mine, tl.cumsum(padded, axis=0) - padded, 0))  # this expert's first row
    count, end = tl.sum(tl.where(mine, counts, 0)), start + tl.sum(tl.where(mine, padded, 0))
    # Its pairs in pair order, then the sentinel up to a whole block, and its blocks' expert.
    seen = 0
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + offs
        is_mine = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) == expert
        rank = seen + tl.cumsum(is_mine.to(tl.int32), axis=0) - 1
        tl.store(sorted_pair_ids_ptr + start + rank, pairs, mask=is_mine)
        seen += tl.sum(is_mine.to(tl.int32))
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_pair_ids_ptr + pad, num_pairs, mask=pad < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK_P):
        tl.store(block_expert_ptr + b0 + offs, expert, mask=b0 + offs < end // BLOCK_M)
    if expert == num_experts - 1:  # the last run's program: padding and no expert past all runs
        for row in range(end, max_blocks * BLOCK_M, BLOCK_P):
            tl.store(sorted_pair_ids_ptr + row + offs, num_pairs, mask=row + offs < max_blocks * BLOCK_M)
        for b0 in range(end // BLOCK_M, max_blocks, BLOCK_P):
            tl.store(block_expert_ptr + b0 + offs, -1, mask=b0 + offs < max_blocks)


def align_pairs_by_expert(expert_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [T, slots] -> (sorted_pair_ids [max_blocks * block_m], block_expert [max_blocks]):
    the pair ids (token * slots + slot) grouped by expert, each expert's run padded with T * slots to whole blocks
    of block_m, then more padding to the bound; the expert of each block, -1 past the last used one.
    One launch, no host sync, in shapes that depend only on T and slots."""
    assert expert_ids.is_contiguous()
    num_pairs = expert_ids.numel()
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pair_ids = expert_ids.new_empty(max_blocks * block_m)  # every entry is written
    block_expert = expert_ids.new_empty(max_blocks)
    _align_kernel[(num_experts,)](expert_ids, sorted_pair_ids, block_expert, num_pairs, num_experts, max_blocks,
                                  BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts + 1),
                                  BLOCK_P=ALIGN_BLOCK_P, num_warps=8, launch_pdl=PDL)
    return sorted_pair_ids, block_expert


def fused_moe_config(num_tokens: int, top_k: int, num_experts: int, num_shared: int = 0) -> dict:
    """Tile sizes of fused_moe_matmul for k of E routed experts and S shared ones (the module lesson
    says why). Chosen from the batch's bucket (forward_batch.py), so a batch padded for a CUDA graph
    tiles like the same batch run eagerly."""
    tokens = batch_bucket(num_tokens)
    pairs_per_expert = triton.cdiv(tokens * top_k, num_experts)
    if num_shared and tokens >= 128:  # the shared experts' re-reads outweigh the routed ones' padding
        pairs_per_expert = 64
    block_m = min(max(triton.next_power_of_2(pairs_per_expert), 16), 64)
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_warps=4 if block_m <= 32 else 8)


@triton.jit
def _fused_moe_kernel(x_ptr, w_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ptr, pair_weights_ptr,
                      num_pairs, N, K, x_row_stride, half_rows, half_stride, expert_stride, row_stride,
                      PAIRS_PER_ROW: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the used blocks: the grid is sized for the worst routing
        return
    pairs = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    is_pair = pairs < num_pairs  # the rest is padding
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = the expert's weight rows
    in_cols = cols < N
    w_rows = (cols // half_rows) * half_stride + (cols % half_rows) * row_stride  # gate rows, then up rows
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + (pairs // PAIRS_PER_ROW)[:, None] * x_row_stride + ks[None, :]  # [BLOCK_M, BLOCK_K] pointers
    w_tile = w_ptr + expert * expert_stride + w_rows[None, :] + ks[:, None]  # [BLOCK_K, BLOCK_N]: w[e, cols, ks]^T
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
    """out[p] = w[expert of p] @ x[p // pairs_per_row] for every pair p = token * slots + slot, times
    pair_weights.flatten()[p] when given. x [T, K] with pairs_per_row = slots (one row per token, the
    up/gate projection) or [T * slots, K] with 1 (one row per pair, the down projection); w [E, N, K]
    or [2, E, N/2, K] (gate_up: its output columns are the gate rows, then the up rows), rows
    contiguous; the pairs laid out by align_pairs_by_expert with config's BLOCK_M -> out
    [T * slots, N], in x's dtype, accumulated in float32."""
    num_pairs = x.shape[0] * pairs_per_row
    halves = w if w.dim() == 4 else w[None]  # [halves, E, rows, K]
    n, k_dim = halves.shape[0] * halves.shape[2], halves.shape[3]
    assert x.stride(-1) == 1 and x.dtype == w.dtype and w.stride(-1) == 1
    assert sorted_pair_ids.numel() == block_expert.numel() * config["BLOCK_M"]
    assert pair_weights is None or (pair_weights.is_contiguous() and pair_weights.numel() == num_pairs)
    out = torch.empty((num_pairs, n), dtype=x.dtype, device=x.device)  # [T * slots, N]
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    precision = dot_precision(x.dtype)
    _fused_moe_kernel[grid](x, w, out, sorted_pair_ids, block_expert, pair_weights, num_pairs, n, k_dim, x.stride(0),
                            halves.shape[2], *halves.stride()[:3], PAIRS_PER_ROW=pairs_per_row,
                            WEIGHTED=pair_weights is not None, PRECISION=precision, **config, launch_pdl=PDL)
    return out
