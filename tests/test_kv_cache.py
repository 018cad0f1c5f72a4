"""The slot allocator and request table, and the engine's batching on top of them (CPU)."""

import random

import pytest
import torch

from nano.config import load_config
from nano.kv_cache import CPU_KV_CACHE_MAX_BYTES, SlotAllocator, kv_bytes_per_token, tokens_for_memory
from nano.memory import free_bytes
from tests.helpers import LLAMA_TINY, random_prompts, save_tiny_llama

from nano.engine import Engine, EngineConfig
from nano.sampling import SamplingParams


def test_allocator_never_hands_out_slot_zero_or_twice_and_reuses_freed():
    alloc = SlotAllocator(63, "cpu")
    assert alloc.available == 63
    held = [alloc.alloc(n) for n in (5, 20, 1, 37)]
    assert alloc.alloc(1) is None  # all 63 are out
    flat = torch.cat(held).tolist()
    assert 0 not in flat and len(set(flat)) == len(flat) == 63
    alloc.free(held[1])
    again = alloc.alloc(20)
    assert sorted(again.tolist()) == sorted(held[1].tolist())
    assert alloc.alloc(1) is None


def test_cpu_pool_is_a_fraction_of_available_memory_capped():
    cfg = load_config("nano/configs/smollm2-135m")
    per_token = kv_bytes_per_token(cfg, torch.float32, use_mla=False)
    cpu = torch.device("cpu")
    assert tokens_for_memory(cfg, torch.float32, cpu, False, 0.85) == CPU_KV_CACHE_MAX_BYTES // per_token - 1
    fraction = 2**29 / free_bytes(cpu)  # half a GiB of what the host has available (it moves a little)
    assert 0.9 * 2**29 < tokens_for_memory(cfg, torch.float32, cpu, False, fraction) * per_token < 1.1 * 2**29


def test_batch_equals_single_runs_and_more_prompts_than_pool(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([3, 30, 11, 7, 25, 1, 16], LLAMA_TINY["vocab_size"], seed=5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    singles = [Engine(tmp_path, EngineConfig(max_total_tokens=64, log=False)).generate([p], params)[0] for p in prompts]
    # the pool holds 64 tokens: at most two or three of these requests at once, so the others
    # wait and join as earlier ones finish (continuous batching)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=64, log=False))
    batched = engine.generate(prompts, params)
    assert batched == singles
    # everything given back: free, or kept by the prefix cache
    assert engine.slots.available + engine.prefix_cache.size == 64 and engine.scheduler.free_room == 64


def test_stop_ids_end_requests_on_their_own(tmp_path):
    save_tiny_llama(tmp_path, "mha")
    prompts = random_prompts([4, 9, 14], LLAMA_TINY["vocab_size"], seed=2)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, log=False))
    free_run = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    stop = free_run[1][3]  # request 1 must stop at its 4th token
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=10), stop_ids={stop})
    assert stopped[1] == free_run[1][: free_run[1].index(stop) + 1]
    for out, ref in zip(stopped, free_run):
        assert out == ref[: ref.index(stop) + 1] if stop in ref else out == ref
    assert engine.generate(prompts, SamplingParams(max_new_tokens=10), stop_ids=iter([stop])) == stopped  # read once


def test_ignore_eos_drops_the_eos_ids_alone(tmp_path):
    """ignore_eos runs past the model's EOS ids, but the caller's own stop ids still end a request
    (vLLM's ignore_eos and stop_token_ids)."""
    save_tiny_llama(tmp_path, "mha")
    prompts = random_prompts([4, 9, 14], LLAMA_TINY["vocab_size"], seed=2)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, log=False))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    free_run = engine.generate(prompts, params)
    eos, stop = free_run[0][1], free_run[1][3]
    assert eos != stop
    engine.cfg.eos_token_ids = [eos]  # the model's EOS, as its config.json names it
    stopped = engine.generate(prompts, params, stop_ids={eos, stop})
    assert stopped == [ref[: ref.index(stop) + 1] if stop in ref else ref for ref in free_run]
    assert stopped[0] != free_run[0][:2] and stopped[1] == free_run[1][:4]


def test_seeded_sampling_does_not_depend_on_the_batch(tmp_path):
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([6, 13, 2], LLAMA_TINY["vocab_size"], seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=8, seed=11, ignore_eos=True)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, log=False))
    batched = engine.generate(prompts, params)
    singles = [engine.generate([p], params)[0] for p in prompts]
    assert batched == singles
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert batched != greedy  # it really sampled


def test_the_cpu_fit_check_counts_the_kv_cache_the_cpu_builds(monkeypatch):
    """Llama-3.1-8B's whole context (131,072 tokens) would take 16 GiB of KV cache in bfloat16, but a CPU
    pool holds at most CPU_KV_CACHE_MAX_BYTES and the context shrinks to it: on a host with 22 GiB
    free the 15 GiB of weights fit, and the engine goes on to load them."""
    from nano import engine as engine_module
    from nano import kv_cache, memory

    class Loading(Exception):
        pass

    def load_model(*args):
        raise Loading

    for module in (memory, kv_cache):
        monkeypatch.setattr(module, "free_bytes", lambda device: 22 * 2**30)
    monkeypatch.setattr(engine_module, "load_model", load_model)
    config = EngineConfig(device="cpu", dtype=torch.bfloat16, load_format="dummy", log=False)
    with pytest.raises(Loading):  # before: NotEnoughMemoryError, "15.0 GiB bfloat16 weights + 16.0 GiB KV cache"
        Engine("nano/configs/llama-3.1-8b", config)


def test_a_kv_cache_too_large_for_memory_names_the_flag_that_asked_for_it(monkeypatch):
    """SmolLM2's weights (0.5 GiB) fit a host with 2 GiB free; the 4.3 GiB of KV cache that
    --max-total-tokens asks for do not, and making it smaller is the way out (not a smaller model)."""
    from nano import memory
    from nano.cli import SHIPPED_CONFIGS
    from nano.memory import NotEnoughMemoryError

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * 2**30)
    config = EngineConfig(device="cpu", load_format="dummy", max_total_tokens=100_000, log=False)
    with pytest.raises(NotEnoughMemoryError, match=r"4.3 GiB KV cache.*try a smaller KV cache \(--max-total-tokens\), "):
        Engine(SHIPPED_CONFIGS / "smollm2-135m", config)


@pytest.mark.parametrize("dtype, device, ways", [
    (torch.float32, "cpu", "try --dtype bfloat16, a GPU or a smaller model"),
    (torch.bfloat16, "cpu", "try a GPU or a smaller model"),  # already 2 bytes: no --dtype to suggest
    (torch.float16, "cuda:1", "try a larger GPU or a smaller model"),
])
def test_not_enough_memory_names_the_large_parts_and_the_ways_out(monkeypatch, dtype, device, ways):
    """Parts under a twentieth of a GiB are left out of the sum's breakdown (not of the total)."""
    from nano import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**30)
    where = "the host (or its container's limit) has" if device == "cpu" else f"{device} has"
    with pytest.raises(memory.NotEnoughMemoryError) as refused:
        memory.ensure_fits(torch.device(device), dtype, {"weights": 2**31, "request table": 2**30 // 40,
                                                         "KV cache": 2**29})
    assert str(refused.value) == (f"the model needs 2.5 GiB (2.0 GiB weights + 0.5 GiB KV cache) but {where} "
                                  f"1.0 GiB free: {ways}")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cpu_free_memory_is_a_containers_limit_not_the_hosts(tmp_path, monkeypatch, version):
    """In a container of 1 GiB on a host of 22, /proc/meminfo says 22: a pool sized from that, or
    a fit check against it, ends in the OOM killer (exit status 137, nothing printed). cgroup v1
    lists its hierarchies highest id first: the memory line is seldom the first."""
    from nano import memory

    (tmp_path / "meminfo").write_text(f"MemTotal: {32 * 2**20} kB\nMemAvailable: {22 * 2**20} kB\n")
    v1 = version == "v1"
    folder = tmp_path / "cgroup" / ("memory" if v1 else "") / "slice" / "box"
    folder.mkdir(parents=True)
    v1_lines = "12:cpu,cpuacct:/slice/box\n4:memory:/slice/box\n1:name=systemd:/\n"
    (tmp_path / "self-cgroup").write_text(v1_lines if v1 else "0::/slice/box\n")
    (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{2**30}\n")
    (folder / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{400 * 2**20}\n")
    (folder / "memory.stat").write_text(f"{'total_inactive_file' if v1 else 'inactive_file'} {100 * 2**20}\n")
    monkeypatch.setattr(memory, "PROC_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(tmp_path / "self-cgroup"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "cgroup")
    assert free_bytes(torch.device("cpu")) == (1024 - 400 + 100) * 2**20  # the limit less the working set
    (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text("9223372036854771712\n" if v1 else "max\n")
    assert free_bytes(torch.device("cpu")) == 22 * 2**30  # no limit: the host's
    for name, value in [("limit_in_bytes" if v1 else "max", 600), ("usage_in_bytes" if v1 else "current", 500)]:
        (folder.parent / f"memory.{name}").write_text(f"{value * 2**20}\n")  # the slice that holds the box
    (folder.parent / "memory.stat").write_text("")
    assert free_bytes(torch.device("cpu")) == 100 * 2**20  # a parent's limit binds its children too
    (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{2**30}\n")
    assert free_bytes(torch.device("cpu")) == 100 * 2**20  # of two limits, the tighter (the box's leaves 724 MiB)


def test_a_cgroup_limit_never_raises_the_hosts_figure_nor_goes_below_zero(tmp_path, monkeypatch):
    from nano import memory

    (tmp_path / "meminfo").write_text(f"MemAvailable: {2**20} kB\n")  # 1 GiB
    folder = tmp_path / "cgroup" / "box"
    folder.mkdir(parents=True)
    (tmp_path / "self-cgroup").write_text("0::/box\n")
    (folder / "memory.max").write_text(f"{8 * 2**30}\n")  # 8 GiB, with none of it used
    (folder / "memory.current").write_text("0\n")
    (folder / "memory.stat").write_text("")
    monkeypatch.setattr(memory, "PROC_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(tmp_path / "self-cgroup"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "cgroup")
    assert free_bytes(torch.device("cpu")) == 2**30  # the host has less than the limit allows
    (folder / "memory.current").write_text(f"{9 * 2**30}\n")  # over the limit (the kernel is reclaiming)
    assert free_bytes(torch.device("cpu")) == 0


def test_a_host_without_proc_checks_the_fit_against_all_its_ram(tmp_path, monkeypatch):
    """macOS has no /proc/meminfo and no cgroups: the fit check read None there and let any model through
    (a petabyte of weights), to swap or be killed. All the RAM there is bounds what can ever fit."""
    from nano import memory

    monkeypatch.setattr(memory, "PROC_MEMINFO", str(tmp_path / "no-meminfo"))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(tmp_path / "no-cgroup"))
    ram = memory.os.sysconf("SC_PHYS_PAGES") * memory.os.sysconf("SC_PAGE_SIZE")
    assert free_bytes(torch.device("cpu")) == ram
    with pytest.raises(memory.NotEnoughMemoryError):
        memory.ensure_fits(torch.device("cpu"), torch.float32, {"float32 weights": 2**50})


def test_generate_refuses_a_call_it_cannot_run_whole(tmp_path):
    """As vLLM's LLM.generate: sampling params that do not pair with the prompts are refused (zip dropped
    the prompts past them), and a bad prompt fails the call without leaving the good ones before it
    queued, to run with the next call."""
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([5, 9, 3], LLAMA_TINY["vocab_size"], seed=7)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, log=False))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="3 prompts but 2 sampling params"):
        engine.generate(prompts, [params, params])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate(prompts + [[]], params)
    assert not engine.has_work()
    alone = Engine(tmp_path, EngineConfig(max_total_tokens=200, log=False))
    assert engine.generate(prompts, params) == [alone.generate([p], params)[0] for p in prompts]
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts))  # those prompts alone were ever computed



@pytest.mark.parametrize("failing_pass", [1, 3])  # the prefill; the decode pass launched while one is in flight
def test_generate_that_raises_leaves_nothing_to_the_next_call(tmp_path, failing_pass):
    """A step that raises (or Ctrl-C) inside generate: its requests leave with it, rows, slots and logprobs
    given back, not left to run (or, holding a pass that never ran, to spin for ever) in the next call."""
    save_tiny_llama(tmp_path, "gqa")
    prompts = random_prompts([5, 9, 3], LLAMA_TINY["vocab_size"], seed=3)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, max_running_requests=4, log=False))
    real_model, passes = engine.model, []

    def model(batch, attn):
        passes.append(batch)
        if len(passes) == failing_pass:
            raise KeyboardInterrupt
        return real_model(batch, attn)

    engine.model = model
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5, logprobs=2)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params)
    assert not (engine.scheduler.waiting or engine.scheduler.running or engine.logprobs)  # a pass in flight may stay
    assert len(engine.req_to_token_pool.free_rows) == 4
    assert engine.slots.available + engine.prefix_cache.evictable_size == 200 and engine.prefix_cache.locked_size == 0
    alone = Engine(tmp_path, EngineConfig(max_total_tokens=200, log=False))
    assert engine.generate(prompts[:2], params) == alone.generate(prompts[:2], params)

@pytest.mark.parametrize("setting, message", [
    (dict(attention_backend="Triton"), "attention-backend must be one of ('torch', 'triton'), got 'Triton'"),
    (dict(load_format="dummmy"), "load-format must be one of ('safetensors', 'dummy'), got 'dummmy'"),
    (dict(dtype="float16"), "dtype must be one of (torch.float32, torch.float16, torch.bfloat16), got 'float16'"),
    (dict(max_total_tokens=64.5), "max-total-tokens must be > 0 (an integer)"),
    (dict(context_length=float("nan")), "context-length must be > 0 (an integer)"),
    (dict(context_length=257), "context length 257: this model's is 256"),  # was cut to 256 silently; vLLM refuses
    # the Python API's graphs (cli.py never asks for them there): torch's AssertionError on CPU, a TypeError in capture
    (dict(cuda_graph=True), "cuda-graph needs a cuda device and the triton backend"),
    (dict(cuda_graph=True, device="cuda", attention_backend="torch"), "cuda-graph needs a cuda device and the triton"),
    (dict(cuda_graph=True, attention_backend="triton"), "cuda-graph needs a cuda device and the triton backend"),
    (dict(device="meta"), "device must be cpu, cuda or cuda:N, got 'meta'"),  # a KeyError or torch's traceback
    (dict(device="gpu"), "device must be cpu, cuda or cuda:N, got 'gpu'"),
])
def test_a_setting_it_cannot_honour_is_refused_not_replaced(tmp_path, setting, message):
    """A misspelt attention backend ran the torch one, a misspelt load format loaded the checkpoint:
    silently not what was asked for (vLLM refuses both). A dtype by name, a pool of 64.5 tokens, a device
    nano has no kernels for failed inside torch, a NaN context as a model needing "nan GiB"."""
    save_tiny_llama(tmp_path, "gqa")
    with pytest.raises(ValueError) as refused:
        Engine(tmp_path, EngineConfig(**{"max_total_tokens": 64, "log": False} | setting))
    assert message in str(refused.value)


@pytest.mark.parametrize("pool", [(300, 900), (40, 90)])  # above the context, or below it: rows as long as the pool
def test_the_fit_check_counts_the_request_table_and_kv_cache_the_engine_builds(tmp_path, monkeypatch, pool):
    """ensure_fits is asked for what the engine then allocates: the request table's int32 rows and the
    pool's slots (one more: slot 0 is the padding slot), not a guess above or below them. (It counted the
    rows at the whole context where a smaller pool shortens them: --max-total-tokens 100 with a million
    requests was refused for a 30 GiB table that would have taken 0.4 GiB.)"""
    from nano import engine as engine_module

    save_tiny_llama(tmp_path, "gqa")
    asked = {}
    real = engine_module.ensure_fits
    monkeypatch.setattr(engine_module, "ensure_fits", lambda *args: asked.update(args[2]) or real(*args))
    rng = random.Random(5)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=rng.randint(*pool), max_running_requests=rng.randint(3, 9),
                                           context_length=rng.randint(100, 256), log=False))
    assert asked["request table"] == engine.req_to_token_pool.req_to_token.nbytes
    pool = sum(t.nbytes for t in engine.kv_pool.k_buffers + engine.kv_pool.v_buffers)
    assert asked["KV cache"] == pool - pool // (engine.kv_pool.capacity + 1)


@pytest.mark.parametrize("size", [0, -1])
def test_chunked_prefill_size_0_or_minus_1_turns_chunking_off(tmp_path, size):
    """As SGLang's --chunked-prefill-size -1 (EngineConfig: "0 or -1: off"): taken, and no prompt is cut."""
    save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=600, chunked_prefill_size=size, log=False))
    prompts = random_prompts([200, 17], LLAMA_TINY["vocab_size"], seed=9)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert not engine.scheduler.chunking and engine.stats["prefill_tokens"] == 217


def test_an_engine_says_what_it_loaded_and_the_kv_cache_it_sized(tmp_path, capsys):
    """By default (log=True) the engine prints its model and its pool on stderr: the pool's real size,
    which --mem-fraction picked and a user sizes --max-running-requests by."""
    save_tiny_llama(tmp_path, "gqa")
    tokens = random.Random(3).randint(100, 900)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=tokens))
    err = capsys.readouterr().err
    assert "loaded LlamaForCausalLM (" in err and f"KV cache: {tokens} tokens ({engine.kv_bytes_per_token:,} bytes" in err


def test_a_model_that_fits_free_memory_exactly_is_let_through(monkeypatch):
    """ensure_fits refuses only what exceeds the free memory: needing exactly what is free fits."""
    from nano import memory

    rng = random.Random(1)
    for _ in range(10):
        parts = {"float32 weights": rng.randint(1, 2**34), "KV cache": rng.randint(1, 2**32),
                 "request table": rng.randint(1, 2**20)}
        total = sum(parts.values())
        monkeypatch.setattr(memory, "free_bytes", lambda device, total=total: total)
        memory.ensure_fits(torch.device("cpu"), torch.float32, parts)
        monkeypatch.setattr(memory, "free_bytes", lambda device, total=total: total - 1)
        with pytest.raises(memory.NotEnoughMemoryError):
            memory.ensure_fits(torch.device("cpu"), torch.float32, parts)


def test_mla_kv_bytes_per_token_count_the_latent_row_once():
    """With absorbed latent attention a DeepSeek token caches one row of kv_lora_rank + rope width a
    layer (the value is a view of it): the bytes per token, from which the pool's capacity and the
    fit check come, count that row once; the expanded form caches K and V for every head."""
    from nano.cli import SHIPPED_CONFIGS
    from nano.kv_cache import KVPool

    cfg = load_config(SHIPPED_CONFIGS / "deepseek-v2-lite")
    row = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 512 + 64
    assert kv_bytes_per_token(cfg, torch.bfloat16, use_mla=True) == cfg.num_layers * row * 2
    assert kv_bytes_per_token(cfg, torch.bfloat16, use_mla=False) == \
        cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 2
    # and it is what a pool really holds per token (slot 0 aside)
    for use_mla in (True, False):
        pool = KVPool(cfg, 3, torch.bfloat16, "meta", use_mla)
        nbytes = sum(b.numel() * b.element_size() for b in pool.k_buffers)
        if not use_mla:
            nbytes += sum(b.numel() * b.element_size() for b in pool.v_buffers)
        assert nbytes == 4 * kv_bytes_per_token(cfg, torch.bfloat16, use_mla)


def test_a_pool_sized_from_too_little_memory_still_holds_one_token(monkeypatch):
    """tokens_for_memory never answers 0 or a negative capacity (a pool with no slot to hand out, or
    torch.zeros of a negative size): memory for less than a token still sizes a 1-token pool, which
    the engine then reports as a context too small for the prompt."""
    from nano import kv_cache
    from nano.cli import SHIPPED_CONFIGS

    cfg = load_config(SHIPPED_CONFIGS / "smollm2-135m")
    per_token = kv_bytes_per_token(cfg, torch.float32, False)
    for free in (0, per_token // 2, per_token, 2 * per_token):
        monkeypatch.setattr(kv_cache, "free_bytes", lambda device, free=free: free)
        assert kv_cache.tokens_for_memory(cfg, torch.float32, torch.device("cpu"), False, 0.5) == 1
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: 1000 * per_token)
    assert kv_cache.tokens_for_memory(cfg, torch.float32, torch.device("cpu"), False, 0.5) == 499  # slot 0 aside
