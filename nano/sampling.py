"""Sampling: turning each request's logits into its next token.

Every request carries its own settings, so one batch may mix greedy and sampled requests:
- temperature 0 is greedy (argmax); otherwise logits are divided by the temperature,
- top-k keeps the k most likely tokens (and those tied with the k-th), then top-p the smallest set
  of those whose probability, renormalised over them, reaches p,
- a request with a seed draws from its own random generator, so its draws do not depend on which
  other requests happen to share its batch (its logits may, by float rounding: a near-tie can flip).
Log-probabilities, for a request that asks (`logprobs`: how many likeliest alternatives to list,
at most 20), are those of the model's own distribution: log_softmax of the raw logits, before
temperature, top-k and top-p, as OpenAI and vLLM report them. Only the rows that ask compute them.
Sampling uses the "exponential race": argmax(p / E) with E ~ Exp(1) picks token i with
probability p_i, and needs no cumulative sums over the vocabulary. Each argmax is `ops.argmax`:
on the GPU a split reduction (triton_ops.py), a few microseconds where torch's takes 20-45.
"""

import math
import numbers
from collections import deque
from dataclasses import dataclass, field

import torch

from nano import ops
from nano.forward_batch import to_device

MAX_LOGPROBS = 20  # alternatives listed per token at most (OpenAI's limit)
# Rows whose logprobs token_logprobs computes at once. A prompt's 8192-token chunk over Llama-3's 128,256-token
# vocabulary is two float32 blocks of 4 GiB (the logits in float32, their log_softmax); 1024 rows hold 0.5 GiB each.
LOGPROB_ROWS = 1024


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_new_tokens: int = 256
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # the sampled token's logprob and its `logprobs` likeliest alternatives; None: off
    prompt_logprobs: bool = False  # also every prompt token's (the server's `echo`), computed by its prefill

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that float32 logits divided by it overflow: the argmax."""
        return self.temperature < 1e-6

    def validate(self):
        """Raise ValueError with a one-line message for a setting that makes no sense."""
        for name in ("top_k", "max_new_tokens", "seed", "logprobs"):  # a NaN or 2.5 would fail a later step, every step
            value = getattr(self, name)
            if value is not None and not integral(value):
                raise ValueError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        for name, value in (("top-k", self.top_k), ("seed", self.seed)):  # they go into int64 tensors
            if value is not None and not 0 <= value < 2**63:
                raise ValueError(f"{name} must be in [0, 2^63), got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("prompt-logprobs needs logprobs")
        if self.max_new_tokens < 1:
            raise ValueError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")


def integral(value) -> bool:
    """An integer (numpy's too), not a bool, NaN or 2.5: what a count, a size or a seed must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class Logprobs:
    """A request's logprobs, when its params ask, from the passes that compute them until its caller
    takes them. Each entry: (the token's logprob, [(id, logprob)] of the k likeliest tokens)."""
    prompt: list = field(default_factory=list)  # per prompt token after the first (prompt_logprobs)
    tokens: deque = field(default_factory=deque)  # per generated token, in order


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """logits [B, vocab] -> next tokens [B] (int64, on the logits' device); probabilities in float32."""
    greedy = ops.argmax(logits)
    if all(p.greedy for p in params):
        return greedy
    device = logits.device
    temperature = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    probs = _top_k_top_p(probs, params)
    race = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        race[row].exponential_(generator=gen)
    sampled = ops.argmax(probs / race)
    is_greedy = to_device([p.greedy for p in params], torch.bool, device)
    return torch.where(is_greedy, greedy, sampled)


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.top_k == 0 and p.top_p >= 1 for p in params):
        return probs
    device, vocab = probs.device, probs.shape[-1]
    top_k = to_device([p.top_k or vocab for p in params], torch.int64, device)
    top_p = to_device([p.top_p for p in params], torch.float32, device)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)
    # top-k keeps every token as likely as the k-th, as HF's and vLLM's do: bf16 logits tie often
    kth = sorted_probs.gather(-1, (top_k.clamp(max=vocab) - 1)[:, None])
    sorted_probs = sorted_probs * (sorted_probs >= kth)
    # then top-p over the k left, renormalised (HF's and vLLM's order): keep a token while the mass
    # before it is below p; the likeliest always stays (a p below float32's range reads as 0), and so
    # does every token at p = 1 (float32's cumsum reaches the sum before the tail of the vocabulary ends)
    mass_before = (sorted_probs.cumsum(dim=-1) - sorted_probs) / sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs * ((mass_before < top_p[:, None]) | (rank[None, :] == 0) | (top_p[:, None] >= 1))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logits [R, vocab], tokens [R] -> each token's logprob [R], and the k likeliest tokens'
    logprobs and ids [R, k], all on the logits' device; LOGPROB_ROWS rows at a time (each row's are its own)."""
    parts = []
    for rows, targets in zip(logits.split(LOGPROB_ROWS), tokens.split(LOGPROB_ROWS)):
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        top = logprobs.topk(k, dim=-1)
        parts.append((logprobs.gather(-1, targets[:, None])[:, 0], top.values, top.indices))
    return parts[0] if len(parts) == 1 else tuple(torch.cat(column) for column in zip(*parts))


def logprob_entries(chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, ks: list[int]) -> list:
    """token_logprobs' tensors -> per row (logprob, [(id, logprob)] of its own k likeliest)."""
    rows = zip(chosen.tolist(), values.tolist(), ids.tolist(), ks)
    return [(logprob, list(zip(top_ids[:k], top_values[:k]))) for logprob, top_values, top_ids, k in rows]
