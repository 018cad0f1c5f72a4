"""The model: the Llama forward pass and the pieces DeepSeek-V2 (deepseek.py) builds on.

A decoder-only transformer turns a batch of token ids into next-token logits:
embed -> N x (RMSNorm -> attention -> add, RMSNorm -> MLP -> add) -> RMSNorm -> lm_head.
An inference engine runs it over a *packed* batch: the new tokens of several requests in one flat
list `[T, hidden]`, each with its own position; attention is the only place where requests are
kept apart, and it is delegated to an attention backend (torch_attn.py, triton_attn.py) that reads
and writes the KV cache. Everything else is per token and does not care which request a token is.
The same model runs Mistral (Llama's layout), Qwen2 (a bias on q, k and v: the loader stacks the
biases like the weights) and Qwen3 (an RMSNorm over each head's query and key, before rope, and a
head width set apart from hidden / heads): options of the config, not classes of their own.

Three things make the code below differ from a training implementation:
- fused projections: q/k/v are one matmul (`qkv_proj`) and gate/up are one (`gate_up_proj`), so a
  decode step launches fewer, larger kernels. The loader writes each checkpoint tensor into its
  rows of the fused weight. What follows works on views into that output where it can: rope
  rotates q and k in place.
- each residual add is fused into the RMSNorm that follows it (`add_and_norm`, one kernel on the
  GPU: ops.py), so a layer hands on its output and the residual stream separately. That kernel
  can also finish the matmul before it: on the GPU, o_proj and down_proj (`split_k`) multiply the
  two halves of their input apart at decode sizes, and the add sums the two products.
- only the last token of each request gets logits, all sampling needs (prompt logprobs: every row).

Loading weights into these modules is loader.py's job; each model only says where a checkpoint
tensor goes (`checkpoint_layout`). Splitting the model across GPUs is tp.py's: it builds these same
modules in smaller shapes and adds the communication from outside. The per-token ops (norms, SiLU,
rope, the MoE router) come from ops.py, which runs a Triton kernel on CUDA tensors and plain torch
on any other, so the model has one code path for both and a CPU run never imports triton.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nano import ops
from nano.config import ModelConfig
from nano.forward_batch import ForwardBatch
from nano.rope import RotaryEmbedding


class Linear(nn.Module):
    """y = x W^T. Several checkpoint matrices that multiply the same input may be stacked into one
    weight: `stacked` names them (their module names in the checkpoint), `output_sizes` gives their
    rows, and a bias is stacked the same way. Both are left uninitialised: the loader fills them.
    split_k: the output goes to `add_and_norm` only, which takes partial products (ops.linear; off
    when tp.py splits the model, whose all-reduce would carry both)."""

    def __init__(self, in_features: int, output_sizes: int | list[int], dtype: torch.dtype | None = None,
                 stacked: tuple[str, ...] | None = None, bias: bool = False, split_k: bool = False):
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else output_sizes
        self.stacked, self.split_k = stacked, split_k
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(len(self.weight), dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias, self.split_k)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x, residual):
        """The residual stream's step: residual += x, then normalise it -> (normed, residual).
        residual None (the first layer): the stream starts at x."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLU(nn.Module):
    """The Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], stacked=("gate_proj", "up_proj"))
        self.down_proj = Linear(intermediate, hidden, split_k=True)

    def forward(self, x):
        return self.down_proj(ops.linear_silu_and_mul(x, self.gate_up_proj.weight))  # silu(gate) * up [T, I]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id, self.rotary = layer_id, rotary
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], stacked=("q_proj", "k_proj", "v_proj"),
                               bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, split_k=True)
        # Qwen3: an RMSNorm over each head's query and key (weight [head_dim]), before rope
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, batch: ForwardBatch, attn):
        qkv = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv)  # views: [T, H, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:  # on [T*H, D] rows, the norm kernel's shape (reshape copies strided views)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        self.rotary(batch.positions, q, k)  # in place
        out = attn.forward(q, k, v, self.layer_id, batch, self.scale)  # [T, H, D]
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, residual, batch, attn):
        """x: the previous block's output, not yet added to the residual stream (maybe as partial
        products [2, T, hidden]: split_k)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h, batch, attn), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and lm_head; the layers decide the architecture."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, batch: ForwardBatch, attn) -> torch.Tensor:
        """-> logits [B, vocab] of each request's last token (or [R, vocab]: batch.logit_rows), in the
        model's dtype: the argmax of bf16 logits is that of their float32 copies, which a greedy batch
        of 160 would spend 60 us a step writing (sampling.py converts where it computes probabilities).
        A CUDA graph records all of it, the backend's per-pass metadata included (cuda_graph_runner.py)."""
        attn.init_forward_metadata(batch)
        x, residual = self.embed(batch.input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(x, residual, batch, attn)
        if not batch.is_decode:  # keep only each request's last token, or the rows the batch names
            rows = batch.extend_start_loc + batch.extend_lens - 1 if batch.logit_rows is None else batch.logit_rows
            x, residual = x[..., rows, :], residual[rows]  # [(2,) B or R, hidden]
        x, _ = self.norm.add_and_norm(x, residual)
        return self.logits(x)

    # tp.py replaces these two with vocabulary-parallel versions on a model split across GPUs
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.embed_tokens if self.lm_head is None else self.lm_head.weight)

    def checkpoint_layout(self) -> dict[str, tuple[torch.Tensor, tuple]]:
        """HF tensor name -> (our parameter, index of the rows it fills)."""
        layout = {"model.embed_tokens.weight": (self.embed_tokens, ())}
        if self.lm_head is not None:
            layout["lm_head.weight"] = (self.lm_head.weight, ())
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                layout.update(_stacked_layout(f"model.{name}", module))
            elif isinstance(module, RMSNorm):
                layout[f"model.{name}.weight"] = (module.weight, ())
        return layout

    def prepare_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Reshuffle a checkpoint tensor before it is copied in (DeepSeek overrides this)."""
        return tensor


def _stacked_layout(prefix: str, linear: Linear) -> dict:
    parent, _, own = prefix.rpartition(".")
    names = linear.stacked or (own,)
    layout, row = {}, 0
    for name, size in zip(names, linear.output_sizes, strict=True):
        for kind, param in (("weight", linear.weight), ("bias", linear.bias)):
            if param is not None:
                layout[f"{parent}.{name}.{kind}"] = (param, (slice(row, row + size),))
        row += size
    return layout


def build_llama(cfg: ModelConfig) -> CausalLM:
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    layers = [
        DecoderLayer(cfg, LlamaAttention(cfg, i, rotary), SwiGLU(cfg.hidden_size, cfg.intermediate_size))
        for i in range(cfg.num_layers)
    ]
    return CausalLM(cfg, layers)
