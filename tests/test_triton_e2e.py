"""End to end: the engine with the Triton attention backend against the torch reference backend.

On CPU (Triton's interpreter, float32, tiny models) greedy tokens must be identical. On the GPU
(bfloat16, random weights in SmolLM2's and Llama-3-8B's shapes) the two backends sum in different
orders, so a near-tie between two tokens can flip and the texts diverge from there: the test
bounds the prefill logits' relative error and prints the token match rate (run with -rP to see it)."""

import pytest
import torch

from nano.config import ConfigError
from nano.engine import Engine, EngineConfig
from nano.sampling import SamplingParams
from tests.helpers import LLAMA_TINY, random_prompts, record_logits, save_tiny_deepseek, save_tiny_llama


def greedy(path, backend, prompts, **engine_args):
    engine = Engine(path, EngineConfig(attention_backend=backend, log=False, **engine_args))
    return engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU variant runs Triton's interpreter")
@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias", "qwen3-qk-norm-tied", "mistral", "deepseek-mla",
                                   "deepseek-expanded"])
def test_triton_backend_greedy_equals_torch_on_cpu(tmp_path, model):
    if model.startswith("deepseek"):
        save_tiny_deepseek(tmp_path, "lite")
        args = dict(use_mla=model == "deepseek-mla")
    else:
        save_tiny_llama(tmp_path, model.removeprefix("llama-"))
        args = {}
    prompts = random_prompts([7, 1, 19], LLAMA_TINY["vocab_size"], seed=4)
    assert greedy(tmp_path, "triton", prompts, max_total_tokens=128, **args) == \
        greedy(tmp_path, "torch", prompts, max_total_tokens=128, **args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama-3-8b", "deepseek-v2-lite"])
def test_triton_backend_matches_torch_on_gpu(shape, monkeypatch):
    from nano.cli import SHIPPED_CONFIGS

    prompts = random_prompts([5, 300, 47, 1000, 2, 129, 700, 64], 32000, seed=7)
    results = {}
    for backend in ("torch", "triton"):
        steps = record_logits(monkeypatch)
        engine = Engine(SHIPPED_CONFIGS / shape, EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                        load_format="dummy", max_total_tokens=4096, max_running_requests=8, log=False))
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
        results[backend] = (outputs, steps[0])
        del engine
        torch.cuda.empty_cache()
    (ref_out, ref_logits), (out, logits) = results["torch"], results["triton"]
    rel_error = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel_error < 0.05, rel_error
    same = sum(a == b for a, b in zip(out, ref_out))
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(out, ref_out)]
    # A request's first token must agree wherever the reference's winning margin exceeds twice the
    # largest logit difference between the backends: there no rounding can flip the argmax.
    top2 = ref_logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * (logits - ref_logits).abs().amax(dim=-1)
    print(f"{shape}: prefill logits relative error {rel_error:.4f}; {same}/{len(prompts)} requests identical over "
          f"32 greedy tokens; tokens before the first difference: {agree}; first token decided for "
          f"{int(decided.sum())}/{len(prompts)}")
    for i in decided.nonzero().flatten().tolist():
        assert out[i][0] == ref_out[i][0], f"request {i}: first token differs despite a clear margin"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["llama3-rope", "qwen3-qk-norm-tied", "deepseek-mla"])
def test_float32_triton_equals_torch_on_gpu(tmp_path, monkeypatch, model):
    """In float32 the kernels multiply in full float32, as torch does, so the two backends agree
    like the CPU variant above: identical greedy tokens, eager and through CUDA graphs (6 requests
    padded to 8), on prompts past the original rope context (32). Tokens alone would not show
    TF32 dots (Triton's default for float32) on models this small: emulated on CPU, TF32 left them
    unchanged but moved the logits by 1.5e-3 in norm, where full float32 moves them by 1e-6."""
    if model == "deepseek-mla":
        save_tiny_deepseek(tmp_path, "lite")
        args = dict(use_mla=True)
    else:
        save_tiny_llama(tmp_path, model)
        args = {}
    prompts = random_prompts([5, 70, 33, 1, 48, 17], LLAMA_TINY["vocab_size"], seed=5)
    runs = {}
    for name, backend, cuda_graph in [("torch", "torch", False), ("triton", "triton", False),
                                      ("triton with graphs", "triton", True)]:
        steps = record_logits(monkeypatch)
        outputs = greedy(tmp_path, backend, prompts, device="cuda", dtype=torch.float32, max_total_tokens=512,
                         max_running_requests=8, cuda_graph=cuda_graph, **args)
        runs[name] = outputs, torch.cat(steps)  # prefill, then each decode step: [6, vocab] each
    ref_out, ref_logits = runs["torch"]
    for name in ("triton", "triton with graphs"):
        out, logits = runs[name]
        rel_error = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        assert rel_error < 1e-4, f"{name}: logits relative error {rel_error:.2g}"
        assert out == ref_out, name


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 8), (32, 1, 16)], ids=["8 wide", "32 per KV head"])
def test_triton_backend_refuses_heads_its_kernels_cannot_run(tmp_path, heads, kv_heads, head_dim):
    """tl.dot's tiles are 16 wide at least: narrower heads (HF's tiny test models) fail to compile
    on a GPU, while the interpreter lets them by; and decode serves at most 16 query heads per KV
    head in one tile. Either is a one-line error before the weights load; the torch backend runs both."""
    import transformers

    cfg = transformers.LlamaConfig(**LLAMA_TINY, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=head_dim)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="use --attention-backend torch"):
        Engine(tmp_path, EngineConfig(attention_backend="triton", log=False, max_total_tokens=128))
    assert len(greedy(tmp_path, "torch", [[1, 2, 3]], max_total_tokens=128)[0]) == 8
