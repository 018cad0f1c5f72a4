"""Rotary position embeddings (rope) and the context-extension tricks built on them.

Rope encodes a token's position by rotating pairs of query/key channels by an angle
`position * inv_freq[i]`; the dot product q.k then depends only on the distance between the two
tokens. Long-context variants only change the frequencies:
- linear: divide every frequency by `factor` (positions are squeezed);
- llama3 (Llama-3.1): keep high frequencies, divide low ones by `factor`, blend in between;
- yarn (DeepSeek-V2): the same idea with a ramp over channel index, plus a magnitude correction
  `mscale` folded into cos/sin (and, for DeepSeek, into the softmax scale: see deepseek.py).

We precompute one cos/sin table for every position once, and rotate "halves" (channel i pairs with
channel i + d/2, the NeoX/HF-Llama convention). DeepSeek checkpoints pair neighbours (2j, 2j+1)
instead; deepseek.py permutes those weight rows at load time so the same rotation serves both.
"""

import math

import torch

from nano import ops


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(rot_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rot_dim/2] float32, magnitude multiplier for cos/sin)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    # dynamic NTK is the default rope up to max_position_embeddings, past which it changes the
    # frequencies and nano never runs
    if scaling is None or scaling["rope_type"] == "dynamic":
        return inv_freq.float(), 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    original_ctx = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen < original_ctx / high, inv_freq,
                               torch.where(wavelen > original_ctx / low, inv_freq / factor, blended))
        return inv_freq.float(), 1.0
    # yarn
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return rot_dim * math.log(original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):  # to whole channels, unless the config says not to (HF's rule)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    if scaling.get("attention_factor") is not None:
        magnitude = scaling["attention_factor"]
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        magnitude = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    else:
        magnitude = yarn_mscale(factor)
    return inv_freq.float(), magnitude


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rot_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        # Computed on the CPU and moved to the device the model is built on, so that a model built
        # on "meta" to count its bytes (loader.py) never runs these ops there: torch's meta versions
        # of some of them import its compiler, seconds of start-up.
        with torch.device("cpu"):
            inv_freq, magnitude = rope_frequencies(rot_dim, theta, scaling)
            angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            # [max_positions, rot_dim]: cos of each pair's angle in the first half, sin in the second.
            cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude
        self.register_buffer("cos_sin", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor | None = None,
                norm: tuple | None = None):
        """Rotate q [T, H, rot_dim] and k [T, Hkv, rot_dim] by their token's position [T], in place:
        they are usually views into a projection's output, which then holds the rotated rows. With
        q_out, the rotated q goes there instead (DeepSeek: into its attention query); with norm
        (x, weight, eps), x's rows are also normalised in place (DeepSeek's latent)."""
        ops.apply_rope_(q, k, self.cos_sin, positions, q_out, norm)


def pairs_to_halves(rows: torch.Tensor) -> torch.Tensor:
    """Rope rows [..., d, in] ordered (x0, x1), (x2, x3), ... -> x0, x2, ..., then x1, x3, ...: each
    rotated pair (2j, 2j+1) becomes (j, j + d/2), what this module rotates. DeepSeek's checkpoints
    and llama.cpp's converter (the GGUF of default_model.py) store rope rows in pairs."""
    return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2)
