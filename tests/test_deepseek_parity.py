"""nano's DeepSeek-V2 vs HF transformers' DeepseekV2ForCausalLM on tiny random models, float32 on CPU.

Same pattern as test_llama_parity: a batch of prompts of different lengths (some past YaRN's
original context of 32) goes through one prefill and several batched decode steps, with latent
(MLA) attention and with K/V expanded per head; every step's logits must equal HF's full forward.
The MoE's three forms are checked against HF's MoE block on their own."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nano import deepseek  # noqa: E402
from nano.config import parse_config  # noqa: E402
from nano.engine import Engine, EngineConfig  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402
from tests.helpers import (DEEPSEEK_TINY, DEEPSEEK_VARIANTS, assert_matches_hf,  # noqa: E402
                           frequency_bands, random_prompts, record_logits, save_tiny_deepseek)

def renormalise_like_deepseek(monkeypatch):
    """HF 5.24's router drops norm_topk_prob (no released V2 checkpoint sets it); DeepSeek's own
    code renormalises the top-k weights instead of scaling them, when k > 1. Make HF do the same."""
    router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter
    hf_forward = router.forward

    def forward(self, hidden_states):
        logits, weights, ids = hf_forward(self, hidden_states)
        if self.top_k == 1:  # one expert's weight is scaled, not renormalised to 1
            return logits, weights, ids
        weights = weights / self.routed_scaling_factor
        return logits, weights / weights.sum(dim=-1, keepdim=True), ids

    monkeypatch.setattr(router, "forward", forward)


def run_and_compare(path, hf_model, monkeypatch, use_mla, lengths=(5, 17, 1, 40), new_tokens=6):
    steps = record_logits(monkeypatch)
    prompts = random_prompts(list(lengths), DEEPSEEK_TINY["vocab_size"])
    engine = Engine(path, EngineConfig(max_total_tokens=256, use_mla=use_mla, log=False))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    assert all(len(o) == new_tokens for o in outputs)
    assert_matches_hf(hf_model, prompts, outputs, steps)


def test_rope_bands():
    """The parity tests check YaRN's ramp (the share of each frequency divided by the factor) at
    both ends and in between only if the tiny config has channels there. The ramp is exactly 0 at
    one channel and exactly 1 at one: two at an end means one where the clamp acts."""
    cfg = parse_config(transformers.DeepseekV2Config(**DEEPSEEK_TINY).to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]})
    kept, on_ramp, divided = frequency_bands(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert kept >= 2 and on_ramp >= 1 and divided >= 2, (kept, on_ramp, divided)


@pytest.mark.parametrize("use_mla", [True, False], ids=["mla", "expanded"])
@pytest.mark.parametrize("variant", list(DEEPSEEK_VARIANTS))
def test_prefill_and_decode_match_hf(tmp_path, monkeypatch, variant, use_mla):
    hf_model = save_tiny_deepseek(tmp_path, variant)
    if DEEPSEEK_VARIANTS[variant].get("norm_topk_prob"):
        renormalise_like_deepseek(monkeypatch)
    run_and_compare(tmp_path, hf_model, monkeypatch, use_mla)


def test_hub_config_form(tmp_path, monkeypatch):
    hf_model = save_tiny_deepseek(tmp_path, "lite", config_form="v4")
    assert json.loads((tmp_path / "config.json").read_text())["rope_scaling"]["type"] == "yarn"
    run_and_compare(tmp_path, hf_model, monkeypatch, use_mla=True, lengths=(45, 2), new_tokens=4)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_moe_forms_match_hf(num_tokens):
    """The grouped, matvec and fused forms each equal HF's MoE block (on CPU the engine runs only
    grouped, so the parity tests above see no other)."""
    torch.manual_seed(0)
    hf_cfg = transformers.DeepseekV2Config(**DEEPSEEK_TINY, routed_scaling_factor=1.5)
    hf_moe = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(hf_cfg)
    for p in hf_moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe = deepseek.MoE(parse_config(hf_cfg.to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}))
    shared, experts = hf_moe.shared_experts, hf_cfg.n_routed_experts
    gate_up, down = moe.expert_weights()  # views of the stacks: the routed experts, then the shared ones
    with torch.no_grad():
        moe.gate.weight.copy_(hf_moe.gate.weight)
        gate_up[:, :experts].copy_(hf_moe.experts.gate_up_proj.unflatten(1, (2, -1)).transpose(0, 1))
        down[:experts].copy_(hf_moe.experts.down_proj)
        gate_up[0, experts:].copy_(shared.gate_proj.weight.view(gate_up[0, experts:].shape))
        gate_up[1, experts:].copy_(shared.up_proj.weight.view(gate_up[1, experts:].shape))
        down[experts:].copy_(shared.down_proj.weight.unflatten(1, (-1, down.shape[2])).transpose(0, 1))
        x = torch.randn(num_tokens, DEEPSEEK_TINY["hidden_size"])
        expected = hf_moe(x[None])[0]
        weights, ids = moe.route(x)
        forms = [moe.grouped]
        # matvec and fused are Triton kernels: on these CPU tensors they run only in Triton's
        # interpreter (conftest), slowly, matvec (a program per pair) too slowly for the prefill size
        if not torch.cuda.is_available():
            forms += [moe.matvec, moe.fused] if num_tokens < 300 else [moe.fused]
        for form in forms:
            torch.testing.assert_close(form(x, weights, ids), expected, atol=1e-5, rtol=1e-5, msg=form.__name__)
        torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("use_mla", [True, False], ids=["mla", "expanded"])
def test_bfloat16_on_gpu_matches_hf_float32(tmp_path, monkeypatch, use_mla, backend):
    """The GPU path in bfloat16 against HF in float32, within 10% in norm at every step. Its
    bound was measured on HF's norms at 1: with norm weights drawn around 1, as the float32
    tests here draw them, bfloat16 drifts past it in all four cases (on an H100 on 2026-12-08; the
    three whose figures came back were 10.5-13% off at the worst step). A real bug is off by O(1); the norm weights are held by the float32 tests and
    the Triton kernels' own tests."""
    hf_model = save_tiny_deepseek(tmp_path, "lite", random_norms=False)
    steps = record_logits(monkeypatch)
    prompts = random_prompts([5, 17, 1, 40], DEEPSEEK_TINY["vocab_size"])
    engine = Engine(tmp_path, EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                    max_total_tokens=256, use_mla=use_mla, log=False))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps, max_rel_error=0.1)  # see the Llama twin
