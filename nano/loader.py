"""Weight loading: build a model's modules on the device, then fill them from a checkpoint.

A Hugging Face checkpoint is a folder of `*.safetensors` files (with an index when sharded) that
map tensor names to arrays. Our modules do not mirror those names one to one: q/k/v and gate/up
are fused into one weight each, DeepSeek's experts are stacked. So each model publishes a
`checkpoint_layout()` (checkpoint name -> our parameter and the rows it fills), and the loader
walks the files once, copying each tensor straight into its place on the device. Tensors are read
one at a time, so an 8B model never needs twice its size in host memory.

The dummy load format fills the same shapes with random numbers, for benchmarks without a download.
Both show a progress bar on a terminal: an 8B model takes seconds on a GPU, minutes on a CPU.

Before any of that, `model_bytes` tells the engine how much the weights will take, from a model
built on torch's `meta` device: modules with shapes and dtypes but no storage.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from nano.config import ModelConfig
from nano.deepseek import build_deepseek_v2
from nano.model import CausalLM, build_llama


class WeightError(ValueError):
    """Missing, mis-shaped or unreadable weights; the message is shown to the user as is."""


def build_model(cfg: ModelConfig, use_mla: bool, device, dtype: torch.dtype) -> CausalLM:
    """The one place that maps an architecture to the code that builds it: the modules on
    `device`, their parameters in `dtype` and left unfilled."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build_deepseek_v2(cfg, use_mla) if cfg.is_deepseek else build_llama(cfg)
    finally:
        torch.set_default_dtype(default_dtype)


def model_bytes(cfg: ModelConfig, dtype: torch.dtype, use_mla: bool) -> int:
    """Bytes of the model's parameters and buffers in `dtype`, counted without allocating them."""
    model = build_model(cfg, use_mla, "meta", dtype)
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


def load_model(cfg: ModelConfig, model_dir, device, dtype: torch.dtype, load_format: str = "safetensors",
               use_mla: bool = True, seed: int = 0) -> CausalLM:
    """Build the model on `device` in `dtype` and fill its weights ("safetensors" or "dummy")."""
    model = build_model(cfg, use_mla, device, dtype)
    if load_format == "dummy":
        _fill_random(model, seed)
    else:
        _load_safetensors(model, Path(model_dir))
    return model.eval()


def _progress(model: CausalLM, what: str) -> tqdm:
    """A bar over the model's weight bytes, on stderr; shown on a terminal, once loading takes a second."""
    return tqdm(total=sum(p.nbytes for p in model.parameters()), desc=what, unit="B", unit_scale=True, delay=1, leave=False, disable=None)


def _fill_random(model: CausalLM, seed: int):
    """Random weights in the real shapes: norms near 1, matrices small enough to keep
    activations bounded through many layers."""
    gen = torch.Generator(device=model.embed_tokens.device).manual_seed(seed)
    with _progress(model, "random weights") as bar:
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.uniform_(0.9, 1.1, generator=gen)
            else:
                p.data.normal_(0, 0.02, generator=gen)
            bar.update(p.nbytes)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(f"{index}: malformed index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{model_dir}: no *.safetensors weights found")
    for f in files:
        if not f.is_file():
            raise WeightError(f"{f}: weight file named in the index is missing")
    return files


def _load_safetensors(model: CausalLM, model_dir: Path):
    layout = model.checkpoint_layout()
    loaded = set()
    device = model.embed_tokens.device
    with _progress(model, "loading weights") as bar:
        for path in _checkpoint_files(model_dir):
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if name not in layout:
                            continue  # e.g. rotary_emb.inv_freq, or lm_head of a tied model
                        param, index = layout[name]
                        target = param.data[index]
                        tensor = f.get_tensor(name)
                        if tensor.shape != target.shape:
                            raise WeightError(
                                f"{path.name}: tensor {name} has shape {list(tensor.shape)}, "
                                f"expected {list(target.shape)}"
                            )
                        target.copy_(model.prepare_checkpoint_tensor(name, tensor).to(device))
                        loaded.add(name)
                        bar.update(target.nbytes)
            except WeightError:
                raise
            except Exception as e:  # safetensors raises its own types for truncated or corrupt files
                raise WeightError(f"{path}: cannot read weights ({e})") from None
    missing = sorted(set(layout) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"{model_dir}: missing tensor {missing[0]}{more}")

