"""The command line end to end: the real default model answers, and bad input ends with one line
on stderr and exit status 2 (never a traceback)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_llama_parity import save_tiny_llama


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "nano.generate", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    assert result.stdout == ""


def test_capital_of_france(smollm2_dir):
    result = run_cli("--model", str(smollm2_dir), "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prefill:" in result.stderr and "Paris" not in result.stderr  # stats on stderr only


def test_several_prompts_print_in_order(smollm2_dir, tmp_path):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("What is the capital of Italy?\n\nName a primary colour.\n")
    result = run_cli("--model", str(smollm2_dir), "--prompt", "What is the capital of France?",
                     "--prompt-file", str(prompt_file), "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    blocks = result.stdout.split("--- prompt ")
    assert [b[:1] for b in blocks[1:]] == ["1", "2", "3"]
    assert "Paris" in blocks[1] and "Italy" in blocks[2] and "Red" in blocks[3]


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


@pytest.fixture
def tiny_model(tmp_path, smollm2_dir):
    folder = save_tiny_chat_model(tmp_path / "tiny", smollm2_dir)
    result = run_cli("--model", str(folder), "--prompt", "hi", "--max-new-tokens", "3")
    assert result.returncode == 0, result.stderr
    return folder


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run_cli("--model", str(tmp_path / "nope"), "--prompt", "hi"), "does not exist")


def test_empty_model_folder(tmp_path):
    assert_one_line_error(run_cli("--model", str(tmp_path), "--prompt", "hi"), "no config.json")


def test_malformed_config(tiny_model):
    (tiny_model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "hi"), "malformed JSON")


def test_unsupported_architecture(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tiny_model / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "hi"), "GPT2LMHeadModel",
                          "LlamaForCausalLM")


def test_missing_tensor(tiny_model):
    weights = load_file(tiny_model / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_model / "model.safetensors")
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "hi"),
                          "missing tensor model.layers.1.mlp.up_proj.weight")


def test_misshaped_tensor(tiny_model):
    weights = load_file(tiny_model / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 32)
    save_file(weights, tiny_model / "model.safetensors")
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "hi"),
                          "model.layers.0.self_attn.o_proj.weight", "[64, 32]")


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "-5"], "max-new-tokens"),
    (["--max-new-tokens", "many"], "max-new-tokens"),
    (["--top-p", "0"], "top-p"),
    (["--mem-fraction", "1.5"], "mem-fraction"),
])
def test_bad_flag_values(tiny_model, flags, fragment):
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "hi", *flags), fragment)


def test_empty_prompt(tiny_model):
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "  "), "empty")


def test_prompt_longer_than_context(tiny_model):
    assert_one_line_error(run_cli("--model", str(tiny_model), "--prompt", "word " * 300), "prompt 1", "256")
