"""expert_matvec (moe_kernels.py) against torch, and the MoE's matvec form against its dense form.

Inputs are random (never zeros), fresh outputs come filled with NaN, and the expert ids repeat
across tokens (more pairs than experts), as a decode batch's do. Without a GPU the kernel runs in
Triton's interpreter at small, odd sizes (rows and columns not multiples of the blocks) in
float32 and float16; the GPU tests run at DeepSeek-V2-Lite's sizes in bfloat16.
"""

import pytest
import torch

from nano.config import load_config
from nano.deepseek import MoE
from nano.generate import SHIPPED_CONFIGS
from nano.moe_kernels import expert_matvec
from tests.test_triton_attn import nan_allocations
from tests.test_triton_ops import DEVICE, DTYPES, assert_close, gpu, randn


def random_expert_ids(num_tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Like the router's: k distinct experts a token. Token 0 picks the last one (the end of w)."""
    scores = torch.rand(num_tokens, num_experts, device=DEVICE)
    scores[0, -1] = 2
    return scores.topk(top_k, dim=-1).indices  # [T, k]


def reference_expert_matvec(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    rows = x.float() if x.dim() == 3 else x.float()[:, None, :].expand(-1, ids.shape[1], -1)  # [T, k, K]
    return torch.einsum("tjk,tjnk->tjn", rows, w.float()[ids]).to(x.dtype)  # [T, k, N]


def check_expert_matvec(num_tokens: int, top_k: int, num_experts: int, n: int, k: int, dtype: torch.dtype,
                        input_per_expert: bool):
    w = randn(num_experts, n, k, dtype=dtype) * k**-0.5  # outputs of about unit size
    ids = random_expert_ids(num_tokens, top_k, num_experts)
    if input_per_expert:  # the down projection's input: one row per chosen expert
        x = randn(num_tokens, top_k, k, dtype=dtype)
    else:  # the up/gate projection's: one row per token, here a column slice of a wider tensor
        x = randn(num_tokens, k + 8, dtype=dtype)[:, :k]
    with nan_allocations():
        out = expert_matvec(x, w, ids)
    assert_close(out, reference_expert_matvec(x, w, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("input_per_expert", [False, True], ids=["shared-input", "input-per-expert"])
@pytest.mark.parametrize("n, k", [(37, 600), (16, 100)])  # K past one block and less than one
def test_expert_matvec(n, k, input_per_expert, dtype):
    check_expert_matvec(num_tokens=4, top_k=3, num_experts=5, n=n, k=k, dtype=dtype,
                        input_per_expert=input_per_expert)


# ---------------------------------------------------------------- GPU, DeepSeek-V2-Lite sizes, bfloat16

V2_LITE = load_config(SHIPPED_CONFIGS / "deepseek-v2-lite")


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_gpu_expert_matvec(num_tokens):
    experts, top_k = V2_LITE.n_routed_experts, V2_LITE.num_experts_per_tok
    hidden, inter = V2_LITE.hidden_size, V2_LITE.moe_intermediate_size
    check_expert_matvec(num_tokens, top_k, experts, 2 * inter, hidden, torch.bfloat16, input_per_expert=False)
    check_expert_matvec(num_tokens, top_k, experts, hidden, inter, torch.bfloat16, input_per_expert=True)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 10])  # 10: the most that runs matvec (T k <= E)
def test_gpu_moe_matvec_matches_dense(num_tokens):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        moe = MoE(V2_LITE).to(torch.bfloat16)
    for p in moe.parameters():  # weights scaled so each projection's outputs are of about unit size
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    x = randn(num_tokens, V2_LITE.hidden_size, dtype=torch.bfloat16)
    weights, ids = moe.route(x)
    assert_close(moe(x), moe.dense(x, weights, ids) + moe.shared_experts(x))  # moe(x) runs matvec
