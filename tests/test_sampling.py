"""The sampler: greedy, temperature, top-k and top-p, per request in one batch."""

import pytest
import torch

from nano.sampling import SamplingParams, _top_k_top_p, sample


def draw(logits, params, n, seed=0):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return torch.stack([sample(logits, params, gens) for _ in range(n)])  # [n, B]


def test_mixed_batch_respects_each_requests_settings():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    top5 = logits[1].topk(5).indices
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5),  # the default: greedy
              SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=1.0, top_k=1)]
    tokens = draw(logits, params, 300)
    greedy = logits.argmax(-1)
    assert (tokens[:, 0] == greedy[0]).all()
    assert torch.isin(tokens[:, 1], top5).all() and tokens[:, 1].unique().numel() > 1  # it samples
    assert (tokens[:, 2] == greedy[2]).all()  # top-p so small only the best token is left
    assert (tokens[:, 3] == greedy[3]).all()


def test_frequencies_follow_the_softmax_and_top_p_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = torch.bincount(draw(logits, [SamplingParams(temperature=1.0)], 4000)[:, 0], minlength=4)
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    # top-p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it; renormalised to 5/8, 3/8
    counts = torch.bincount(draw(logits, [SamplingParams(temperature=1.0, top_p=0.7)], 4000)[:, 0], minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / 4000 - 0.625) < 0.03


def test_frequencies_follow_the_softmax_of_the_logits_over_the_temperature():
    """Temperature T samples from softmax(logits / T): below 1 sharper, above 1 flatter (each row its own)."""
    torch.manual_seed(2)
    logits = torch.randn(3, 5) * 1.5
    temperatures = [0.5, 2.0, 1.3]
    tokens = draw(logits, [SamplingParams(temperature=t) for t in temperatures], 4000)
    for row, t in enumerate(temperatures):
        counts = torch.bincount(tokens[:, row], minlength=5)
        assert torch.allclose(counts / 4000, torch.softmax(logits[row] / t, dim=-1), atol=0.03), (row, t)


def test_settings_below_float32s_range_act_as_their_limit():
    """A temperature or top-p that rounds to 0 in float32 means greedy, not the garbage a division by
    0 (or an empty nucleus) would give: token 0 every time."""
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 3
    logits[:, 0] = -10  # token 0 is the one an all-zero or NaN row would pick
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=1e-50),
              SamplingParams(temperature=1e-7, top_k=3)]
    assert (draw(logits, params, 50) == logits.argmax(-1)).all()


def test_top_k_then_top_p_keeps_the_tokens_hf_keeps():
    """Top-p applies to what top-k leaves, renormalised, as HF's warpers (and vLLM) apply them:
    with probabilities .35 .25 .2 .2, top-k 2 and top-p .55, only the first token is left."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from nano.sampling import _top_k_top_p

    torch.manual_seed(2)
    logits = torch.randn(64, 40) * 2
    logits[0, :4] = torch.log(torch.tensor([0.35, 0.25, 0.2, 0.2]))
    logits[0, 4:] = -1e4
    ks = [2] + torch.randint(1, 41, (63,)).tolist()
    ps = [0.55] + torch.rand(63).clamp(min=0.01).tolist()
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(ks, ps)]
    kept = _top_k_top_p(torch.softmax(logits, dim=-1), params) > 0
    for row, (k, p) in enumerate(zip(ks, ps)):
        hf = TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, logits[row : row + 1].clone()))
        assert torch.equal(kept[row], torch.isfinite(hf[0])), (row, k, p)
    assert kept[0].nonzero().flatten().tolist() == [0]


@pytest.mark.parametrize("field", ["max_new_tokens", "top_k", "seed", "logprobs"])
@pytest.mark.parametrize("value", [float("nan"), 2.5, float("inf"), True])
def test_a_count_that_is_no_integer_is_refused_at_once(field, value):
    """vLLM's max_tokens, top_k, seed and logprobs are ints. A NaN budget passed the range checks, and then
    every step of the engine raised (its admission estimate rounds it); 2.5 logprobs failed inside a step."""
    with pytest.raises(ValueError, match=f"{field.replace('_', '-')} must be an integer"):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("setting, message", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top-p"), (dict(top_p=1.01), "top-p"),
    (dict(top_k=-1), "top-k"), (dict(seed=2**63), "seed"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=True), "prompt-logprobs"),
    (dict(max_new_tokens=0), "max-new")])
def test_a_setting_out_of_its_range_is_refused_at_once(setting, message):
    """Each setting's range (validate's rules, OpenAI's and vLLM's): one line naming the setting,
    while the same setting at its limit passes."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**setting).validate()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=2**63 - 1, logprobs=20, prompt_logprobs=True,
                   max_new_tokens=1).validate()


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_hf_does():
    """bf16 logits tie often; HF's TopKLogitsWarper and vLLM keep every token as likely as the k-th,
    so with probabilities .5 .2 .2 ... top-k 2 samples from three tokens, not two."""
    from transformers.generation.logits_process import TopKLogitsWarper

    from nano.sampling import _top_k_top_p

    torch.manual_seed(3)
    logits = (torch.randn(64, 40) * 2).round()  # integers: many ties
    ks = torch.randint(1, 41, (64,)).tolist()
    params = [SamplingParams(temperature=1.0, top_k=k) for k in ks]
    kept = _top_k_top_p(torch.softmax(logits, dim=-1), params) > 0
    for row, k in enumerate(ks):
        hf = TopKLogitsWarper(k)(None, logits[row : row + 1].clone())
        assert torch.equal(kept[row], torch.isfinite(hf[0])), (row, k)
    tied = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]]))
    counts = torch.bincount(draw(tied, [SamplingParams(temperature=1.0, top_k=2)], 3000)[:, 0], minlength=4)
    assert counts[3] == 0 and abs(counts[2] / 3000 - 2 / 9) < 0.03  # .2 of the .9 kept


def test_a_request_without_truncation_keeps_its_whole_vocabulary_beside_one_with_it():
    """A row at top_p 1 beside a row with top-k goes through the same sort and cumsum: float32's running
    mass reached the sum before the vocabulary's tail, and the tail's tokens (44 of 128,256 here, each
    about 8e-9 likely) could never be drawn in that batch, where alone they could."""
    vocab = 128256
    logits = torch.full((vocab,), -17.3)
    logits[0], logits[1:50] = 0.0, torch.linspace(-1, -8, 49)
    probs = torch.softmax(logits, -1)
    kept = _top_k_top_p(torch.stack([probs, probs]), [SamplingParams(), SamplingParams(top_k=5)])
    assert torch.equal(kept[0], probs) and (kept[1] > 0).sum() == 5


def test_a_top_k_above_the_vocabulary_keeps_every_token():
    """top_k 10^6 over a 50-token vocabulary (the API takes any int64) is no top-k at all, as vLLM reads
    it, not an index past the vocabulary's end (a 500)."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(2, 50), dim=-1)
    kept = _top_k_top_p(probs, [SamplingParams(temperature=1.0, top_k=10**6), SamplingParams(temperature=1.0, top_k=5)])
    assert torch.equal(kept[0], probs[0]) and (kept[1] > 0).sum() == 5


def test_top_p_stops_where_the_mass_reaches_p_as_hf_does():
    """Probabilities .5 .25 .25 at top-p .5: the first token's mass reaches p, so it alone is kept
    (HF's TopPLogitsWarper, vLLM alike); `<=` in place of `<` kept the second too."""
    from transformers import TopPLogitsWarper

    probs = torch.tensor([[0.5, 0.25, 0.25]])
    kept = _top_k_top_p(probs, [SamplingParams(temperature=1.0, top_p=0.5)])
    hf = TopPLogitsWarper(0.5)(None, probs.log())
    assert (kept[0] > 0).tolist() == torch.isfinite(hf[0]).tolist() == [True, False, False]
    # a top-p just under 1, alone in its batch, still drops the tail past it
    probs = torch.tensor([[0.9, 0.096, 0.004]])
    kept = _top_k_top_p(probs, [SamplingParams(temperature=1.0, top_p=0.995)])
    hf = TopPLogitsWarper(0.995)(None, probs.log())
    assert (kept[0] > 0).tolist() == torch.isfinite(hf[0]).tolist() == [True, True, False]
