"""The fused kernels of triton_ops.py against torch references: ops.py's (`op.reference`), or HF's
formula where its rounding order is the point.

Inputs are random (never zeros, so a kernel that skips work cannot pass by luck), fresh outputs
are filled with NaN before the kernel runs, and in-place rope is checked over the whole tensor it
was carved out of, so a write outside its view shows up too. Without a GPU the kernels run in
Triton's interpreter at small, odd sizes in float32 and float16; the GPU tests run at
Llama-3-8B's sizes in bfloat16.
"""

import pytest
import torch
import torch.nn.functional as F

from nano import ops
from nano.moe_kernels import route
from nano.rope import RotaryEmbedding
from nano.triton_ops import (SPLIT_K_MAX_ROWS, apply_rope_, argmax, fused_add_rms_norm, linear, linear_silu_and_mul,
                             silu_and_mul)
from tests.helpers import DEVICE, DTYPES, assert_close, gpu, nan_allocations, randn

DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
LLAMA_3_1_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: normalise in float32, round to x's dtype, then multiply by the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def check_norms(num_tokens: int, hidden: int, dtype: torch.dtype, row_stride: int, scale: float = 1.0):
    """x is a column slice of a wider tensor when row_stride > hidden (DeepSeek's latent): the
    kernel reads strided rows and writes nothing into x or the columns past it. At a scale of
    1e-3 (Llama's embeddings) a row's mean square is near eps, which then moves the output by tens
    of percent, not by a rounding."""
    wide = scale * randn(num_tokens, row_stride, dtype=dtype)
    x, original = wide[:, :hidden], wide.clone()  # [T, hidden], strided rows
    residual = scale * randn(num_tokens, hidden, dtype=dtype)
    weight = 1 + 0.1 * randn(hidden, dtype=dtype)
    eps = 1e-6
    with nan_allocations():
        normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
        alone, first_residual = fused_add_rms_norm(x, None, weight, eps)  # the first layer: nothing to add
    assert_close(new_residual, x + residual)
    assert_close(normed, reference_rms_norm(x + residual, weight, eps))
    assert_close(alone, reference_rms_norm(x, weight, eps))
    assert first_residual is x
    assert torch.equal(wide, original)


def check_split_k(num_tokens: int, hidden: int, in_features: int, dtype: torch.dtype):
    """A split-K linear hands on the products of in's two halves, and the residual add sums them.
    Each half is rounded to dtype (cuBLAS may also reduce inside a half in bf16, as torch allows),
    so their sum is held to the exact product in norm, within 2^-7 (bf16 rounds at 2^-9 on
    average); a wrong half would be off by O(1)."""
    x = randn(num_tokens, in_features, dtype=dtype)
    weight = randn(hidden, in_features, dtype=dtype) / in_features**0.5
    residual, norm_weight = randn(num_tokens, hidden, dtype=dtype), 1 + 0.1 * randn(hidden, dtype=dtype)
    parts = linear(x, weight, split_k=True).float()  # [2, T, hidden]
    assert parts.shape == (2, num_tokens, hidden) and linear(x[:1], weight, split_k=True).shape == (1, hidden)
    exact = F.linear(x.double(), weight.double())
    assert (parts.sum(0) - exact).norm() <= exact.norm() / 2**7
    assert linear(randn(SPLIT_K_MAX_ROWS + 1, in_features, dtype=dtype), weight, split_k=True).dim() == 2  # one product
    with nan_allocations():
        normed, new_residual = fused_add_rms_norm(parts.to(dtype), residual, norm_weight, 1e-6)
    ref_normed, ref_residual = ops.fused_add_rms_norm.reference(parts.to(dtype), residual, norm_weight, 1e-6)
    assert_close(new_residual, ref_residual)
    assert_close(normed, ref_normed)


def check_silu_and_mul(num_tokens: int, intermediate: int, dtype: torch.dtype):
    gate_up = 2 * randn(num_tokens, 2 * intermediate, dtype=dtype)  # [T, 2I]
    with nan_allocations():
        out = silu_and_mul(gate_up)
    assert_close(out, reference_silu_and_mul(gate_up))


def check_rope(rotary: RotaryEmbedding, buffers: tuple[torch.Tensor, ...], carve, positions: torch.Tensor):
    """carve(*buffers) -> (q, k, options): views into the buffers, options apply_rope_'s q_out and
    norm. Rotates q and k in place, or q into q_out, and norms the norm's rows in place; everything
    else in the buffers must be left as it was."""
    expected = tuple(b.clone() for b in buffers)
    q, k, options = carve(*expected)
    ops.apply_rope_.reference(q, k, rotary.cos_sin, positions, **options)
    q, k, options = carve(*buffers)
    apply_rope_(q, k, rotary.cos_sin, positions, **options)
    for out, ref in zip(buffers, expected, strict=True):
        assert_close(out, ref)


def check_rope_fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         scaling: dict | None):
    """q and k are [T, heads, head_dim] views of a fused qkv output, as in LlamaAttention."""
    max_positions = 4096
    rotary = RotaryEmbedding(head_dim, max_positions, 500000.0, scaling).to(DEVICE)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = randn(num_tokens, sum(sizes), dtype=dtype)  # [T, (H + 2 Hkv) D]

    def carve(qkv):
        q, k, _ = qkv.split(sizes, dim=-1)
        return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), {}

    positions = torch.randint(0, max_positions, (num_tokens,), device=DEVICE)
    check_rope(rotary, (qkv,), carve, positions)


def check_argmax(num_rows: int, width: int, dtype: torch.dtype):
    """Rows of a wider tensor, whose columns past the view hold larger values than any in it; first
    with random values, all below 0 (ties between the largest are common in bfloat16), then with
    each row's largest value planted three times: at a random place, beside it, and at the row's end
    (another slice, unless the row is one). The first of equal values must win, as in torch's argmax (the
    interpreter ignores Triton's tie-break: only the GPU tests check it). Then NaN in the first row."""
    wide = -1 - randn(num_rows, width + 3, dtype=dtype).abs()  # below 0, as log-probabilities: a lane
    wide[:, width:] = 100.0  # past the row (or a padded slice) read as 0 would win
    x = wide[:, :width]
    expected = ops.argmax.reference(x)
    with nan_allocations():
        assert torch.equal(argmax(x), expected)
    rows, first = torch.arange(num_rows, device=DEVICE), torch.randint(0, width - 2, (num_rows,), device=DEVICE)
    for at in (first + 1, torch.full_like(first, width - 1), first):
        x[rows, at] = 10.0
    with nan_allocations():
        assert torch.equal(argmax(x), first)
    x[0, 0], x[0, -1] = float("inf"), float("nan")  # NaN counts as larger than any value, +inf too (torch)
    with nan_allocations():
        assert argmax(x)[0] == ops.argmax.reference(x)[0] == width - 1  # in the +inf's slice or a later one
    x[0, 1], x[0, -1] = float("nan"), float("inf")  # the first NaN wins, before a later +inf
    with nan_allocations():
        assert argmax(x)[0] == ops.argmax.reference(x)[0] == 1
    x[0] = float("nan")  # a row gone NaN (an overflow upstream) picks the first token, not one past the vocabulary
    with nan_allocations():
        assert argmax(x)[0] == 0


# ---------------------------------------------------------------- small, odd sizes (CPU: interpreter)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden, row_stride", [(576, 576), (512, 576), (100, 100)])
def test_norms(hidden, row_stride, dtype):
    check_norms(5, hidden, dtype, row_stride)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k(dtype):
    check_split_k(70, 100, 96, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [1536, 100])  # past one block of columns, and less than one
def test_silu_and_mul(intermediate, dtype):
    check_silu_and_mul(3, intermediate, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_on_fused_qkv(dtype):
    check_rope_fused_qkv(5, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, scaling=None)


def check_rope_deepseek_slices(num_tokens: int, dtype: torch.dtype, into_query: bool):
    """MLA rotates q_pe = q[..., 128:192] of every head and the one shared k_pe [T, 1, 64], the
    last 64 columns of the kv_a projection [T, 576], and in the same launch norms the latent, its
    first 512; absorbed, it writes q_pe into the last 64 channels of the attention query [T, H, 576]
    instead."""
    num_heads, nope, rope = 16, 128, 64
    rotary = RotaryEmbedding(rope, 8192, 10000.0, DEEPSEEK_YARN).to(DEVICE)
    q = randn(num_tokens, num_heads, nope + rope, dtype=dtype)
    kv_a = randn(num_tokens, 512 + rope, dtype=dtype)
    query = randn(num_tokens, num_heads, 512 + rope, dtype=dtype)
    weight = 1 + 0.1 * randn(512, dtype=dtype)

    def carve(q, kv_a, query):  # q_pe [T, H, 64], k_pe [T, 1, 64] (, the query's q_pe [T, H, 64])
        options = {"norm": (kv_a[:, :512], weight, 1e-6)} | ({"q_out": query[..., 512:]} if into_query else {})
        return q[..., nope:], kv_a[:, 512:].unsqueeze(1), options

    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    positions[:2] = torch.tensor([0, 8191])[:num_tokens]  # the table's first and last rows
    check_rope(rotary, (q, kv_a, query), carve, positions)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("into_query", [False, True], ids=["in place", "into the query"])
def test_rope_on_deepseek_slices(dtype, into_query):
    check_rope_deepseek_slices(5, dtype, into_query)


def check_linear(out_features: int, in_features: int, dtype: torch.dtype, bias: bool):
    """The one-row mat-vec against a float32 matmul, x a row of a wider tensor; two rows go to torch."""
    x = randn(2, in_features + 8, dtype=dtype)[:, :in_features]
    weight = randn(out_features, in_features, dtype=dtype) / in_features**0.5
    b = randn(out_features, dtype=dtype) if bias else None
    with nan_allocations():
        out = linear(x[:1], weight, b)
    assert_close(out, F.linear(x[:1].float(), weight.float(), None if b is None else b.float()).to(dtype))
    assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))


def check_linear_silu_and_mul(intermediate: int, in_features: int, dtype: torch.dtype):
    """The gated mat-vec against a float32 matmul rounded to dtype (the gate/up output), then
    SiLU-and-mul in float32; two rows go to torch."""
    x = randn(2, in_features + 8, dtype=dtype)[:, :in_features]
    weight = randn(2 * intermediate, in_features, dtype=dtype) / in_features**0.5
    with nan_allocations():
        out = linear_silu_and_mul(x[:1], weight)
    gate, up = F.linear(x[:1].float(), weight.float()).to(dtype).float().chunk(2, dim=-1)
    assert_close(out, (F.silu(gate) * up).to(dtype))
    assert torch.equal(linear_silu_and_mul(x, weight), silu_and_mul(F.linear(x, weight)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_features, in_features, bias", [(37, 2100, False), (8, 64, True), (12, 2048, False)])  # partial and whole tiles
def test_linear(out_features, in_features, bias, dtype):
    check_linear(out_features, in_features, dtype, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate, in_features", [(37, 2100), (12, 2048)])  # partial and whole tiles
def test_linear_silu_and_mul(intermediate, in_features, dtype):
    check_linear_silu_and_mul(intermediate, in_features, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [100, 4096, 10000])  # one partial slice, one whole, three
def test_argmax(width, dtype):
    check_argmax(3, width, dtype)


def test_argmax_on_cpu_picks_the_first_of_equal_largest_values():
    """Greedy sampling's choice between tied logits: the first, as the Triton kernel and torch pick."""
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    x[:, [7, 30, 41]] = x.max() + 1
    x[2, 3] = x.max()  # row 2: tied at 3, 7, 30 and 41
    assert ops.argmax(x).tolist() == [7, 7, 3, 7]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_of_small_rows_adds_epsilon_inside_the_root(dtype):
    check_norms(5, 100, dtype, row_stride=100, scale=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_launch_norms_a_latent_narrower_than_its_block(dtype):
    """The norm that shares rope's launch, on a latent of 100 channels (a block of 128) followed in
    its row by the rope part: the norm must neither read nor write the rope part's channels."""
    num_tokens, num_heads, rope, width = 5, 3, 16, 100
    rotary = RotaryEmbedding(rope, 64, 10000.0, None).to(DEVICE)
    q, kv_a = randn(num_tokens, num_heads, rope, dtype=dtype), randn(num_tokens, width + rope, dtype=dtype)
    weight = 1 + 0.1 * randn(width, dtype=dtype)
    positions = torch.randint(0, 64, (num_tokens,), device=DEVICE)

    def carve(q, kv_a):  # q_pe [T, H, 16], k_pe [T, 1, 16] (the row's last 16 channels), the latent's norm
        return q, kv_a[:, width:].unsqueeze(1), {"norm": (kv_a[:, :width], weight, 1e-6)}

    check_rope(rotary, (q, kv_a), carve, positions)


# ---------------------------------------------------------------- GPU, Llama-3-8B sizes, bfloat16


@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 160])
def test_gpu_norms(num_tokens):
    check_norms(num_tokens, 4096, torch.bfloat16, row_stride=4096)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 160])
def test_gpu_silu_and_mul(num_tokens):
    check_silu_and_mul(num_tokens, 14336, torch.bfloat16)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 160])
def test_gpu_rope(num_tokens):
    check_rope_fused_qkv(num_tokens, 32, 8, 128, torch.bfloat16, LLAMA_3_1_SCALING)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 160])
def test_gpu_rope_on_deepseek_slices(num_tokens):
    check_rope_deepseek_slices(num_tokens, torch.bfloat16, into_query=True)


@gpu
@pytest.mark.parametrize("num_tokens, in_features", [(64, 4096), (160, 14336)])
def test_gpu_split_k(num_tokens, in_features):  # Llama-3-8B's o_proj and down_proj
    check_split_k(num_tokens, 4096, in_features, torch.bfloat16)


@gpu
@pytest.mark.parametrize("out_features, in_features", [(6144, 4096), (4096, 14336), (2048, 10944)])
def test_gpu_linear(out_features, in_features):  # Llama-3-8B's q/k/v and down_proj, DeepSeek's dense down_proj
    check_linear(out_features, in_features, torch.bfloat16, bias=False)


@gpu
@pytest.mark.parametrize("intermediate, in_features", [(14336, 4096), (10944, 2048)])
def test_gpu_linear_silu_and_mul(intermediate, in_features):  # Llama-3-8B's and DeepSeek's dense gate/up
    check_linear_silu_and_mul(intermediate, in_features, torch.bfloat16)


@gpu
@pytest.mark.parametrize("num_rows, width", [(1, 128256), (160, 128256), (1, 102400)])  # Llama-3's vocabulary, DeepSeek-V2's
def test_gpu_argmax(num_rows, width):
    check_argmax(num_rows, width, torch.bfloat16)  # where random values tie often


@gpu
def test_gpu_kernels_started_early_wait_for_their_inputs():
    """Programmatic dependent launch (triton_ops.py): every kernel lets the next one start at once,
    then waits for its inputs. Behind a slow mat-vec (128 programs, each reading 8 MB) the kernels
    of a CUDA graph start long before their inputs exist; every output is set to NaN before the
    replay, so a kernel that read its input before waiting would not match the same ops run one
    at a time."""
    x = randn(1, 1 << 20, dtype=torch.bfloat16)
    slow = randn(512, 1 << 20, dtype=torch.bfloat16) / 1024  # 1 GB, read by 128 programs
    norm_weight = 1 + 0.1 * randn(512, dtype=torch.bfloat16)
    gate_up = randn(2048, 512, dtype=torch.bfloat16) / 16
    router = randn(64, 1024, dtype=torch.float32)

    def chain(step=lambda: None):
        outputs = [linear(x, slow)]  # [1, 512]
        for op in (lambda y: fused_add_rms_norm(y, None, norm_weight, 1e-6)[0], lambda y: linear(y, gate_up),
                   silu_and_mul, lambda y: route(y, router, 6, True, 1.0)[0]):
            step()
            outputs.append(op(outputs[-1]))
        return outputs

    expected = chain(step=torch.cuda.synchronize)  # one kernel at a time
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = chain()
    for out in outputs:
        out.fill_(float("nan"))
    graph.replay()
    for out, ref in zip(outputs, expected, strict=True):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-5, 1e-2])  # Llama's, and one far from every other test's 1e-6
def test_norms_use_the_eps_they_are_given(eps, dtype):
    """Rows of about 1e-3 (mean square 1e-6): the eps given, not some default, sets the output."""
    x, residual = 1e-3 * randn(5, 100, dtype=dtype), 1e-3 * randn(5, 100, dtype=dtype)
    weight = 1 + 0.1 * randn(100, dtype=dtype)
    with nan_allocations():
        normed, _ = fused_add_rms_norm(x, residual, weight, eps)
        alone, _ = fused_add_rms_norm(x, None, weight, eps)
    assert_close(normed, reference_rms_norm(x + residual, weight, eps))
    assert_close(alone, reference_rms_norm(x, weight, eps))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_launch_norm_uses_its_eps(dtype):
    """The norm in rope's launch with an eps of 0.5 on rows of unit size: a kernel that drops it moves
    every output by tens of percent."""
    num_tokens, num_heads, rope, width = 5, 3, 16, 64
    rotary = RotaryEmbedding(rope, 64, 10000.0, None).to(DEVICE)
    q, kv_a = randn(num_tokens, num_heads, rope, dtype=dtype), randn(num_tokens, width + rope, dtype=dtype)
    weight = 1 + 0.1 * randn(width, dtype=dtype)
    positions = torch.randint(0, 64, (num_tokens,), device=DEVICE)

    def carve(q, kv_a):
        return q, kv_a[:, width:].unsqueeze(1), {"norm": (kv_a[:, :width], weight, 0.5)}

    check_rope(rotary, (q, kv_a), carve, positions)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_on_heads_whose_half_is_not_a_power_of_two(dtype):
    """Head dim 100 (OpenLLaMA-3B): halves of 50 in 64-lane tiles. The second half starts at 50, as
    does sin in the cos/sin row, and lanes 50-63 of a tile belong to the other half."""
    check_rope_fused_qkv(5, num_heads=6, num_kv_heads=2, head_dim=100, dtype=dtype, scaling=None)


@pytest.mark.skipif(DEVICE != "cpu", reason="measured under the interpreter, whose float32 is torch's")
def test_norm_rounds_where_hf_does():
    """float16 rows 4096 wide: the residual sum rounded to float16 before it is normalised, and the
    normalised row rounded before the weight multiplies it (HF's order, reference_rms_norm). Another
    order moves about a quarter of the outputs by one float16 step, within assert_close's 1e-3; the
    kernel's own summation order may move a few: at least 99% must equal HF's bit for bit."""
    x, residual = randn(64, 4096, dtype=torch.float16), randn(64, 4096, dtype=torch.float16)
    weight = 1 + 0.1 * randn(4096, dtype=torch.float16)
    with nan_allocations():
        normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    same = (normed == reference_rms_norm(x + residual, weight, 1e-6)).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of outputs equal HF's"
