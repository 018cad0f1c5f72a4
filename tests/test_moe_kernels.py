"""The kernels of moe_kernels.py against torch: expert_matvec, align_pairs_by_expert and
fused_moe_matmul; and the MoE's kernel forms against its torch form, eagerly and in a CUDA graph.

Inputs are random (never zeros), fresh outputs come filled with NaN, and the expert ids repeat
across tokens (more pairs than experts), as a decode batch's do. Without a GPU the kernels run in
Triton's interpreter at small, odd sizes (rows and columns not multiples of the blocks) in
float32 and float16; the GPU tests run at DeepSeek-V2-Lite's sizes in bfloat16.
"""

import pytest
import torch
import torch.nn.functional as F
import triton

from nano.config import load_config
from nano.deepseek import MoE
from nano.cli import SHIPPED_CONFIGS
from nano.moe_kernels import align_pairs_by_expert, expert_matvec, fused_moe_config, fused_moe_matmul
from tests.helpers import DEVICE, DTYPES, assert_close, gpu, nan_allocations, randn


def random_expert_ids(num_tokens: int, top_k: int, num_experts: int,
                      unused_expert: int | None = None) -> torch.Tensor:
    """Like the router's: k distinct experts a token. Token 0 picks the last one (the end of w)."""
    scores = torch.rand(num_tokens, num_experts, device=DEVICE)
    scores[0, -1] = 2
    if unused_expert is not None:
        scores[:, unused_expert] = -1  # no token chooses it
    return scores.topk(top_k, dim=-1).indices  # [T, k]


def reference_expert_products(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                              pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[t, j] = w[ids[t, j]] @ x[t] (x [T, K]) or @ x[t, j] (x [T, k, K]), times pair_weights[t, j]
    when given: in float32, one expert at a time -> [T, k, N] in x's dtype."""
    rows = x.float() if x.dim() == 3 else x.float()[:, None, :].expand(-1, ids.shape[1], -1)  # [T, k, K]
    out = torch.zeros(*ids.shape, w.shape[1], device=x.device)  # [T, k, N]
    for e in range(w.shape[0]):
        chosen = ids == e  # [T, k]
        out[chosen] = rows[chosen] @ w[e].float().T
    if pair_weights is not None:
        out *= pair_weights[..., None]
    return out.to(x.dtype)


def fused_expert_products(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                          pair_weights: torch.Tensor | None) -> torch.Tensor:
    """The same products through align_pairs_by_expert and fused_moe_matmul -> [T, k, N]."""
    num_tokens, top_k = ids.shape
    config = fused_moe_config(num_tokens, top_k, w.shape[0])
    pairs = align_pairs_by_expert(ids, w.shape[0], config["BLOCK_M"])
    per_pair = x.dim() == 3
    with nan_allocations():
        out = fused_moe_matmul(x.flatten(0, 1) if per_pair else x, w, *pairs, config,
                               pairs_per_row=1 if per_pair else top_k, pair_weights=pair_weights)
    return out.view(num_tokens, top_k, -1)


def check_expert_products(kernel: str, num_tokens: int, top_k: int, num_experts: int, n: int, k: int,
                          dtype: torch.dtype, input_per_expert: bool):
    w = randn(num_experts, n, k, dtype=dtype) * k**-0.5  # outputs of about unit size
    ids = random_expert_ids(num_tokens, top_k, num_experts)
    pair_weights = None
    if input_per_expert:  # the down projection's input: one row per chosen expert
        x = randn(num_tokens, top_k, k, dtype=dtype)
        pair_weights = torch.rand(num_tokens, top_k, device=DEVICE) + 0.5  # which also applies the routing weights
    else:  # the up/gate projection's: one row per token, here a column slice of a wider tensor
        x = randn(num_tokens, k + 8, dtype=dtype)[:, :k]
    if kernel == "matvec":
        with nan_allocations():
            out = expert_matvec(x, w, ids, pair_weights)
    else:
        out = fused_expert_products(x, w, ids, pair_weights)
    assert_close(out, reference_expert_products(x, w, ids, pair_weights))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("input_per_expert", [False, True], ids=["shared-input", "input-per-expert"])
@pytest.mark.parametrize("n, k", [(37, 600), (16, 100)])  # K past one block and less than one
def test_expert_matvec(n, k, input_per_expert, dtype):
    check_expert_products("matvec", num_tokens=4, top_k=3, num_experts=5, n=n, k=k, dtype=dtype,
                          input_per_expert=input_per_expert)


@pytest.mark.parametrize("num_tokens", [1, 5, 33, 200])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_pairs_by_expert(num_tokens, block_m):
    """Against a layout built pair by pair: each expert's pairs in pair order, padded with the
    sentinel to whole blocks, experts in order; then padding up to the bound, blocks of expert -1."""
    num_experts, top_k = 8, 3
    ids = random_expert_ids(num_tokens, top_k, num_experts, unused_expert=2)
    num_pairs = ids.numel()
    layout, block_experts = [], []
    for e in range(num_experts):
        run = [p for p in range(num_pairs) if ids.flatten()[p] == e]
        run += [num_pairs] * (-len(run) % block_m)
        layout += run
        block_experts += [e] * (len(run) // block_m)
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    layout += [num_pairs] * (max_blocks * block_m - len(layout))
    block_experts += [-1] * (max_blocks - len(block_experts))

    sorted_pair_ids, block_expert = align_pairs_by_expert(ids, num_experts, block_m)
    assert sorted_pair_ids.tolist() == layout
    assert block_expert.tolist() == block_experts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("input_per_expert", [False, True], ids=["up-gate", "down-weighted"])
@pytest.mark.parametrize("num_tokens", [1, 5, 33, 48, 100])  # blocks of 16, 16, 16, 32 and 64 rows
def test_fused_moe_matmul(num_tokens, input_per_expert, dtype):
    hidden, inter = 64, 48
    n, k = (hidden, inter) if input_per_expert else (2 * inter, hidden)
    check_expert_products("fused", num_tokens, top_k=3, num_experts=8, n=n, k=k, dtype=dtype,
                          input_per_expert=input_per_expert)


# ---------------------------------------------------------------- GPU, DeepSeek-V2-Lite sizes, bfloat16

V2_LITE = load_config(SHIPPED_CONFIGS / "deepseek-v2-lite")


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_gpu_expert_matvec(num_tokens):
    experts, top_k = V2_LITE.n_routed_experts, V2_LITE.num_experts_per_tok
    hidden, inter = V2_LITE.hidden_size, V2_LITE.moe_intermediate_size
    check_expert_products("matvec", num_tokens, top_k, experts, 2 * inter, hidden, torch.bfloat16, False)
    check_expert_products("matvec", num_tokens, top_k, experts, hidden, inter, torch.bfloat16, True)


@gpu
@pytest.mark.parametrize("num_tokens", [16, 64, 160, 512])
def test_gpu_fused_moe_matmul(num_tokens):
    experts, top_k = V2_LITE.n_routed_experts, V2_LITE.num_experts_per_tok
    hidden, inter = V2_LITE.hidden_size, V2_LITE.moe_intermediate_size
    check_expert_products("fused", num_tokens, top_k, experts, 2 * inter, hidden, torch.bfloat16, False)
    check_expert_products("fused", num_tokens, top_k, experts, hidden, inter, torch.bfloat16, True)


def v2_lite_moe() -> MoE:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        moe = MoE(V2_LITE).to(torch.bfloat16)
    for p in moe.parameters():  # weights scaled so each projection's outputs are of about unit size
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return moe


@gpu
@pytest.mark.parametrize("num_tokens, form", [(1, "matvec"), (8, "matvec"), (9, "fused"), (160, "fused"),
                                              (600, "fused")])  # 8: the largest bucket with T k <= E
def test_gpu_moe_kernel_forms_match_grouped(num_tokens, form):
    moe = v2_lite_moe()
    assert moe.form(num_tokens, on_cuda=True) == form
    x = randn(num_tokens, V2_LITE.hidden_size, dtype=torch.bfloat16)
    weights, ids = moe.route(x)
    assert_close(moe(x), moe.grouped(x, weights, ids) + moe.shared_experts(x))  # moe(x) runs `form`


@gpu
@pytest.mark.parametrize("num_tokens", [16, 160])
def test_gpu_fused_moe_in_cuda_graph(num_tokens):
    """The whole MoE, fused form, captured once and replayed on new inputs, equals eager exactly."""
    moe = v2_lite_moe()
    static_x = randn(num_tokens, V2_LITE.hidden_size, dtype=torch.bfloat16)
    side = torch.cuda.Stream()  # warm up (compile the kernels) off the capture stream, as torch asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
    for _ in range(2):
        x = randn(num_tokens, V2_LITE.hidden_size, dtype=torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, moe(x))


@gpu
@pytest.mark.parametrize("num_tokens", [64, 160])
def test_gpu_fused_against_every_expert_on_every_token(num_tokens):
    """The fused form against running every expert on every token and zeroing the unchosen (what
    batches this size ran before), which reads each expert once too but does E/k times the flops:
    they agree, and `pytest -s` prints the time each takes for the routed experts of one layer."""
    moe = v2_lite_moe()
    x = randn(num_tokens, V2_LITE.hidden_size, dtype=torch.bfloat16)
    weights, ids = moe.route(x)

    def every_expert():
        expert_weights = weights.new_zeros(num_tokens, moe.num_experts).scatter_(1, ids, weights)  # [T, E]
        gate, up = (x @ moe.w13.mT).chunk(2, dim=-1)  # [E, T, I] each
        return torch.einsum("eth,te->th", (F.silu(gate) * up) @ moe.w2.mT, expert_weights.to(x.dtype))

    assert_close(moe.fused(x, weights, ids), every_expert())
    fused_ms = triton.testing.do_bench(lambda: moe.fused(x, weights, ids))
    every_ms = triton.testing.do_bench(every_expert)
    print(f"\nrouted experts of one layer, {num_tokens} tokens: fused {fused_ms * 1e3:.0f} us, "
          f"every expert on every token {every_ms * 1e3:.0f} us ({every_ms / fused_ms:.1f}x)")
