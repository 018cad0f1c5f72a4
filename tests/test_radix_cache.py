"""The prefix cache (radix tree) against a naive reference, and the engine's prefix reuse and
chunked prefill against the engine without them (CPU, tiny models)."""

import heapq
import random
import sys

import pytest
import torch

from nano.engine import Engine, EngineConfig
from nano.kv_cache import SlotAllocator
from nano.radix_cache import RadixCache
from nano.sampling import SamplingParams
from tests.helpers import LLAMA_TINY, random_prompts, save_tiny_deepseek, save_tiny_llama


def cached_prefixes(tree: RadixCache) -> dict[tuple, int]:
    """Every cached prefix -> the slot of its last token, read off the tree."""
    out, stack = {}, [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            path = prefix
            for token, slot in zip(child.key, child.slots.tolist()):
                path += (token,)
                out[path] = slot
            stack.append((path, child))
    return out


def reference_match(ref: dict[tuple, int], tokens: list[int]) -> list[int]:
    slots = []
    while tuple(tokens[: len(slots) + 1]) in ref and len(slots) < len(tokens):
        slots.append(ref[tuple(tokens[: len(slots) + 1])])
    return slots


def tree_nodes(tree: RadixCache) -> list:
    out, stack = [], [tree.root]
    while stack:
        out.append(stack.pop())
        stack.extend(out[-1].children.values())
    return out


def lru_victims(tree: RadixCache, num_tokens: int) -> list:
    """The leaves a least-recently-used eviction of num_tokens takes, worked out from every unlocked
    leaf collected afresh (the tree itself keeps them in a heap as they come and go)."""
    children = {id(n): len(n.children) for n in tree_nodes(tree)}
    heap = [(n.last_used, id(n), n) for n in tree_nodes(tree) if not n.children and n.lock_count == 0]
    heapq.heapify(heap)
    victims = []
    while num_tokens > 0 and heap:
        victims.append(heapq.heappop(heap)[2])
        num_tokens -= len(victims[-1].key)
        parent = victims[-1].parent
        children[id(parent)] -= 1
        if children[id(parent)] == 0 and parent.lock_count == 0:
            heapq.heappush(heap, (parent.last_used, id(parent), parent))
    return victims


def test_radix_tree_agrees_with_a_naive_reference_under_random_operations():
    rng = random.Random(0)
    pool = 96
    allocator = SlotAllocator(pool, "cpu")
    tree = RadixCache(allocator)
    ref: dict[tuple, int] = {}  # prefix -> slot: the whole cache, one entry per cached token
    locks: list[tuple] = []  # (node, the prefix it ends at)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 10))] for _ in range(4)]

    def random_tokens():  # a few alphabets and stems, so sequences share prefixes and diverge anywhere
        return rng.choice(stems)[: rng.randrange(11)] + [rng.randrange(4) for _ in range(rng.randrange(8))]

    for op in range(3000):
        kind = rng.choice(["insert", "insert", "match", "lock", "unlock", "evict"])
        if kind == "insert":  # as the engine does: reuse the matched slots, fresh ones for the rest
            tokens = random_tokens()
            matched, _ = tree.match(tokens)
            if rng.random() < 0.3:  # a request that computed the prefix itself: all its slots are duplicates
                matched = matched[:0]
            fresh = len(tokens) - len(matched)
            if allocator.available < fresh:
                tree.evict(fresh - allocator.available)
                ref = cached_prefixes(tree)
            if allocator.available < fresh:
                continue
            slots = torch.cat([matched, allocator.alloc(fresh)])
            available = allocator.available
            expected_freed = 0
            for k, slot in enumerate(slots.tolist()):
                prefix = tuple(tokens[: k + 1])
                if prefix in ref:
                    expected_freed += ref[prefix] != slot
                else:
                    ref[prefix] = slot
            tree.insert(tokens, slots)
            assert allocator.available - available == expected_freed
        elif kind == "match":
            tokens = random_tokens()
            slots, _ = tree.match(tokens)
            assert slots.tolist() == reference_match(ref, tokens)
        elif kind == "lock":
            tokens = random_tokens()
            slots, node = tree.match(tokens)
            tree.lock(node)
            locks.append((node, tuple(tokens[: len(slots)])))
        elif kind == "unlock" and locks:
            node, _ = locks.pop(rng.randrange(len(locks)))
            tree.unlock(node)
        elif kind == "evict":
            want = rng.randrange(1, 40)
            locked = {path[:k] for _, path in locks for k in range(1, len(path) + 1)}
            evictable = len(ref) - len(locked)
            assert tree.locked_size == len(locked) and tree.evictable_size == evictable
            available, before, victims = allocator.available, tree_nodes(tree), lru_victims(tree, want)
            tree.evict(want)
            assert {id(n) for n in before} - {id(n) for n in tree_nodes(tree)} == {id(n) for n in victims}
            after = cached_prefixes(tree)
            removed = set(ref) - set(after)
            assert set(after) <= set(ref) and all(after[p] == ref[p] for p in after)
            assert not removed & locked, "evicted a locked prefix"
            assert len(removed) >= min(want, evictable)
            assert allocator.available - available == len(removed)
            ref = after
        assert cached_prefixes(tree) == ref
        assert tree.size == len(ref)
        assert allocator.available + tree.size == pool  # no slot lost or counted twice
    for node, _ in locks:
        tree.unlock(node)
    tree.evict(pool)
    assert allocator.available == pool and tree.size == tree.locked_size == 0


def test_eviction_takes_the_least_recently_used_leaf_first():
    allocator = SlotAllocator(32, "cpu")
    tree = RadixCache(allocator)
    for tokens in ([1, 2, 3, 4], [5, 6], [7, 8]):
        tree.insert(tokens, allocator.alloc(len(tokens)))

    def cached(tokens):
        return tree.match(tokens)[0].numel()

    assert cached([1, 2, 3, 4]) == 4  # now the most recent
    tree.evict(1)
    assert cached([5, 6]) == 0 and cached([7, 8]) == 2  # the oldest went; the match made [7, 8] newer
    tree.insert([1, 2, 9], allocator.alloc(3))  # splits [1, 2 | 3, 4]; its own slots for [1, 2] go back
    tree.evict(1)
    assert cached([1, 2, 3, 4]) == 2 and cached([1, 2, 9]) == 3  # [3, 4]: untouched since the split
    assert allocator.available + tree.size == 32


def test_evicting_a_leaf_from_a_large_tree_does_not_walk_the_tree():
    """Once the pool is full every step evicts a few slots: that must cost about a leaf, not a walk over
    every cached prefix. Counted in lines of radix_cache.py run (sys.settrace), not in seconds."""
    allocator = SlotAllocator(20_000, "cpu")
    tree = RadixCache(allocator)
    rng = random.Random(3)
    for n in range(4_000):  # 4,000 prompts under 40 system prompts
        tree.insert([n % 40, 1000 + n, *(rng.randrange(50) for _ in range(3))], allocator.alloc(5))
    for n in range(0, 4_000, 7):  # used again: their leaves' stamps move on
        tree.match([n % 40, 1000 + n])
    nodes, lines = len(tree_nodes(tree)), 0

    def count_lines(frame, event, arg):
        nonlocal lines
        lines += event == "line" and frame.f_code.co_filename.endswith("radix_cache.py")
        return count_lines

    sys.settrace(lambda frame, event, arg: count_lines)
    try:
        for _ in range(20):  # twenty steps of a full pool, a leaf each
            tree.evict(1)
    finally:
        sys.settrace(None)
    assert len(tree_nodes(tree)) == nodes - 20
    assert lines < 20 * 200, lines  # a walk over the tree runs its loop's lines ~4,000 times a step


def test_eviction_frees_what_is_asked_and_not_a_leaf_more():
    allocator = SlotAllocator(16, "cpu")
    tree = RadixCache(allocator)
    for first in (1, 11, 21, 31):
        tree.insert(list(range(first, first + 4)), allocator.alloc(4))
    tree.evict(4)  # one leaf's worth
    assert tree.size == 12 and allocator.available == 4


# ---- the engine ---------------------------------------------------------------------------

PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


def shared_prefix_prompts(seed=0):
    stem, other = random_prompts([14, 9], LLAMA_TINY["vocab_size"], seed=seed)
    tails = random_prompts([3, 6, 1, 8], LLAMA_TINY["vocab_size"], seed=seed + 1)
    # a stem shared by most, one prompt that is all stem (fully cached the second time), one apart
    return [stem + tails[0], stem + tails[1], stem, other + tails[2], stem[:5] + tails[3]]


def save_model(path, model):
    if model == "llama":
        save_tiny_llama(path, "gqa")
        return {}
    save_tiny_deepseek(path, "lite")
    return dict(use_mla=True)


@pytest.mark.parametrize("model", ["llama", "deepseek-mla"])
def test_greedy_tokens_same_with_and_without_prefix_cache_and_chunking(tmp_path, model):
    args = save_model(tmp_path, model) | dict(max_total_tokens=160, log=False)
    prompts = shared_prefix_prompts()
    expected = Engine(tmp_path, EngineConfig(radix_cache=False, chunked_prefill_size=0, **args)).generate(prompts, PARAMS)
    for chunk in [0, 1, 2, 3, 8]:
        engine = Engine(tmp_path, EngineConfig(chunked_prefill_size=chunk, **args))
        # one by one, so later prompts find earlier ones cached; then all again, every prompt cached
        assert [engine.generate([p], PARAMS)[0] for p in prompts] == expected, f"chunk {chunk}"
        assert engine.generate(prompts, PARAMS) == expected, f"chunk {chunk}, second round"
        assert engine.stats["cached_tokens"] >= sum(len(p) - 1 for p in prompts)  # the second round's alone
        assert engine.slots.available + engine.prefix_cache.size == 160 and engine.scheduler.free_room == 160
    plain_chunked = Engine(tmp_path, EngineConfig(radix_cache=False, chunked_prefill_size=3, **args))
    assert plain_chunked.generate(prompts, PARAMS) == expected
    assert plain_chunked.slots.available == 160


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton's interpreter; the GPU tests cover Triton")
@pytest.mark.parametrize("model", ["llama", "deepseek-mla"])
def test_triton_backend_with_prefix_cache_and_chunks_equals_torch(tmp_path, model):
    """The interpreter is slow: few prompts, one chunk size, one decode step each."""
    args = save_model(tmp_path, model) | dict(max_total_tokens=160, log=False)
    prompts, params = shared_prefix_prompts()[:3], SamplingParams(max_new_tokens=2, ignore_eos=True)
    expected = Engine(tmp_path, EngineConfig(radix_cache=False, chunked_prefill_size=0, **args)).generate(prompts, params)
    engine = Engine(tmp_path, EngineConfig(attention_backend="triton", chunked_prefill_size=3, **args))
    assert engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params) == expected
    assert engine.stats["cached_tokens"] == 13 + 14  # prompts 1 and 2 start with prompt 0's stem


def test_second_turn_computes_only_its_new_tokens(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    turn1, user2 = random_prompts([17, 6], LLAMA_TINY["vocab_size"], seed=3)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=128, log=False))
    answer1 = engine.generate([turn1], PARAMS)[0]
    turn2 = turn1 + answer1 + user2
    before = dict(engine.stats)
    answer2 = engine.generate([turn2], PARAMS)[0]
    # cached: turn 1's prompt and answer, but the answer's last token, which was never fed back
    assert engine.stats["cached_tokens"] - before["cached_tokens"] == len(turn1) + len(answer1) - 1
    assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == len(turn2)
    plain = Engine(tmp_path, EngineConfig(max_total_tokens=128, radix_cache=False, log=False))
    assert answer2 == plain.generate([turn2], PARAMS)[0]


def test_small_pool_randomized_run_never_leaks_and_matches_the_plain_engine(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    rng = random.Random(7)
    stems = random_prompts([12, 20, 6], LLAMA_TINY["vocab_size"], seed=8)
    prompts = [rng.choice(stems)[: rng.randrange(1, 21)] + random_prompts([rng.randrange(1, 9)], LLAMA_TINY["vocab_size"],
                                                                         seed=100 + i)[0] for i in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 9), ignore_eos=True) for _ in prompts]
    expected = Engine(tmp_path, EngineConfig(max_total_tokens=200, radix_cache=False, chunked_prefill_size=0,
                      log=False)).generate(prompts, params)

    pool = 48  # two or three requests at a time; the cache must keep evicting
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=pool, max_running_requests=4, chunked_prefill_size=5, log=False))
    cache, reqs, pending = engine.prefix_cache, [], list(zip(prompts, params))
    while pending or engine.has_work():
        for _ in range(rng.randrange(3) if pending else 0):  # requests arrive while others run
            reqs.append(engine.add_request(*pending.pop(0)))
            if not pending:
                break
        engine.step()
        admitted = engine.scheduler.running + ([engine.scheduler.chunked] if engine.scheduler.chunked else [])
        # slots a request holds outside the tree: one more while a decode pass in flight writes its next token
        own = {r.rid: r.kv_len - r.cached_len + r.in_flight for r in admitted}
        assert engine.slots.available + cache.size + sum(own.values()) == pool
        assert cache.locked_size <= sum(r.cached_len for r in admitted)
    assert [r.output_ids for r in reqs] == expected
    assert engine.slots.available + cache.size == pool and cache.locked_size == 0 and engine.scheduler.free_room == pool
    assert engine.stats["cached_tokens"] > 0


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    short, long = random_prompts([4, 30], LLAMA_TINY["vocab_size"], seed=9)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=128, chunked_prefill_size=8, log=False))
    running = engine.add_request(short, params)
    engine.step()
    late = engine.add_request(long, SamplingParams(max_new_tokens=3, ignore_eos=True))
    got = [[r for r, _ in engine.step()] for _ in range(9)]  # 30 tokens in chunks of 8: 4 chunk steps
    # between chunks a decode step hands its tokens out at once; once nothing waits, decode passes
    # overlap and each step hands out the tokens of the pass before (the last two steps)
    assert got == [[], [running], [], [running], [], [running], [late], [], [running, late]]
    plain = Engine(tmp_path, EngineConfig(max_total_tokens=128, chunked_prefill_size=0, radix_cache=False, log=False))
    while engine.has_work():
        engine.step()
    assert [running.output_ids, late.output_ids] == plain.generate([short, long], [params, late.params])


def test_a_parent_left_a_leaf_by_an_eviction_keeps_its_own_age():
    """Evicting a leaf can leave its parent a leaf; the parent then competes at the age of its own last
    use, not as if used just now: older than another leaf, it goes first."""
    rng = random.Random(2)
    for trial in range(10):
        allocator = SlotAllocator(64, "cpu")
        tree = RadixCache(allocator)
        a, b = rng.randint(2, 6), rng.randint(1, 6)
        seq = random_prompts([a + b], LLAMA_TINY["vocab_size"], seed=trial)[0]
        other = [seq[0] + 1] + random_prompts([rng.randint(1, 6)], LLAMA_TINY["vocab_size"], seed=50 + trial)[0]
        tree.insert(seq, allocator.alloc(a + b))
        tree.match(seq[:a])  # splits seq into parent seq[:a] (used now) and its leaf seq[a:] (older)
        tree.insert(other, allocator.alloc(len(other)))  # a leaf newer than both
        tree.match([seq[0] + 2])  # time passes (a miss)
        tree.evict(b + 1)  # the old leaf, then the next oldest: the parent it left, not `other`
        assert tree.match(seq)[0].numel() == 0 and tree.match(other)[0].numel() == len(other), trial
        assert allocator.available + tree.size == 64
