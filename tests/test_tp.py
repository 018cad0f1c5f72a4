"""Tensor parallelism (tp.py): what each rank loads, and a model split over two processes against the
same model in one.

On CPU (CI) the two ranks talk over gloo: the engine is rank 0 in the test process and starts rank 1
itself. In float32 the split model must pick the same greedy tokens as the whole one, with logits
within 1e-4 (the row-parallel all-reduce adds the partial sums in another order, nothing more).
On two GPUs (skipped elsewhere) the ranks talk over NCCL, and greedy tokens with CUDA graphs, which
capture the all-reduce, must equal eager decoding of the same batches."""

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from nano.config import ConfigError, load_config
from nano.cuda_graph_runner import StaticDecodeInputs
from nano.cli import SHIPPED_CONFIGS
from nano.loader import _fill_random, build_model, load_model
from nano.sampling import SamplingParams
from nano.tp import TensorParallel, checkpoint_shard, shard_config

transformers = pytest.importorskip("transformers")

from nano.engine import Engine, EngineConfig  # noqa: E402
from tests.helpers import random_prompts, record_logits, save_tiny_deepseek, save_tiny_llama  # noqa: E402


def rank_weights(path, rank, size=2, load_format="safetensors"):
    model = load_model(load_config(path), path, "cpu", torch.float32, load_format, tp_rank=rank, tp_size=size)
    return {name: param for name, param in model.named_parameters()}


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_loads_its_block(tmp_path, load_format):
    """Checkpoint tensors cut by role: heads and widths by rows, o_proj/down_proj by columns, a KV
    head shared by both ranks when there is only one, norms and the router whole. Dummy weights
    are cut the same way from the same draws, so any split is the same model."""
    save_tiny_llama(tmp_path / "llama", "llama3-rope")  # 4 heads of 32, 1 KV head, vocab 320
    save_tiny_deepseek(tmp_path / "deepseek", "q-lora-scaled")  # 4 heads, q_lora 24, latent 32, 8 experts of 24
    whole = {shape: rank_weights(tmp_path / shape, 0, 1, load_format) for shape in ("llama", "deepseek")}
    for rank in (0, 1):
        rows, halves = slice(32 * 2 * rank, 32 * 2 * (rank + 1)), slice(160 * rank, 160 * (rank + 1))
        part, full = rank_weights(tmp_path / "llama", rank, load_format=load_format), whole["llama"]
        attn, mlp = "layers.1.self_attn", "layers.1.mlp"
        q, kv = full[f"{attn}.qkv_proj.weight"].split([128, 64])  # 4 query heads, then the one K and V head
        assert torch.equal(part[f"{attn}.qkv_proj.weight"], torch.cat([q[rows], kv]))
        assert torch.equal(part[f"{attn}.o_proj.weight"], full[f"{attn}.o_proj.weight"][:, rows])
        gate, up = full[f"{mlp}.gate_up_proj.weight"].chunk(2)
        width = slice(48 * rank, 48 * (rank + 1))
        assert torch.equal(part[f"{mlp}.gate_up_proj.weight"], torch.cat([gate[width], up[width]]))
        assert torch.equal(part[f"{mlp}.down_proj.weight"], full[f"{mlp}.down_proj.weight"][:, width])
        assert torch.equal(part["embed_tokens"], full["embed_tokens"][halves])
        assert torch.equal(part["lm_head.weight"], full["lm_head.weight"][halves])
        assert torch.equal(part["layers.1.input_layernorm.weight"], full["layers.1.input_layernorm.weight"])

        part, full = rank_weights(tmp_path / "deepseek", rank, load_format=load_format), whole["deepseek"]
        heads = slice(2 * rank, 2 * (rank + 1))
        per_head = full[f"{attn}.q_b_proj.weight"].view(4, 24, 24)  # [heads, nope 8 + rope 16, q_lora]
        assert torch.equal(part[f"{attn}.q_b_proj.weight"], per_head[heads].reshape(48, 24))
        per_head = full[f"{attn}.kv_b_proj.weight"].view(4, 24, 32)  # [heads, nope 8 + v 16, latent]
        assert torch.equal(part[f"{attn}.kv_b_proj.weight"], per_head[heads].reshape(48, 32))
        for replicated in (f"{attn}.fused_a_proj.weight", f"{mlp}.gate.weight"):  # q_a_proj and kv_a_proj_with_mqa
            assert torch.equal(part[replicated], full[replicated]), replicated
        # 8 routed experts of 24, then the shared MLP (2 x 24) as 2 more: each rank holds half of
        # every routed expert's width and half of the shared MLP's (its 2 experts of 12)
        gate_up, down = full[f"{mlp}.w13"].view(2, 10, 24, 64), full[f"{mlp}.w2"].view(64, 10, 24)
        part_gate_up, part_down = part[f"{mlp}.w13"].view(2, 10, 12, 64), part[f"{mlp}.w2"].view(64, 10, 12)
        width, shared_width = slice(12 * rank, 12 * (rank + 1)), slice(24 * rank, 24 * (rank + 1))
        assert torch.equal(part_gate_up[:, :8], gate_up[:, :8, width])
        assert torch.equal(part_down[:, :8], down[:, :8, width])
        assert torch.equal(part_gate_up[:, 8:].flatten(1, 2), gate_up[:, 8:].flatten(1, 2)[:, shared_width])
        assert torch.equal(part_down[:, 8:].flatten(1), down[:, 8:].flatten(1)[:, shared_width])


@pytest.mark.parametrize("save", [save_tiny_llama, save_tiny_deepseek], ids=["llama", "deepseek"])
def test_dummy_weights_fill_every_parameter(tmp_path, save):
    """Dummy weights are drawn per checkpoint tensor: a parameter no checkpoint tensor fills would
    keep whatever memory it got."""
    save(tmp_path, "gqa" if save is save_tiny_llama else "lite")
    cfg = load_config(tmp_path)
    model = build_model(shard_config(cfg, 2), True, "cpu", torch.float32)
    for param in model.parameters():
        param.data.fill_(float("nan"))
    _fill_random(model, partial(checkpoint_shard, cfg=cfg, rank=1, size=2), seed=0)
    assert [name for name, param in model.named_parameters() if param.isnan().any()] == []


def test_device_cuda_n_puts_the_ranks_on_gpus_n_and_up(monkeypatch):
    """--device cuda:1 --tp-size 2 runs ranks 0 and 1 on GPUs 1 and 2 (SGLang's --base-gpu-id), not on 0
    and 1 while the flag names 1; a host without GPU 2 is refused before any worker starts. (No GPU here:
    the devices are only named, and the device count is patched.)"""
    from nano.tp import launch, rank_device

    for device, ranks in [("cuda", ["cuda:0", "cuda:1"]), ("cuda:1", ["cuda:1", "cuda:2"]), ("cpu", ["cpu", "cpu"])]:
        assert [str(rank_device(torch.device(device), rank)) for rank in range(2)] == ranks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="over 2 GPUs from cuda:1, but 2 are visible"):
        launch(load_config(SHIPPED_CONFIGS / "llama-3-8b"), 2, torch.device("cuda:1"), worker=None)


def test_one_gpu_engine_makes_its_gpu_the_current_device(tmp_path, monkeypatch):
    """Triton kernels, CUDA events and graph capture run on torch's current device: an engine on cuda:1
    sets it, as vLLM's and SGLang's workers do, or its kernels would run on cuda:0 while its tensors sit
    on cuda:1. (No GPU here: the call is recorded, and stops the build before any CUDA memory is used.)"""
    class Called(Exception):
        pass

    def set_device(device):
        raise Called(str(device))

    save_tiny_llama(tmp_path, "gqa")
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(Called, match="^cuda:1$"):
        Engine(tmp_path, EngineConfig(device="cuda:1", log=False))


def test_uneven_splits_are_refused():
    cfg = load_config(SHIPPED_CONFIGS / "llama-3-8b")  # 32 heads, 8 KV heads
    assert (shard_config(cfg, 2).num_heads, shard_config(cfg, 2).num_kv_heads) == (16, 4)
    assert shard_config(cfg, 16).num_kv_heads == 1  # each KV head on two ranks
    with pytest.raises(ConfigError, match=r"over 3 GPUs: its attention head count \(32\) is not a multiple of 3$"):
        shard_config(cfg, 3)
    with pytest.raises(ConfigError, match="KV heads"):
        shard_config(replace(cfg, num_heads=48, num_kv_heads=12), 8)


def test_a_weight_missing_on_every_rank_is_one_line_from_each(tmp_path):
    """Rank 1 is a process of its own: its one-line error must not become a traceback, and the
    command ends with status 2 whichever rank reports first."""
    save_tiny_llama(tmp_path, "gqa")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.2.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    code = (f"from nano.cli import cli\nfrom nano.engine import Engine, EngineConfig\n"
            f"def run(args):\n    Engine({str(tmp_path)!r}, EngineConfig(tp_size=2, max_total_tokens=64, log=False))\n"
            f"if __name__ == '__main__':\n    cli(lambda: __import__('argparse').ArgumentParser(), run, [])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines and all(line.startswith("error: ") and "down_proj" in line for line in lines), result.stderr


def run(path, tp_size, prompts, monkeypatch, **engine_args):
    steps = record_logits(monkeypatch)
    engine = Engine(path, EngineConfig(max_total_tokens=256, tp_size=tp_size, log=False, **engine_args))
    try:
        if tp_size > 1:
            assert [w.is_alive() for w in engine.tp.workers] == [True] * (tp_size - 1)
            assert not any(getattr(m, "split_k", False) for m in engine.model.modules())  # one product to all-reduce
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    finally:
        engine.close()
    if tp_size > 1:
        assert [w.exitcode for w in engine.tp.workers] == [0] * (tp_size - 1)  # stopped cleanly
    return outputs, steps


# The splits that differ: one KV head on two ranks, tied embeddings, q/k/v biases (cut like their
# rows), per-head q/k norms (whole on every rank), MLA and MoE, MLA expanded.
TINY_MODELS = {
    "llama-1kv": (save_tiny_llama, "llama3-rope", {}),
    "llama-tied": (save_tiny_llama, "gqa4-tied", {}),
    "qwen2-bias": (save_tiny_llama, "qwen2-bias", {}),
    "qwen3-qk-norm": (save_tiny_llama, "qwen3-qk-norm-tied", {}),
    "deepseek-mla": (save_tiny_deepseek, "q-lora-scaled", {}),
    "deepseek-expanded": (save_tiny_deepseek, "lite", dict(use_mla=False)),
}


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_two_ranks_match_one(tmp_path, monkeypatch, model):
    save, variant, engine_args = TINY_MODELS[model]
    save(tmp_path, variant)
    prompts = random_prompts([5, 17, 1, 40], 320)  # a batched prefill, then batched decode steps
    expected, expected_steps = run(tmp_path, 1, prompts, monkeypatch, **engine_args)
    monkeypatch.undo()
    outputs, steps = run(tmp_path, 2, prompts, monkeypatch, **engine_args)
    assert outputs == expected
    assert len(steps) == len(expected_steps)
    for step, (got, want) in enumerate(zip(steps, expected_steps)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"step {step}")


def test_two_ranks_retract_and_recompute_like_one(tmp_path):
    """A pool too small for its requests (scheduler.py retracts on rank 0): the recomputing prefill
    after a retraction reaches rank 1 like any other pass, and the tokens equal one rank's on a
    roomy pool."""
    save_tiny_llama(tmp_path, "gqa4-tied")
    prompts = random_prompts([20] * 6, 320, seed=3)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    expected = Engine(tmp_path, EngineConfig(max_total_tokens=1000, log=False)).generate(prompts, params)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=200, chunked_prefill_size=16, tp_size=2, log=False))
    try:
        assert engine.generate(prompts, params) == expected
        assert engine.stats["retractions"] > 0
    finally:
        engine.close()


def _random_prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]


def pad_decode_batches(engine, max_bs):
    """Make rank 0 pad each decode batch to its graph size, as a replay pads it, before it sends
    the batch: every rank then runs the padded batch eagerly. (The padded rows write req_to_token's
    row 0, which these tests never give a request: rows are handed out from the top.)"""
    inputs, forward = StaticDecodeInputs(max_bs, engine.device), engine.forward

    def padded_forward(batch):
        if not batch.is_decode:
            return forward(batch)
        return forward(inputs.batch(inputs.fill(batch)))[: batch.batch_size]

    engine.forward = padded_forward


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("shape", ["llama-3-8b", "deepseek-v2-lite"])
def test_graphs_match_eager_at_tp2(shape):
    """The graph test of test_cuda_graph_runner at tensor parallelism 2, with the NCCL all-reduce
    inside the graphs. First 16 requests that stay 16, a graph size, so no step is padded: graphs
    must equal eager decoding exactly. Then 13 requests shrinking through padded sizes 16, 8, 4,
    2, 1, and 5 of them again: graphs must equal eager decoding of the same padded batches.
    Unpadded eager decoding may differ there, and for Llama it does: cuBLAS picks its kernel by
    the row count, and for one rank's down_proj (4096 x 7168) 9-15 rows round differently from 16
    (scripts/matmul_rows.py). That is a batch-size effect any cuBLAS engine has, not a graph one.
    With two ranks an all-reduce is one addition, exact in any order."""
    prompts = _random_prompts(13, 32000, seed=0)
    params = [SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True) for i in range(13)]
    runs = {}
    for graphs in (True, False):
        engine = Engine(SHIPPED_CONFIGS / shape, EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                        load_format="dummy", max_total_tokens=8192, max_running_requests=32, cuda_graph=graphs,
                        cuda_graph_max_bs=32, tp_size=2, radix_cache=False, log=False))
        try:
            modes = ["graphs"] if graphs else ["eager", "padded eager"]
            for mode in modes:
                if mode == "padded eager":
                    pad_decode_batches(engine, 32)
                runs[mode, "unpadded"] = engine.generate(_random_prompts(16, 32000, seed=1),
                                                         SamplingParams(max_new_tokens=8, ignore_eos=True))
                runs[mode, "13"] = engine.generate(prompts, params)
                runs[mode, "5"] = engine.generate(prompts[:5], params[:5])
        finally:
            engine.close()
        del engine
        gc.collect()  # the split model refers to itself (tp.py's embed and logits): free it before the next
        torch.cuda.empty_cache()
    for case in ("unpadded", "13", "5"):
        for mode in ("padded eager", "eager"):
            same = sum(a == b for a, b in zip(runs["graphs", case], runs[mode, case]))
            print(f"{shape} at tp 2, {case} requests: {same}/{len(runs['graphs', case])} identical "
                  f"with graphs and {mode} decoding")
    assert runs["graphs", "unpadded"] == runs["eager", "unpadded"] == runs["padded eager", "unpadded"]
    assert runs["graphs", "13"] == runs["padded eager", "13"]
    assert runs["graphs", "5"] == runs["padded eager", "5"]


@pytest.mark.parametrize("where", ["embedding", "layer 1 MLP"])
def test_a_pass_that_fails_on_rank_0_does_not_hang_the_next(tmp_path, where):
    """A forward pass that raises on rank 0 after rank 1 began it (the server's loop fails that step's
    requests and goes on): rank 1 still waits in one of its collectives. The next pass must either
    give rank 1's tokens or end rank 0 with a one-line error and no worker left: never hang."""
    save_tiny_llama(tmp_path, "gqa4-tied")
    fault = ("model.embed = fail_once(model.embed)" if where == "embedding"
             else "model.layers[1].mlp.forward = fail_once(model.layers[1].mlp.forward)")
    code = f"""
from nano.engine import Engine, EngineConfig
from nano.engine_process import _step
from nano.sampling import SamplingParams
from tests.helpers import random_prompts

def fail_once(f, armed=[True]):
    def failing(*args):
        if armed and armed.pop():
            raise RuntimeError("planted fault on rank 0")
        return f(*args)
    return failing

if __name__ == "__main__":
    prompts, params = random_prompts([5, 17], 320), SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = Engine({str(tmp_path)!r}, EngineConfig(max_total_tokens=256, log=False)).generate(prompts, params)
    engine = Engine({str(tmp_path)!r}, EngineConfig(max_total_tokens=256, tp_size=2, log=False))
    print("worker", engine.tp.workers[0].pid, flush=True)
    model = engine.model
    {fault}
    failed = _step(engine, {{i: engine.add_request(p, params) for i, p in enumerate(prompts)}})
    assert [e.status for _, e in failed] == [500, 500], failed
    print("same" if engine.generate(prompts, params) == want else "different", flush=True)
    engine.close()
"""
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the pass after the failed one hangs: {e.stdout}")
    worker = int(result.stdout.split()[1])
    if result.returncode == 0:
        assert result.stdout.split()[-1] == "same", result.stdout
    else:
        lines = result.stderr.splitlines()
        assert result.returncode == 1 and any(line.startswith("error: ") for line in lines), result.stderr
        assert not _running_after(worker, 10)  # no worker left behind


def _running_after(pid: int, seconds: float) -> bool:
    """Whether process pid still runs (exists and is no zombie) `seconds` from now."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.2)
    return True


def _rank_0_script(tmp_path, body: str) -> str:
    """A command (nano.cli's cli) that runs `body` with `path`, a tiny model's folder, and prints its worker's pid."""
    save_tiny_llama(tmp_path, "gqa4-tied")
    lines = "".join(f"    {line}\n" for line in body.strip().splitlines())
    return (f"import os, signal, sys, threading, time\nimport nano.engine as ne\nfrom nano.cli import cli\n"
            f"from nano.sampling import SamplingParams\npath = {str(tmp_path)!r}\n"
            f"def run(args):\n{lines}"
            f"if __name__ == '__main__':\n    cli(lambda: __import__('argparse').ArgumentParser(), run, [])\n")


def test_ctrl_c_under_tp_ends_every_rank_without_a_traceback(tmp_path):
    """Ctrl-C reaches the terminal's whole process group, the workers too: exit status 130 as at tp 1,
    no worker's traceback, no worker left."""
    code = _rank_0_script(tmp_path, """
engine = ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=4000, log=False))
print("worker", engine.tp.workers[0].pid, flush=True)
engine.generate([[5, 6, 7]] * 8, SamplingParams(max_new_tokens=3000, ignore_eos=True))
""")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    worker = int(proc.stdout.readline().split()[1])
    time.sleep(1)  # decoding
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert not _running_after(worker, 10)


def test_a_ctrl_c_caught_on_rank_0_alone_leaves_an_engine_that_refuses_to_run(tmp_path):
    """A notebook's interrupt reaches rank 0 alone, mid-pass (planted here after the pass was handed to the
    worker), and the caller catches it: the worker still waits in that pass, and the next generate waited for
    ever in its first broadcast. It is refused in one line, and the process still ends."""
    code = _rank_0_script(tmp_path, """
engine = ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=4000, log=False))
run, passes = engine._run, []
def interrupted(batch):
    passes.append(batch)
    if len(passes) == 3:
        raise KeyboardInterrupt
    return run(batch)
engine._run = interrupted
try:
    engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=10, ignore_eos=True))
except KeyboardInterrupt:
    pass
try:
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
except RuntimeError as e:
    print("refused:", e, flush=True)
""")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "refused: the engine cannot run again: Ctrl-C interrupted" in result.stdout, \
        result.stdout + result.stderr


def test_ctrl_c_while_a_worker_starts_is_quiet(tmp_path):
    """Ctrl-C while a worker still imports torch (the first seconds of a start): it printed a KeyboardInterrupt
    traceback and died of the signal, and rank 0 reported it as a worker that stopped, with status 1, not 130."""
    code = _rank_0_script(tmp_path, """
import nano.tp
real = nano.tp.TensorParallel
def joining(*args):
    print("worker", args[5][0].pid, flush=True)
    return real(*args)
nano.tp.TensorParallel = joining
ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=64, log=False))
""")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    worker = int(proc.stdout.readline().split()[1])
    while b"spawn_main" not in open(f"/proc/{worker}/cmdline", "rb").read():  # until it runs Python
        time.sleep(0.01)
    time.sleep(0.3)  # importing torch, which takes seconds
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr and "error" not in stderr, stderr
    assert not _running_after(worker, 10)


def test_the_rendezvous_port_is_held_from_before_the_first_worker_starts(tmp_path, monkeypatch):
    """A port found free, then bound again once the workers had started, could be taken by another
    program in between (the rendezvous failed with a traceback): a look at the port just before each
    worker starts finds it taken."""
    import multiprocessing
    import socket

    save_tiny_llama(tmp_path, "gqa4-tied")
    spawned, found_free = multiprocessing.get_context("spawn").Process, []
    real_start = spawned.start

    def start_after_a_look(process):
        port = process._args[4]  # _run_worker's (outlives_sigterm, hears_ctrl_c, worker, rank, port, pipe)
        with socket.socket() as other_program, contextlib.suppress(OSError):
            other_program.bind(("127.0.0.1", port))
            found_free.append(port)
        real_start(process)

    monkeypatch.setattr(spawned, "start", start_after_a_look)
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=64, tp_size=2, log=False))
    engine.close()
    assert [w.exitcode for w in engine.tp.workers] == [0] and found_free == []


def test_rank_0_failing_alone_at_startup_is_one_line(tmp_path):
    """Rank 0's GPU short of memory while rank 1's has room: rank 1 waits for rank 0 in the KV cache's
    sizing. The command ends with rank 0's one line and status 2, no traceback or warning from rank 1."""
    code = _rank_0_script(tmp_path, """
def planted(*_):
    time.sleep(2)  # rank 1 gets past its own check meanwhile
    raise ne.NotEnoughMemoryError("planted: rank 0 has no room")
ne.ensure_fits = planted
ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=64, log=False))
""")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == "error: planted: rank 0 has no room", result.stderr


def test_a_worker_that_dies_before_the_rendezvous_ends_rank_0(tmp_path):
    """A worker that dies while it starts (its GPU fails to initialise, say) would leave rank 0 in the
    process group's rendezvous for its 30-minute timeout."""
    code = _rank_0_script(tmp_path, """
spawned = __import__("multiprocessing").get_context("spawn").Process
real_start = spawned.start
def start_and_kill(process):
    real_start(process)
    os.kill(process.pid, signal.SIGKILL)
spawned.start = start_and_kill
ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=64, log=False))
""")
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 waits for a worker that died")
    assert result.returncode == 1, result.stderr
    assert "error: tensor-parallel worker rank 1 (exit code -9)" in result.stderr, result.stderr


@pytest.mark.parametrize("codes, exit_code, printed", [
    # a worker's sentinel fires as it closes its files, a moment before its exit code can be read (None
    # until waited for): the watcher must still say which worker stopped and how, not exit 2 silently
    ([None], 1, "error: tensor-parallel worker rank 1 (exit code -9) stopped"),
    ([2, 2], 2, ""),  # each printed its one-line error
    ([130, 130], 130, ""),  # each met Ctrl-C: rank 0 ends as quietly, with Ctrl-C's status
    ([2, 130], 1, "error: tensor-parallel worker rank 1 (exit code 2), rank 2 (exit code 130) stopped"),
])
def test_the_watcher_ends_rank_0_as_its_ended_workers_say(monkeypatch, capsys, codes, exit_code, printed):
    class Ended:
        def __init__(self, code):
            read, write = os.pipe()
            os.close(write)  # the worker's end: closed, as at its exit
            self.sentinel, self.exitcode = read, code

        def join(self):
            self.exitcode = -9 if self.exitcode is None else self.exitcode

    group = object.__new__(TensorParallel)
    group.workers, group.closed = [Ended(code) for code in codes], False
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as exit_:
        group._exit_if_a_worker_dies()
    for worker in group.workers:
        os.close(worker.sentinel)
    assert exit_.value.code == exit_code
    err = capsys.readouterr().err
    assert printed in err and (printed or err == "")


def test_the_servers_engine_at_tp2_outlives_a_service_managers_sigterm(tmp_path):
    """systemd stops a service with SIGTERM to each of its processes (test_server: the request in flight
    finishes, then the server stops the engine). The engine process outlives it; its workers must too,
    or the request fails and the engine exits with status 1."""
    from nano.engine_process import AddRequest, Shutdown, start_engine_process

    save_tiny_llama(tmp_path, "gqa4-tied")
    client = start_engine_process(partial(Engine, str(tmp_path), EngineConfig(tp_size=2, max_total_tokens=400,
                                                                             log=False)))
    ranks = [client.worker.pid] + [int(pid) for pid in subprocess.run(
        ["pgrep", "-P", str(client.worker.pid)], capture_output=True, text=True).stdout.split()]
    assert len(ranks) >= 2  # the engine process and its worker (and the resource tracker, which ignores SIGTERM)
    try:
        client.inbox.put(AddRequest(0, [5, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True), set()))
        tokens = []
        while not tokens or tokens[-1].finish_reason is None:
            events = client.outbox.get(timeout=30).events
            assert all(hasattr(event, "finish_reason") for _, event in events), events  # no APIError
            tokens += [event for _, event in events]
            if len(tokens) >= 5 and len(tokens) - len(events) < 5:
                for pid in ranks:
                    os.kill(pid, signal.SIGTERM)
        assert len(tokens) == 200
        client.inbox.put(Shutdown())
        client.worker.join(60)
        assert client.worker.exitcode == 0
    finally:
        client.worker.kill()


def test_an_engine_used_after_close_says_so(tmp_path):
    """close() stops the workers; a pass sent to them afterwards failed like a pass the ranks fell out of
    step on, which ends the process (os._exit, status 1): a caller that used the engine once more lost
    its whole program. It gets a one-line error instead, and a second close() is harmless."""
    code = _rank_0_script(tmp_path, """
engine = ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=64, log=False))
params = SamplingParams(max_new_tokens=3, ignore_eos=True)
engine.generate([[5, 6, 7]], params)
engine.close()
engine.close()
try:
    engine.generate([[5, 6, 7]], params)
except RuntimeError as e:
    print("refused:", e)
""")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "refused: the engine is closed" in result.stdout, result.stderr


def test_an_engine_built_after_one_that_failed_to_start_runs(tmp_path):
    """A caller that catches rank 0's failure at start-up (its GPU short of memory) and builds the engine
    again: the failed engine's process group stayed, and the next engine failed in torch ("trying to
    initialize the default process group twice", a ValueError) with its new worker left waiting for the
    rendezvous. A second engine beside a running one is refused in one line, before it starts a worker."""
    code = _rank_0_script(tmp_path, """
config, params = ne.EngineConfig(tp_size=2, max_total_tokens=64, log=False), SamplingParams(max_new_tokens=3)
want = ne.Engine(path, ne.EngineConfig(max_total_tokens=64, log=False)).generate([[5, 6, 7]], params)
real = ne.ensure_fits
ne.ensure_fits = lambda *_: (_ for _ in ()).throw(ne.NotEnoughMemoryError("planted: rank 0 has no room"))
try:
    ne.Engine(path, config)
except ne.NotEnoughMemoryError:
    ne.ensure_fits = real
engine = ne.Engine(path, config)
try:
    ne.Engine(path, config)
except ne.ConfigError as e:
    print("refused:", e)
print("same" if engine.generate([[5, 6, 7]], params) == want else "different")
engine.close()
print("left:", len(__import__("multiprocessing").active_children()))
""")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["refused: a tensor-parallel engine already runs in this process: close() "
                                          "it first", "same", "left: 0"], result.stdout


def test_a_worker_does_not_outlive_rank_0(tmp_path):
    """Rank 0 gone before the rendezvous (the server's engine process, ended by os._exit when a SIGTERM ends
    the server while the model loads; or killed): its worker waited for it there for 30 minutes."""
    code = _rank_0_script(tmp_path, """
spawned = __import__("multiprocessing").get_context("spawn").Process
real_start = spawned.start
def start_and_die(process):
    real_start(process)
    print("worker", process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
spawned.start = start_and_die
ne.Engine(path, ne.EngineConfig(tp_size=2, max_total_tokens=64, log=False))
""")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    worker = int(proc.stdout.readline().split()[1])  # (the worker holds the pipe open: no communicate())
    try:
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert not _running_after(worker, 60), "the worker still waits for rank 0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_ranks_that_share_a_kv_head_hold_the_one_their_query_heads_read():
    """2 KV heads on 4 ranks: ranks 0 and 1 hold query heads 0-15, which read KV head 0; ranks 2 and 3
    KV head 1 (not alternating: rank 1 with KV head 1 would attend with the wrong keys)."""
    from dataclasses import replace

    from nano.cli import SHIPPED_CONFIGS
    from nano.config import load_config
    from nano.tp import checkpoint_shard

    cfg = replace(load_config(SHIPPED_CONFIGS / "llama-3-8b"), num_kv_heads=2)  # 32 query heads
    for role in ("k_proj", "v_proj"):
        blocks = [checkpoint_shard(f"model.layers.0.self_attn.{role}.weight", cfg, rank, 4) for rank in range(4)]
        assert blocks == [(0, 2, 0), (0, 2, 0), (0, 2, 1), (0, 2, 1)], role


def test_an_expert_width_that_does_not_split_is_refused():
    """Each routed expert's width is split over the ranks: an odd one is refused, as the MLP width is."""
    from dataclasses import replace

    from nano.cli import SHIPPED_CONFIGS
    from nano.config import ConfigError, load_config
    from nano.tp import shard_config

    cfg = load_config(SHIPPED_CONFIGS / "deepseek-v2-lite")
    assert shard_config(cfg, 2).moe_intermediate_size == cfg.moe_intermediate_size // 2
    with pytest.raises(ConfigError, match=r"over 2 GPUs: its expert width \(1409\) is not a multiple of 2$"):
        shard_config(replace(cfg, moe_intermediate_size=1409), 2)


def test_each_rank_embeds_the_ids_of_its_vocabulary_block_alone():
    """Rank r holds embedding rows [r * V, (r + 1) * V): the id one past its block is the next rank's
    (an off-by-one there would index past the table, or sum two ranks' rows)."""
    from types import SimpleNamespace

    from nano.tp import _embed_vocab_block

    table = torch.randn(4, 3)  # V = 4 rows a rank
    model, group = SimpleNamespace(embed_tokens=table), SimpleNamespace(all_reduce=lambda x: x)
    ids = torch.tensor([0, 3, 4, 7, 8])
    zeros = torch.zeros(1, 3)
    assert torch.equal(_embed_vocab_block(model, 0, group, ids), torch.cat([table[[0, 3]], zeros, zeros, zeros]))
    assert torch.equal(_embed_vocab_block(model, 4, group, ids), torch.cat([zeros, zeros, table[[0, 3]], zeros]))
