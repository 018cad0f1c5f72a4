"""config.json fields of the Llama-layout families, in transformers 5.x's dialect (what its config
classes write) and 4.x's (the hub's: no `layer_types`). nano has no sliding-window attention, so a
config where one acts, over a window shorter than the context, is one ConfigError line."""

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from nano.config import ConfigError, load_config, parse_config  # noqa: E402
from tests.helpers import DEEPSEEK_TINY, LLAMA_TINY  # noqa: E402

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "nano" / "configs"


def raw_config(family: str, dialect: str, **fields) -> dict:
    fields = {"num_key_value_heads": 2} | fields  # Mistral's and Qwen's defaults (8, 32) exceed the tests' 4 heads
    raw = getattr(transformers, f"{family}Config")(**LLAMA_TINY, **fields).to_dict()
    if dialect == "v4":  # as written: transformers 5.x also nulls a Qwen window that is switched off
        raw = {k: v for k, v in raw.items() if k != "layer_types"} | fields
    return raw | {"architectures": [f"{family}ForCausalLM"]}


@pytest.mark.parametrize("dialect", ["v5", "v4"])
@pytest.mark.parametrize("family, fields, slides", [
    ("Mistral", dict(sliding_window=64), True),
    ("Mistral", dict(sliding_window=None), False),
    ("Mistral", dict(sliding_window=4096), False),  # longer than the context (256): never slides
    ("Qwen2", dict(use_sliding_window=False, sliding_window=64), False),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), True),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=3), False),  # on no layer
    ("Qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), True),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=None, max_window_layers=1), False),  # no window: full
])
def test_sliding_window_is_refused_where_it_acts(family, fields, slides, dialect):
    raw = raw_config(family, dialect, num_attention_heads=4, **fields)
    if not slides:
        parse_config(raw)
        return
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    message = str(error.value)
    assert "sliding_window 64 is shorter than the context (256)" in message and "\n" not in message


def test_mistral_without_the_sliding_window_key_slides_over_4096():
    """transformers' MistralConfig defaults the window to 4096: a context past it would slide."""
    raw = raw_config("Mistral", "v4", num_attention_heads=4)
    del raw["sliding_window"]
    parse_config(raw)  # a context of 256
    with pytest.raises(ConfigError, match=r"sliding_window 4096 is shorter than the context \(8192\)"):
        parse_config(raw | {"max_position_embeddings": 8192})


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_qwen_without_the_sliding_window_key_slides_over_4096(family):
    """transformers' Qwen configs default the window to 4096 too, when use_sliding_window turns it on."""
    raw = raw_config(family, "v4", num_attention_heads=4, use_sliding_window=True, max_window_layers=1)
    del raw["sliding_window"]
    parse_config(raw)  # a context of 256
    with pytest.raises(ConfigError, match=r"sliding_window 4096 is shorter than the context \(8192\)"):
        parse_config(raw | {"max_position_embeddings": 8192})


@pytest.mark.parametrize("fields, fragment", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),  # it would load and run SiLU
    (dict(quantization_config={"quant_method": "fp8"}), "quantized"),  # fp8 weights, read without their scales
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "low_freq_factor"),
    # transformers' scaled ropes rotate part of the head (and its models crash); nano would rotate all of it
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5 with 'linear'"),
    (dict(partial_rotary_factor=0.5, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "partial_rotary_factor 0.5 with 'yarn'"),
    (dict(num_attention_heads=0, head_dim=None), "num_attention_heads must be a whole number from 1 to 2147483647, got 0"),  # was "division"
    (dict(num_hidden_layers=0), "num_hidden_layers must be a whole number from 1 to 2147483647, got 0"),  # a TypeError traceback
    (dict(num_attention_heads=-4), "num_attention_heads must be a whole number from 1 to 2147483647, got -4"),  # a traceback at load
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),  # attention would crash
    (dict(head_dim=17), "head_dim 17 is odd"),  # rope's halves: the first request crashed (RuntimeError)
    (dict(hidden_size=68, head_dim=None), "head_dim 17 is odd"),  # hidden / heads
    (dict(head_dim=-16), "head_dim must be a whole number from 1 to 2147483647, got -16"),  # even: rope's traceback
    (dict(max_position_embeddings=-5), "max_position_embeddings must be a whole number from 1 to 2147483647, got -5"),  # rope's traceback
    (dict(num_key_value_heads=-2), "num_key_value_heads must be a whole number from 1 to 2147483647, got -2"),  # a weights shape [0, 64]
    (dict(architectures=None, model_type=["llama"]), "unsupported architecture \\['llama'\\]"),  # unhashable
    # past float's range (1e999 in the file) or any tensor's: an OverflowError traceback, a hang building layers
    (dict(hidden_size=float("inf")), "hidden_size must be a whole number from 1 to 2147483647, got inf"),
    (dict(num_hidden_layers=10**30), "num_hidden_layers must be a whole number"),
    (dict(max_position_embeddings=10**12), "max_position_embeddings must be a whole number"),
    (dict(hidden_size=64.7), "hidden_size must be a whole number"),  # cut to 64 without a word
    (dict(num_key_value_heads=0), "num_key_value_heads must be a whole number from 1"),  # read as one a head
    # ran, silently: NaN logits (an empty answer), an EOS that never matches
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number above 0, got nan"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite number above 0, got inf"),  # a norm of 0
    (dict(num_key_value_heads=True), "num_key_value_heads must be a whole number from 1 to 2147483647, got True"),
    (dict(eos_token_id=[2, True]), "eos_token_id must be a token id or a list of them"),  # true: id 1
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}),
     "unsupported rope scaling type 'longrope'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "beta_fast": "x"}), "bad or missing"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), "rope_theta must be a finite number above 0"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 0}), "rope_scaling.factor must be"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4,
                           "high_freq_factor": 4}), "low_freq_factor must be below its high_freq_factor"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id or a list of them, got '2'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,  # a math domain error's traceback
                           "original_max_position_embeddings": 0}), "original_max_position_embeddings must be"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "mscale": "x"}), "bad or missing"),
])
def test_configs_that_would_compute_something_else_or_crash_are_one_line(fields, fragment):
    raw = raw_config("Llama", "v5", num_attention_heads=4) | fields
    with pytest.raises(ConfigError, match=fragment) as error:
        parse_config(raw)
    assert "\n" not in str(error.value)


def test_family_fields():
    mistral = raw_config("Mistral", "v4", num_attention_heads=4, sliding_window=None) | {"head_dim": None}
    assert parse_config(mistral).head_dim == 16  # null: hidden / heads
    qwen2 = parse_config(raw_config("Qwen2", "v5", num_attention_heads=4))
    qwen3 = parse_config(raw_config("Qwen3", "v5", num_attention_heads=4, head_dim=32))
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (True, False, False, True, 32)
    with pytest.raises(ConfigError, match="attention_bias"):
        parse_config(raw_config("Qwen3", "v5", num_attention_heads=4, attention_bias=True))


@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen2", "Qwen3", "DeepseekV2"])
def test_keys_absent_take_the_config_class_defaults(family):
    """A config.json without these keys: transformers' config class for the family fills in its own
    defaults, which size the weights the model loads and its context. Mistral's KV heads are 8 and
    Qwen's 32 (nano took one per head and refused those weights); Qwen3's head_dim is 128, not hidden /
    heads; Mistral's context is 131,072 tokens and Qwen's 32,768 (nano took 2,048)."""
    keys = ["num_key_value_heads", "max_position_embeddings", "rms_norm_eps"]
    if family == "DeepseekV2":  # MLA: one latent KV head, and a head_dim of its own (a test below)
        raw = transformers.DeepseekV2Config(**DEEPSEEK_TINY).to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}
    else:  # 64 heads: Qwen's 32 KV heads must divide them
        raw = raw_config(family, "v4", num_attention_heads=64, sliding_window=None) | {"hidden_size": 128}
        keys.append("head_dim")
    for key in keys:
        raw.pop(key, None)
    hf, cfg = getattr(transformers, f"{family}Config").from_dict(raw), parse_config(raw)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps) == (hf.max_position_embeddings, hf.rms_norm_eps)
    if family == "DeepseekV2":
        return
    assert (cfg.num_kv_heads, cfg.head_dim) == (hf.num_key_value_heads, getattr(hf, "head_dim", None) or 128 // 64)
    assert parse_config(raw | {"num_key_value_heads": None}).num_kv_heads == 64  # null: one a head, as transformers


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen2.5-7b"])
def test_shipped_qwen_shapes_load(shape):
    cfg = load_config(SHIPPED_CONFIGS / shape)
    assert cfg.head_dim == 128 and cfg.eos_token_ids == [151645]


@pytest.mark.parametrize("family, fields", [
    ("Qwen2", dict(attention_bias=True)),  # Qwen2's q/k/v biases are fixed, its o_proj has none
    ("Qwen2", dict(mlp_bias=True)),
    ("Qwen3", dict(mlp_bias=True, head_dim=16)),
    ("Mistral", dict(attention_bias=True, mlp_bias=True, sliding_window=None)),
    ("Llama", dict(hidden_act="swish")),  # transformers' nn.SiLU
])
def test_keys_transformers_does_not_act_on_are_accepted(family, fields):
    raw = raw_config(family, "v5", num_attention_heads=4, **fields) | fields
    assert parse_config(raw).qkv_bias == (family == "Qwen2")


@pytest.mark.parametrize("family, fields", [
    ("Llama", dict(attention_bias=True)), ("Llama", dict(mlp_bias=True)), ("Qwen3", dict(attention_bias=True)),
])
def test_biases_transformers_adds_are_refused(family, fields):
    with pytest.raises(ConfigError, match="attention_bias and mlp_bias"):
        parse_config(raw_config(family, "v5", num_attention_heads=4, **fields) | fields)


@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen2", "Qwen3", "DeepseekV2"])
def test_config_without_architectures_goes_by_model_type(family):
    """A config saved on its own has `architectures: null`; transformers' AutoModelForCausalLM then
    picks the class from model_type, and nano must pick the same one."""
    raw = getattr(transformers, f"{family}Config")(**LLAMA_TINY, num_attention_heads=4, num_key_value_heads=2,
                                                    kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                    v_head_dim=8, num_experts_per_tok=2).to_dict()
    assert raw["architectures"] is None
    expected = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[raw["model_type"]]
    assert parse_config(raw).architecture == expected
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'"):
        parse_config(raw | {"model_type": "gpt2"})


@pytest.mark.parametrize("top_k", [None, 0, 9])
def test_deepseek_top_k_outside_its_experts_is_one_line(top_k):
    """DeepseekV2Config's default num_experts_per_tok is null: nano's top-0 would run the shared
    experts alone (another model), and 9 of 8 crashes the first request on CPU (on CUDA the router
    kernel picks an expert twice). A config whose layers are all dense needs no top-k."""
    raw = transformers.DeepseekV2Config(**DEEPSEEK_TINY).to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}
    assert raw["n_routed_experts"] == 8
    with pytest.raises(ConfigError, match=rf"num_experts_per_tok \({top_k}\) must be from 1 to n_routed_experts \(8\)"):
        parse_config(raw | {"num_experts_per_tok": top_k})
    dense = raw | {"num_experts_per_tok": top_k, "first_k_dense_replace": raw["num_hidden_layers"]}
    assert not any(parse_config(dense).is_moe_layer(i) for i in range(raw["num_hidden_layers"]))


@pytest.mark.parametrize("fields, fragment", [  # each crashed in a traceback as the model was built or first ran
    ({"q_lora_rank": -1}, "q_lora_rank must be a whole number from 1"), ({"q_lora_rank": 1.5}, "q_lora_rank"),
    ({"moe_intermediate_size": -5}, "moe_intermediate_size must be a whole number from 0"),
    ({"n_shared_experts": -1}, "n_shared_experts must be a whole number from 0"),
    ({"n_routed_experts": 10**30}, "n_routed_experts must be a whole number"),
    # V2's later routers, which would load and route another way
    ({"topk_method": "group_limited_greedy"}, "unsupported DeepSeek router"),
    ({"scoring_func": "sigmoid"}, "unsupported DeepSeek router"),
])
def test_deepseek_fields_nano_cannot_run_are_one_line(fields, fragment):
    raw = transformers.DeepseekV2Config(**DEEPSEEK_TINY).to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}
    with pytest.raises(ConfigError, match=fragment):
        parse_config(raw | fields)


def test_deepseek_moe_keys_absent_take_transformers_defaults():
    """Absent, transformers runs 2 shared experts (and the checkpoint's weights for them); nano ran
    none and skipped those weights, a different model. Null means none (DeepSeek's code)."""
    moe_keys = ("n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor")
    raw = transformers.DeepseekV2Config(**(DEEPSEEK_TINY | {"n_shared_experts": 1, "first_k_dense_replace": 2,
                                                            "norm_topk_prob": True, "routed_scaling_factor": 2.5}))
    raw = {k: v for k, v in raw.to_dict().items() if k not in moe_keys} | {"architectures": ["DeepseekV2ForCausalLM"]}
    cfg, hf = parse_config(raw), transformers.DeepseekV2Config.from_dict(raw)
    assert [getattr(cfg, key) for key in moe_keys] == [getattr(hf, key) for key in moe_keys]
    assert parse_config(raw | {"n_shared_experts": None}).n_shared_experts == 0


@pytest.mark.parametrize("architectures, fragment", [("LlamaForCausalLM", None), (5, "unsupported architecture 5")])
def test_architectures_not_in_a_list(architectures, fragment):
    """A hand-written `"architectures": "LlamaForCausalLM"`: transformers loads it (by model_type); nano
    said 'unsupported architecture 'LlamaForCausalLM'; nano supports LlamaForCausalLM, ...'. Junk is one
    line, not a TypeError."""
    raw = transformers.LlamaConfig(**LLAMA_TINY, num_attention_heads=4).to_dict() | {"architectures": architectures}
    if fragment is None:
        assert parse_config(raw).architecture == "LlamaForCausalLM"
        return
    with pytest.raises(ConfigError, match=fragment):
        parse_config(raw)


@pytest.mark.parametrize("experts", [1, 5])
def test_deepseek_moe_layers_are_transformers(experts):
    """A MoE layer past first_k_dense_replace however few its experts, and a top-k of all of them, as
    transformers builds it; a config without routed experts is dense (DeepSeek's code: `is not None`)."""
    raw = transformers.DeepseekV2Config(**(DEEPSEEK_TINY | {"n_routed_experts": experts, "num_experts_per_tok": experts}))
    cfg = parse_config(raw.to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]})
    hf_layers = transformers.DeepseekV2ForCausalLM(raw).model.layers
    assert [cfg.is_moe_layer(i) for i in range(len(hf_layers))] == [type(x.mlp).__name__ == "DeepseekV2Moe" for x in hf_layers]
    dense = {k: v for k, v in raw.to_dict().items() if k not in ("n_routed_experts", "num_experts_per_tok")}
    assert not any(parse_config(dense | {"architectures": ["DeepseekV2ForCausalLM"]}).is_moe_layer(i) for i in range(3))


def test_qwen_sliding_window_edges():
    """Without max_window_layers Qwen2Config slides from layer 28 (its default) on; a window as long as
    the context masks nothing (a query sees at most context - 1 keys back), so it loads."""
    fields = dict(num_attention_heads=4, use_sliding_window=True, sliding_window=64)
    raw = raw_config("Qwen2", "v4", **fields) | {"num_hidden_layers": 29}
    del raw["max_window_layers"]
    assert transformers.Qwen2Config.from_dict(raw).layer_types[28] == "sliding_attention"
    with pytest.raises(ConfigError, match="sliding_window 64 is shorter"):
        parse_config(raw)
    # 28 layers slide nowhere, and neither does a config without use_sliding_window (off by default)
    for off in (raw | {"num_hidden_layers": 28}, {k: v for k, v in raw.items() if k != "use_sliding_window"}):
        parse_config(off)
        assert "sliding_attention" not in transformers.Qwen2Config.from_dict(off).layer_types
    parse_config(raw_config("Mistral", "v4", num_attention_heads=4, sliding_window=256))  # the context: 256


def test_rope_scaling_added_to_a_v5_config_keeps_its_theta():
    """Qwen2.5's card adds a `rope_scaling` of YaRN by hand, with no theta in it; in a config that
    transformers 5 wrote, the theta (1e6) is in `rope_parameters`. transformers 5.25 takes the
    `rope_scaling` whole and falls back to a theta of 10000, a model other than the one trained; nano
    keeps the 1e6, the hand-added scaling on top of it."""
    raw = raw_config("Qwen2", "v5", num_attention_heads=4, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    cfg = parse_config(raw)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0


# ---- configs written by hand: only the keys a test is about (transformers' to_dict() writes every
# default out, so a default nano falls back to would never be read) ----------------------------------

HAND_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 256}
HAND_DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 320, "hidden_size": 60, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 256, "kv_lora_rank": 32,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 16}  # 60 / 4 heads: an odd 15


def test_absent_keys_take_transformers_defaults():
    """LlamaConfig's defaults: untied embeddings (a tied model would read the embedding as lm_head) and
    rope_theta 10000 (another base rotates every position differently)."""
    cfg = parse_config(HAND_LLAMA)
    assert cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 10000.0


def test_yarn_stretches_an_unstretched_context():
    """Qwen2.5's card adds rope_scaling alone: the context grows to original x factor (vLLM's rule)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert parse_config(HAND_LLAMA | {"rope_scaling": rope}).max_position_embeddings == 1024
    # one already past original x factor is kept
    assert parse_config(HAND_LLAMA | {"max_position_embeddings": 4096, "rope_scaling": rope}).max_position_embeddings == 4096
    # a rope_type beside 4.x's `type` wins, as transformers 5 reads it
    assert parse_config(HAND_LLAMA | {"rope_scaling": {**rope, "type": "linear"}}).max_position_embeddings == 1024


def test_a_top_level_original_context_wins_over_the_rope_parameters():
    """transformers' order: a top-level original_max_position_embeddings, then the rope parameters'."""
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    cfg = parse_config(HAND_LLAMA | {"rope_scaling": rope, "original_max_position_embeddings": 128})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 128
    assert cfg.max_position_embeddings == 256  # max(256, 128 x 2)
    del rope["original_max_position_embeddings"]  # the last resort: the context
    cfg = parse_config(HAND_LLAMA | {"rope_scaling": rope})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256 and cfg.max_position_embeddings == 512


def test_deepseek_head_dim_comes_from_mla_not_hidden_over_heads():
    """DeepSeek's head width is qk_nope + qk_rope: an odd hidden_size / heads is no reason to refuse it."""
    assert parse_config(HAND_DEEPSEEK).head_dim == 24
    with pytest.raises(ConfigError, match="is odd"):
        parse_config(HAND_LLAMA | {"hidden_size": 60})  # Llama's head_dim is hidden / heads: 15


@pytest.mark.parametrize("bias", ["mlp_bias", "attention_bias"])  # transformers' DeepseekV2 reads both
def test_deepseek_biases_are_refused(bias):
    with pytest.raises(ConfigError, match="attention_bias and mlp_bias"):
        parse_config(HAND_DEEPSEEK | {bias: True})


@pytest.mark.parametrize("eos", [-1, [2, -1]])
def test_a_negative_eos_id_is_refused(eos):
    with pytest.raises(ConfigError, match="eos_token_id must be a token id"):
        parse_config(HAND_LLAMA | {"eos_token_id": eos})
    # the ends of what the messages promise are taken: id 0, and a size of 2**31 - 1
    cfg = parse_config(HAND_LLAMA | {"max_position_embeddings": 2**31 - 1, "eos_token_id": 0})
    assert (cfg.max_position_embeddings, cfg.eos_token_ids) == (2**31 - 1, [0])


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def test_llama3_rope_reads_its_original_context_in_transformers_order():
    """Llama-3.1's rope blends frequencies around its original context (rope.py reads the key): the
    rope's own value, else a top-level one, else the context (transformers 5.25's order)."""
    cfg = parse_config(HAND_LLAMA | {"rope_scaling": LLAMA3_ROPE | {"original_max_position_embeddings": 64}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64
    cfg = parse_config(HAND_LLAMA | {"rope_scaling": LLAMA3_ROPE, "original_max_position_embeddings": 128})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 128
    assert parse_config(HAND_LLAMA | {"rope_scaling": LLAMA3_ROPE}).rope_scaling["original_max_position_embeddings"] == 256


def test_a_top_level_theta_wins_over_rope_parameters_under_a_hand_added_rope_scaling():
    """transformers 5 takes a `rope_scaling` whole and sets its theta from the top-level `rope_theta`:
    that theta, not the one in `rope_parameters`, is the model's; without `rope_scaling` the
    rope_parameters' theta wins (nano falls back to it for configs with no top-level theta)."""
    raw = HAND_LLAMA | {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert parse_config(raw).rope_theta == 5e5
    assert parse_config({k: v for k, v in raw.items() if k != "rope_scaling"}).rope_theta == 1e6


def test_a_folder_named_config_json_is_no_config(tmp_path):
    """A config.json that is a folder (a bad unpack) is the missing config's one-line error, not an
    IsADirectoryError traceback."""
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)


def test_a_config_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """A config.json there but unreadable (permissions, an I/O error; root reads any file, so the
    refusal is planted) is a ConfigError naming the file, which the commands print as one line."""
    (tmp_path / "config.json").write_text("{}")

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError, match=r"config.json: cannot be read \(Permission denied\)$"):
        load_config(tmp_path)
