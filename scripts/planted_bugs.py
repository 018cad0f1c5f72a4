"""Plant known bugs one at a time in a scratch copy of the repository and check that the tests
aimed at each one fail. A test that stays green with its bug planted checks nothing: a tiny
config that leaves a rope band empty, say, passes whatever the code does in that band.

Each bug is one text substitution, which must apply exactly once (so the list notices when the
code it names moves), and the tests that must catch it. First the union of those tests runs
with nothing planted and must pass, so a failure below is the bug's doing. Bugs whose tests need
a GPU are skipped without one. Minutes long, so not part of the test suite:

    python scripts/planted_bugs.py          # every bug
    python scripts/planted_bugs.py yarn     # the bugs whose name contains "yarn"
"""

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Bug:
    name: str
    path: str  # the file to plant it in, relative to the repository root
    old: str
    new: str
    tests: list[str]  # pytest node ids that must fail
    needs_cuda: bool = False


DEEPSEEK_MLA = "tests/test_deepseek_parity.py::test_prefill_and_decode_match_hf[lite-mla]"
PDL_RULE = "tests/test_structure.py::test_every_kernel_waits_for_its_inputs_before_touching_them"
GRAPH_CONTRACT = "tests/test_cuda_graph_runner.py::test_padding_to_the_graph_size_changes_no_choice"
BUGS = [
    Bug("llama3 rope: blend weights swapped", "nano/rope.py",
        "blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq",
        "blended = smooth * inv_freq / factor + (1 - smooth) * inv_freq",
        ["tests/test_llama_parity.py::test_prefill_and_decode_match_hf[llama3-rope]"]),
    Bug("yarn rope: ramp reversed", "nano/rope.py",
        "inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)",
        "inv_freq = inv_freq * ramp + inv_freq / factor * (1 - ramp)", [DEEPSEEK_MLA]),
    Bug("yarn rope: ramp rounded to a step (only channels on the ramp change)", "nano/rope.py",
        "/ (high - low)).clamp(0, 1)", "/ (high - low)).clamp(0, 1).round()", [DEEPSEEK_MLA]),
    Bug("yarn rope: ramp not clamped (only channels past its ends change)", "nano/rope.py",
        "/ (high - low)).clamp(0, 1)", "/ (high - low))", [DEEPSEEK_MLA]),
    Bug("yarn rope: the magnitude's two mscales the other way up (DeepSeek's are equal)", "nano/rope.py",
        'yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])',
        'yarn_mscale(factor, scaling["mscale_all_dim"]) / yarn_mscale(factor, scaling["mscale"])',
        ["tests/test_llama_parity.py::test_rope_frequencies_match_transformers[params6]"]),
    Bug("deepseek: the latent norm's weight ignored", "nano/deepseek.py",
        "latent_norm = (latent, self.kv_a_layernorm.weight,",
        "latent_norm = (latent, torch.ones_like(self.kv_a_layernorm.weight),", [DEEPSEEK_MLA]),
    Bug("deepseek: softmax scale times mscale instead of mscale squared", "nano/deepseek.py",
        'yarn_mscale(cfg.rope_scaling["factor"], mscale_all_dim) ** 2',
        'yarn_mscale(cfg.rope_scaling["factor"], mscale_all_dim)', [DEEPSEEK_MLA]),
    Bug("deepseek: routed scaling factor dropped", "nano/ops.py",
        "weights = weights * routed_scaling\n", "weights = weights\n",
        ["tests/test_deepseek_parity.py::test_moe_forms_match_hf"]),
    Bug("moe mat-vec: the down kernel sums a token's experts without their routing weights", "nano/moe_kernels.py",
        "out = tl.sum(tl.sum(acc, axis=2) * weights[:, None], axis=0)", "out = tl.sum(tl.sum(acc, axis=2), axis=0)",
        ["tests/test_moe_kernels.py::test_matvecs", "tests/test_deepseek_parity.py::test_moe_forms_match_hf"]),
    Bug("moe router: the shared experts get weight 0", "nano/moe_kernels.py",
        "weights = tl.where(is_shared, 1.0, weights)", "weights = tl.where(is_shared, weights, weights)",
        ["tests/test_moe_kernels.py::test_route"]),
    Bug("moe router: the last chunk of hidden channels left out of the logits", "nano/moe_kernels.py",
        "mask=(chunks[:, None] < num_chunks)", "mask=(chunks[:, None] < num_chunks - 1)",
        ["tests/test_moe_kernels.py::test_route"]),
    Bug("rope: the launch leaves out the norm it was given (DeepSeek's latent)", "nano/triton_ops.py",
        "(num_tokens, 2 if norm is None else 3)", "(num_tokens, 2)",
        ["tests/test_triton_ops.py::test_rope_on_deepseek_slices"]),
    Bug("moe alignment: each step of pairs placed from its expert's first row again", "nano/moe_kernels.py",
        "rank = seen + tl.cumsum(", "rank = tl.cumsum(", ["tests/test_moe_kernels.py::test_align_pairs_by_expert"]),
    Bug("moe alignment: each run's blocks named for the expert before it", "nano/moe_kernels.py",
        "tl.store(block_expert_ptr + b0 + offs, expert,", "tl.store(block_expert_ptr + b0 + offs, expert - 1,",
        ["tests/test_moe_kernels.py::test_align_pairs_by_expert"]),
    Bug("gated mat-vec: up read from the gate's rows", "nano/triton_ops.py",
        "up_offset = N * w_row_stride", "up_offset = 0", ["tests/test_triton_ops.py::test_linear_silu_and_mul"]),
    Bug("one-row linear: the bias dropped in the mat-vec", "nano/triton_ops.py",
        "y += tl.load(bias_ptr + rows", "y += 0 * tl.load(bias_ptr + rows", ["tests/test_triton_ops.py::test_linear"]),
    Bug("moe layout: the shared MLP's up rows land one expert early", "nano/deepseek.py",
        "(self.w13, (slice(half + first, half + first + width),))",
        "(self.w13, (slice(half + first - inter * (width > inter), half + first + width - inter * (width > inter)),))",
        [DEEPSEEK_MLA]),
    Bug("qwen2: the q/k/v bias dropped", "nano/model.py",
        "return ops.linear(x, self.weight, self.bias, self.split_k)", "return ops.linear(x, self.weight, None, self.split_k)",
        ["tests/test_llama_parity.py::test_prefill_and_decode_match_hf[qwen2-bias]"]),
    Bug("qwen3: the query's per-head norm skipped", "nano/model.py",
        "q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)", "q = q",
        ["tests/test_llama_parity.py::test_prefill_and_decode_match_hf[qwen3-qk-norm-tied]"]),
    Bug("scheduler: a finished request also gives back its never-written last position", "nano/scheduler.py",
        "return max(self.num_tokens - 1, self.prefilled) if", "return max(self.num_tokens, self.prefilled) if",
        ["tests/test_kv_cache.py::test_batch_equals_single_runs_and_more_prompts_than_pool",
         "tests/test_radix_cache.py"]),
    Bug("scheduler: a retracted request loses the tokens it generated", "nano/scheduler.py",
        "req.status, req.prefilled = Status.RETRACTED, 0", "req.status, req.prefilled, req.output_ids = Status.RETRACTED, 0, []",
        ["tests/test_scheduler.py"]),
    Bug("scheduler: a prompt enters the prefix cache only when its request finishes", "nano/scheduler.py",
        "        tokens = req.fill_ids[: req.prefilled]\n", "        return\n",
        ["tests/test_scheduler.py::test_samples_of_one_prompt_compute_it_once"]),
    Bug("prefix cache: a leaf used since it entered the eviction heap goes at its old age", "nano/radix_cache.py",
        "if stamp != leaf.last_used:", "if False:",
        ["tests/test_radix_cache.py::test_radix_tree_agrees_with_a_naive_reference_under_random_operations"]),
    Bug("prefix cache: a leaf left unlocked never enters the eviction heap", "nano/radix_cache.py",
        "                self.locked_size -= len(node.key)\n                self._offer(node)\n",
        "                self.locked_size -= len(node.key)\n",
        ["tests/test_radix_cache.py::test_radix_tree_agrees_with_a_naive_reference_under_random_operations"]),
    Bug("scheduler: an abort leaves a queued request in the queue", "nano/scheduler.py",
        "            self.waiting.pop(req, None)\n", "",
        ["tests/test_scheduler.py::test_a_request_that_ends_does_not_search_the_queue"]),
    Bug("cuda graphs: padded rows write K/V into slot 1, a real request's", "nano/cuda_graph_runner.py",
        'static[bs:padded_bs] = 1 if name == "seq_lens" else 0', "static[bs:padded_bs] = 1",
        ["tests/test_cuda_graph_runner.py::test_fill_copies_real_rows_and_pads_harmlessly"]),
    Bug("triton decode: splits merged with e^lse for a base-2 lse", "nano/triton_attn.py",
        "weight = tl.exp2(lse - tl.max(lse, 0))", "weight = tl.exp(lse - tl.max(lse, 0))",
        ["tests/test_triton_attn.py::test_decode_with_most_splits", "tests/test_triton_attn.py::test_gpu_decode"]),
    Bug("triton decode: a request's only split writes its output unnormalised", "nano/triton_attn.py",
        "tl.store(out_ptrs, (acc / l[:, None]).to(out.dtype.element_ty), mask=out_mask)",
        "tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=out_mask)",
        ["tests/test_triton_attn.py::test_decode_of_a_batch_that_fills_the_gpu", "tests/test_triton_attn.py::test_gpu_decode"]),
    Bug("triton decode: a request of exactly SHORT_CONTEXT tokens is served by neither launch", "nano/triton_attn.py",
        "(seq_len <= up_to)", "(seq_len < up_to)", ["tests/test_triton_attn.py::test_decode_of_a_batch_that_fills_the_gpu"]),
    Bug("triton decode: the merge projects every head's output with head 0's matrix (MLA's W_UV at batch 1)",
        "nano/triton_attn.py", "proj = tl.load(v_proj + h * stride_vph", "proj = tl.load(v_proj + 0 * stride_vph",
        ["tests/test_triton_attn.py::test_value_projection", "tests/test_triton_attn.py::test_gpu_value_projection"]),
    Bug("MLA: rope rotates q_pe in place and the query's rope channels stay unwritten", "nano/deepseek.py",
        "self.rotary(batch.positions, q_pe, k_pe, q_out=q_rope, norm=latent_norm)",
        "self.rotary(batch.positions, q_pe, k_pe, norm=latent_norm)",
        [DEEPSEEK_MLA]),
    Bug("triton attention: online softmax forgets to rescale the output", "nano/triton_attn.py",
        "acc = acc * rescale[:, None] + tl.dot(", "acc = acc + tl.dot(",
        ["tests/test_triton_attn.py::test_extend", "tests/test_triton_attn.py::test_gpu_extend"]),
    Bug("triton kernels: dots in TF32 for float32 inputs", "nano/triton_ops.py",
        'return "ieee" if dtype == torch.float32 else "tf32"', 'return "tf32"',
        ["tests/test_triton_e2e.py::test_float32_triton_equals_torch_on_gpu"], needs_cuda=True),
    Bug("PDL: the mat-vec reads its input before the kernel before it has finished", "nano/triton_ops.py",
        "    wait_for_inputs()\n    x = _load_tile(x_ptr + cols, cols < K, WHOLE_TILES).to(tl.float32)[None, :]\n",
        "    x = _load_tile(x_ptr + cols, cols < K, WHOLE_TILES).to(tl.float32)[None, :]\n    wait_for_inputs()\n",
        [PDL_RULE]),
    Bug("PDL: the KV store reads the new keys before the kernel before it has finished", "nano/triton_attn.py",
        "    wait_for_inputs()\n    h = tl.arange(0, BLOCK_H)[:, None]\n",
        "    h = tl.arange(0, BLOCK_H)[:, None]\n    k_first = tl.load(k + t * stride_kt)\n    wait_for_inputs()\n",
        [PDL_RULE]),
    Bug("PDL: rope rotates the query before the kernel before it has finished", "nano/triton_ops.py",
        "    wait_for_inputs()\n    if part == 0:\n",
        "    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, q_out_ptr + token * q_out_token_stride,\n"
        "                  q_out_head_stride, num_q_heads, cos, sin, HALF, HALF_BLOCK, Q_HEADS_BLOCK)\n"
        "    wait_for_inputs()\n    if part == 0:\n",
        [PDL_RULE]),
    Bug("PDL: the norm never waits for its input", "nano/triton_ops.py",
        "    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)\n    wait_for_inputs()\n",
        "    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)\n",
        [PDL_RULE, "tests/test_triton_ops.py::test_gpu_kernels_started_early_wait_for_their_inputs"], needs_cuda=True),
    Bug("graph contract: attention split cap from the raw batch size, not its bucket", "nano/triton_attn.py",
        "batch_bucket(bs) * self.num_kv_heads", "bs * self.num_kv_heads", [GRAPH_CONTRACT]),
    Bug("graph contract: MoE form from the raw token count, not its bucket", "nano/deepseek.py",
        "batch_bucket(num_tokens) * slots", "num_tokens * slots", [GRAPH_CONTRACT]),
    Bug("graph contract: replay pads to a power of two, not the bucket", "nano/cuda_graph_runner.py",
        "bs, padded_bs = batch.batch_size, batch_bucket(batch.batch_size)",
        "bs, padded_bs = batch.batch_size, 1 << (batch.batch_size - 1).bit_length()", [GRAPH_CONTRACT]),
    Bug("moe router: softmax without the row's max taken out (inf / inf past logits of 88)", "nano/moe_kernels.py",
        "scores = tl.exp(logits - tl.max(logits, 0))", "scores = tl.exp(logits)",
        ["tests/test_moe_kernels.py::test_route_softmax_survives_logits_past_float32_exp_range"]),
    Bug("serve: a completion's text decoded without its prompt as context", "nano/serve.py",
        "Detokenizer(state.tokenizer, [] if chat else s.prompt_ids, stop)", "Detokenizer(state.tokenizer, [], stop)",
        ["tests/test_server.py::test_a_completion_continues_its_prompts_text_under_a_sentencepiece_tokenizer"]),
    Bug("serve: a second Ctrl-C left to uvicorn's force quit", "nano/serve.py",
        "if server.should_exit and sig == signal.SIGINT:", "if False:",
        ["tests/test_server.py::test_a_stop_finishes_the_request_in_flight_and_a_second_ctrl_c_cuts_it_off"]),
    Bug("config: an absent context takes Llama's 2,048 in every family (Mistral's is 131,072, Qwen's 32,768)",
        "nano/config.py", "LLAMA_DEFAULTS | FAMILY_DEFAULTS.get(arch, {}) | raw", "LLAMA_DEFAULTS | raw",
        ["tests/test_config.py::test_keys_absent_take_the_config_class_defaults"]),
    Bug("serve: a chat's max_completion_tokens past the context refused as max_tokens", "nano/serve.py",
        'field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"',
        'field = "max_tokens"', ["tests/test_server.py::test_bad_input_gets_an_error_and_the_server_goes_on"]),
]


def scratch_copy(into: Path) -> Path:
    repo = into / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", "weights", "__pycache__", ".pytest_cache"))
    return repo


def planted(bug: Bug, repo: Path) -> str:
    """The text of bug.path in repo with the bug in it; exits if its substitution no longer applies."""
    text = (repo / bug.path).read_text()
    count = text.count(bug.old)
    if count != 1:
        sys.exit(f"{bug.name}: {bug.path} holds {bug.old!r} {count} times, not once: update this list")
    return text.replace(bug.old, bug.new)


def pytest_exit_code(repo: Path, tests: list[str]) -> int:
    """0: all passed (or skipped), 1: some failed; anything else (collection error, no such test) is
    neither a pass nor a catch."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=repo, capture_output=True).returncode


def main():
    wanted = sys.argv[1:]
    bugs = [b for b in BUGS if not wanted or any(w in b.name for w in wanted)]
    if not bugs:  # (not the whole suite, which pytest runs when given no tests)
        sys.exit(f"no bug's name contains {' or '.join(map(repr, wanted))}; the bugs:\n"
                 + "\n".join(b.name for b in BUGS))
    for bug in bugs:  # every substitution checked before minutes of tests, not when its turn comes
        planted(bug, ROOT)
    runnable = [b for b in bugs if torch.cuda.is_available() or not b.needs_cuda]
    tests = sorted({t for b in runnable for t in b.tests})
    with tempfile.TemporaryDirectory() as tmp:
        code = pytest_exit_code(scratch_copy(Path(tmp)), tests) if tests else 0  # no tests: the whole suite
        if code != 0:
            sys.exit(f"the tests fail (pytest exit code {code}) with nothing planted: fix them first")
    missed = 0
    for bug in bugs:
        if bug not in runnable:
            print(f"skipped (needs CUDA)  {bug.name}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            repo = scratch_copy(Path(tmp))
            (repo / bug.path).write_text(planted(bug, repo))
            code = pytest_exit_code(repo, bug.tests)
        missed += code != 1
        note = "" if code in (0, 1) else f" (pytest exit code {code})"
        print(f"{'caught' if code == 1 else 'NOT CAUGHT':20}  {bug.name}{note}", flush=True)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
