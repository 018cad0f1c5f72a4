"""Modules built the way a user might (loaded in float32, then cast with `.to(dtype)`) must run
and agree with the same modules the loader built in that dtype. The loader keeps some weights in
float32 on purpose (DeepSeek's router); a cast must not turn that into a crash or a wrong dtype.
Folders written by other tools than save_pretrained must load as transformers loads them."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

pytest.importorskip("transformers")

from nano.config import load_config  # noqa: E402
from nano.forward_batch import ForwardBatch  # noqa: E402
from nano.kv_cache import KVPool  # noqa: E402
from nano.loader import WeightError, load_model, model_bytes  # noqa: E402
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
    assert torch.get_default_dtype() == torch.float32  # the loader's bfloat16 default is its own
    cast = load_model(cfg, tmp_path, "cpu", torch.float32).to(torch.bfloat16)
    prompt = random_prompts([40], cfg.vocab_size)[0]
    expected = prefill_logits(loaded, cfg, prompt, torch.bfloat16)
    got = prefill_logits(cast, cfg, prompt, torch.bfloat16)
    assert got.dtype == expected.dtype == torch.bfloat16  # the model's dtype (a float32 router's would leak)
    # the two differ only by where weights were rounded to bfloat16 (a router rounded by the cast)
    assert ((got - expected).norm() / expected.norm()).item() < 0.05


def test_tied_checkpoint_with_lm_head_only(tmp_path):
    """safetensors' save_model keeps `lm_head.weight` of a tied model's two shared tensors and drops
    the embedding; transformers loads that folder, tying them back, and so must nano."""
    hf_model = save_tiny_llama(tmp_path, "gqa4-tied")
    save_model(hf_model, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert "model.embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    cfg = load_config(tmp_path)
    prompt = random_prompts([30], cfg.vocab_size)[0]
    got = prefill_logits(load_model(cfg, tmp_path, "cpu", torch.float32), cfg, prompt, torch.float32)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_tensors_read_twice_must_agree_and_every_weight_has_a_place(tmp_path):
    """A tied config whose checkpoint also holds an lm_head.weight: equal to the embedding it loads (in
    either order of the files); different, transformers 5 unties the two and vLLM takes the embedding,
    so it is refused, as is a tensor in two files that differ. A weight the model has no place for (a
    qwen2 model_type's q/k/v biases under Llama's architecture, or Qwen3's q_norm weight under Llama's) was
    skipped, the logits silently wrong."""
    import json

    hf_model = save_tiny_llama(tmp_path, "gqa4-tied")
    cfg = load_config(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    embedding = tensors["model.embed_tokens.weight"]
    prompt = random_prompts([20], cfg.vocab_size)[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    for first, second in (("a", "b"), ("b", "a")):  # the lm_head's file read first, then second
        save_file({"lm_head.weight": embedding.clone()}, tmp_path / f"{first}.safetensors")
        save_file(tensors, tmp_path / f"{second}.safetensors")
        got = prefill_logits(load_model(cfg, tmp_path, "cpu", torch.float32), cfg, prompt, torch.float32)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        save_file({"lm_head.weight": embedding + 0.01}, tmp_path / f"{first}.safetensors")
        with pytest.raises(WeightError, match=r"^\S+: tensor \S+ differs from the model.embed_tokens.weight read"):
            load_model(cfg, tmp_path, "cpu", torch.float32)
    name = "model.norm.weight"
    save_file({name: tensors[name] * 2}, tmp_path / "b.safetensors")  # a.safetensors holds the model
    with pytest.raises(WeightError, match=f"b.safetensors: tensor {name} differs"):
        load_model(cfg, tmp_path, "cpu", torch.float32)
    save_file({"model.layers.0.self_attn.q_proj.bias": torch.randn(cfg.num_heads * cfg.head_dim)},
              tmp_path / "b.safetensors")
    llama_config = (tmp_path / "config.json").read_text()
    config = json.loads(llama_config) | {"model_type": "qwen2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match="b.safetensors: tensor model.layers.0.self_attn.q_proj.bias has no place"):
        load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32)
    (tmp_path / "config.json").write_text(llama_config)
    name = "model.layers.0.self_attn.q_norm.weight"  # Qwen3's, which a Llama has no place for
    save_file({name: torch.randn(cfg.head_dim)}, tmp_path / "b.safetensors")
    with pytest.raises(WeightError, match=f"b.safetensors: tensor {name} has no place"):
        load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32)


def test_shards_with_or_without_an_index_and_malformed_folders(tmp_path, monkeypatch):
    """transformers reads every *.safetensors of a folder that has no index; an index names a shard once
    per tensor in it (hundreds for an 8B model), and each shard is still opened once; a folder with no
    weights, or an index whose weight_map is not a dict of file names, is one WeightError line."""
    from nano import loader

    hf_model = save_tiny_llama(tmp_path, "gqa")
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, tmp_path / f"model-{i + 1:05d}-of-00002.safetensors")
    cfg = load_config(tmp_path)
    prompt = random_prompts([20], cfg.vocab_size)[0]
    got = prefill_logits(load_model(cfg, tmp_path, "cpu", torch.float32), cfg, prompt, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(got, hf_model(torch.tensor([prompt])).logits[0, -1], atol=1e-4, rtol=1e-4)
    index = {"weight_map": {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    opened, real = [], loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda path, **kw: opened.append(path.name) or real(path, **kw))
    load_model(cfg, tmp_path, "cpu", torch.float32)
    assert sorted(opened) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index["weight_map"][names[0]] = "model-00003.safetensors"  # a shard not there
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="model-00003.safetensors: weight file named in the index is missing"):
        load_model(cfg, tmp_path, "cpu", torch.float32)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ["model-00001-of-00002.safetensors"]}')
    with pytest.raises(WeightError, match="malformed index"):
        load_model(cfg, tmp_path, "cpu", torch.float32)
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(WeightError, match="no \\*.safetensors weights found"):
        load_model(cfg, tmp_path, "cpu", torch.float32)


def test_dummy_weights_are_near_one_and_small(tmp_path):
    """load_format="dummy" (the loader's rule): norms drawn from [0.9, 1.1], matrices from N(0, 0.02)."""
    save_tiny_llama(tmp_path, "gqa")
    model = load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32, "dummy", seed=7)
    for name, (param, index) in model.checkpoint_layout().items():
        w = param.data[index]
        if name.endswith("norm.weight"):
            assert 0.9 <= w.min() and w.max() <= 1.1 and w.std() > 0.01, name
        else:
            assert abs(w.mean()) < 0.002 and 0.018 < w.std() < 0.022, name


def test_dummy_weights_follow_the_seed(tmp_path):
    """load_format="dummy": the same seed gives the same model, another seed another one."""
    save_tiny_llama(tmp_path, "gqa")
    cfg = load_config(tmp_path)
    a, b, c = (load_model(cfg, tmp_path, "cpu", torch.float32, "dummy", seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and "cos_sin" not in k)
    assert not torch.equal(a["layers.0.mlp.down_proj.weight"], a["layers.1.mlp.down_proj.weight"])  # each its own


def test_one_file_wins_over_a_stale_index(tmp_path):
    """transformers' order: model.safetensors beside an index (save_pretrained leaves an old one behind
    when it saves as one file what a folder held in shards) loads the one file."""
    save_tiny_llama(tmp_path, "gqa")
    cfg = load_config(tmp_path)
    expected = load_model(cfg, tmp_path, "cpu", torch.float32).state_dict()
    stale = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}  # a file long gone
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(stale))
    got = load_model(cfg, tmp_path, "cpu", torch.float32).state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_one_missing_tensor_is_named_alone(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError) as error:
        load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32)
    assert str(error.value).endswith("missing tensor model.norm.weight"), str(error.value)
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"missing tensor lm_head.weight \(and 1 more\)$"):
        load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])  # a download cut off
    with pytest.raises(WeightError, match="model.safetensors: cannot read weights") as error:
        load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32)
    assert "\n" not in str(error.value)


def test_model_bytes_counts_parameters_and_buffers(tmp_path):
    """What the engine budgets for the weights: every parameter and buffer (the rope table too)."""
    save_tiny_llama(tmp_path, "gqa")
    cfg = load_config(tmp_path)
    model = load_model(cfg, tmp_path, "cpu", torch.bfloat16)
    tensors = [*model.parameters(), *model.buffers()]
    assert len(list(model.buffers())) > 0
    assert model_bytes(cfg, torch.bfloat16, use_mla=True) == sum(t.nbytes for t in tensors)


@pytest.mark.parametrize("variant", ["gqa", "gqa4-tied"])
def test_a_checkpoint_without_its_embedding_is_refused(tmp_path, variant):
    """The embedding is checked like every other tensor: a checkpoint without it (an untied one that
    keeps its lm_head, or a tied one with neither name) is a WeightError naming it, not a model run on
    an embedding of zeros."""
    save_tiny_llama(tmp_path, variant)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    if variant == "gqa4-tied":
        tensors.pop("lm_head.weight", None)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"missing tensor model.embed_tokens.weight$"):
        load_model(load_config(tmp_path), tmp_path, "cpu", torch.float32)
