"""DeepSeek-V2: multi-head latent attention (MLA) and a mixture of experts (MoE).

DeepSeek-V2 keeps the Llama skeleton (model.py: RMSNorm, residuals, SwiGLU, lm_head) and changes
the two blocks that dominate inference cost: the KV cache and the MLP weights.

MLA shrinks the cache. Every token is projected to one small latent `c` (512 channels for
V2-Lite) plus one 64-channel rope key `k_pe` shared by all heads; per head, the key's non-rope part
and the value are linear images of `c`: `k_nope_h = W_UK_h c`, `v_h = W_UV_h c` (both stacked in
`kv_b_proj`). Expanding them would cache 16 heads x (192 + 128) values per token; instead we
*absorb* the two matrices into the query and the output:
    q_nope_h . k_nope_h = (W_UK_h^T q_nope_h) . c          (q_lat, 512 channels)
    sum_s p_s v_h,s     = W_UV_h (sum_s p_s c_s)            (o_lat, 512 channels)
so attention runs as if there were one 576-wide KV head `[c | k_pe]` shared by all query heads,
queries `[q_lat | q_pe]` and values = the first 512 channels of that same row: 576 cached values
per token and layer instead of 5120, and decode reads 9x fewer bytes. The absorbed form costs
extra matmuls per query (q_nope -> q_lat, o_lat -> o), cheap next to reading the cache. We use it
for prefill too, so the backend sees one layout; there it does ~3x the attention flops of the
expanded form (576 + 512 channels a head instead of 192 + 128), a trade to revisit for long prompts.
`use_mla=False` expands K/V per head instead: plain multi-head attention with a 5120-value cache
row, for comparison.

Rope touches only q_pe and k_pe (the "decoupled" rope key: a rotation cannot be absorbed into
W_UK, so it rides on separate channels). DeepSeek checkpoints pair channels (2j, 2j+1) for the
rotation, while rope.py rotates halves (j, j + d/2); we reorder those weight rows once at load,
which permutes q_pe and k_pe alike and leaves their dot product unchanged. YaRN's magnitude
correction rides on cos/sin (rope.py) and, squared, on the softmax scale (below).

MoE makes the MLP sparse: a router scores 64 experts (small SwiGLUs) per token, the top 6 run and
their outputs are summed with the router's weights, plus 2 "shared" experts every token uses (one
SwiGLU of twice the width). A token uses 2.4 B of V2-Lite's 16 B parameters, so a small decode
batch reads a fraction of the weights, as a 2.4 B dense model would. How to run the chosen
experts without host syncs (so a decode step can be a CUDA graph) is explained at `MoE.form`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nano import ops
from nano.config import ModelConfig
from nano.forward_batch import ForwardBatch, batch_bucket
from nano.model import CausalLM, DecoderLayer, Linear, RMSNorm, SwiGLU
from nano.rope import RotaryEmbedding, pairs_to_halves, yarn_mscale

# DeepSeek's reference code and HF transformers build the norms inside attention (q_a_layernorm,
# kv_a_layernorm) with RMSNorm's default eps, not the config's rms_norm_eps (the same value in every
# released V2 config).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, use_mla: bool):
        super().__init__()
        self.layer_id, self.rotary, self.use_mla = layer_id, rotary, use_mla
        self.num_heads = cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent_dim = cfg.kv_lora_rank
        q_size = cfg.num_heads * cfg.head_dim  # head_dim = nope + rope = 192
        self.q_lora = cfg.q_lora_rank is not None
        # The query's first projection and the latent's (kv_a_proj_with_mqa: latent and rope key)
        # both read the layer's input, so they are stacked into one matmul. V2 sends the query
        # through its own low-rank bottleneck (q_a_proj, a norm, q_b_proj); V2-Lite projects it at once.
        query_proj, self.query_width = ("q_a_proj", cfg.q_lora_rank) if self.q_lora else ("q_proj", q_size)
        self.fused_a_proj = Linear(cfg.hidden_size, [self.query_width, cfg.kv_lora_rank + cfg.qk_rope_head_dim],
                                   stacked=(query_proj, "kv_a_proj_with_mqa"))
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_size)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size)
        # YaRN sharpens attention at long context: DeepSeek multiplies every logit (rope and
        # non-rope channels alike) by mscale(factor, mscale_all_dim)^2, and rope.py divides that
        # mscale out of its cos/sin magnitude. Also in the absorbed form: its logits are the same.
        self.scale = cfg.head_dim**-0.5
        mscale_all_dim = (cfg.rope_scaling or {}).get("mscale_all_dim")
        if mscale_all_dim:
            self.scale *= yarn_mscale(cfg.rope_scaling["factor"], mscale_all_dim) ** 2

    def forward(self, x, batch: ForwardBatch, attn):
        q, kv = self.fused_a_proj(x).split([self.query_width, self.latent_dim + self.rope_dim], dim=-1)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.unflatten(-1, (self.num_heads, -1))  # [T, H, 192]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, 128], [T, H, 64]
        # kv [T, 576] becomes the row the cache stores, [c | k_pe], in place: the norm turns the
        # latent into c and leaves the rope key alone, rope rotates k_pe (and q_pe). The norm runs
        # in rope's launch (ops.apply_rope_), one kernel fewer.
        latent, k_pe = kv.split([self.latent_dim, self.rope_dim], dim=-1)  # [T, 512], [T, 64]
        latent_norm = (latent, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)  # latent -> c
        k_pe = k_pe.unsqueeze(1)  # [T, 1, 64]
        if self.use_mla:
            out = self._attend_absorbed(q_nope, q_pe, k_pe, kv.unsqueeze(1), latent_norm, batch, attn)
        else:
            self.rotary(batch.positions, q_pe, k_pe, norm=latent_norm)
            out = self._attend_expanded(q_nope, q_pe, latent, k_pe, batch, attn)
        return self.o_proj(out.flatten(1))

    def _attend_absorbed(self, q_nope, q_pe, k_pe, key, latent_norm, batch, attn):
        # Per-head views of kv_b_proj (no copies), taken afresh each call so they follow the
        # weight through any later `.to()`.
        per_head = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk, w_uv = per_head.split([self.nope_dim, self.v_dim], dim=1)  # [H, 128, 512]: latent -> k_nope, v
        # The query [T, H, 576] is [q_lat | q_pe], written in place, not concatenated: q_lat = W_UK^T
        # q_nope head by head straight into its first 512 channels, rope's q_pe into the rest.
        query = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.latent_dim + self.rope_dim)
        q_lat, q_rope = query.split([self.latent_dim, self.rope_dim], dim=-1)
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))
        self.rotary(batch.positions, q_pe, k_pe, q_out=q_rope, norm=latent_norm)
        # key [T, 1, 576] is the cached row; the value is the latent c: its first 512 channels (a
        # view, as in kv_cache.py). The backend multiplies each head's o_lat by W_UV, so that it can
        # do so in its last kernel (triton_attn.py).
        value = key[..., : self.latent_dim]
        return attn.forward(query, key, value, self.layer_id, batch, self.scale, v_proj=w_uv)  # [T, H, 128]

    def _attend_expanded(self, q_nope, q_pe, c, k_pe, batch, attn):
        kv = self.kv_b_proj(c).view(len(c), self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [T, H, 128] each
        query = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, 192]
        key = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1)], dim=-1)  # [T, H, 192]
        return attn.forward(query, key, v, self.layer_id, batch, self.scale)  # [T, H, 128]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.num_shared = cfg.n_shared_experts
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Linear(hidden, cfg.n_routed_experts, dtype=torch.float32)  # the router, see route()
        # The shared experts are one SwiGLU of S times an expert's width. A SwiGLU's width splits into
        # independent parts whose outputs add up, so they are S more experts (E, E+1, ...) that every
        # token chooses with weight 1: one set of kernels runs both kinds. All experts' weights are
        # stacked, so a batch of expert ids can index them on the device: w13 holds every expert's
        # gate rows, then every expert's up rows; w2 every expert's down matrix, side by side. Both
        # keep the shared MLP's checkpoint tensors whole (rows E*I.. of each half, columns E*I..).
        experts = cfg.n_routed_experts + cfg.n_shared_experts
        self.w13 = nn.Parameter(torch.empty(2 * experts * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(hidden, experts * inter), requires_grad=False)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the stacks: gate_up [2, E + S, I, hidden] (gate, up) and down [E + S, hidden, I]."""
        hidden, experts = self.w2.shape[0], self.num_experts + self.num_shared
        return self.w13.view(2, experts, -1, hidden), self.w2.view(hidden, experts, -1).transpose(0, 1)

    def expert_layout(self, prefix: str) -> dict[str, tuple[torch.Tensor, tuple]]:
        """Checkpoint names of each expert's matrices, and of the shared MLP's -> their place in w13 / w2."""
        inter = self.w2.shape[1] // (self.num_experts + self.num_shared)
        # (checkpoint module, its first row in each half of w13 = its first column of w2, its width)
        parts = [(f"{prefix}.experts.{e}", e * inter, inter) for e in range(self.num_experts)]
        if self.num_shared:
            parts.append((f"{prefix}.shared_experts", self.num_experts * inter, self.num_shared * inter))
        half, layout = self.w13.shape[0] // 2, {}
        for name, first, width in parts:
            rows = slice(first, first + width)
            layout[f"{name}.gate_proj.weight"] = (self.w13, (rows,))
            layout[f"{name}.up_proj.weight"] = (self.w13, (slice(half + first, half + first + width),))
            layout[f"{name}.down_proj.weight"] = (self.w2, (slice(None), rows))
        return layout

    def route(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k + S] float32, expert ids [T, k + S]): the k chosen, then the S shared experts."""
        # DeepSeek-V2's rule (ops.route): renormalise the chosen weights *or* scale them, never both.
        renormalize = self.top_k > 1 and self.norm_topk_prob
        return ops.route(x, self.gate.weight, self.top_k, renormalize, self.routed_scaling_factor, self.num_shared)

    def form(self, num_tokens: int, on_cuda: bool) -> str:
        """Which of three forms of the same sum runs, chosen from the number of tokens (a shape,
        never a value), so a CUDA graph can capture it:
        - "matvec" (small batches on CUDA: decode, or a prompt of a few tokens): two fused kernels
          (moe_kernels.py) run each (token, expert) pair as a matrix-vector product, reading that
          expert's weights in place, with SiLU-and-mul and the weighted sum over a token's experts
          inside them. Its cost grows with the pairs, about one expert's bytes each, and an expert
          several tokens chose (the shared ones: all) is read again for each. It pays while the pairs
          are at most half the experts (2 T (k + S) <= E + S; on an H200 at 8 tokens of V2-Lite, 64
          pairs of 66 experts, the fused form is the faster: BENCHMARKS.md). T is taken as its batch
          bucket (forward_batch.py), so a batch padded for a graph picks the same form as the same
          batch run eagerly;
        - "fused" (every larger batch on CUDA, decode and prefill): a grouped matmul kernel
          (moe_kernels.py) sorts the pairs by expert on the device and multiplies each chosen
          expert's weights by the rows of its pairs in one launch: only the needed flops, each
          chosen expert read about once, and no host sync, so a graph can capture it at any size;
        - "grouped" (on CPU, the reference): sort the pairs by expert and run each expert on its
          own tokens with torch matmuls. Sizes depend on the routing, so the host must see them
          (a sync, which costs nothing on CPU)."""
        if not on_cuda:
            return "grouped"
        slots, experts = self.top_k + self.num_shared, self.num_experts + self.num_shared
        return "matvec" if 2 * batch_bucket(num_tokens) * slots <= experts else "fused"

    def forward(self, x):
        weights, ids = self.route(x)
        return getattr(self, self.form(x.shape[0], x.is_cuda))(x, weights, ids)  # a method per form

    def matvec(self, x, weights, ids):
        kernels = ops.kernels("moe_kernels")
        gate_up, down = self.expert_weights()
        h = kernels.gate_up_matvec(x, gate_up, ids)  # [T, slots, I]: silu(gate) * up
        return kernels.down_matvec(h, down, ids, weights)  # [T, hidden]: the weighted sum over slots

    def fused(self, x, weights, ids):
        kernels = ops.kernels("moe_kernels")
        (num_tokens, slots), (gate_up, down) = ids.shape, self.expert_weights()
        config = kernels.fused_moe_config(num_tokens, self.top_k, self.num_experts, self.num_shared)
        pairs = kernels.align_pairs_by_expert(ids, self.num_experts + self.num_shared, config["BLOCK_M"])
        h = kernels.fused_moe_matmul(x, gate_up, *pairs, config, pairs_per_row=slots)  # [T*slots, 2I]
        out = kernels.fused_moe_matmul(ops.silu_and_mul(h), down, *pairs, config, pair_weights=weights)
        return out.view(num_tokens, slots, -1).sum(dim=1)  # [T*slots, hidden] -> [T, hidden]: already weighted

    def grouped(self, x, weights, ids):
        gate_up, down = self.expert_weights()
        order = ids.flatten().argsort()  # (token, slot) pairs sorted by expert
        token_of_pair = order // ids.shape[1]  # [T*slots]
        tokens_per_expert = torch.bincount(ids.flatten(), minlength=len(down)).tolist()  # host sync
        pairs_of_expert = x[token_of_pair].split(tokens_per_expert)
        out = torch.cat([(F.silu(xs @ gate_up[0, e].mT) * (xs @ gate_up[1, e].mT)) @ down[e].mT
                         for e, xs in enumerate(pairs_of_expert)])
        out *= weights.flatten()[order, None].to(x.dtype)  # [T*slots, hidden], pairs in expert order
        # Back to (token, slot) order and sum each token's slots. Not index_add_: its atomic adds
        # land in a different order each run, and the next decode step's routing can flip on that.
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted.view(len(x), -1, x.shape[-1]).sum(dim=1)


class DeepseekV2(CausalLM):
    """CausalLM plus the loading steps DeepSeek needs: stacked experts, rope rows reordered."""

    def checkpoint_layout(self):
        layout = super().checkpoint_layout()  # every Linear and RMSNorm, by its module path
        for name, module in self.named_modules():
            if isinstance(module, MoE):
                layout.update(module.expert_layout(f"model.{name}"))
        return layout

    def prepare_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            per_head = tensor.view(cfg.num_heads, cfg.head_dim, -1)  # [H, nope + rope, in]
            nope, rope = per_head.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=1)
            return torch.cat([nope, pairs_to_halves(rope)], dim=1).view_as(tensor)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            latent, rope = tensor.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim])
            return torch.cat([latent, pairs_to_halves(rope)])
        return tensor


def build_deepseek_v2(cfg: ModelConfig, use_mla: bool) -> CausalLM:
    rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    layers = []
    for i in range(cfg.num_layers):
        mlp = MoE(cfg) if cfg.is_moe_layer(i) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        layers.append(DecoderLayer(cfg, MLAttention(cfg, i, rotary, use_mla), mlp))
    return DeepseekV2(cfg, layers)
