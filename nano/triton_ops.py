"""Fused per-token kernels: residual add + RMSNorm, SiLU-and-multiply, rope (one launch each); the
linear layer of a single row, alone or with SiLU-and-multiply, and of a few rows split in K; and the
argmax of each row of logits (two). (The MoE router's kernels live with the experts': moe_kernels.py.)

Besides its matmuls and attention, a decoder layer does a few small things to each token on its
own: two RMSNorms, two residual adds, the MLP's gate activation, and rope on q and k. Written in
torch, each is several elementwise kernels (rope alone is about 19: a gather of cos/sin, casts,
chunks, multiplies, adds, a cat, casts back), and each reads and writes the whole activation. At
a large batch those bytes are small next to the matmuls. At decode batch 1 they are tiny, and
what counts is the number of launches: every kernel costs about 2-3 us even replayed in a CUDA
graph, while a whole Llama-3-8B layer should take about 110 us (its share of the 3.6 ms of weight
reads). Here each op is one kernel, whose intermediates stay in registers.

How each kernel splits the work:
- fused_add_rms_norm (alone, with residual None): one program per token row. The whole row (hidden <= 8192) is
  one block in registers, so the mean of squares is one `tl.sum`; wider rows get more warps, so
  that each thread still loads a couple of 16-byte vectors. The residual add shares the launch:
  the sum is stored as the new residual stream and normalised from registers. Its input may be a
  split-K linear's two partial products (below), added in float32 before the residual.
- apply_rope_: a grid of (token, 2): program 0 rotates all of the token's query heads, program 1
  all its key heads, each as two [heads, d/2] tiles (the halves); the token's cos/sin row is
  loaded once and broadcast over heads. It writes in place, or the query heads into `q_out`
  (DeepSeek's absorbed query: deepseek.py). A third program per token may run an RMSNorm of
  another row in the same launch (DeepSeek's latent, whose norm is due at the same point).
- silu_and_mul: a grid of (token, block of columns) over the [T, I] output; a program reads its
  columns of gate and the same columns of up, I elements further along the row.
- linear, for one row (decode at batch 1): a mat-vec, grid (N / 4): a program reads 4 rows of the
  weight along K in 1024-wide steps (8 bf16 values, one 16-byte load, per thread and row),
  multiplies element by element into a float32 tile and sums it once at the end. Every program
  has its loads in flight at once and nothing else to do, so it reads weights faster than
  cuBLAS's kernels for one row: 3.5 against 3.1 TB/s for Llama-3-8B's fused q/k/v, 3.2 against
  2.5 for its o_proj (BENCHMARKS.md). More rows go to cuBLAS: there the matrix units pay.
  `linear_silu_and_mul` is the MLP's gate/up projection in the same kernel: a program reads 2
  gate rows and the 2 up rows that go with them, side by side in one loop, and stores
  silu(gate) * up, so at batch 1 the SiLU-and-mul kernel is gone.
- linear with `split_k`, for 2-256 rows (o_proj and down_proj): at so few rows cuBLAS's tiles leave
  much of the GPU idle (o_proj at 160 rows reads its weight at 1.8 TB/s). One strided-batched
  matmul over the two halves of K runs twice the programs, each half writing its own product, and
  the residual add + RMSNorm that reads the output next adds the two: on an H200, o_proj at 160
  rows takes 12.5 against 18.9 us, down_proj 34.2 against 40.1 (BENCHMARKS.md). Each half is
  rounded to the activation dtype, as torch lets cuBLAS's own split-K reductions do in bf16.
- argmax (sampling.py): torch reduces a row of logits in one block, far below the bandwidth; here
  a grid of (row, 4096-wide slice) finds each slice's best, then one program a row the best slice.

Arithmetic is in float32, rounded to the activation dtype where the HF reference rounds, so bf16
results match torch's to the bit or nearly. The kernels take each tensor's row (token, head)
strides and need only the last dimension contiguous: q and k may be views into the fused qkv
output, and DeepSeek's norm and rope inputs are column slices of wider tensors.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision for inputs of this dtype. Triton's default rounds float32 inputs
    to TF32 (a 10-bit mantissa) on tensor cores, while torch multiplies float32 in full: "ieee"
    keeps float32 float32. 16-bit inputs keep the default: tensor cores multiply them exactly."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Programmatic dependent launch (PDL, Hopper and later). Even replayed in a CUDA graph, a kernel
# starts only when the one before it has finished: its programs are placed on the multiprocessors
# and wait out their first loads while the GPU reads nothing, and at decode batch 1 most kernels
# last 1-7 us, so that start is a large share of each. Launched with `launch_pdl=True`, a kernel
# may start as soon as every program of the kernel before it has called `launch_dependents()`.
# Every nano kernel is launched so and calls it first thing; then it loads what no kernel of the
# pass writes, so those bytes are in flight while the kernel before finishes: weights (a mat-vec's
# first weight tiles, a norm's weight, rope's table) and the batch's metadata (positions, sequence
# lengths, slots: torch writes them before the embedding, and the first nano kernel starts after
# that torch kernel has finished). Then `wait_for_inputs()`, which returns once the kernel before
# has finished and its writes are visible (and so everything before it), before it reads any
# activation or writes anything. On an H200 a norm and a mat-vec in a row took 4.8 us instead of
# 6.3 (BENCHMARKS.md). Torch's kernels do neither, and one that follows a nano kernel starts as usual.
# In Triton's interpreter and on older GPUs both calls do nothing and launches keep stream order.
PDL = not triton.knobs.runtime.interpret and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
if PDL:
    from triton.language.extra.cuda import gdc_launch_dependents as launch_dependents
    from triton.language.extra.cuda import gdc_wait as wait_for_inputs
else:
    @triton.jit
    def launch_dependents():
        pass

    @triton.jit
    def wait_for_inputs():
        pass


# silu_and_mul's columns per program: 8 per thread of 4 warps, one 16-byte load each in bf16.
SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                     x_part_stride, x_row_stride, residual_row_stride, out_row_stride, new_residual_row_stride,
                     hidden, eps, ADD_RESIDUAL: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    wait_for_inputs()
    x = tl.zeros([BLOCK], dtype=tl.float32)
    for part in tl.static_range(NUM_PARTS):  # a split-K linear's partial products (linear), summed in float32
        x += tl.load(x_ptr + part * x_part_stride + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        # The residual stream lives in the activation dtype: round the sum, then normalise that.
        x += tl.load(residual_ptr + row * residual_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_row_stride + cols, x, mask=in_row)
        x = x.to(tl.float32)
    _store_normed(x, weight, hidden, eps, out_ptr + row * out_row_stride + cols, in_row)


@triton.jit
def _store_normed(x, weight, hidden, eps, out_ptrs, in_row):
    """Store rms_norm(x) * weight (x, weight: one row in float32) at out_ptrs."""
    mean_square = tl.sum(x * x, axis=0) / hidden
    # HF order: normalise in float32, round to the activation dtype, then multiply by the weight.
    normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptrs.dtype.element_ty).to(tl.float32)
    tl.store(out_ptrs, (weight * normed).to(out_ptrs.dtype.element_ty), mask=in_row)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] -> (rms_norm(x + residual) * weight, x + residual), in x's dtype; x
    may be a split-K linear's partial products [S, T, hidden] (linear), whose sum is added. With
    residual None (the first layer: nothing to add yet) -> (rms_norm(x) * weight, x)."""
    parts = x.unsqueeze(0) if x.dim() == 2 else x  # [S, T, hidden]
    num_parts, num_tokens, hidden = parts.shape
    assert x.stride(-1) == 1 and weight.shape == (hidden,) and weight.is_contiguous()
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)  # [T, hidden]
    add_residual = residual is not None
    if not add_residual:
        assert num_parts == 1, "the residual stream starts at a whole row"
        residual = new_residual = x  # the kernel reads and writes neither
    else:
        assert residual.shape == out.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        new_residual = torch.empty_like(out)  # [T, hidden]
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, new_residual,
        parts.stride(0), parts.stride(1), residual.stride(0), out.stride(0), new_residual.stride(0),
        hidden, eps, ADD_RESIDUAL=add_residual, NUM_PARTS=num_parts, BLOCK=block,
        num_warps=min(max(block // 512, 1), 16), launch_pdl=PDL,
    )
    return out, new_residual


@triton.jit
def _rotate_heads(x_ptr, head_stride, out_ptr, out_head_stride, num_heads, cos, sin,
                  HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    """Rotate one token's heads (x_ptr: its first head) into out_ptr, which may be x_ptr; cos/sin are
    [1, HALF_BLOCK]."""
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    dims = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first_half = x_ptr + heads * head_stride + dims  # [HEADS_BLOCK, HALF_BLOCK] pointers
    x1 = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_half + HALF, mask=mask, other=0.0).to(tl.float32)
    out_half = out_ptr + heads * out_head_stride + dims
    tl.store(out_half, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_half + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, q_out_ptr, k_ptr, cos_sin_ptr, positions_ptr, norm_ptr, norm_weight_ptr,
                 q_token_stride, q_head_stride, q_out_token_stride, q_out_head_stride,
                 k_token_stride, k_head_stride, cos_sin_stride, norm_token_stride, num_q_heads, num_k_heads,
                 norm_width, eps, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, Q_HEADS_BLOCK: tl.constexpr,
                 K_HEADS_BLOCK: tl.constexpr, NORM_BLOCK: tl.constexpr):
    launch_dependents()
    token, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF_BLOCK)
    angles_row = cos_sin_ptr + position * cos_sin_stride
    cos = tl.load(angles_row + dims, mask=dims < HALF, other=0.0)[None, :]  # [1, HALF_BLOCK]
    sin = tl.load(angles_row + HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    cols = tl.arange(0, NORM_BLOCK)
    in_row = cols < norm_width
    norm_weight = tl.load(norm_weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    wait_for_inputs()
    if part == 0:
        _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, q_out_ptr + token * q_out_token_stride,
                      q_out_head_stride, num_q_heads, cos, sin, HALF, HALF_BLOCK, Q_HEADS_BLOCK)
    elif part == 1:
        k_row = k_ptr + token * k_token_stride
        _rotate_heads(k_row, k_head_stride, k_row, k_head_stride, num_k_heads, cos, sin,
                      HALF, HALF_BLOCK, K_HEADS_BLOCK)
    else:  # the norm that shares the launch, in place
        norm_row = norm_ptr + token * norm_token_stride + cols
        x = tl.load(norm_row, mask=in_row, other=0.0).to(tl.float32)
        _store_normed(x, norm_weight, norm_width, eps, norm_row, in_row)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                q_out: torch.Tensor | None = None, norm: tuple | None = None):
    """ops.apply_rope_ (rope.py's rotate-halves convention), the norm in a third program a token:
    cos_sin [max_positions, d] float32 is RotaryEmbedding.cos_sin. All may be strided views (last
    dimension contiguous), e.g. slices of a fused qkv output."""
    num_tokens, num_q_heads, rot_dim = q.shape
    q_out = q if q_out is None else q_out
    assert k.shape[0] == positions.shape[0] == num_tokens and k.shape[2] == rot_dim == cos_sin.shape[1]
    assert q_out.shape == q.shape and rot_dim % 2 == 0
    assert q.stride(2) == q_out.stride(2) == k.stride(2) == cos_sin.stride(1) == 1
    norm_x, norm_weight, eps = norm or (k, cos_sin, 0.0)  # without a norm its program is not launched
    assert norm is None or (norm_x.shape == (num_tokens, norm_weight.shape[0]) and norm_x.stride(-1) == 1)
    half = rot_dim // 2
    _rope_kernel[(num_tokens, 2 if norm is None else 3)](
        q, q_out, k, cos_sin, positions, norm_x, norm_weight,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        norm_x.stride(0), num_q_heads, k.shape[1], norm_weight.shape[-1] if norm else 0, eps,
        HALF=half, HALF_BLOCK=triton.next_power_of_2(half),
        Q_HEADS_BLOCK=triton.next_power_of_2(num_q_heads), K_HEADS_BLOCK=triton.next_power_of_2(k.shape[1]),
        NORM_BLOCK=triton.next_power_of_2(norm_weight.shape[-1]) if norm else 16, num_warps=4, launch_pdl=PDL,
    )


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, gate_up_row_stride, out_row_stride, intermediate,
                         BLOCK: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < intermediate
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols  # [BLOCK]
    gate = tl.load(gate_ptrs, mask=in_row, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate, mask=in_row, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # silu(gate) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate in the first I columns, up in the rest) -> silu(gate) * up [T, I]."""
    num_tokens, width = gate_up.shape
    assert gate_up.stride(-1) == 1 and width % 2 == 0
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    grid = (num_tokens, triton.cdiv(intermediate, SILU_BLOCK))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), intermediate,
                               BLOCK=SILU_BLOCK, num_warps=4, launch_pdl=PDL)
    return out


LINEAR_BLOCK_N, LINEAR_BLOCK_K = 4, 1024  # the mat-vec's tile (the module lesson says why)


@triton.jit
def _load_tile(ptrs, mask, WHOLE_TILES: tl.constexpr):
    """tl.load of a tile, masked with 0 outside the tensor, unless the tiles cover it exactly: the
    mat-vec reads memory as fast as it can issue loads, and unmasked ones take fewer instructions."""
    if WHOLE_TILES:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _weight_tiles(w_tile, up_offset, k0, K, in_rows, cols, GATED: tl.constexpr, WHOLE_TILES: tl.constexpr):
    """The weight's [BLOCK_N, BLOCK_K] tile at column k0 and, GATED, up's tile up_offset further on."""
    mask = in_rows[:, None] & (k0 + cols < K)[None, :]
    w = _load_tile(w_tile + k0, mask, WHOLE_TILES).to(tl.float32)
    up = w
    if GATED:
        up = _load_tile(w_tile + up_offset + k0, mask, WHOLE_TILES).to(tl.float32)
    return w, up


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, w_row_stride, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                   WHOLE_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    in_rows = rows < N
    w_tile = w_ptr + rows[:, None].to(tl.int64) * w_row_stride + cols[None, :]  # [BLOCK_N, BLOCK_K]
    up_offset = N * w_row_stride  # GATED: acc sums gate's rows, up_acc up's, N rows further on
    w, up = _weight_tiles(w_tile, up_offset, 0, K, in_rows, cols, GATED, WHOLE_TILES)  # before the wait (PDL)
    wait_for_inputs()
    x = _load_tile(x_ptr + cols, cols < K, WHOLE_TILES).to(tl.float32)[None, :]
    acc, up_acc = w * x, up * x
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w, up = _weight_tiles(w_tile, up_offset, k0, K, in_rows, cols, GATED, WHOLE_TILES)
        x = _load_tile(x_ptr + k0 + cols, k0 + cols < K, WHOLE_TILES).to(tl.float32)[None, :]
        acc += w * x
        if GATED:
            up_acc += up * x
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    if GATED:  # rounded where the linear's output is, then silu(gate) * up in float32
        gate, up = y.to(out_ptr.dtype.element_ty).to(tl.float32), tl.sum(up_acc, axis=1).to(out_ptr.dtype.element_ty)
        y = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=in_rows)


def _matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """x [1, in] -> x weight^T + bias [1, out], or with `gated` (weight: out gate rows, then out up
    rows) silu(x gate^T) * (x up^T) [1, out]: then a program reads half as many rows of each."""
    out_features, in_features = weight.shape[0] // (2 if gated else 1), weight.shape[1]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and x.shape == (1, in_features)
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)  # [1, out]
    block_n = LINEAR_BLOCK_N // 2 if gated else LINEAR_BLOCK_N
    _matvec_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, weight if bias is None else bias, out, out_features, in_features, weight.stride(0),
        HAS_BIAS=bias is not None, GATED=gated,
        WHOLE_TILES=out_features % block_n == 0 and in_features % LINEAR_BLOCK_K == 0,
        BLOCK_N=block_n, BLOCK_K=LINEAR_BLOCK_K, num_warps=4, launch_pdl=PDL)
    return out


# The most rows at which a split-K linear hands on two partial products (linear): a batch bucket's
# edge (forward_batch.py), so a batch padded to its bucket splits as the batch itself does.
SPLIT_K_MAX_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split_k: bool = False):
    """x [T, in] -> x weight^T + bias [T, out]: the mat-vec kernel for one row, cuBLAS for more. With
    split_k, up to SPLIT_K_MAX_ROWS rows -> the products of the two halves of `in` [2, T, out], for
    fused_add_rms_norm to add up: two batched halves fill the GPU where one matmul of so few rows did not."""
    if x.dim() == 2 and x.shape[0] == 1:
        return _matvec(x, weight, bias, gated=False)
    if split_k and bias is None and x.dim() == 2 and x.shape[0] <= SPLIT_K_MAX_ROWS and x.shape[1] % 2 == 0:
        return torch.bmm(_halves(x), _halves(weight).transpose(1, 2))  # [2, T, in/2] x [2, in/2, out]
    return F.linear(x, weight, bias)


def _halves(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> a view [2, R, K/2] of its column halves (cuBLAS reads them in place, by strides)."""
    return t.unflatten(1, (2, -1)).transpose(0, 1)


def linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """x [T, in], gate_up_weight [2I, in] -> silu_and_mul(x gate_up_weight^T) [T, I]: for one row,
    the mat-vec with SiLU-and-mul in its epilogue (one launch, no [1, 2I] round trip); cuBLAS and
    silu_and_mul for more."""
    if x.shape[0] != 1:
        return silu_and_mul(F.linear(x, gate_up_weight))
    return _matvec(x, gate_up_weight, None, gated=True)


ARGMAX_BLOCK = 4096  # one slice of a row: 32 values a thread of 4 warps


@triton.jit
def _argmax_slices_kernel(x_ptr, best_ptr, index_ptr, width, row_stride, num_slices, BLOCK: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    row, piece = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = piece * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * row_stride + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
    # torch's argmax counts NaN larger than any value, +inf too: the first NaN wins. A comparison with
    # NaN is false, so tl.max would skip it, and a NaN row would end on a masked lane past the vocabulary.
    best, at = tl.max(tl.where(x != x, float("inf"), x), 0, return_indices=True)  # the first of equal values
    best, at = _first_nan_wins(x, best, at, BLOCK)
    tl.store(best_ptr + row * num_slices + piece, best)
    tl.store(index_ptr + row * num_slices + piece, piece * BLOCK + at)


@triton.jit
def _first_nan_wins(x, best, at, BLOCK: tl.constexpr):
    """(best, at) of x [BLOCK], or (NaN, the first NaN's lane) where x holds NaN."""
    first_nan = tl.min(tl.where(x != x, tl.arange(0, BLOCK), BLOCK), 0)
    return tl.where(first_nan < BLOCK, float("nan"), best), tl.where(first_nan < BLOCK, first_nan, at)


@triton.jit
def _argmax_pick_kernel(best_ptr, index_ptr, out_ptr, num_slices, BLOCK_S: tl.constexpr):
    launch_dependents()
    wait_for_inputs()
    row, slices = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK_S)
    best = tl.load(best_ptr + row * num_slices + slices, mask=slices < num_slices, other=float("-inf"))
    first_best = tl.argmax(tl.where(best != best, float("inf"), best), 0)  # the first slice of equal values
    _, first_best = _first_nan_wins(best, best, first_best, BLOCK_S)  # but the first NaN slice before all
    tl.store(out_ptr + row, tl.load(index_ptr + row * num_slices + first_best).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> the index of each row's largest value (the first of equal ones) [B], int64."""
    num_rows, width = x.shape
    assert x.stride(-1) == 1
    num_slices = triton.cdiv(width, ARGMAX_BLOCK)
    best = torch.empty((num_rows, num_slices), dtype=torch.float32, device=x.device)
    index = torch.empty((num_rows, num_slices), dtype=torch.int32, device=x.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    _argmax_slices_kernel[(num_rows, num_slices)](x, best, index, width, x.stride(0), num_slices,
                                                  BLOCK=ARGMAX_BLOCK, num_warps=4, launch_pdl=PDL)
    _argmax_pick_kernel[(num_rows,)](best, index, out, num_slices, BLOCK_S=triton.next_power_of_2(num_slices),
                                     num_warps=1, launch_pdl=PDL)
    return out
