"""What the test modules share: tiny random HF models to compare nano against, random prompts,
the logits the engine samples from, NaN-poisoned allocations for kernel tests, and a way to run
a command line. The test modules import from here, never from each other."""

import contextlib
import importlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors

from nano import engine as engine_module
from nano.rope import rope_frequencies

# ---- tiny random models, saved as HF folders (transformers is the reference) ----

LLAMA_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, vocab_size=320,
            max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2)
LLAMA_VARIANTS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa4-tied": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    # 16 frequencies with wavelengths 6.3, 11, 20, 35, ...: llama3 keeps the first (shorter than
    # 32 / 4), blends the next two and divides the rest (longer than 32 / 1); see test_rope_bands
    "llama3-rope": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "linear-rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0)),
    # The families built on Llama's layout, each from its own transformers classes (`family`).
    "qwen2-bias": dict(family="Qwen2", num_attention_heads=4, num_key_value_heads=2),
    # a large eps, so that a norm built with another eps than the config's shows
    "qwen3-qk-norm-tied": dict(family="Qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               tie_word_embeddings=True, rms_norm_eps=0.5),
    "mistral": dict(family="Mistral", num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    # YaRN's ramp between fractional channels: over 32 tokens it ends at channel 2.83, not 3
    "yarn-untruncated": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, truncate=False)),
    # dynamic NTK changes the frequencies only past max_position_embeddings, where nano never goes
    "dynamic-rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    # keys Qwen2's classes do not read (its q/k/v biases are fixed) and swish, transformers' other name for SiLU
    "qwen2-ignored-keys": dict(family="Qwen2", num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                               mlp_bias=True, hidden_act="swish"),
}


def randomize_norms_and_biases(model):
    """HF starts biases at 0 and norms at 1, where a misplaced or ignored one would not show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)


def save_tiny_llama(path, variant: str, config_form: str = "v5", seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    args = dict(LLAMA_VARIANTS[variant])
    family = args.pop("family", "Llama")
    cfg = getattr(transformers, f"{family}Config")(**(LLAMA_TINY | args))
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    randomize_norms_and_biases(model)
    model.save_pretrained(path)
    if config_form == "v4":  # rewrite the config the way transformers 4.x wrote it
        raw = json.loads((path / "config.json").read_text())
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        if params.pop("rope_type") != "default":
            raw["rope_scaling"] = {"type": "llama3" if "low_freq_factor" in params else "linear", **params}
        (path / "config.json").write_text(json.dumps(raw))
    return model


# YaRN's ramp runs from the rope channel that turns beta_fast times over the original context to
# the one that turns beta_slow times. Over 32 tokens DeepSeek's 32 and 1 would start it at channel
# 0, leaving no channel where its clamp at 0 acts. With these betas, of the 8 channels, 0 is clamped
# to 0, 2 and 3 are on the ramp, 5 to 7 are clamped to 1 (test_rope_bands checks).
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
            mscale=0.707, mscale_all_dim=0.707, beta_fast=1, beta_slow=0.125)
# Keys of 8 + 16 = 24 channels: the Triton kernels split them into a 16-wide main part and a rest.
DEEPSEEK_TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8,
            qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
            n_shared_experts=2, first_k_dense_replace=1, vocab_size=320, max_position_embeddings=128,
            initializer_range=0.2, rope_parameters=DEEPSEEK_YARN)
DEEPSEEK_VARIANTS = {
    "lite": {},
    # the layer norms take the config's large eps, the latent ones keep their 1e-6
    "q-lora-scaled": dict(q_lora_rank=24, routed_scaling_factor=2.5, rms_norm_eps=0.5),
    "norm-topk": dict(norm_topk_prob=True, routed_scaling_factor=2.5),
    "top1-norm-topk": dict(norm_topk_prob=True, routed_scaling_factor=2.5, num_experts_per_tok=1),
    # dynamic NTK keeps the default frequencies here, but DeepSeek still scales its softmax by mscale_all_dim
    "dynamic-mscale": dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0,
                                                mscale_all_dim=0.707)),
}


def save_tiny_deepseek(path, variant: str, config_form: str = "v5", seed: int = 0, random_norms: bool = True):
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**(DEEPSEEK_TINY | DEEPSEEK_VARIANTS[variant]))).eval()
    if random_norms:
        randomize_norms_and_biases(model)
    model.save_pretrained(path)
    if config_form == "v4":  # the hub checkpoints' form: rope_theta on top, rope_scaling keyed `type`
        raw = json.loads((path / "config.json").read_text())
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        (path / "config.json").write_text(json.dumps(raw))
    return model


# ---- comparing with the reference ----

def record_logits(monkeypatch):
    """Wrap the engine's sampler to keep each step's logits, in float32 (the model returns its own
    dtype's), so that comparisons of bfloat16 runs do their arithmetic in float32."""
    steps = []
    real_sample = engine_module.sample

    def recording_sample(logits, params, generators):
        steps.append(logits.float().clone())
        return real_sample(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", recording_sample)
    return steps


def assert_matches_hf(hf_model, prompts, outputs, steps, atol=1e-4, max_rel_error=None):
    """steps[0] holds every prompt's prefill logits; steps[k] the k-th decode step's, for the
    requests still running (all of them here: same max_new_tokens, EOS ignored).
    With max_rel_error, each step's logits are held to ||mine - ref|| / ||ref|| instead of
    elementwise: the bound for low-precision runs, where single logits can be off by more."""
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            ref = hf_model(ids).logits[0]  # [S, vocab]
        for k in range(len(out)):
            mine = steps[k][i].cpu()
            expected = ref[len(prompt) - 1 + k]
            if max_rel_error is None:
                torch.testing.assert_close(mine, expected, atol=atol, rtol=1e-4, msg=f"prompt {i} step {k}")
            else:
                rel_error = ((mine - expected).norm() / expected.norm()).item()
                assert rel_error < max_rel_error, f"prompt {i} step {k}: relative error {rel_error:.3f}"


def random_prompts(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def frequency_bands(rot_dim: int, theta: float, scaling: dict) -> tuple[int, int, int]:
    """How many rope frequencies a scaling keeps as they are, moves part of the way, and divides
    by its factor: read off its output, so it holds whatever the config and the code say."""
    ratio = rope_frequencies(rot_dim, theta, scaling)[0] / rope_frequencies(rot_dim, theta, None)[0]
    kept = torch.isclose(ratio, torch.tensor(1.0))
    divided = torch.isclose(ratio, torch.tensor(1 / scaling["factor"]))
    return int(kept.sum()), int((~kept & ~divided).sum()), int(divided.sum())


# ---- kernels: random inputs, tolerances, outputs poisoned before a kernel writes them ----

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "the kernel left or produced NaN"
    torch.testing.assert_close(out, ref, atol=TOLERANCE[ref.dtype], rtol=TOLERANCE[ref.dtype])


@contextlib.contextmanager
def nan_allocations():
    """Fresh torch.empty tensors come filled with NaN (torch does this in deterministic mode)."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


# ---- the command line ----

def run_cli(*args, timeout=300, module="nano.generate", **kwargs):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def run_main(*args, module="nano.generate"):
    """A command run as `run_cli` runs it, but in this process: its `main` through the same `cli()`
    (one-line errors, exit statuses), without starting Python and torch anew, which takes 3 s on the
    GPU machine. What only a process of its own shows (stdin, stdout's encoding, signals, imports)
    stays with `run_cli`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            importlib.import_module(module).main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    assert result.stdout == ""


def save_byte_fallback_tokenizer(folder):
    """A Llama-2-style tokenizer: SentencePiece "▁" for spaces, and a character outside the small
    vocabulary spelled as its UTF-8 bytes, one <0xNN> token each (the decoder joins a run of them)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {piece: len(vocab) + i for i, piece in enumerate(["▁", "a", "b", "▁a", "▁b"])}
    tok = HFTokenizer(models.BPE(vocab, [("▁", "a"), ("▁", "b")], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def save_tiny_chat_model(folder, tokenizer_dir, **config):
    """A tiny random Llama with a real vocabulary, tokenizer and chat template (SmolLM2's)."""
    folder.mkdir()
    save_tiny_llama(folder, "gqa")
    config = {**json.loads((folder / "config.json").read_text()), "vocab_size": 49152, **config}
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"] = torch.randn(49152, 64)
    weights["lm_head.weight"] = torch.randn(49152, 64)
    save_file(weights, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


# one thread: for a model this small, splitting each op across threads costs more than it saves
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, log_path, *flags, host="127.0.0.1", timeout=120):
    """`python -m nano.serve` on a free port, waited for until /health answers -> (process, url)."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "nano.serve", "--model", str(model), "--host", host,
                             "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=SERVER_ENV)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, open(log_path).read()
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            assert f"serving on {url} " in open(log_path).read()  # the address, for whoever started it
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not come up: {open(log_path).read()}")
