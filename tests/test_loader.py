"""Modules built the way a user might (loaded in float32, then cast with `.to(dtype)`) must run
and agree with the same modules the loader built in that dtype. The loader keeps some weights in
float32 on purpose (DeepSeek's router); a cast must not turn that into a crash or a wrong dtype."""

import pytest
import torch

pytest.importorskip("transformers")

from nano.config import load_config  # noqa: E402
from nano.forward_batch import ForwardBatch  # noqa: E402
from nano.kv_cache import KVPool  # noqa: E402
from nano.loader import load_model  # noqa: E402
from nano.torch_attn import TorchAttnBackend  # noqa: E402
from tests.helpers import random_prompts, save_tiny_deepseek, save_tiny_llama  # noqa: E402


def prefill_logits(model, cfg, prompt: list[int], dtype) -> torch.Tensor:
    """One request's prefill through the reference backend -> its last token's logits."""
    n = len(prompt)
    kv_pool = KVPool(cfg, n + 1, dtype, "cpu", use_mla=cfg.is_deepseek)
    slots = torch.arange(1, n + 1, dtype=torch.int32)
    req_to_token = slots[None].clone()
    attn = TorchAttnBackend(kv_pool, req_to_token)
    batch = ForwardBatch.extend(prompt, [0], [n], [0], slots, "cpu")
    attn.init_forward_metadata(batch)
    with torch.no_grad():
        return model(batch, attn)[0]


@pytest.mark.parametrize("save", [save_tiny_llama, save_tiny_deepseek], ids=["llama", "deepseek"])
def test_cast_module_matches_loader_built(tmp_path, save):
    save(tmp_path, "gqa" if save is save_tiny_llama else "lite")
    cfg = load_config(tmp_path)
    loaded = load_model(cfg, tmp_path, "cpu", torch.bfloat16)
    cast = load_model(cfg, tmp_path, "cpu", torch.float32).to(torch.bfloat16)
    prompt = random_prompts([40], cfg.vocab_size)[0]
    expected = prefill_logits(loaded, cfg, prompt, torch.bfloat16)
    got = prefill_logits(cast, cfg, prompt, torch.bfloat16)
    # the two differ only by where weights were rounded to bfloat16 (a router rounded by the cast)
    assert ((got - expected).norm() / expected.norm()).item() < 0.05
