"""CUDA-graph runner: bucketing and static-buffer filling on CPU (CI); capture and replay
against eager decoding on the GPU (skipped without CUDA)."""

from dataclasses import replace

import pytest
import torch

from nano.cli import SHIPPED_CONFIGS
from nano.config import load_config
from nano.cuda_graph_runner import StaticDecodeInputs, capture_batch_sizes
from nano.forward_batch import ForwardBatch, batch_bucket

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_sizes_and_bucketing():
    sizes = capture_batch_sizes(160)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 160 and sizes == sorted(sizes)
    assert capture_batch_sizes(6) == [1, 2, 4]
    assert capture_batch_sizes(100)[-1] == 96
    assert [batch_bucket(bs) for bs in (1, 2, 3, 5, 8, 9, 17, 159, 160)] == [1, 2, 4, 8, 8, 16, 24, 160, 160]


def test_fill_copies_real_rows_and_pads_harmlessly():
    inputs = StaticDecodeInputs(16, "cpu")
    for buf in vars(inputs).values():
        buf.fill_(77)  # poison: every row must be written
    batch = ForwardBatch.decode([5, 6, 7], [10, 3, 42], [2, 0, 9],
                                torch.tensor([31, 32, 33], dtype=torch.int32), "cpu")
    assert inputs.fill(batch) == 4
    inputs.seq_lens[4:8] = 5  # a 5-request batch's padding leaves the others' rows untouched
    assert inputs.fill(ForwardBatch.decode([5, 6, 7, 8, 9], [10, 3, 42, 7, 7], [2, 0, 9, 1, 3],
                                           torch.tensor([31, 32, 33, 34, 35], dtype=torch.int32), "cpu")) == 8
    assert inputs.input_ids[:8].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert inputs.positions[:8].tolist() == [9, 2, 41, 6, 6, 0, 0, 0]
    assert inputs.out_cache_loc[:8].tolist() == [31, 32, 33, 34, 35, 0, 0, 0]  # padding writes slot 0
    assert inputs.req_pool_indices[:8].tolist() == [2, 0, 9, 1, 3, 0, 0, 0]
    assert inputs.seq_lens[:8].tolist() == [10, 3, 42, 7, 7, 1, 1, 1]
    assert inputs.seq_lens[8:].tolist() == [77] * 8  # rows past the padded size are not read
    view = inputs.batch(8)
    assert view.batch_size == 8 and view.is_decode
    assert view.input_ids.data_ptr() == inputs.input_ids.data_ptr()  # views, not copies


def test_padding_to_the_graph_size_changes_no_choice():
    """The graph contract: for every batch size a graph serves, the batch padded as a replay pads
    it chooses the same decode-attention splits and the same MoE form as the batch itself, run
    eagerly. Any rounding applied in one place only (capture list, padding, split cap, MoE
    threshold) breaks this, and graph and eager tokens would part."""
    from nano.deepseek import MoE
    from nano.kv_cache import KVPool
    from nano.triton_attn import TritonAttnBackend

    max_bs, sizes = 160, capture_batch_sizes(160)
    llama, deepseek = load_config(SHIPPED_CONFIGS / "llama-3-8b"), load_config(SHIPPED_CONFIGS / "deepseek-v2-lite")
    with torch.device("meta"):  # only shapes are needed: nothing is allocated
        # V2-Lite's threshold (66 experts / 16 pair-halves) falls on a bucket's edge; with 4 of 64 routed
        # it falls inside one (5 tokens, in bucket 8), where a rounding in one place only would show
        moes = [MoE(deepseek), MoE(replace(deepseek, num_experts_per_tok=4))]
    req_to_token = torch.zeros(max_bs, 8, dtype=torch.int32)
    backends = [TritonAttnBackend(KVPool(cfg, 2, torch.bfloat16, "cpu", use_mla=True), req_to_token, max_bs,
                                  cfg.num_heads) for cfg in (llama, deepseek)]
    inputs = StaticDecodeInputs(max_bs, "cpu")
    g = torch.Generator().manual_seed(0)
    for bs in range(1, max_bs + 1):
        seq_lens = torch.randint(1, 20000, (bs,), generator=g).tolist()
        batch = ForwardBatch.decode([1] * bs, seq_lens, list(range(bs)), torch.ones(bs, dtype=torch.int32), "cpu")
        padded_bs = inputs.fill(batch)
        assert padded_bs in sizes and padded_bs >= bs
        for backend in backends:
            backend.init_forward_metadata(batch)
            eager_splits = backend.num_kv_splits[:bs].clone()
            backend.init_forward_metadata(inputs.batch(padded_bs))
            assert backend.num_kv_splits[:bs].tolist() == eager_splits.tolist(), f"batch {bs}: splits differ"
        for moe in moes:
            assert moe.form(bs, on_cuda=True) == moe.form(padded_bs, on_cuda=True), f"batch {bs}: MoE forms differ"
    for moe in moes:  # both forms are exercised
        assert {moe.form(bs, on_cuda=True) for bs in range(1, max_bs + 1)} == {"matvec", "fused"}


def _random_prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]


class EagerReplay:
    """Stands in for a captured graph: runs the same padded static batch eagerly."""

    def __init__(self, runner, bs):
        self.runner, self.bs = runner, bs

    def replay(self):
        runner = self.runner
        runner.logits[self.bs].copy_(runner.model(runner.inputs.batch(self.bs), runner.attn))


@requires_cuda
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama-3-8b", "deepseek-v2-lite"])
def test_graphs_match_eager_as_the_batch_shrinks(shape):
    """13 requests of different lengths and budgets: the batch shrinks through padded sizes 16, 8,
    4, 2, 1; a later generate() of 5 of them replays graphs used at other sizes before. The tokens
    must equal eager decoding exactly: of the same padded batches, and of unpadded ones (the MoE
    form and the attention split counts are chosen so that padding does not change them, and at
    these sizes neither does cuBLAS's choice of kernel: scripts/matmul_rows.py finds the sizes
    where it does).
    DeepSeek's router makes this strict: with random weights some experts' scores nearly tie, and
    any last-bit difference (an atomic add in another order) flips one and the texts part."""
    from nano.cli import SHIPPED_CONFIGS
    from nano.engine import Engine, EngineConfig
    from nano.sampling import SamplingParams

    prompts = _random_prompts(13, 32000, seed=0)
    params = [SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True) for i in range(13)]
    # The prefix cache is off: the modes share one engine, and a cache warmed by the first mode
    # would make the later ones prefill less, round differently, and part for that reason alone.
    engine = Engine(SHIPPED_CONFIGS / shape, EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                    load_format="dummy", max_total_tokens=8192, max_running_requests=32, cuda_graph=True,
                    cuda_graph_max_bs=32, radix_cache=False, log=False))
    runs = {}
    runner = engine.graph_runner
    captured = runner.graphs
    for mode in ("graphs", "padded eager", "eager"):
        runner.graphs = captured if mode == "graphs" else {bs: EagerReplay(runner, bs) for bs in captured}
        engine.graph_runner = None if mode == "eager" else runner
        runs[mode] = engine.generate(prompts, params)
        # then 5 of them alone: graphs captured and replayed at other sizes before serve them too
        runs[mode + ", 5 requests"] = engine.generate(prompts[:5], params[:5])
    for mode in ("padded eager", "eager"):
        same = sum(a == b for a, b in zip(runs["graphs"], runs[mode]))
        print(f"{shape}: {same}/13 requests identical with graphs and with {mode} decoding")
    assert runs["graphs"] == runs["padded eager"] == runs["eager"]
    assert runs["graphs, 5 requests"] == runs["padded eager, 5 requests"] == runs["eager, 5 requests"]


def test_out_of_memory_during_capture_names_the_knobs(monkeypatch):
    """Capture runs out of memory at the largest batch: one line saying what to lower.
    (On CPU the CUDA calls around the capture are stubbed; the model raises the OOM.)"""
    from types import SimpleNamespace

    from nano.cuda_graph_runner import CudaGraphRunner, GraphCaptureError

    def model(batch, attn):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    attn = SimpleNamespace(init_forward_metadata=lambda batch: None)
    with pytest.raises(GraphCaptureError) as err:
        CudaGraphRunner(model, attn, max_bs=160, device="cpu", log=False)
    message = str(err.value)
    assert "\n" not in message and "batch size 160" in message
    assert "--cuda-graph-max-bs" in message and "--mem-fraction" in message
