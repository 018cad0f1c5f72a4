"""Model configuration: one HF `config.json` in, one flat `ModelConfig` out.

An inference engine needs a handful of numbers before it can allocate anything: how many layers,
heads and KV heads, how wide each head is, how positions are rotated (rope and its scaling), and
for DeepSeek-V2 the latent-attention and mixture-of-experts shapes. Mistral is Llama's layout;
Qwen2 adds a bias to q/k/v, Qwen3 an RMSNorm over each head's query and key: two flags on the
Llama model. Mistral's and Qwen's sliding-window attention is not implemented: a config that
turns it on for a window shorter than its context is refused. Hugging Face writes these in
two dialects: transformers 4.x puts `rope_theta` at the top level and the scaling in
`rope_scaling` (keyed `type` or `rope_type`); transformers 5.x folds both into `rope_parameters`.
We read either into the same dataclass, so nothing downstream ever looks at raw JSON.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "DeepseekV2ForCausalLM")
# A config saved on its own (config.save_pretrained, not the model's) has no `architectures`:
# transformers' Auto classes then go by model_type, and so do we.
MODEL_TYPES = dict(zip(("llama", "mistral", "qwen2", "qwen3", "deepseek_v2"), SUPPORTED_ARCHITECTURES))
# A key absent from config.json takes its family's default, as transformers' config classes set them:
# Llama's (and DeepSeek-V2's), or where Mistral's and Qwen's differ (Mistral's context is 131,072 tokens).
LLAMA_DEFAULTS = dict(max_position_embeddings=2048, rms_norm_eps=1e-6, num_key_value_heads=None, head_dim=None)
FAMILY_DEFAULTS = {"MistralForCausalLM": dict(num_key_value_heads=8, max_position_embeddings=131072),
                   "Qwen2ForCausalLM": dict(num_key_value_heads=32, max_position_embeddings=32768),
                   "Qwen3ForCausalLM": dict(num_key_value_heads=32, max_position_embeddings=32768, head_dim=128),
                   # no MoE keys: no MoE; 2 shared experts, whose weights transformers' model then runs
                   "DeepseekV2ForCausalLM": dict(n_routed_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                                 n_shared_experts=2, first_k_dense_replace=0, moe_layer_freq=1,
                                                 norm_topk_prob=False, routed_scaling_factor=1.0)}
MAX_SIZE = 2**31 - 1  # no width or count past this is a model (10**30 layers were built for ever)


class ConfigError(ValueError):
    """A model folder or config.json we cannot use; the message is shown to the user as is."""


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int  # the context: with YaRN, its original context times its factor, if longer
    tie_word_embeddings: bool
    rope_theta: float
    # Normalised rope scaling: None, or a dict with "rope_type" in {"linear", "llama3", "yarn", "dynamic"}
    # and that type's parameters (factor, original_max_position_embeddings, ...).
    rope_scaling: dict | None
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    qkv_bias: bool = False  # Qwen2: a bias on the q, k and v projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key, before rope
    # DeepSeek-V2: multi-head latent attention (MLA) ...
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # ... and mixture of experts (MoE).
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @property
    def is_deepseek(self) -> bool:
        return self.architecture == "DeepseekV2ForCausalLM"

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace
                and layer_id % self.moe_layer_freq == 0)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face model folder?)")
    return parse_config(read_json(path), source=str(path))


def read_json(path: Path, error: type[Exception] = ConfigError) -> dict:
    """The JSON object in `path`; anything else raises `error` with a one-line message."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))  # as HF reads it, whatever the locale
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: malformed JSON ({e})") from None
    except OSError as e:  # there but unreadable: permissions, an I/O error
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    named = raw.get("architectures") or raw.get("model_type")
    archs = raw.get("architectures") or [MODEL_TYPES.get(str(raw.get("model_type")))]  # str: junk finds none
    if not isinstance(archs, list):  # one name, not in a list (transformers goes by model_type), or junk
        archs = [archs]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"{source}: unsupported architecture {named!r}; "
                          f"nano supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    raw = LLAMA_DEFAULTS | FAMILY_DEFAULTS.get(arch, {}) | raw

    def need(key):  # a size the model is built from (0 layers or -4 heads crashed later, in a traceback)
        if key not in raw or raw[key] is None:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return _size(source, key, raw[key])

    try:
        rope_theta, rope_scaling = _parse_rope(raw, source)
        num_heads, hidden = need("num_attention_heads"), need("hidden_size")
        # null KV heads: one a head; a null head_dim: hidden / heads
        kv_heads, head_dim = raw["num_key_value_heads"], raw["head_dim"] or hidden // num_heads
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_heads if kv_heads is None else _size(source, "num_key_value_heads", kv_heads),
            head_dim=_size(source, "head_dim", head_dim),
            intermediate_size=need("intermediate_size"),
            rms_norm_eps=_positive(source, "rms_norm_eps", raw["rms_norm_eps"]),
            max_position_embeddings=_size(source, "max_position_embeddings", raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(source, "eos_token_id", raw.get("eos_token_id")),
            qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
        )
        if rope_scaling and rope_scaling["rope_type"] == "yarn":  # YaRN stretches the original context by its
            # factor, and a config may keep the unstretched length (Qwen2.5's card adds only rope_scaling): vLLM's rule
            stretched = int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"])
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, stretched)
        _refuse_unsupported(raw, arch, cfg, source)
        if arch == "DeepseekV2ForCausalLM":
            _parse_deepseek(raw, cfg, need, source)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as e:  # Overflow: 1e999
        raise ConfigError(f"{source}: bad or missing value ({e})") from None
    return cfg


def _size(source: str, key: str, value, low: int = 1) -> int:
    """A width or a count: a whole number from low to MAX_SIZE (unchecked, 64.7 was cut to 64)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= MAX_SIZE \
            or value != int(value):
        raise ConfigError(f"{source}: {key} must be a whole number from {low} to {MAX_SIZE}, got {value!r}")
    return int(value)


def _positive(source: str, key: str, value) -> float:
    """An epsilon, a base or a factor: finite and above 0 (unchecked, 0 or NaN ran to NaN logits)."""
    if not 0 < float(value) < math.inf:
        raise ConfigError(f"{source}: {key} must be a finite number above 0, got {value!r}")
    return float(value)


def _token_ids(source: str, key: str, value) -> list[int]:
    """Null, an id, or a list of ids: "2" or true would never match a token (EOS that never stops)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: {key} must be a token id or a list of them, got {value!r}")
    return ids


def _refuse_unsupported(raw: dict, arch: str, cfg: ModelConfig, source: str) -> None:
    """transformers' rules: Mistral slides over `sliding_window` when one is set (4096 when the key is
    absent, for Qwen too); Qwen only with use_sliding_window, on the layers from max_window_layers on
    (`layer_types` names them in 5.x). Also refused: what would load and then compute something else."""
    window = raw.get("sliding_window", 4096)  # both families' default; a null window never slides
    if arch == "MistralForCausalLM":
        slides = True
    elif not raw.get("use_sliding_window", False):  # Qwen's config nulls its window then
        slides = False
    elif "layer_types" in raw:
        slides = "sliding_attention" in raw["layer_types"]
    else:
        slides = raw.get("max_window_layers", 28) < cfg.num_layers
    if slides and window is not None and window < cfg.max_position_embeddings:
        raise ConfigError(f"{source}: sliding_window {window} is shorter than the context "
                          f"({cfg.max_position_embeddings}): nano has no sliding-window attention")
    # transformers' Llama and DeepSeek read both bias flags, Qwen3 attention_bias; Mistral and Qwen2
    # fix their biases in code (Qwen2's: the q/k/v biases nano has), as Qwen3 its MLP's (none)
    reads_attention_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV2ForCausalLM")
    reads_mlp_bias = arch in ("LlamaForCausalLM", "DeepseekV2ForCausalLM")
    if (reads_attention_bias and raw.get("attention_bias")) or (reads_mlp_bias and raw.get("mlp_bias")):
        raise ConfigError(f"{source}: attention_bias and mlp_bias are not supported (nano has q/k/v biases, as Qwen2)")
    if cfg.head_dim % 2 and not cfg.is_deepseek:  # else a crash in rope at the first request (transformers refuses it)
        raise ConfigError(f"{source}: head_dim {cfg.head_dim} is odd: rope needs pairs of channels")
    if cfg.num_heads % cfg.num_kv_heads:  # else it loads, then the first request crashes in attention
        raise ConfigError(f"{source}: num_attention_heads ({cfg.num_heads}) is not a multiple of "
                          f"num_key_value_heads ({cfg.num_kv_heads})")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' "swish" is nn.SiLU
        raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (nano's MLP is SiLU-gated)")
    if raw.get("quantization_config"):
        raise ConfigError(f"{source}: quantized checkpoints are not supported (nano loads 16- and 32-bit weights)")


def _parse_rope(raw: dict, source: str) -> tuple[float, dict | None]:
    """Both dialects -> (rope_theta, normalised scaling dict or None)."""
    # transformers' order: a `rope_scaling` (4.x's key, which model cards say to add by hand, also to a
    # 5.x config) wins over `rope_parameters` (5.x, where rope_theta moved); theta as a last resort from it
    v5_params = raw.get("rope_parameters") or {}
    params = dict(raw.get("rope_scaling") or v5_params)
    theta = params.pop("rope_theta", raw.get("rope_theta", v5_params.get("rope_theta", 10000.0)))
    theta = _positive(source, "rope_theta", theta)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    partial = float(params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0)
    if rope_type == "default":  # transformers' default rope rotates the whole head whatever partial says
        return theta, None
    if rope_type not in ("linear", "llama3", "yarn", "dynamic"):
        raise ConfigError(f"unsupported rope scaling type {rope_type!r} (nano has linear, llama3, yarn, dynamic)")
    if partial != 1.0:  # transformers' scaled ropes rotate part of the head (its models then crash); nano all
        raise ConfigError(f"partial_rotary_factor {partial} with {rope_type!r} rope is not supported")
    params["rope_type"] = rope_type
    params["factor"] = _positive(source, "rope_scaling.factor", params["factor"])
    if rope_type == "dynamic":  # kept (not None): DeepSeek's softmax scale reads its factor (deepseek.py)
        return theta, params
    if rope_type == "llama3":  # read now: one missing is a config error, not a KeyError while the model is built
        params["low_freq_factor"], params["high_freq_factor"] = (float(params[key]) for key in
                                                                 ("low_freq_factor", "high_freq_factor"))
        if params["low_freq_factor"] >= params["high_freq_factor"]:  # the band between them divides by their gap
            raise ConfigError(f"{source}: rope_scaling's low_freq_factor must be below its high_freq_factor")
    if rope_type != "linear":  # transformers' order: a top-level value, the rope parameters', the context
        key = "original_max_position_embeddings"
        original = params.get(key, raw["max_position_embeddings"])
        params[key] = _size(source, key, original if raw.get(key) is None else raw[key])
        for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow", "attention_factor"):  # yarn's, if given
            if params.get(key) is not None:
                params[key] = float(params[key])
    return theta, params


def _parse_deepseek(raw: dict, cfg: ModelConfig, need, source: str) -> None:
    rank = raw.get("q_lora_rank")  # null: a full-rank query projection (V2-Lite's)
    cfg.q_lora_rank = None if rank is None else _size(source, "q_lora_rank", rank)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):  # MLA's shapes
        setattr(cfg, name, need(name))
    # absent, FAMILY_DEFAULTS' (n_shared_experts 2: 0 would skip the checkpoint's shared experts unseen);
    # null: none, as in DeepSeek's own code
    for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                 "first_k_dense_replace"):
        setattr(cfg, name, _size(source, name, raw[name] or 0, low=0))
    cfg.moe_layer_freq = _size(source, "moe_layer_freq", raw["moe_layer_freq"])
    cfg.norm_topk_prob = bool(raw["norm_topk_prob"])
    cfg.routed_scaling_factor = _positive(source, "routed_scaling_factor", raw["routed_scaling_factor"])
    # else a MoE layer's top-k picks no expert (only the shared ones run: silently another model) or more than exist
    moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if moe and not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({raw.get('num_experts_per_tok')}) must be "
                          f"from 1 to n_routed_experts ({cfg.n_routed_experts})")
    scoring, topk_method = raw.get("scoring_func", "softmax"), raw.get("topk_method", "greedy")
    if scoring != "softmax" or topk_method != "greedy":
        raise ConfigError(f"unsupported DeepSeek router (scoring_func={scoring!r}, topk_method={topk_method!r}); "
                          "nano has softmax scoring with greedy top-k (DeepSeek-V2-Lite)")
    # MLA keeps one latent "KV head"; num_kv_heads/head_dim describe the query/key width instead.
    cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
