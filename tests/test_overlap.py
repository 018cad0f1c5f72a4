"""Overlapped decode passes (engine.py: the host books pass N's tokens while pass N+1 runs) against
the engine that finishes each pass before the next (CPU, tiny Llama). Same tokens, stop ids and
aborts included, and every KV slot back in the pool at the end."""

import random
import time

import pytest

from nano.engine import Engine, EngineConfig
from nano.sampling import SamplingParams
from nano.scheduler import Status
from tests.helpers import LLAMA_TINY, random_prompts, save_tiny_llama

POOL = 400


def engine_for(path, overlap):
    return Engine(path, EngineConfig(max_total_tokens=POOL, max_running_requests=8, overlap=overlap, log=False))


def all_slots_back(engine):
    """Every slot free or cached, none twice (a slot freed twice would be handed out twice)."""
    free = engine.slots.free_slots.tolist()
    cached = engine.prefix_cache.size if engine.prefix_cache else 0
    return engine.in_flight is None and len(free) + cached == POOL and len(set(free)) == len(free)


def test_overlapped_passes_give_the_same_tokens_and_free_every_slot(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([5, 17, 1, 40, 9, 23], LLAMA_TINY["vocab_size"], seed=11)
    budget = SamplingParams(max_new_tokens=12, ignore_eos=True)
    free_run = engine_for(tmp_path, overlap=False).generate(prompts, budget)
    # stop ids that the free run generates part-way: those requests end early on a stop token,
    # after the next pass was launched for them (a wasted token that must leave no trace)
    stop_ids = {out[4] for out in free_run[:3]}
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=7),
              SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)] * 2
    outputs = {}
    for overlap in (False, True):
        engine = engine_for(tmp_path, overlap)
        reqs = [engine.add_request(p, sp, stop_ids) for p, sp in zip(prompts, params)]
        overlapped_steps = 0
        while engine.has_work():
            engine.step()
            overlapped_steps += engine.in_flight is not None
        outputs[overlap] = [r.output_ids for r in reqs]
        assert all_slots_back(engine)
        assert (overlapped_steps > 0) == overlap
    assert outputs[True] == outputs[False]
    assert any(len(out) < sp.max_new_tokens for out, sp in zip(outputs[True], params))  # some stopped early


def test_a_request_aborted_while_its_pass_runs_leaves_no_trace(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([8, 13, 21], LLAMA_TINY["vocab_size"], seed=12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    expected = engine_for(tmp_path, overlap=False).generate(prompts[1:], params)
    engine = engine_for(tmp_path, overlap=True)
    victim = engine.add_request(prompts[0], SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=1))
    others = [engine.add_request(p, params) for p in prompts[1:]]
    for _ in range(4):
        engine.step()
    assert engine.in_flight is not None and victim in engine.in_flight.reqs and victim.in_flight == 1
    assert engine.logprobs[victim.rid].tokens  # booked, not taken: the abort drops them
    engine.abort(victim)
    assert victim.rid not in engine.logprobs
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in others] == expected
    assert len(victim.output_ids) < 20 and all_slots_back(engine)


@pytest.mark.parametrize("seed", range(16))
def test_random_arrivals_aborts_and_stops_keep_every_slot_accounted_for(tmp_path, seed):
    """The scheduler's moving parts at once, in random order: requests arriving while others run,
    aborts in every state (waiting, part-way through a chunked prompt, running, in flight), stop
    ids, a pool so small that the prefix cache keeps evicting, overlapped passes or not, chunks and prefill budgets
    of every size. After every step
    each slot is free, cached or held by exactly one request, retractions included; every request that was not aborted
    gets the tokens the plain engine gives it, and an aborted one a prefix of them."""
    save_tiny_llama(tmp_path, "gqa")
    rng, vocab = random.Random(seed), LLAMA_TINY["vocab_size"]
    stems = random_prompts([10, 16], vocab, seed=seed)
    prompts = [rng.choice(stems)[: rng.randrange(1, 17)] + random_prompts([rng.randrange(1, 7)], vocab,
                                                                         seed=1000 * seed + i)[0] for i in range(16)]
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 20)) for _ in prompts]
    plain = Engine(tmp_path, EngineConfig(max_total_tokens=POOL, radix_cache=False, chunked_prefill_size=0, overlap=False, log=False))
    stop_ids = {out[rng.randrange(len(out))] for out in rng.sample(plain.generate(prompts, params), 4)}
    expected = plain.generate(prompts, params, stop_ids)

    pool = 48  # and the other settings that decide what runs when, drawn: the tokens must not depend on them
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=pool, max_running_requests=rng.randrange(4, 7),
                                           chunked_prefill_size=rng.choice([0, 5, 16]), overlap=rng.random() < 0.7,
                                           max_prefill_tokens=rng.choice([5, 16, 64, 16384]), log=False))
    cache, pending, reqs, aborted = engine.prefix_cache, list(range(len(prompts))), {}, set()
    while pending or engine.has_work():
        for i in pending[: rng.randrange(3)]:
            reqs[i] = engine.add_request(prompts[i], params[i], stop_ids)
            pending.remove(i)
        if reqs and rng.random() < 0.2:
            i = rng.choice(list(reqs))
            if not reqs[i].finished:
                aborted.add(i)
            engine.abort(reqs[i])
        # a bolder bet than the scheduler's own: running requests outgrow it and are retracted
        # (scheduler.py) while others arrive, stop and are aborted
        engine.scheduler.new_token_ratio = 0.05
        engine.step()
        admitted = engine.scheduler.running + ([engine.scheduler.chunked] if engine.scheduler.chunked else [])
        own = {r.rid: r.kv_len - r.cached_len + r.in_flight for r in admitted}
        assert engine.slots.available + cache.size + sum(own.values()) == pool
    assert aborted and len(aborted) < len(prompts)
    assert engine.stats["retractions"] > 0, engine.config
    for i, req in reqs.items():
        assert req.output_ids == (expected[i] if i not in aborted else expected[i][: len(req.output_ids)]), i
    assert engine.slots.available + cache.size == pool and cache.locked_size == 0 and engine.scheduler.free_room == pool


def test_stats_time_the_steps_within_the_wall_clock(tmp_path):
    """engine.stats' prefill_s and decode_s (bench and the server's stats line read them): each step's
    time, added up, so both grow with the steps and together stay under the time generate took."""
    save_tiny_llama(tmp_path, "gqa")
    engine = engine_for(tmp_path, overlap=True)
    prompts = random_prompts([7, 30, 12], LLAMA_TINY["vocab_size"], seed=3)
    started = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    wall, stats = time.perf_counter() - started, engine.stats
    assert stats["prefill_steps"] > 0 and stats["decode_steps"] > 0
    assert 0 < stats["prefill_s"] and 0 < stats["decode_s"] and stats["prefill_s"] + stats["decode_s"] <= wall


def test_overlap_is_the_default(tmp_path):
    """README: by default, while no prompt waits, the next pass is launched before the last is booked
    (--disable-overlap books first): a default engine's decode step leaves a pass in flight."""
    save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=POOL, log=False))
    prompts = random_prompts([9, 4], LLAMA_TINY["vocab_size"], seed=random.Random(2).randint(0, 99))
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a decode pass launched, the one before it (none) booked
    assert engine.in_flight is not None and engine.in_flight.reqs


def test_a_retraction_with_a_pass_in_flight_books_it_first_at_the_last_free_slot(tmp_path):
    """Two requests decode with overlap on a pool that, after some steps, has exactly one slot left for
    the two of them: the engine must book the pass in flight before the scheduler retracts (the room
    is short by one, not only when none is left), and every request still gets a roomy pool's tokens."""
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([10, 10], LLAMA_TINY["vocab_size"], seed=12)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.7, seed=s) for s in (1, 2)]
    expected = Engine(tmp_path, EngineConfig(max_total_tokens=400, log=False)).generate(prompts, params)
    pool = 2 * 10 + 2 * 5 + 1  # odd: after 5 decode launches of 2 slots, one slot is left
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=pool, overlap=True, chunked_prefill_size=0, log=False))
    engine.scheduler.new_token_ratio = 0.1  # admit both in one prefill
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    assert all(r.status is Status.RUNNING for r in reqs)
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in reqs] == expected and engine.stats["retractions"] > 0
    assert engine.slots.available + engine.prefix_cache.size == pool and engine.prefix_cache.locked_size == 0
