"""Weight loading: build a model's modules on the device, then fill them from a checkpoint.

A Hugging Face checkpoint is a folder of `*.safetensors` files (with an index when sharded) that
map tensor names to arrays. Our modules do not mirror those names one to one: q/k/v and gate/up
are fused into one weight each, DeepSeek's experts are stacked. So each model publishes a
`checkpoint_layout()` (checkpoint name -> our parameter and the rows it fills), and the loader
walks the files once, copying each tensor straight into its place on the device. Tensors are read
one at a time, so an 8B model never needs twice its size in host memory.

A model split across GPUs (tp.py) is built in its rank's smaller shapes, and each rank reads only
its block of every tensor (safetensors reads a slice without the rest of the tensor).

The dummy load format fills the same shapes with random numbers, for benchmarks without a download.
Each tensor is drawn whole from a generator seeded by its name, then cut to the rank's block, so a
model split over any number of GPUs is the same model. Both show a progress bar on a terminal: an
8B model takes seconds on a GPU, minutes on a CPU.

Before any of that, `model_bytes` tells the engine how much the weights will take, from a model
built on torch's `meta` device: modules with shapes and dtypes but no storage.
"""

import zlib
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from nano.config import ModelConfig, read_json
from nano.deepseek import build_deepseek_v2
from nano.model import CausalLM, build_llama
from nano.tp import checkpoint_shard, shard_config

EMBEDDING = "model.embed_tokens.weight"


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
               use_mla: bool = True, seed: int = 0, tp_rank: int = 0, tp_size: int = 1) -> CausalLM:
    """Build the model (rank `tp_rank`'s part of it) on `device` in `dtype` and fill its weights
    ("safetensors" or "dummy")."""
    model = build_model(shard_config(cfg, tp_size), use_mla, device, dtype)
    shard_of = partial(checkpoint_shard, cfg=cfg, rank=tp_rank, size=tp_size)
    if load_format == "dummy":
        _fill_random(model, shard_of, seed)
    else:
        _load_safetensors(model, Path(model_dir), shard_of)
    return model.eval()


def _progress(model: CausalLM, what: str) -> tqdm:
    """A bar over the model's weight bytes, on stderr; shown on a terminal, once loading takes a second."""
    return tqdm(total=sum(p.nbytes for p in model.parameters()), desc=what, unit="B", unit_scale=True, delay=1,
                leave=False, disable=None)


def _checkpoint_block(target: torch.Tensor, shard) -> tuple[list[int], tuple[slice, ...]]:
    """The checkpoint tensor of which `target` holds the rank's block -> (its shape, that block's index in it)."""
    shape = list(target.shape)
    if shard is None:
        return shape, (slice(None),)
    dim, blocks, index = shard
    shape[dim] *= blocks
    n = target.shape[dim]  # the block's width along dim
    return shape, (slice(None),) * dim + (slice(index * n, (index + 1) * n),)


def _fill_random(model: CausalLM, shard_of, seed: int):
    """Random weights in the real shapes: norms near 1, matrices small enough to keep
    activations bounded through many layers."""
    device = model.embed_tokens.device
    with _progress(model, "random weights") as bar:
        for name, (param, index) in model.checkpoint_layout().items():
            target, shard = param.data[index], shard_of(name)
            shape, block = _checkpoint_block(target, shard)
            # drawn whole and contiguous, then its block copied in (in place when it is all of a
            # contiguous target): torch draws a strided tensor's values in another order
            in_place = shard is None and target.is_contiguous()
            full = target if in_place else torch.empty(shape, dtype=target.dtype, device=device)
            gen = torch.Generator(device).manual_seed(seed + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                full.uniform_(0.9, 1.1, generator=gen)
            else:
                full.normal_(0, 0.02, generator=gen)
            if not in_place:
                target.copy_(full[block])
            bar.update(target.nbytes)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():  # transformers' order: one file wins over an index, which save_pretrained leaves
        return [single]  # behind, stale, when it saves as one file the model a folder held in shards
    if index.is_file():
        weight_map = read_json(index, WeightError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise WeightError(f"{index}: malformed index (no weight_map of tensor name -> file name)")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{model_dir}: no *.safetensors weights found")
    for f in files:
        if not f.is_file():
            raise WeightError(f"{f}: weight file named in the index is missing")
    return files


def _layout_name(name: str, layout: dict, file: Path) -> str | None:
    """The layout entry checkpoint tensor `name` fills, or None for one that is no weight. A tied model's
    lm_head.weight fills the embedding: safetensors' save_model keeps that name of the two shared tensors.
    A checkpoint may hold both; then they must be equal (transformers 5 unties two that differ, vLLM
    takes the embedding: the answer would depend on the engine)."""
    if name in layout:
        return name
    if name == "lm_head.weight" and EMBEDDING in layout:  # (not in the layout: the model is tied)
        return EMBEDDING
    if name.endswith((".weight", ".bias")):  # say a qwen2 model_type under Llama's architecture: its biases
        raise WeightError(f"{file.name}: tensor {name} has no place in the model config.json describes (is "
                          "its architecture the checkpoint's?)")
    return None  # e.g. rotary_emb.inv_freq, computed, not read


def _load_safetensors(model: CausalLM, model_dir: Path, shard_of):
    layout = model.checkpoint_layout()
    loaded = set()
    device = model.embed_tokens.device
    with _progress(model, "loading weights") as bar:
        for path in _checkpoint_files(model_dir):
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for stored_name in f.keys():
                        if (name := _layout_name(stored_name, layout, path)) is None:
                            continue
                        param, index = layout[name]
                        target, shard = param.data[index], shard_of(name)
                        stored, (expected, block) = f.get_slice(stored_name), _checkpoint_block(target, shard)
                        if stored.get_shape() != expected:
                            raise WeightError(f"{path.name}: tensor {stored_name} has shape {stored.get_shape()}, "
                                              f"expected {expected}")
                        tensor = stored[block]  # reads only this rank's block
                        tensor = model.prepare_checkpoint_tensor(name, tensor).to(device, target.dtype)
                        if name in loaded:  # a tied lm_head beside its embedding, or a tensor in two files
                            if not torch.equal(target, tensor):
                                raise WeightError(f"{path.name}: tensor {stored_name} differs from the {name} "
                                                  "read before it: which one is the model's?")
                            continue
                        target.copy_(tensor)
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

