"""nano's Llama vs HF transformers' LlamaForCausalLM on tiny random models, in float32 on CPU.

The engine runs a batch of prompts of different lengths through one prefill and several batched
decode steps; every step's logits must equal HF's full forward over the same tokens."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nano.config import parse_config  # noqa: E402
from nano.engine import Engine, EngineConfig  # noqa: E402
from nano.rope import rope_frequencies  # noqa: E402
from nano.sampling import SamplingParams  # noqa: E402
from tests.helpers import (LLAMA_TINY, LLAMA_VARIANTS, assert_matches_hf, frequency_bands,  # noqa: E402
                           random_prompts, record_logits, save_tiny_llama)

def test_rope_bands():
    """llama3 keeps a frequency, blends it or divides it, by its wavelength: the parity tests check
    each of the three only if the tiny config puts a frequency in its band."""
    cfg = parse_config(transformers.LlamaConfig(**LLAMA_TINY, **LLAMA_VARIANTS["llama3-rope"]).to_dict()
                       | {"architectures": ["LlamaForCausalLM"]})
    kept, blended, divided = frequency_bands(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert kept >= 1 and blended >= 1 and divided >= 1, (kept, blended, divided)



@pytest.mark.parametrize("params", [
    # a low_freq_factor other than 1: the divided band starts at original_ctx / low, not original_ctx * low
    dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0,
         original_max_position_embeddings=64),
    # yarn's ramp from a channel inside the head to one past it, which transformers clamps to dim - 1
    dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=8192, beta_fast=64,
         beta_slow=0.05),
    # no beta_fast / beta_slow (Qwen2.5's model card's rope_scaling): the defaults, 32 and 1, set the ramp
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8192),
    # both ends of the ramp round to channel 0: widened by 0.001, not 0 / 0 (NaN) there
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
         beta_slow=6.0),
    # a given attention_factor is the magnitude, whatever yarn's rule would give
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8192, attention_factor=0.8),
    # mscale without mscale_all_dim: the plain rule, not the ratio DeepSeek's two mscales give
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8192, mscale=0.707),
    # two mscales that differ (DeepSeek's are equal, a ratio of 1 either way up): mscale's over mscale_all_dim's
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8192, mscale=1.0,
         mscale_all_dim=0.707),
])
def test_rope_frequencies_match_transformers(params):
    """The tiny models' ropes leave these edges of transformers' rules unused: compare the frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg = transformers.LlamaConfig(**(LLAMA_TINY | dict(head_dim=64, max_position_embeddings=1 << 19)),
                                      rope_parameters=params)
    cfg = parse_config(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    ours, magnitude = rope_frequencies(64, cfg.rope_theta, cfg.rope_scaling)
    expected, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(ours, expected.float())
    assert magnitude == pytest.approx(attention_factor)

@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_prefill_and_decode_match_hf(tmp_path, monkeypatch, variant):
    hf_model = save_tiny_llama(tmp_path, variant)
    steps = record_logits(monkeypatch)
    # the llama3 variant's original context is 32: prompts run past it
    prompts = random_prompts([5, 17, 1, 60], LLAMA_TINY["vocab_size"])
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=512, log=False))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(o) == 6 for o in outputs)
    assert_matches_hf(hf_model, prompts, outputs, steps)


def test_transformers4_config_form(tmp_path, monkeypatch):
    hf_model = save_tiny_llama(tmp_path, "llama3-rope", config_form="v4")
    assert "rope_scaling" in json.loads((tmp_path / "config.json").read_text())
    steps = record_logits(monkeypatch)
    prompts = random_prompts([40, 3], LLAMA_TINY["vocab_size"])
    outputs = Engine(tmp_path, EngineConfig(max_total_tokens=256, log=False)).generate(
        prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_bfloat16_on_gpu_matches_hf_float32(tmp_path, monkeypatch, variant):
    """The GPU path (fused Triton norm/rope/SiLU kernels, bfloat16 weights) against HF in float32.
    bfloat16 keeps 8 bits of mantissa; with these large random weights the logits come out 2-3% off
    in norm on average and up to 12% at the worst step (an H200: 10% before o_proj and down_proj
    were split in K, whose halves are rounded apart; any change to where bf16 rounds moves that
    tail), while a real bug (rope, masking, a wrong half) is off by O(1)."""
    hf_model = save_tiny_llama(tmp_path, variant)
    steps = record_logits(monkeypatch)
    prompts = random_prompts([5, 17, 1, 60], LLAMA_TINY["vocab_size"])
    engine = Engine(tmp_path, EngineConfig(device="cuda", dtype=torch.bfloat16, max_total_tokens=512, log=False))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps, max_rel_error=0.15)


def test_sharded_checkpoint(tmp_path, monkeypatch):
    """Weights split over several safetensors files with an index, as 8B checkpoints come."""
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY, **LLAMA_VARIANTS["gqa"])).eval()
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    steps = record_logits(monkeypatch)
    prompts = random_prompts([9, 4], LLAMA_TINY["vocab_size"])
    outputs = Engine(tmp_path, EngineConfig(max_total_tokens=128, log=False)).generate(
        prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps)


def test_sharded_checkpoint_saved_again_as_one_file(tmp_path, monkeypatch):
    """save_pretrained into a folder that held shards deletes them but leaves their index behind;
    transformers loads model.safetensors over an index, and so must nano (it said a shard was missing)."""
    save_tiny_llama(tmp_path, "gqa", seed=1).save_pretrained(tmp_path, max_shard_size="100KB")
    hf_model = save_tiny_llama(tmp_path, "gqa", seed=2)
    assert (tmp_path / "model.safetensors.index.json").exists() and not list(tmp_path.glob("model-*.safetensors"))
    steps = record_logits(monkeypatch)
    prompts = random_prompts([9, 4], LLAMA_TINY["vocab_size"])
    outputs = Engine(tmp_path, EngineConfig(max_total_tokens=128, log=False)).generate(
        prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert_matches_hf(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), prompts, outputs, steps)
    assert_matches_hf(hf_model, prompts, outputs, steps)


def test_original_context_at_the_top_level(tmp_path, monkeypatch):
    """transformers takes a top-level original_max_position_embeddings (Phi-3's place for it) over
    the one in the rope parameters, for yarn and llama3."""
    save_tiny_llama(tmp_path, "yarn-untruncated")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"]["original_max_position_embeddings"] = 256  # what a config without it defaults to
    raw["original_max_position_embeddings"] = 32
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf_model.config.rope_parameters["original_max_position_embeddings"] == 32
    steps = record_logits(monkeypatch)
    prompts = random_prompts([40, 3], LLAMA_TINY["vocab_size"])
    outputs = Engine(tmp_path, EngineConfig(max_total_tokens=256, log=False)).generate(
        prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps)


def test_rope_scaling_added_to_a_v5_config(tmp_path, monkeypatch):
    """Model cards (Qwen2.5's) say to add a `rope_scaling` to config.json for long context; in a config
    transformers 5.x wrote, next to its `rope_parameters`. transformers takes the `rope_scaling`."""
    save_tiny_llama(tmp_path, "qwen2-bias")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_model = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf_model.config.rope_parameters["rope_type"] == "yarn"
    steps = record_logits(monkeypatch)
    prompts = random_prompts([40, 3], LLAMA_TINY["vocab_size"])
    outputs = Engine(tmp_path, EngineConfig(max_total_tokens=256, log=False)).generate(
        prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps)


def test_yarn_stretches_the_context(tmp_path, monkeypatch):
    """Qwen2.5's model card adds YaRN (factor 4 over its 32768 tokens) to a config whose
    max_position_embeddings stays 32768, to run 131072: transformers computes any position, vLLM
    takes the original context times the factor. nano refused every prompt past max_position_embeddings."""
    save_tiny_llama(tmp_path, "qwen2-bias")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_model = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    steps = record_logits(monkeypatch)
    prompts = random_prompts([300, 3], LLAMA_TINY["vocab_size"])  # past the 256 of max_position_embeddings
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=2048, log=False))
    assert engine.context_length == 1024
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert_matches_hf(hf_model, prompts, outputs, steps)
