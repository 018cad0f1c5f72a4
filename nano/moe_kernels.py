"""Decode-time mixture of experts: one matrix-vector product per (token, chosen expert), fused.

At decode a MoE layer sees a handful of tokens, each routed to k of E experts (DeepSeek-V2-Lite:
6 of 64). Its work is then T*k tiny products `w[e] @ x_row`: a matrix of a few megabytes times a
single vector, two flops for every two bytes of bf16 weight. No matrix unit helps there; the
time is the time to read the chosen experts' weights, and the goal is to read each of them once,
in place, at the memory's full bandwidth (about 4 TB/s on an H200). Two things stand in the way
in plain torch:
- the expert ids come from the router on the device. Asking the host which experts were chosen
  costs a sync (and breaks CUDA graphs), so torch must either copy the chosen weights out of the
  stack by those ids (`w13[ids]`: the copy reads and writes them, then the matmul reads them
  again, about 3x the bytes) or run every expert (E/k times the bytes);
- each product is too small for a matmul kernel to fill the GPU on its own.
A Triton kernel reads the id itself: a program loads `expert_ids[pair]` and points into the
stacked weights, so nothing is copied and the host never looks.

The grid is (T*k pairs, N / BLOCK_N). Program (p, n) computes BLOCK_N outputs of pair p: it walks
along K in BLOCK_K steps, loads a [BLOCK_N, BLOCK_K] tile of its expert's weight rows and the
matching chunk of the input row, multiplies them element by element and adds into a float32
tile, which it sums along K once at the end (a GEMV: `tl.dot` wants at least 16 rows of input,
and decode has one per pair). The pair is the grid's first, fastest-varying axis, so the programs
running side by side are all the pairs at the same few row blocks: pairs that chose the same
expert read the same tile at about the same time, and some of the repeats hit in L2. Only some:
past about as many pairs as experts, reading every expert once (MoE.dense) is cheaper.

Sizing for bf16 (hidden 2048, expert width 1408): 8 bf16 values are one 16-byte
load, so a warp covers BLOCK_K = 256 columns of a row; BLOCK_N = 32 rows over 4 warps give each
thread eight such loads (128 bytes) per step, all issued before any is used, and a float32 tile
of 64 registers. At batch 1 the up/gate product (N = 2816) runs 6 * 88 = 528 programs and the
down product (N = 2048) 384, a few per multiprocessor, so all of an H200's 132 keep tens of
kilobytes in flight: what streaming at full bandwidth takes (BENCHMARKS.md has the timings).

Shapes depend only on T, k, N and K, never on the ids, so a CUDA graph can capture the kernel.
"""

import torch
import triton
import triton.language as tl

BLOCK_N = 32
BLOCK_K = 256
NUM_WARPS = 4


@triton.jit
def _expert_matvec_kernel(x_ptr, w_ptr, expert_ids_ptr, out_ptr, x_token_stride, x_slot_stride, N, K,
                          TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    tl.store(out_ptr + pair.to(tl.int64) * N + rows, out.to(out_ptr.dtype.element_ty), mask=in_rows)


def expert_matvec(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """out[t, j] = w[expert_ids[t, j]] @ x[t] (x [T, K]: one input row per token, used by all its
    experts, as in the up/gate projection) or @ x[t, j] (x [T, k, K]: one row per chosen expert,
    as in the down projection). w [E, N, K] contiguous, expert_ids [T, k] integer -> out [T, k, N],
    in x's dtype, accumulated in float32."""
    num_tokens, top_k = expert_ids.shape
    _, n, k_dim = w.shape
    if x.dim() == 2:
        x = x[:, None, :].expand(num_tokens, top_k, k_dim)  # stride 0 over the slots: nothing copied
    assert x.shape == (num_tokens, top_k, k_dim) and x.stride(-1) == 1 and x.dtype == w.dtype
    assert w.is_contiguous() and expert_ids.is_contiguous()
    out = torch.empty((num_tokens, top_k, n), dtype=x.dtype, device=x.device)  # [T, k, N]
    grid = (num_tokens * top_k, triton.cdiv(n, BLOCK_N))
    _expert_matvec_kernel[grid](x, w, expert_ids, out, x.stride(0), x.stride(1), n, k_dim,
                                TOP_K=top_k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out
