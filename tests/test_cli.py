"""The command line end to end: the real default model answers, and bad input ends with one line
on stderr and exit status 2 (never a traceback), Ctrl-C with exit status 130."""

import argparse
import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import assert_one_line_error, run_cli, run_main, save_tiny_chat_model, save_tiny_llama


def run_bench(*args):
    return run_cli(*args, module="nano.bench_latency")


def test_capital_of_france(smollm2_dir):
    result = run_cli("--model", str(smollm2_dir), "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prefill:" in result.stderr and "Paris" not in result.stderr  # stats on stderr only
    assert "note:" not in result.stderr  # SmolLM2 has a chat template: nothing to note


def test_several_prompts_print_in_order(smollm2_dir, tmp_path):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("What is the capital of Italy?\n\nName a primary colour.\n")
    result = run_cli("--model", str(smollm2_dir), "--prompt", "What is the capital of France?",
                     "--prompt-file", str(prompt_file), "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    blocks = result.stdout.split("--- prompt ")
    assert [b[:1] for b in blocks[1:]] == ["1", "2", "3"]
    assert "Paris" in blocks[1] and "Italy" in blocks[2] and "Red" in blocks[3]


@pytest.fixture
def tiny_model(tmp_path, smollm2_dir):
    folder = save_tiny_chat_model(tmp_path / "tiny", smollm2_dir)
    result = run_main("--model", str(folder), "--prompt", "hi", "--max-new-tokens", "3")
    assert result.returncode == 0, result.stderr
    return folder


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run_main("--model", str(tmp_path / "nope"), "--prompt", "hi"), "does not exist")


def test_model_that_is_a_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = run_main("--model", str(tmp_path / "model.safetensors"), "--prompt", "hi")
    assert_one_line_error(result, "not a model folder")


def test_a_model_folder_given_as_dot_keeps_its_name(tmp_path, monkeypatch):
    """serve names the model after its folder (/v1/models, the `model` a request must send): `--model .`
    named it '' and `--model ..` named it '..'."""
    from nano.cli import resolve_model

    (tmp_path / "my-model" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "my-model")
    assert resolve_model(".").name == "my-model"
    monkeypatch.chdir(tmp_path / "my-model" / "sub")
    assert resolve_model("..").name == "my-model"


def test_no_model_flag_is_the_embedded_default(smollm2_dir):
    from nano.cli import resolve_model

    assert resolve_model(None) == smollm2_dir  # generate and serve without --model: SmolLM2-135M-Instruct


def test_empty_model_folder(tmp_path):
    assert_one_line_error(run_main("--model", str(tmp_path), "--prompt", "hi"), "no config.json")


def test_malformed_config(tiny_model):
    (tiny_model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi"), "malformed JSON")
    for not_an_object in ("[]", "null", '"LlamaForCausalLM"'):
        (tiny_model / "config.json").write_text(not_an_object)
        assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi"), "expected a JSON object")


def test_unsupported_architecture(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tiny_model / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi"), "GPT2LMHeadModel",
                          "LlamaForCausalLM")


def test_missing_tensor(tiny_model):
    weights = load_file(tiny_model / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_model / "model.safetensors")
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi"),
                          "missing tensor model.layers.1.mlp.up_proj.weight")


@pytest.mark.parametrize("index, fragment", [
    (b'{"weight_map": ', "malformed JSON"),
    (b"\xff\xfe{}", "malformed JSON"),  # not UTF-8
    (b'{"weight_map": {"lm_head.weight": 3}}', "malformed index"),
])
def test_malformed_weight_index(tiny_model, index, fragment):
    # sharded: beside a model.safetensors, an index is not read (transformers' order)
    (tiny_model / "model.safetensors").rename(tiny_model / "model-00001-of-00001.safetensors")
    (tiny_model / "model.safetensors.index.json").write_bytes(index)
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi"), "model.safetensors.index.json",
                          fragment)


def test_misshaped_tensor(tiny_model):
    weights = load_file(tiny_model / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 32)
    save_file(weights, tiny_model / "model.safetensors")
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi"),
                          "model.layers.0.self_attn.o_proj.weight", "[64, 32]")


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "-5"], "max-new-tokens"),
    (["--max-new-tokens", "many"], "max-new-tokens"),
    (["--top-p", "0"], "top-p"),
    (["--mem-fraction", "1.5"], "mem-fraction"),
    (["--mem-fraction", "1"], "mem-fraction"),  # the whole of the free memory, none left for the activations
    (["--mem-fraction", "nan"], "mem-fraction"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--seed", "-1"], "seed"),
    (["--chunked-prefill-size", "-5"], "chunked-prefill-size"),
])
def test_bad_flag_values(tiny_model, flags, fragment):
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi", *flags), fragment)


def test_an_empty_prompt_file_name_names_no_file(tiny_model):
    """`--prompt-file ""` (a variable left unset in a script) was skipped, and the run went on with --prompt."""
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "hi", "--prompt-file", ""),
                          "cannot read --prompt-file")


def test_prompt_file_that_is_not_text(tiny_model, tmp_path):
    (tmp_path / "prompts.bin").write_bytes(b"\xff\xfe\x00bad\n")
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt-file", str(tmp_path / "prompts.bin")),
                          "is not UTF-8 text")


def test_prompt_that_is_not_utf8(tiny_model):
    # bytes that are not UTF-8 reach Python's argv as lone surrogates (and go back out as the same bytes)
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "caf\udce9"), "prompt 1 is not UTF-8 text")


def test_a_reader_that_goes_away_ends_the_run_quietly(smollm2_dir):
    """`generate ... | head -c 1`: the next write finds the pipe closed (a run long enough that it
    cannot have written everything into the pipe's buffer first)."""
    proc = subprocess.Popen([sys.executable, "-m", "nano.generate", "--model", str(smollm2_dir), "--prompt", "Count to 1000.",
                             "--max-new-tokens", "1000", "--ignore-eos", "--max-total-tokens", "2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr


def test_max_new_tokens_past_a_small_kv_cache_are_capped_with_a_note(tiny_model):
    """A request holds no more tokens than the KV cache: 16 slots leave a 1-token prompt room for 15."""
    result = run_cli("--model", str(tiny_model), "--prompt", "hi", "--no-chat-template", "--max-total-tokens", "16",
                     "--max-new-tokens", "100", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "prompt 1: the context leaves room for 15 new tokens" in result.stderr
    assert "decode: 14 more tokens" in result.stderr


def test_the_cap_note_names_only_the_prompts_that_were_capped(tiny_model):
    """16 slots and 13 new tokens: a prompt of several tokens is capped, a 1-token prompt after it is not."""
    result = run_cli("--model", str(tiny_model), "--prompt", "hi hi hi hi hi", "--prompt", "hi", "--no-chat-template",
                     "--max-total-tokens", "16", "--max-new-tokens", "13", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: prompt 1: the context leaves room for"), result.stderr


def test_empty_prompt(tiny_model):
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "  "), "empty")


def test_prompt_longer_than_context(tiny_model):
    assert_one_line_error(run_main("--model", str(tiny_model), "--prompt", "word " * 300), "prompt 1", "256")


def test_prompt_file_dash_reads_stdin(smollm2_dir):
    result = run_cli("--model", str(smollm2_dir), "--prompt-file", "-", "--max-new-tokens", "8",
                     "--max-total-tokens", "512", input="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    # prefill samples the first token, decode the other seven, and the stats line says so
    assert "-> 1 first token(s)" in result.stderr and "decode: 7 more tokens" in result.stderr


def test_model_without_chat_template_is_noted(tiny_model):
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tiny_model / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_cli("--model", str(tiny_model), "--prompt", "hi", "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert "has no chat template; the prompts go to the model as raw text" in result.stderr


def test_a_chat_template_that_refuses_the_prompt_is_one_line(tiny_model):
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('a system message is required') }}"
    (tiny_model / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_cli("--model", str(tiny_model), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(result, "the chat template refused these messages: a system message is required")


def test_a_tokenizer_past_the_models_vocabulary_is_one_line(tmp_path, smollm2_dir):
    """SmolLM2's tokenizer (49,152 tokens) on a model of 320: the prompt's ids would index past the embedding."""
    save_tiny_llama(tmp_path, "gqa")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    result = run_cli("--model", str(tmp_path), "--prompt", "What is the capital of France?")
    assert_one_line_error(result, "prompt 1: token ids must be in [0, 320)")


def test_cpu_run_never_imports_triton(smollm2_dir):
    argv = ["--model", str(smollm2_dir), "--prompt", "hi", "--max-new-tokens", "2", "--max-total-tokens", "256"]
    code = f"import sys; from nano.generate import main; main({argv!r}); assert 'triton' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr


def test_shipped_shape_in_generate_points_to_the_benchmark():
    assert_one_line_error(run_main("--model", "llama-3-8b", "--prompt", "hi"),
                          "python -m nano.bench_latency --model llama-3-8b")


def test_bench_latency_without_flags_times_a_shape_that_fits():
    result = run_bench("--device", "cpu", "--input-len", "8", "--output-len", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("smollm2-135m: LlamaForCausalLM, torch.float32, cpu")
    assert "Decode.  median latency" in result.stdout


def test_bench_latency_computes_every_prompt_token(monkeypatch, capsys):
    """Batch sizes 1, 2 and 4 draw their prompts from the same seeds: with a prefix cache a later
    batch would find its first prompts cached, and its prefill would time less than it reports."""
    from nano import bench_latency

    engines = []
    build = bench_latency.build_engine
    monkeypatch.setattr(bench_latency, "build_engine", lambda *a, **k: engines.append(build(*a, **k)) or engines[-1])
    bench_latency.main(["--device", "cpu", "--threads", "1", "--batch-size", "1", "2", "4", "--input-len", "16",
                        "--output-len", "3", "--max-total-tokens", "2000"])
    assert engines[0].stats["prefill_tokens"] == 2 * 16 * (1 + 2 + 4) and engines[0].stats["cached_tokens"] == 0
    assert capsys.readouterr().out.count("Prefill. latency") == 3


@pytest.mark.parametrize("flags", [[], ["--disable-overlap"]])
def test_bench_latency_times_the_middle_decode_steps(monkeypatch, capsys, flags):
    """Of a request's output_len - 1 decode passes, the step that only launches the first (with overlap)
    and the step that lets the batch go are left out: output_len - 2 steps timed, with overlap or without."""
    from nano import bench_latency

    timed, run_once = [], bench_latency.run_once
    monkeypatch.setattr(bench_latency, "run_once", lambda *a, **k: timed.append(run_once(*a, **k)) or timed[-1])
    bench_latency.main(["--device", "cpu", "--threads", "1", "--input-len", "8", "--output-len", "3", *flags])
    assert [len(decode_s) for _, decode_s in timed] == [1, 1]  # the warm-up, then the timed run
    assert "Decode.  median latency" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [[], ["--cuda-graph-max-bs", "4"], ["--max-running-requests", "8"]])
@pytest.mark.parametrize("batch_size", ["12", "300"])
def test_bench_latency_lets_its_largest_batch_run_in_a_graph(monkeypatch, flags, batch_size):
    """A batch runs in the graph of its bucket (12 in 16's): with the limits raised only to 12, the
    largest graph was 8's, and batch 12 was timed eagerly under "CUDA graphs on" (300 past 256 too)."""
    from nano import bench_latency
    from nano.forward_batch import batch_bucket

    class Built(Exception):
        pass

    def build_engine(args, *rest, **overrides):
        raise Built(args)

    monkeypatch.setattr(bench_latency, "build_engine", build_engine)
    monkeypatch.setattr(bench_latency, "engine_config", lambda args: None)  # a GPU's flags, checked on CPU
    with pytest.raises(Built) as built:
        bench_latency.run(bench_latency.build_parser().parse_args(["--device", "cpu", "--input-len", "8",
                                                                   "--batch-size", "1", batch_size, *flags]))
    args = built.value.args[0]
    bucket = batch_bucket(int(batch_size))
    assert args.max_running_requests >= bucket and (args.cuda_graph_max_bs or bucket) >= bucket


def test_bench_latency_refuses_a_request_past_the_context_before_building_the_engine(monkeypatch, capsys):
    """--input-len 100000 on smollm2-135m (a context of 8192) sized a 4 GiB KV cache, then refused."""
    from nano import bench_latency

    monkeypatch.setattr(bench_latency, "build_engine", lambda *a, **k: pytest.fail("built an engine first"))
    with pytest.raises(SystemExit) as exited:
        bench_latency.main(["--device", "cpu", "--threads", "1", "--input-len", "100000"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: 100000 + 8 tokens per request do not fit: the context holds 8192 tokens\n"


def test_bench_latency_reports_throughput_bandwidth_and_floor_from_its_timings(monkeypatch, capsys):
    """The report's arithmetic, from faked timings and sizes: a 0.25 s prefill of 2 x 3 tokens, decode
    steps of 2, 0.5 and 1 ms (median 1 ms), 1.5 GB of weights and 10 MB of KV a token. A middle step
    reads the KV of 2 x (3 + 5 // 2) tokens: 0.1 GB, so 1.6 GB a millisecond, a quarter of 6,400 GB/s.
    --peak-bandwidth needs no GPU."""
    from nano import bench_latency

    build = bench_latency.build_engine

    def build_with_large_kv_tokens(*args, **kwargs):
        engine = build(*args, **kwargs)
        engine.kv_bytes_per_token = 10**7
        return engine

    monkeypatch.setattr(bench_latency, "build_engine", build_with_large_kv_tokens)
    monkeypatch.setattr(bench_latency, "run_once", lambda *a, **k: (0.25, [0.002, 0.0005, 0.001]))
    monkeypatch.setattr(bench_latency, "weight_bytes_per_step", lambda model, bs: 1.5e9)
    bench_latency.main(["--device", "cpu", "--threads", "1", "--batch-size", "2", "--input-len", "3",
                        "--output-len", "5", "--peak-bandwidth", "6400"])
    assert capsys.readouterr().out.splitlines() == [
        "smollm2-135m: LlamaForCausalLM, torch.float32, cpu, CUDA graphs off, attention TorchAttnBackend",
        "peak bandwidth 6400 GB/s (given)",
        "batch size 2",
        "Prefill. latency: 0.25000 s, throughput:     24.00 token/s",
        "Decode.  median latency: 0.00100 s, median throughput:   2000.00 token/s",
        "Bytes read per decode step: 1.50 GB weights + 0.100 GB KV; achieved 1600 GB/s = 25% of the copy "
        "bandwidth (floor 0.25 ms)",
    ]


@pytest.mark.parametrize("flags, kv_tokens", [
    ([], 2 * (1 + 3)),  # sized to the batch
    (["--context-length", "4", "--max-total-tokens", "8"], 8),  # a request fills the context, the batch the cache
    (["--max-total-tokens", "100"], 100),
    (["--max-running-requests", "1"], 2 * (1 + 3)),  # raised to the batch: else it times one at a time
])
def test_bench_latency_runs_a_batch_that_exactly_fits(monkeypatch, capsys, flags, kv_tokens):
    """The bounds are inclusive: a 1-token prompt, a request as long as the context, a batch as large
    as the KV cache all run; without --max-total-tokens the cache holds the batch and no more. The
    whole batch is prefilled in one step, whatever --max-running-requests says."""
    from nano import bench_latency

    engines, build = [], bench_latency.build_engine
    monkeypatch.setattr(bench_latency, "build_engine", lambda *a, **k: engines.append(build(*a, **k)) or engines[-1])
    bench_latency.main(["--device", "cpu", "--threads", "1", "--batch-size", "2", "--input-len", "1",
                        "--output-len", "3", *flags])
    assert engines[0].kv_pool.capacity == kv_tokens
    assert engines[0].stats["prefill_steps"] == 2  # the warm-up's batch and the timed one, each in one step
    assert "Decode.  median latency" in capsys.readouterr().out


@pytest.mark.parametrize("overlap", [True, False])
def test_bench_latency_times_prefill_and_decode_steps_apart(tmp_path, monkeypatch, overlap):
    """run_once on a tiny model whose first step, the prefill, is slowed by 0.3 s: the prefill figure
    holds the sleep and no decode figure does; every request runs to its length (EOS ignored)."""
    from nano.bench_latency import run_once
    from nano.engine import Engine, EngineConfig

    save_tiny_llama(tmp_path, "gqa")
    engine = Engine(tmp_path, EngineConfig(max_total_tokens=64, overlap=overlap, log=False))
    step, add_request, params, steps = engine.step, engine.add_request, [], []

    def first_step_slowed():
        time.sleep(0 if steps else 0.3)
        steps.append(step())
        return steps[-1]

    monkeypatch.setattr(engine, "step", first_step_slowed)
    monkeypatch.setattr(engine, "add_request", lambda prompt, p: params.append(p) or add_request(prompt, p))
    started = time.perf_counter()
    prefill_s, decode_s = run_once(engine, batch_size=2, input_len=4, output_len=6, seed=0)
    wall_s = time.perf_counter() - started
    assert len(params) == 2 and all(p.ignore_eos and p.max_new_tokens == 6 for p in params)
    assert prefill_s >= 0.3 and len(decode_s) == 4 and all(0 < s < 0.3 for s in decode_s)
    assert prefill_s + sum(decode_s) <= wall_s


@pytest.mark.parametrize("shape", ["llama-3-8b", "smollm2-135m", "deepseek-v2-lite"])
def test_bench_latency_floor_counts_the_weights_a_decode_step_reads(shape):
    """The floor's weights: all but the embedding table (unless lm_head is the same tensor). Of a MoE
    layer's routed experts, one token reads exactly the k it picks; a batch of b tokens, each picking k
    of E, reads E (1 - (1 - k/E)^b) on average, so a batch far larger than E reads every expert. The
    shared experts are read at every batch size. Checked against counts from the config alone."""
    from nano.bench_latency import weight_bytes_per_step
    from nano.cli import shipped_shape
    from nano.config import load_config
    from nano.loader import build_model

    cfg = load_config(shipped_shape(shape))
    model = build_model(cfg, cfg.is_deepseek, "meta", torch.bfloat16)
    every_weight = sum(p.numel() * p.element_size() for p in model.parameters())  # the router is float32
    embedding = 0 if cfg.tie_word_embeddings else 2 * cfg.vocab_size * cfg.hidden_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert (moe_layers > 0) == (shape == "deepseek-v2-lite")
    expert = 2 * 3 * cfg.moe_intermediate_size * cfg.hidden_size  # gate, up, down
    routed, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    dense = every_weight - embedding - moe_layers * routed * expert  # all a step reads but routed experts
    pairs = [(1, top_k), (2, routed * (1 - (1 - top_k / routed) ** 2)), (100_000, routed)] if routed else [(1, 0)]
    for batch, experts_read in pairs:  # (batch size, routed experts it reads a MoE layer)
        assert weight_bytes_per_step(model, batch) == pytest.approx(dense + moe_layers * experts_read * expert)


@pytest.mark.parametrize("module", ["generate", "serve", "bench_latency", "bench_throughput", "bench_serving"])
def test_every_flag_has_a_help_text(module):
    parser = importlib.import_module(f"nano.{module}").build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []


@pytest.mark.parametrize("module", ["nano.generate", "nano.bench_latency"])
def test_help_shows_defaults_and_examples(module):
    result = run_cli("--help", module=module)
    assert result.returncode == 0, result.stderr
    assert "(default: 0.85)" in result.stdout and "examples:" in result.stdout


@pytest.mark.parametrize("flags, fragment", [
    (["--device", "foo"], "nano runs on cpu or cuda"),
    (["--device", "mps"], "nano runs on cpu or cuda"),
    (["--device", "cpu:5"], "nano runs on cpu or cuda"),  # torch has one CPU device
    pytest.param(["--device", "cuda"], "no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU")),
    (["--device", "cpu", "--attention-backend", "triton"], "TRITON_INTERPRET=1"),
    (["--device", "cpu", "--cuda-graph-max-bs", "8"], "CUDA graphs run only on a GPU"),
    (["--output-len", "2"], "--output-len >= 3"),
    (["--batch-size"], "--batch-size"),
    (["--batch-size", "1", "0"], "--batch-size and --input-len must be >= 1"),
    (["--input-len", "0"], "--batch-size and --input-len must be >= 1"),
    (["--peak-bandwidth", "nan"], "--peak-bandwidth"),
    (["--peak-bandwidth", "0"], "--peak-bandwidth must be a positive number"),
    (["--peak-bandwidth", "inf"], "--peak-bandwidth must be a positive number"),
    (["--device", "cpu", "--tp-size", "2"], "splits the model over GPUs, and this run has none"),
    (["--device", "cpu", "--threads", "0"], "--threads must be > 0"),
    (["--device", "cpu", "--threads", "100000"], "--threads 100000: this process may run on"),  # torch crashed on it
    (["--device", "cpu", "--context-length", "-1"], "--context-length must be > 0"),  # "the context holds -1"
    (["--device", "cpu", "--max-running-requests", "-5"], "--max-running-requests must be > 0"),  # raised silently
    (["--device", "cpu", "--chunked-prefill-size", "2"], "prefills each batch in one pass"),  # set aside silently
])
def test_bad_engine_flags(flags, fragment, monkeypatch):
    """Flag errors come before any model is loaded; bench_latency reports them as generate does."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_one_line_error(run_main(*flags, module="nano.bench_latency"), fragment)


def test_a_batch_that_does_not_fit_the_sized_kv_cache_is_one_line():
    """Found once the model is loaded and its KV cache sized (else it would time one at a time). In a
    process of its own: on a GPU it loads Llama-3-8B, whose memory would stay with the test process."""
    result = run_cli("--max-total-tokens", "200", "--batch-size", "2", module="nano.bench_latency")
    assert_one_line_error(result, "does not fit")


def test_help_leaves_out_defaults_that_are_none_or_off():
    """A flag whose default is None or off explains it in its own words: no "(default: False)"."""
    from nano import generate

    text = generate.build_parser().format_help()
    assert "(default: 0.85)" in text and "(default: None)" not in text and "(default: False)" not in text


def test_generate_samples_as_the_readme_says_by_default():
    """256 new tokens, greedy, no top-p or top-k (README's flag table): a default cut in half would
    pass every test that names its own length."""
    from nano import generate

    args = generate.build_parser().parse_args(["--prompt", "x"])
    assert (args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed) == (256, 0.0, 1.0, 0, None)


@pytest.mark.parametrize("seed", range(6))  # each flag both on and off among them
def test_engine_flags_reach_the_engine_config(seed, monkeypatch):
    """Each --disable-* flag turns its setting off and only that one; on CPU with the torch backend
    Triton is not needed, so a host without it still runs."""
    from nano import cli, generate

    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)  # as if triton were not installed
    rng = random.Random(seed)
    off = {flag: rng.random() < 0.5 for flag in ("mla", "radix_cache", "overlap")}
    limits = {"max_total_tokens": rng.randint(64, 4096), "max_running_requests": rng.randint(1, 64)}
    argv = ["--prompt", "x", "--device", "cpu"] + [f"--disable-{f.replace('_', '-')}" for f in off if off[f]]
    argv += [a for k, v in limits.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    config = cli.engine_config(generate.build_parser().parse_args(argv))
    assert (config.use_mla, config.radix_cache, config.overlap) == tuple(not v for v in off.values())
    assert (config.max_total_tokens, config.max_running_requests) == tuple(limits.values())
    assert config.dtype == torch.float32  # the CPU's default


@pytest.mark.parametrize("interpret", ["1", "true", "On", "YES"])  # as Triton reads it
def test_the_interpreter_by_any_of_its_spellings_lets_triton_run_on_cpu(monkeypatch, interpret):
    from nano import generate
    from nano.cli import engine_config

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    argv = ["--prompt", "x", "--device", "cpu", "--attention-backend", "triton"]
    assert engine_config(generate.build_parser().parse_args(argv)).attention_backend == "triton"


def test_as_many_threads_as_cpus_is_allowed():
    from nano import generate
    from nano.cli import engine_config
    from nano.engine import CPUS

    argv = ["--prompt", "x", "--device", "cpu", "--threads", str(CPUS)]
    assert engine_config(generate.build_parser().parse_args(argv)).threads == CPUS


@pytest.mark.parametrize("affinity, threads", [("lambda pid: {0, 1, 2, 3}", 2), (None, 32)])  # None: macOS's
def test_cpu_threads_count_the_cpus_this_process_may_use(affinity, threads):
    """taskset or a container's cpuset leaves the process 4 of the host's 64 cores: torch gets half of
    those 4 by default, and --threads 8 is refused (on macOS, which has no affinity, the host's count)."""
    code = (f"import os; os.cpu_count = lambda: 64; os.sched_getaffinity = {affinity}\n"
            "if os.sched_getaffinity is None: del os.sched_getaffinity\n"
            "from nano import engine, generate; from nano.cli import engine_config; print(engine.CPU_THREADS)\n"
            "engine_config(generate.build_parser().parse_args(['--prompt', 'x', '--device', 'cpu', '-t', '8']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == [str(threads)]
    assert ("--threads 8: this process may run on 4 CPUs" in result.stderr) == (threads == 2), result.stderr


@pytest.mark.parametrize("omp, flag, threads", [("1", None, 1), (None, None, 3), ("1", 2, 2)])
def test_omp_num_threads_where_set_is_kept(tmp_path, omp, flag, threads):
    """OMP_NUM_THREADS is how a user (and the test servers, helpers.py) gives torch its threads: the engine
    set its own default over it. Where it is not set, the default stands (half of these 6 CPUs); --threads
    wins over both."""
    save_tiny_llama(tmp_path, "gqa")
    code = ("import os, torch; os.sched_getaffinity = lambda pid: set(range(6))\n"
            "from nano.engine import Engine, EngineConfig\n"
            f"Engine({str(tmp_path)!r}, EngineConfig(max_total_tokens=64, threads={flag}, log=False))\n"
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | ({"OMP_NUM_THREADS": omp} if omp else {})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.split() == [str(threads)], result.stderr


@pytest.mark.parametrize("flags, fragment", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--input-len", "500", "100"], "need 1 <= MIN <= MAX"),
    (["--output-len", "0", "4"], "need 1 <= MIN <= MAX"),
    (["--input-len", "9000", "9000"], "does not fit the context of 8192"),
    (["--output-len", "20", "20", "--max-total-tokens", "25"], "does not fit the context of 25"),  # else cut short
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**63)], "--seed in [0, 2^63)"),
    (["--peer-prompts", "-1"], "--peer-prompts >= 0"),  # else it times all requests but the last
])
def test_bad_throughput_flags(flags, fragment):
    result = run_main("--model", "smollm2-135m", "--device", "cpu", "--num-prompts", "2", "--output-len", "2", "3",
                     *flags, module="nano.bench_throughput")
    assert_one_line_error(result, fragment)


def test_bench_throughput_runs_a_request_that_fills_the_context_exactly():
    """The context check's boundary: 5 + 20 tokens in a context of 25 fit."""
    result = run_main("--model", "smollm2-135m", "--device", "cpu", "--num-prompts", "1", "--input-len", "5", "5",
                      "--output-len", "20", "20", "--max-total-tokens", "25", "--peer-prompts", "0",
                      module="nano.bench_throughput")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nano: 1 requests, 5 input tokens, 20 output tokens"), result.stdout


def test_model_larger_than_memory_fails_at_once(tmp_path):
    """Llama-3-8B in float32 needs 30 GiB: the engine says so before allocating any of it."""
    from nano.memory import free_bytes

    if free_bytes(torch.device("cpu")) > 31 * 2**30:
        pytest.skip("this host could hold Llama-3-8B in float32")
    # The child's peak memory is read from its own /proc/self/status at exit (VmHWM: this process
    # image alone; rusage's maxrss would also count the pytest process it was forked from).
    peak_file = tmp_path / "peak"
    code = ("import atexit, runpy, sys; "
            f"atexit.register(lambda: open({str(peak_file)!r}, 'w').write("
            "next(l for l in open('/proc/self/status') if l.startswith('VmHWM')))); "
            "sys.argv = ['bench_latency', '--model', 'llama-3-8b', '--load-format', 'dummy', '--device', 'cpu', "
            "'--dtype', 'float32']; runpy.run_module('nano.bench_latency', run_name='__main__')")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # wait4: the child's own CPU time
    wall_s, cpu_s = time.perf_counter() - started, usage.ru_utime + usage.ru_stime
    result = subprocess.CompletedProcess(proc.args, os.waitstatus_to_exitcode(status), stdout, stderr)
    assert_one_line_error(result, "29.9 GiB float32 weights", "try --dtype bfloat16, a GPU or a smaller model")
    peak_rss = int(peak_file.read_text().split()[1]) * 1024  # "VmHWM:  249316 kB"
    assert peak_rss < 2**30, f"peak RSS {peak_rss / 2**30:.1f} GiB"
    assert cpu_s < 5, f"{cpu_s:.1f} s of CPU time ({wall_s:.1f} s on the clock)"


@pytest.mark.parametrize("when", ["importing", "generating"])
def test_ctrl_c_exits_130_without_traceback(smollm2_dir, when):
    # -X importtime reports each import as it ends: the first torch submodule says `import torch`
    # has begun, and it goes on for a second or more (a fixed wait could land before Python is up)
    flags = ["-X", "importtime"] if when == "importing" else []
    proc = subprocess.Popen([sys.executable, *flags, "-m", "nano.generate", "--model", str(smollm2_dir),
                             "--prompt", "Count to 100.", "--max-new-tokens", "500", "--ignore-eos",
                             "--max-total-tokens", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if when == "importing":
        while "torch._utils" not in proc.stderr.readline():
            assert proc.poll() is None, proc.stderr.read()
    else:
        while "prompt tokens" not in proc.stderr.readline():  # the engine is up and decoding
            assert proc.poll() is None, proc.stderr.read()
        streamed = proc.stdout.read(1)  # the answer has begun
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    if when == "generating":  # the cut line ends, else the shell's next prompt lands on it
        assert (streamed + stdout).endswith("\n") and len(streamed + stdout) > 1, streamed + stdout
    # CPython remembers a KeyboardInterrupt that lands inside eval() (collections.namedtuple calls it
    # while torch imports) and, though `cli` catches it, ends the process by SIGINT on the way out
    # instead of exit(130). A shell reports both as status 130; an uncaught one would print a traceback.
    assert proc.returncode in (130, -signal.SIGINT), stderr
    assert "Traceback" not in stderr, stderr


def test_several_prompts_that_end_on_the_same_step_print_every_token(tiny_model):
    """Prompts that finish in one step (the same --max-new-tokens, --ignore-eos) each print their
    whole completion, as the same prompt run alone prints it: none loses its last token."""
    prompts, flags = ["hi", "Name a colour."], ("--max-new-tokens", "6", "--ignore-eos")
    alone = []
    for prompt in prompts:
        result = run_cli("--model", str(tiny_model), "--prompt", prompt, *flags)
        assert result.returncode == 0, result.stderr
        alone.append(result.stdout.removesuffix("\n"))
    result = run_cli("--model", str(tiny_model), "--prompt", prompts[0], "--prompt", prompts[1], *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"--- prompt {i + 1} ---\n{text}\n" for i, text in enumerate(alone))


def test_prompt_file_dash_with_stdin_closed_is_one_line(tiny_model):
    """`... --prompt-file - <&-`: with file descriptor 0 closed, Python's sys.stdin is None."""
    result = run_cli("--model", str(tiny_model), "--prompt-file", "-", preexec_fn=lambda: os.close(0))
    assert_one_line_error(result, "--prompt-file -", "standard input")


@pytest.mark.parametrize("text", ["", "\n \n\t\n"])
def test_prompt_file_of_blank_lines_names_the_file(tiny_model, text):
    """`: | nano.generate --prompt-file -` was told to give --prompt-file, which it had given."""
    result = run_cli("--model", str(tiny_model), "--prompt-file", "-", input=text)
    assert_one_line_error(result, "--prompt-file - holds only blank lines")


@pytest.mark.parametrize("separator", ["\f", "\v", "\x1c", "\x85", "\u2028", "\u2029"])
def test_prompt_file_splits_prompts_only_at_line_ends(tiny_model, tmp_path, separator):
    """One prompt a line: a form feed or a Unicode line separator inside a line does not start a new prompt."""
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(f"first half{separator}second half\r\nanother prompt\n", encoding="utf-8")
    result = run_cli("--model", str(tiny_model), "--prompt-file", str(prompt_file), "--max-new-tokens", "1",
                     "--no-chat-template")
    assert result.returncode == 0, result.stderr
    assert "2 prompt(s)" in result.stderr


def test_stdout_that_cannot_encode_the_text_gets_it_escaped(smollm2_dir):
    """PYTHONIOENCODING=ascii: the completion comes out as a UTF-8 stdout gets it, each character ascii
    cannot encode escaped (as Python's stderr does), not a UnicodeEncodeError traceback mid-stream."""
    args = ("--model", str(smollm2_dir), "--prompt", "Écris en français: je suis très content",
            "--max-new-tokens", "12")
    utf8 = run_cli(*args, env=os.environ | {"PYTHONIOENCODING": "utf-8"})
    assert utf8.returncode == 0 and not utf8.stdout.isascii(), utf8.stderr  # else this tests nothing
    result = run_cli(*args, env=os.environ | {"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == utf8.stdout.encode("ascii", "backslashreplace").decode()


@pytest.mark.parametrize("how", ["file with a BOM", "stdin, PYTHONIOENCODING=ascii"])
def test_prompt_file_is_read_as_utf8_text(tiny_model, tmp_path, how):
    """A prompt file is UTF-8 text whatever stdin's encoding, and a byte order mark (Notepad writes one)
    is not part of the prompt: the model gets the tokens that --prompt with the same text gives it."""
    prompts = ["Écris un poème", "Say hi"]
    flags = ("--model", str(tiny_model), "--max-new-tokens", "1", "--no-chat-template")
    reference = run_cli(*flags, "--prompt", prompts[0], "--prompt", prompts[1])
    assert reference.returncode == 0, reference.stderr
    data = "\r\n".join(prompts).encode()
    if how == "file with a BOM":
        (tmp_path / "prompts.txt").write_bytes(b"\xef\xbb\xbf" + data)
        result = run_cli(*flags, "--prompt-file", str(tmp_path / "prompts.txt"))
    else:
        result = run_cli(*flags, "--prompt-file", "-", input=data.decode(),
                         env=os.environ | {"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    count = next(line for line in reference.stderr.splitlines() if "prompt tokens" in line)
    assert count in result.stderr, result.stderr


def test_ctrl_c_while_the_server_imports_exits_130_without_traceback(smollm2_dir):
    """serve.py imports torch at its top, before `cli` runs: Ctrl-C there ends as it does in generate."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "nano.serve", "--model", str(smollm2_dir),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "torch._utils" not in proc.stderr.readline():  # `import torch` has begun (see the test above)
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT), stderr
    assert "Traceback" not in stderr, stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_stdout_that_cannot_be_written_is_one_line(tiny_model):
    """`> /dev/full` (a full disk): one line, as cat's `write error`; the flush at exit must not fail again."""
    for prompts in (["hi"], ["hi", "Name a colour."]):  # streamed, and printed whole per prompt
        with open("/dev/full", "w") as full:
            result = subprocess.run([sys.executable, "-m", "nano.generate", "--model", str(tiny_model),
                                     "--max-new-tokens", "3", *(f for p in prompts for f in ("--prompt", p))],
                                    stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        result.stdout = ""
        assert_one_line_error(result, "cannot write the output", "No space left on device")


def test_stdout_closed_is_one_line(tiny_model):
    """`... >&-`: Python's sys.stdout is None and print() writes nowhere: the run would end with status 0."""
    result = run_cli("--model", str(tiny_model), "--prompt", "hi", preexec_fn=lambda: os.close(1))
    assert_one_line_error(result, "standard output is closed")


def test_bench_throughput_random_requests_cover_their_ranges():
    """Lengths uniform in each inclusive range, ids inside the vocabulary, the same for the same seed."""
    from nano.bench_throughput import random_requests

    requests = random_requests(400, (3, 5), (1, 2), 20, seed=7)
    assert {len(prompt) for prompt, _ in requests} == {3, 4, 5} and {n for _, n in requests} == {1, 2}
    assert all(0 <= t < 20 for prompt, _ in requests for t in prompt)
    assert random_requests(400, (3, 5), (1, 2), 20, seed=7) == requests != random_requests(400, (3, 5), (1, 2), 20, 8)


def test_bench_throughput_counts_the_timed_requests_alone(tmp_path, monkeypatch, capsys):
    """Every output token asked for comes out (EOS ignored: here every token is one), and the warm-up's
    steps are not counted: the five prompts take one prefill step."""
    from nano import bench_throughput

    save_tiny_llama(tmp_path, "gqa")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": list(range(config["vocab_size"]))}))
    drawn, draw = [], bench_throughput.random_requests
    monkeypatch.setattr(bench_throughput, "random_requests", lambda *a: drawn.append(draw(*a)) or drawn[-1])
    bench_throughput.main(["--model", str(tmp_path), "--device", "cpu", "--num-prompts", "5", "--input-len", "3", "9",
                           "--output-len", "2", "6", "--peer-prompts", "0"])
    requests = drawn[0]  # the timed ones; the warm-up's come second
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"nano: 5 requests, {sum(len(p) for p, _ in requests)} input tokens, "
                           f"{sum(n for _, n in requests)} output tokens in "), line
    assert re.search(r"\(prefill [\d.]+ s in 1 steps at ", line), line


def test_bench_throughput_without_a_model_runs_a_shape_that_fits():
    """As bench_latency: on CPU the default shape is smollm2-135m, not Llama-3-8B (30 GiB in float32)."""
    result = run_cli("--device", "cpu", "--num-prompts", "2", "--input-len", "4", "8", "--output-len", "2", "3",
                     module="nano.bench_throughput")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nano: 2 requests")
    assert "generate_batch: not timed on CPU" in result.stdout  # --peer-prompts (64 by default) is not silently dropped


def test_a_model_folder_named_like_a_shipped_shape_is_the_folder(tmp_path, monkeypatch):
    """A shape name is a shape only where no folder of that name exists: a local model folder named
    `smollm2-135m` is that folder (its weights, safetensors), not the shipped config with dummy weights."""
    import argparse
    from pathlib import Path

    from nano.cli import SHIPPED_CONFIGS, resolve_model, resolve_model_or_shape, shipped_shape

    (tmp_path / "smollm2-135m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert shipped_shape("smollm2-135m") is None
    assert resolve_model("smollm2-135m") == Path.cwd() / "smollm2-135m"  # not "a shape for benchmarks"
    args = argparse.Namespace(model="smollm2-135m", load_format=None, device="cpu")
    assert resolve_model_or_shape(args) == Path.cwd() / "smollm2-135m" and args.load_format == "safetensors"
    monkeypatch.chdir(tmp_path / "smollm2-135m")  # where no such folder is, the name is the shape
    assert shipped_shape("smollm2-135m") == SHIPPED_CONFIGS / "smollm2-135m"
    args = argparse.Namespace(model="smollm2-135m", load_format=None, device="cpu")
    assert resolve_model_or_shape(args) == SHIPPED_CONFIGS / "smollm2-135m" and args.load_format == "dummy"


def test_a_symlinked_model_folder_keeps_the_links_name(tmp_path, monkeypatch):
    """serve names the model after the folder given: a link `my-model` to a hub snapshot folder
    (snapshots/<commit hash>) is served as my-model, not as the hash the link points to."""
    from nano.cli import resolve_model

    (tmp_path / "snapshots" / "0123abcd").mkdir(parents=True)
    (tmp_path / "my-model").symlink_to(tmp_path / "snapshots" / "0123abcd", target_is_directory=True)
    assert resolve_model(str(tmp_path / "my-model")).name == "my-model"
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model").name == "my-model" and resolve_model("my-model").is_absolute()


def test_triton_on_cpu_needs_triton_installed_and_takes_no_cuda_graph_flag(monkeypatch):
    """The Triton backend on CPU (in its interpreter) needs triton installed as on a GPU: a one-line
    error, not an ImportError later; and CUDA graphs stay off on CPU, so --cuda-graph-max-bs is refused."""
    from nano import cli, generate

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--prompt", "x", "--device", "cpu", "--attention-backend", "triton"]
    config = cli.engine_config(generate.build_parser().parse_args(argv))
    assert config.attention_backend == "triton" and not config.cuda_graph
    with pytest.raises(cli.UsageError, match="CUDA graphs run only on a GPU"):
        cli.engine_config(generate.build_parser().parse_args(argv + ["--cuda-graph-max-bs", "4"]))
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)  # as if triton were not installed
    with pytest.raises(cli.UsageError, match="Triton, which is not installed"):
        cli.engine_config(generate.build_parser().parse_args(argv))
    config = cli.engine_config(generate.build_parser().parse_args(argv[:-2]))  # the torch backend needs none
    assert config.attention_backend == "torch"


@pytest.mark.parametrize("flags", [["--disable-cuda-graph"], ["--attention-backend", "torch"]])
def test_cuda_graph_max_bs_is_refused_wherever_cuda_graphs_are_off(monkeypatch, flags):
    """--cuda-graph-max-bs means something only where CUDA graphs run: on a GPU (faked here: flags
    alone), with the triton backend, without --disable-cuda-graph. A GPU run with them off refuses it too."""
    import torch as torch_module

    from nano import cli, generate

    monkeypatch.setattr(cli, "parse_device", lambda name: torch_module.device("cuda"))
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())  # triton "installed"
    argv = ["--prompt", "x", "--device", "cuda", "--dtype", "float32", "--cuda-graph-max-bs", "4", *flags]
    with pytest.raises(cli.UsageError, match="CUDA graphs run only on a GPU"):
        cli.engine_config(generate.build_parser().parse_args(argv))


def test_a_gpu_run_takes_the_gpus_defaults_and_refuses_what_it_cannot_run(monkeypatch):
    """On a GPU (faked as above): bfloat16, Triton and CUDA graphs by default, and Llama-3-8B's shape for a
    benchmark without a model. A T4 emulates bfloat16 (slowly), so it is refused there; --threads too."""
    from nano import cli, generate

    monkeypatch.setattr(cli, "parse_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())  # triton "installed"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    native_bf16 = [True]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native_bf16[0] or including_emulation)
    parse = generate.build_parser().parse_args
    config = cli.engine_config(parse(["--prompt", "x", "--device", "cuda"]))
    assert (config.dtype, config.attention_backend, config.cuda_graph) == (torch.bfloat16, "triton", True)
    with pytest.raises(cli.UsageError, match="--threads sets the CPU's threads"):
        cli.engine_config(parse(["--prompt", "x", "--device", "cuda", "--threads", "2"]))
    args = argparse.Namespace(model=None, load_format=None, device="cuda")
    assert cli.resolve_model_or_shape(args, default_shape=True).name == "llama-3-8b" and args.load_format == "dummy"
    native_bf16[0] = False
    with pytest.raises(cli.UsageError, match="Tesla T4 has no bfloat16; use --dtype float16"):
        cli.engine_config(parse(["--prompt", "x", "--device", "cuda"]))
    assert cli.engine_config(parse(["--prompt", "x", "--device", "cuda", "--dtype", "float16"])).dtype == torch.float16


def test_device_names_torch_takes(monkeypatch):
    from nano import cli

    assert cli.parse_device("cpu:0") == torch.device("cpu:0")  # the one CPU device, by its index
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.parse_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(cli.UsageError, match="--device cuda:1, but there are only 1 CUDA devices"):
        cli.parse_device("cuda:1")


# ---- nano.generate in-process: what it hands the engine and prints -------------------------

@pytest.fixture(scope="module")
def in_process_model(tmp_path_factory, smollm2_dir):
    return save_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny", smollm2_dir)


def generate_in_process(model, prompts, *flags) -> tuple[str, str]:
    argv = ["--model", str(model), "--no-chat-template", "--ignore-eos", *flags]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    result = run_main(*argv)
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def test_a_retraction_that_books_two_passes_at_once_prints_every_token(in_process_model):
    """generate prints a prompt's block once its last token is in: a retraction (a pool too small for
    both requests) books two passes in one step, so a request can be finished while the loop still
    holds its second-to-last token. Each block must equal what its prompt prints alone."""
    # prompts of 1 and 5 tokens, 12 new tokens each, 26 KV slots: a retraction books the first request's
    # last two tokens in one step, while it is the next block to print (the whole schedule depends on
    # these lengths alone, not on the random weights)
    prompts, flags = ["hi", "one two three four five"], ("--max-new-tokens", "12", "--max-total-tokens", "26")
    alone = []
    for prompt in prompts:
        out, _ = generate_in_process(in_process_model, [prompt], *flags)
        alone.append(out.removesuffix("\n"))
    out, err = generate_in_process(in_process_model, prompts, *flags)
    assert "retraction" in err  # the case under test did happen
    assert out == "".join(f"--- prompt {i + 1} ---\n{text}\n" for i, text in enumerate(alone))


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_prompt_file_line_ends_of_every_kind_split_prompts(tmp_path, end):
    """--prompt-file takes one prompt a line whatever ends the lines: \\n, \\r\\n and a lone \\r."""
    import argparse

    from nano.generate import read_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes(end.join(["first prompt", "second one", "", "third"]).encode() + end.encode())
    prompts = read_prompts(argparse.Namespace(prompt=None, prompt_file=str(path)))
    assert prompts == ["first prompt", "second one", "third"]


def test_every_sampling_flag_reaches_the_requests(in_process_model, monkeypatch, capsys):
    """A seed that never reached the engine made `--temperature 1 --seed 5` differ every run."""
    from nano.engine import Engine
    from nano.generate import main

    params, add_request = [], Engine.add_request

    def spy(self, prompt_ids, p, stop_ids=()):
        params.append(p)
        return add_request(self, prompt_ids, p, stop_ids)

    monkeypatch.setattr(Engine, "add_request", spy)
    main(["--model", str(in_process_model), "--prompt", "hi", "--prompt", "Name a colour.", "--max-new-tokens", "3",
          "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "1234", "--ignore-eos"])
    assert len(params) == 2
    for p in params:
        assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.seed, p.ignore_eos) == (0.7, 0.9, 5, 3, 1234, True)


def test_the_same_seed_gives_the_same_sampled_text(in_process_model):
    flags = ("--max-new-tokens", "24", "--temperature", "1.5")
    outs = [generate_in_process(in_process_model, ["hi"], *flags, "--seed", seed)[0] for seed in ("5", "5", "6")]
    assert outs[0] == outs[1] != outs[2]


def test_a_streamed_completion_ends_with_one_newline(in_process_model):
    """Else the shell's prompt lands on the completion's last line."""
    out, _ = generate_in_process(in_process_model, ["hi"], "--max-new-tokens", "4")
    assert out.strip() and out.endswith("\n")  # (this completion's own text does not end with one)


def test_stats_line_counts_computed_tokens_without_the_cached_ones(capsys):
    from nano.generate import print_stats

    stats = dict(prefill_s=2.0, prefill_steps=3, prefill_tokens=1000, cached_tokens=400, decode_s=1.0,
                 decode_steps=7, decode_tokens=70, retractions=0, recomputed_tokens=0)
    print_stats(stats, 4)
    err = capsys.readouterr().err
    assert "1,000 prompt tokens, 400 from the prefix cache, 600 computed -> 4 first token(s)" in err
    assert "(300.0 tok/s)" in err and "decode: 70 more tokens" in err and "(70.0 tok/s)" in err
