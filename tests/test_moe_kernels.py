"""The kernels of moe_kernels.py against torch: route, gate_up_matvec, down_matvec,
align_pairs_by_expert and fused_moe_matmul; and the MoE's kernel forms against its torch form, eagerly and in a CUDA graph.

Inputs are random (never zeros), fresh outputs come filled with NaN, the weights are strided views
of stacks laid out as the MoE's are (expert_weights), and the expert ids repeat across tokens (more
pairs than experts), as a decode batch's do, with the last expert of every token a shared one.
Without a GPU the kernels run in Triton's interpreter at small, odd sizes (rows and columns not
multiples of the blocks) in float32 and float16; the GPU tests run at DeepSeek-V2-Lite's sizes in
bfloat16.
"""

import contextlib
import copy
import os

import pytest
import torch
import torch.nn.functional as F
import triton

from nano import ops
from nano.cli import SHIPPED_CONFIGS
from nano.config import load_config
from nano.deepseek import MoE
from nano.moe_kernels import (
    ALIGN_BLOCK_P,
    align_pairs_by_expert,
    down_matvec,
    fused_moe_config,
    fused_moe_matmul,
    gate_up_matvec,
    route,
)
from tests.helpers import DEVICE, DTYPES, assert_close, gpu, nan_allocations, randn


def random_expert_ids(num_tokens: int, top_k: int, num_experts: int,
                      unused_expert: int | None = None) -> torch.Tensor:
    """Like the router's: k distinct experts a token. Token 0 picks the last one (the end of w)."""
    scores = torch.rand(num_tokens, num_experts, device=DEVICE)
    scores[0, -1] = 2
    if unused_expert is not None:
        scores[:, unused_expert] = -1  # no token chooses it
    return scores.topk(top_k, dim=-1).indices  # [T, k]


def random_stacks(num_experts: int, inter: int, hidden: int, dtype: torch.dtype):
    """gate_up [2, E, I, hidden] and down [E, hidden, I], strided views of stacks as MoE's are."""
    w13 = randn(2 * num_experts * inter, hidden, dtype=dtype) * hidden**-0.5  # outputs of about unit size
    w2 = randn(hidden, num_experts * inter, dtype=dtype) * inter**-0.5
    return w13.view(2, num_experts, inter, hidden), w2.view(hidden, num_experts, inter).transpose(0, 1)


def random_routing(num_tokens: int, slots: int, num_experts: int):
    """(ids [T, slots], weights [T, slots] float32): slots - 1 routed, then the last expert for all."""
    ids = random_expert_ids(num_tokens, slots - 1, num_experts - 1)
    ids = torch.cat([ids, ids.new_full((num_tokens, 1), num_experts - 1)], dim=1)
    return ids, torch.rand(num_tokens, slots, device=DEVICE) + 0.5


def reference_gate_up(x, gate_up, ids):
    """[T, slots, I]: silu(gate[e] @ x[t]) * (up[e] @ x[t]) pair by pair, in float32, rounded once."""
    gate = torch.stack([gate_up[0, e].float() @ x[t].float() for t, e in enumerate(ids.tolist()) for e in e])
    up = torch.stack([gate_up[1, e].float() @ x[t].float() for t, e in enumerate(ids.tolist()) for e in e])
    return (F.silu(gate) * up).view(*ids.shape, -1).to(x.dtype)


def reference_down(h, down, ids, weights):
    """[T, hidden]: sum_j weights[t, j] * down[ids[t, j]] @ h[t, j], in float32, rounded once."""
    rows = [sum(w * (down[e].float() @ h[t, j].float()) for j, (e, w) in enumerate(zip(ids[t].tolist(), weights[t])))
            for t in range(len(ids))]
    return torch.stack(rows).to(h.dtype)


def check_route(num_tokens, hidden, num_experts, top_k, num_shared, renormalize, dtype, logit_shift=0.0):
    """The router's two kernels against torch's float32 matmul, softmax, topk, the weight rule and
    the shared experts appended. Their logits are summed in another order than torch's, so where
    two experts nearly tie either may come first: the chosen experts' torch logits must equal the
    best ones, in order, and the weights torch's. logit_shift moves every logit by that much (input
    channel 0 holds it, weighted 1), the scores staying as far apart."""
    x = randn(num_tokens, hidden + 8, dtype=dtype)[:, :hidden]  # rows of a wider tensor
    gate_weight = randn(num_experts, hidden, dtype=torch.float32) * 3 / hidden**0.5
    if logit_shift:
        x[:, 0], gate_weight[:, 0] = logit_shift, 1.0
        assert (F.linear(x.float(), gate_weight) > logit_shift - 10).all()
    with nan_allocations():
        weights, ids = route(x, gate_weight, top_k, renormalize, routed_scaling=2.5, num_shared=num_shared)
    ref_weights, ref_ids = ops.route.reference(x, gate_weight, top_k, renormalize, 2.5, num_shared)
    assert ids.shape == (num_tokens, top_k + num_shared) and torch.equal(ids[:, top_k:], ref_ids[:, top_k:])
    logits = F.linear(x.float(), gate_weight)
    torch.testing.assert_close(logits.gather(1, ids[:, :top_k]), logits.gather(1, ref_ids[:, :top_k]))
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_tokens, hidden, num_experts, top_k, num_shared",
                         [(5, 200, 64, 6, 2), (3, 72, 10, 3, 0), (40, 130, 64, 6, 2)])  # 40: ten token blocks
@pytest.mark.parametrize("renormalize", [False, True], ids=["scaled", "renormalized"])
def test_route(num_tokens, hidden, num_experts, top_k, num_shared, renormalize):
    check_route(num_tokens, hidden, num_experts, top_k, num_shared, renormalize, torch.float16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on the NaN row
def test_a_nan_row_is_routed_to_experts_that_exist():
    """NaN scores equal no maximum: the pick must still name an expert of the stacks, where a lane
    past them would send the MoE kernels to read past the weights (a device fault on a GPU)."""
    x = randn(3, 72, dtype=torch.float16)
    x[1, 5] = float("nan")
    weights, ids = route(x, randn(10, 72, dtype=torch.float32), 3, False, routed_scaling=2.5, num_shared=1)
    assert ((0 <= ids) & (ids < 10 + 1)).all(), ids
    assert ids[1, 3] == 10 and not weights[[0, 2]].isnan().any()  # the shared expert; the other rows as ever


def check_matvecs(num_tokens: int, slots: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype):
    gate_up, down = random_stacks(num_experts, inter, hidden, dtype)
    ids, weights = random_routing(num_tokens, slots, num_experts)
    x = randn(num_tokens, hidden + 8, dtype=dtype)[:, :hidden]  # a column slice of a wider tensor
    with nan_allocations():
        h = gate_up_matvec(x, gate_up, ids)
    assert_close(h, reference_gate_up(x, gate_up, ids))
    with nan_allocations():
        out = down_matvec(h, down, ids, weights)
    assert_close(out, reference_down(h, down, ids, weights))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter, hidden", [(37, 600), (16, 100)])  # K past one block and less than one
@pytest.mark.parametrize("num_tokens", [1, 4])  # a single token's down product has tiles of its own
def test_matvecs(num_tokens, inter, hidden, dtype):
    check_matvecs(num_tokens=num_tokens, slots=3, num_experts=5, inter=inter, hidden=hidden, dtype=dtype)


@pytest.mark.parametrize("num_tokens", [1, 5, 33, 200, 1000])  # 1000: three steps of pairs, the last partial
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_pairs_by_expert(num_tokens, block_m):
    """Against a layout built pair by pair: each expert's pairs in pair order, padded with the
    sentinel to whole blocks, experts in order; then padding up to the bound, blocks of expert -1."""
    num_experts, top_k = 8, 3
    assert 2 * ALIGN_BLOCK_P < 1000 * top_k < 3 * ALIGN_BLOCK_P
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

    with nan_allocations():  # int tensors come filled with their largest value: an entry left unwritten shows
        sorted_pair_ids, block_expert = align_pairs_by_expert(ids, num_experts, block_m)
    assert sorted_pair_ids.tolist() == layout
    assert block_expert.tolist() == block_experts


def check_fused(num_tokens: int, slots: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype):
    """Both products of fused_moe_matmul against pair-by-pair float32 ones: gate_up (one input row
    per token, gate rows then up rows out) and down (one row per pair, weighted)."""
    gate_up, down = random_stacks(num_experts, inter, hidden, dtype)
    ids, weights = random_routing(num_tokens, slots, num_experts)
    config = fused_moe_config(num_tokens, slots - 1, num_experts - 1, num_shared=1)
    pairs = align_pairs_by_expert(ids, num_experts, config["BLOCK_M"])
    x = randn(num_tokens, hidden + 8, dtype=dtype)[:, :hidden]
    h = randn(num_tokens * slots, inter, dtype=dtype)
    with nan_allocations():
        out_up = fused_moe_matmul(x, gate_up, *pairs, config, pairs_per_row=slots)
        out_down = fused_moe_matmul(h, down, *pairs, config, pair_weights=weights)
    experts, tokens = ids.flatten().tolist(), [p // slots for p in range(ids.numel())]
    ref_up = torch.stack([gate_up[:, e].flatten(0, 1).float() @ x[t].float() for e, t in zip(experts, tokens)])
    ref_down = torch.stack([down[e].float() @ row.float() for e, row in zip(experts, h)]) * weights.view(-1, 1)
    assert_close(out_up, ref_up.to(dtype))
    assert_close(out_down, ref_down.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5, 33, 48, 100])  # blocks of 16, 16, 16, 32 and 64 rows
def test_fused_moe_matmul(num_tokens, dtype):
    check_fused(num_tokens, slots=4, num_experts=9, inter=40, hidden=64, dtype=dtype)  # tiles cross gate/up


def test_fused_moe_matmul_accumulates_a_long_k_in_float32():
    """float16 at DeepSeek-V2-Lite's hidden size (2048, 32 K-steps of 64): the sum over K must stay
    in float32 and be rounded once, as the reference is."""
    check_fused(5, slots=4, num_experts=9, inter=40, hidden=2048, dtype=torch.float16)


@pytest.mark.parametrize("renormalize", [False, True], ids=["scaled", "renormalized"])
def test_route_softmax_survives_logits_past_float32_exp_range(renormalize):
    """Router logits near 100 (exp overflows float32 past 88): the softmax must subtract the row's
    max first, as torch's does, or every score is inf / inf = NaN."""
    check_route(3, 72, 10, 3, 1, renormalize, torch.float16, logit_shift=100.0)


# ---------------------------------------------------------------- GPU, DeepSeek-V2-Lite sizes, bfloat16

V2_LITE = load_config(SHIPPED_CONFIGS / "deepseek-v2-lite")
V2_LITE_SLOTS = V2_LITE.num_experts_per_tok + V2_LITE.n_shared_experts
V2_LITE_EXPERTS = V2_LITE.n_routed_experts + V2_LITE.n_shared_experts


@gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 160, 1000])
def test_gpu_route(num_tokens):  # DeepSeek-V2-Lite's router
    check_route(num_tokens, 2048, 64, 6, 2, renormalize=False, dtype=torch.bfloat16)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_gpu_matvecs(num_tokens):
    check_matvecs(num_tokens, V2_LITE_SLOTS, V2_LITE_EXPERTS, V2_LITE.moe_intermediate_size, V2_LITE.hidden_size,
                  torch.bfloat16)


@gpu
@pytest.mark.parametrize("num_tokens", [16, 64, 160, 512])
def test_gpu_fused_moe_matmul(num_tokens):
    check_fused(num_tokens, V2_LITE_SLOTS, V2_LITE_EXPERTS, V2_LITE.moe_intermediate_size, V2_LITE.hidden_size,
                torch.bfloat16)


def v2_lite_moe() -> MoE:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        moe = MoE(V2_LITE).to(torch.bfloat16)
    # weights scaled so each projection's outputs are of about unit size
    for weight, fan_in in [(moe.gate.weight, V2_LITE.hidden_size), (moe.w13, V2_LITE.hidden_size),
                           (moe.w2, V2_LITE.moe_intermediate_size)]:
        torch.nn.init.normal_(weight, std=fan_in**-0.5)
    return moe


@gpu
@pytest.mark.parametrize("num_tokens, form", [(1, "matvec"), (4, "matvec"), (5, "fused"), (160, "fused"),
                                              (600, "fused")])  # 4: the largest bucket with 2 T (k + S) <= E + S
def test_gpu_moe_kernel_forms_match_grouped(num_tokens, form):
    moe = v2_lite_moe()
    assert moe.form(num_tokens, on_cuda=True) == form
    x = randn(num_tokens, V2_LITE.hidden_size, dtype=torch.bfloat16)
    weights, ids = moe.route(x)
    # The reference in float32: the kernels sum a token's 8 expert rows (of about unit size) in
    # float32 and round once, where grouped rounds each row to bf16 first (4e-3 apart each).
    reference = copy.deepcopy(moe).float().grouped(x.float(), weights, ids)
    torch.testing.assert_close(moe(x).float(), reference, atol=3e-2, rtol=1e-2)  # moe(x) runs `form`


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

    def every_expert(dtype=torch.bfloat16):
        gate_up, down = (w.to(dtype) for w in moe.expert_weights())
        expert_weights = weights.new_zeros(num_tokens, len(down)).scatter_(1, ids, weights)  # [T, E + S]
        gate, up = x.to(dtype) @ gate_up[0].mT, x.to(dtype) @ gate_up[1].mT  # [E + S, T, I] each
        return torch.einsum("eth,te->th", (F.silu(gate) * up) @ down.mT, expert_weights.to(dtype))

    # in float32: each form rounds a token's 8 expert rows of about unit size (4e-3 apart each)
    torch.testing.assert_close(moe.fused(x, weights, ids).float(), every_expert(torch.float32), atol=3e-2, rtol=1e-2)
    fused_ms = triton.testing.do_bench(lambda: moe.fused(x, weights, ids))
    every_ms = triton.testing.do_bench(every_expert)
    print(f"\nexperts of one layer (shared ones too), {num_tokens} tokens: fused {fused_ms * 1e3:.0f} us, "
          f"every expert on every token {every_ms * 1e3:.0f} us ({every_ms / fused_ms:.1f}x)")


@contextlib.contextmanager
def programs_in_reverse_order():
    """Triton's interpreter runs a grid's programs one after another in order; a GPU runs them in any
    order, at once. A kernel whose program writes where a later program's output goes (and is
    overwritten by it) passes in order: run the grid last program first too."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    original = type(builder).set_grid_idx

    def reversed_idx(self, x, y, z):
        nx, ny, nz = self.grid_dim
        original(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    type(builder).set_grid_idx = reversed_idx
    try:
        yield
    finally:
        type(builder).set_grid_idx = original


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="reorders the interpreter's programs")
@pytest.mark.parametrize("num_tokens", [5, 33])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_pairs_by_expert_writes_only_its_own_run(num_tokens, block_m):
    """Each expert's program writes its own run, padding and blocks only (the last also the padding past
    every run): the layout cannot depend on the order the programs run in."""
    num_experts, top_k = 8, 3
    ids = random_expert_ids(num_tokens, top_k, num_experts, unused_expert=2)
    with nan_allocations():
        in_order = align_pairs_by_expert(ids, num_experts, block_m)
    with nan_allocations(), programs_in_reverse_order():
        reversed_ = align_pairs_by_expert(ids, num_experts, block_m)
    assert in_order[0].tolist() == reversed_[0].tolist()
    assert in_order[1].tolist() == reversed_[1].tolist()
