"""The engine's logprobs against HF transformers' log_softmax on a tiny random Llama, float32 on CPU:
each generated token's and its top-k (decode passes with and without overlap), and every prompt
token's (computed in the prefill, chunk by chunk, never from a cached prefix)."""

import pytest
import torch

from nano.engine import Engine, EngineConfig
from nano.sampling import SamplingParams
from tests.helpers import LLAMA_TINY, random_prompts, save_tiny_llama


def run(engine, prompts, params):
    """-> per request: (its generated tokens' (logprob, top) entries, its prompt's)."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens, prompt = {r.rid: [] for r in reqs}, {}
    for req, _ in engine.stream():
        computed = engine.logprobs[req.rid]
        tokens[req.rid].append(computed.tokens.popleft())
        if computed.prompt is not None:
            prompt[req.rid], computed.prompt = computed.prompt, None
    return reqs, tokens, prompt


@pytest.mark.parametrize("chunk, overlap", [(8192, True), (5, True), (5, False)])
def test_logprobs_match_hf(tmp_path, chunk, overlap):
    hf = save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=2000, chunked_prefill_size=chunk, overlap=overlap, log=False))
    prompts = random_prompts([12, 7, 12], LLAMA_TINY["vocab_size"])
    prompts[2] = prompts[0]  # the same prompt again, in the cache by then: its prompt logprobs still all come
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=True),
              SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=0, temperature=0.8, seed=1),
              SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=True)]
    for some in (slice(0, 2), slice(2, 3)):  # the third after the first two are done
        reqs, tokens, prompt = run(engine, prompts[some], params[some])
        for req in reqs:
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([req.prompt_ids + req.output_ids])).logits[0], dim=-1)
            k, n = req.params.logprobs, len(req.prompt_ids)
            entries = (prompt[req.rid] if req.params.prompt_logprobs else []) + tokens[req.rid]
            first = 1 if req.params.prompt_logprobs else n  # the first token with an entry
            targets = (req.prompt_ids + req.output_ids)[first:]
            assert len(entries) == len(targets)
            for i, ((logprob, top), token) in enumerate(zip(entries, targets)):
                row = ref[first + i - 1]
                assert abs(logprob - row[token].item()) < 1e-4
                values, ids = row.topk(k)
                assert [t for t, _ in top] == ids.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=0)
    assert not any(engine.logprobs[r].tokens for r in engine.logprobs)


def test_generate_checks_each_prompt_once_and_keeps_no_logprobs(tmp_path, monkeypatch):
    """generate gives back the tokens alone: the logprobs its requests computed stayed in engine.logprobs,
    where nobody takes them, for the engine's life; and every prompt was checked twice."""
    from nano import engine as engine_module

    save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=400, chunked_prefill_size=8, log=False))
    prompts = random_prompts([12, 30, 5], LLAMA_TINY["vocab_size"], seed=4)
    params = [SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=True),
              SamplingParams(max_new_tokens=4, logprobs=0, temperature=0.7, seed=3), SamplingParams(max_new_tokens=5)]
    checked = []
    monkeypatch.setattr(engine_module, "check_request", lambda *args: checked.append(args[0]))
    outputs = engine.generate(prompts, params)
    assert [len(o) for o in outputs] == [6, 4, 5] and checked == prompts
    assert engine.logprobs == {}
    later = engine.add_request(prompts[0], params[0])  # a request of the caller's own keeps them until taken
    for _ in engine.stream():
        pass
    assert len(engine.logprobs[later.rid].tokens) == 6 and len(engine.logprobs[later.rid].prompt) == 11


@pytest.mark.parametrize("rows", [0, 1, 8, 37])  # none, fewer than a slice, one slice exactly, several and a part
def test_logprobs_are_computed_a_slice_of_rows_at_a_time(monkeypatch, rows):
    """A prompt's 8192-row chunk held its float32 logits and their log_softmax whole (4 GiB each over
    Llama-3's vocabulary): token_logprobs computes LOGPROB_ROWS rows at a time (patched to 8 here), with
    the numbers of the whole block's log_softmax."""
    from nano import sampling

    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, 50, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (rows,), generator=g)
    whole = torch.log_softmax(logits.float(), dim=-1)
    top = whole.topk(5, dim=-1)
    sizes, log_softmax = [], torch.log_softmax
    monkeypatch.setattr(sampling, "LOGPROB_ROWS", 8, raising=False)
    monkeypatch.setattr(torch, "log_softmax", lambda x, dim: sizes.append(len(x)) or log_softmax(x, dim=dim))
    chosen, values, ids = sampling.token_logprobs(logits, tokens, 5)
    assert max(sizes) <= 8 and sum(sizes) == rows
    assert torch.equal(chosen, whole.gather(-1, tokens[:, None])[:, 0])
    assert torch.equal(values, top.values) and torch.equal(ids, top.indices)
