"""What would removing a launch, or changing a kernel choice, save in a real decode step? Runs
`nano.bench_latency` (or `--bench throughput`: `nano.bench_throughput`; `--bench profile`:
scripts/profile_decode.py) with parts of the step patched out or changed. Removals make the tokens
wrong on purpose: only the timings mean anything.
Several removals at once (no-store,no-rope,no-silu,no-norm) ended in a device-side assert on an
H200: the sampled ids left the vocabulary.

    python scripts/decode_ablation.py VARIANT[,VARIANT...] -- BENCH_ARGS
    python scripts/decode_ablation.py no-merge,no-router -- --model deepseek-v2-lite --load-format dummy --batch-size 1
    python scripts/decode_ablation.py gqa-tile=16.2.3 --bench throughput -- --model llama-3-8b --load-format dummy

Variants: none (as is); no-merge (decode attention's merge kernel); no-store (the KV store);
no-attention (store, split and merge); no-long (decode attention's launch for requests over 256
tokens, empty in a batch of shorter ones, whose tokens stay right); long-aside (that launch on a
second stream, beside the short requests' launch); residual-in-matmul (no norm launches in the
layers, each residual add as cuBLAS's beta = 1 on o_proj and down_proj, whose weights are scaled by
1/64 so the stream stays in bf16's range: what folding the norms into the matmuls could save at
most); no-rope (Llama's rope launch); no-silu (SiLU-and-mul: down reads the gate half of gate/up's
output); no-norm (every residual add + RMSNorm launch: a norm hands on its input, of a split-K
linear the first half); no-latent-norm (MLA's norm of the 512-wide latent, the third program of
rope's launch); no-router (DeepSeek's router, replaced by fixed expert ids); cublaslt-96 (linear
layers of 2-96 rows through cuBLASLt instead of cuBLAS); cublaslt=OUTxIN@ROWS+... (the weights of
those shapes at those row counts through cuBLASLt, e.g. cublaslt=4096x4096@160); lt-fastest (gate/up
and lm_head through the fastest of the kernels cuBLASLt's heuristic lists, timed at each row count's
first call: scripts/cublaslt_probe.py); gqa-tile=BLOCK_N.WARPS.STAGES (decode attention's tile for
128-wide heads, every batch size). Run on a GPU (BENCHMARKS.md, fifth, tenth, fourteenth,
seventeenth and eighteenth rounds).
"""

import ctypes
import importlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import nano.deepseek as deepseek  # noqa: E402
import nano.model as model  # noqa: E402
import nano.triton_attn as triton_attn  # noqa: E402
import nano.triton_ops as triton_ops  # noqa: E402


class _Skipped:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _ShortOnly:
    """Decode stage 1 without the long requests' launch, which a batch of short requests leaves empty."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        # args[10] is the launch's `longer_than`: SHORT_CONTEXT marks the long requests' launch
        return lambda *args, **kwargs: None if args[10] == triton_attn.SHORT_CONTEXT else launch(*args, **kwargs)


class SideStream:
    """Fork a piece of work off the current stream; join it later (in a CUDA graph too)."""

    def __init__(self):
        self.stream, self.forked = None, False

    def fork(self, work):
        self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            work()
        self.forked = True

    def join(self):
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


class _LongAside:
    """Decode stage 1's long requests' launch on a second CUDA stream, beside the short requests'
    launch: forked after the KV store, joined after the short launch (a graph records both edges)."""

    def __init__(self, kernel):
        self.kernel, self.side = kernel, SideStream()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            if args[10] == triton_attn.SHORT_CONTEXT:  # `longer_than`: the long requests' launch
                self.side.fork(lambda: launch(*args, **kwargs))
                return
            launch(*args, **kwargs)
            if args[11] == triton_attn.SHORT_CONTEXT:  # `up_to`: the short requests' launch, the last
                self.side.join()
        return run


def _cublaslt_where(chosen):
    """Linears for which chosen(rows, weight shape) is true run in cuBLASLt, the others in cuBLAS."""
    def linear(x, weight, bias=None):
        library = "cublaslt" if chosen(x.numel() // x.shape[-1], tuple(weight.shape)) else "cublas"
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return F.linear(x, weight, bias)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    one_row_linear, one_row_gated = triton_ops.linear, triton_ops.linear_silu_and_mul
    triton_ops.linear = lambda x, w, b=None, split_k=False: (one_row_linear(x, w, b) if x.dim() == 2 and x.shape[0] == 1
                                                            else linear(x, w, b))
    triton_ops.linear_silu_and_mul = lambda x, w: (one_row_gated(x, w) if x.shape[0] == 1
                                                   else triton_ops.silu_and_mul(linear(x, w)))


def _lt_fastest():
    """gate/up and lm_head at 2+ rows through the fastest of cuBLASLt's candidates, chosen by CUDA
    events around ten eager calls each, at the first call of each (rows, weight shape)."""
    import cublaslt_probe as probe

    lt, handle, chosen = probe.load_cublaslt(), ctypes.c_void_p(), {}
    probe.check(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    workspace = torch.empty(probe.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    def fastest(x, weight):
        problem = probe.Problem(lt, handle, x.shape[0], weight.shape[0], weight.shape[1], w_as_m=True)
        out, timed = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype), []
        for heuristic in problem.heuristics(16):
            run = problem.runner(heuristic, workspace)
            try:
                run(x, weight, out)
            except RuntimeError:  # a candidate that fails to run is not a candidate
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                run(x, weight, out)
            end.record()
            torch.cuda.synchronize()
            timed.append((start.elapsed_time(end), len(timed), run))
        best = min(timed)
        print(f"lt-fastest: rows {x.shape[0]}, weight {tuple(weight.shape)}: candidate #{best[1]} of {len(timed)}, "
              f"{best[0] * 100:.1f} us against the first's {timed[0][0] * 100:.1f}", flush=True)
        return best[2]

    def linear(x, weight):
        key = (x.shape[0], *weight.shape)
        if key not in chosen:  # the eager warm-up before capture comes here first
            chosen[key] = fastest(x, weight)
        out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
        chosen[key](x, weight, out)
        return out

    one_row_linear, one_row_gated = triton_ops.linear, triton_ops.linear_silu_and_mul
    triton_ops.linear_silu_and_mul = lambda x, w: (one_row_gated(x, w) if x.shape[0] == 1
                                                   else triton_ops.silu_and_mul(linear(x, w)))
    triton_ops.linear = lambda x, w, b=None, split_k=False: (linear(x, w) if w.shape[0] > 100_000 and x.dim() == 2
                                                            and x.shape[0] > 1 else one_row_linear(x, w, b, split_k))


def _fixed_router():
    cache = {}

    def route(moe, x):
        if x.shape[0] not in cache:  # built on the eager warm-up, before any graph capture
            ids = torch.arange(moe.top_k + moe.num_shared, device=x.device).repeat(x.shape[0], 1)
            ids[:, moe.top_k:] += moe.num_experts - moe.top_k  # the shared experts
            cache[x.shape[0]] = (torch.ones(ids.shape, device=x.device), ids)
        return cache[x.shape[0]]

    deepseek.MoE.route = route


def _no_norm(x, residual, weight, eps):
    x = x[0] if x.dim() == 3 else x  # a split-K linear's first half
    return x, x if residual is None else residual


def _residual_in_matmul():
    """An upper bound on folding each RMSNorm into the matmul after it (its weight into the
    matmul's columns, 1/rms into the kernel after the matmul): no norm launches in the layers, and
    each residual add done by cuBLAS as the matmul's beta = 1 (o_proj and down_proj without their
    split-K halves). The 1/rms scaling is left out, so the tokens are wrong."""
    residual_stream = [None]  # what the next split-K linear adds its product to
    scaled, plain_forward = set(), model.Linear.forward

    def linear_forward(self, x):
        if self.split_k and x.shape[0] > 1:
            if id(self) not in scaled:  # at the first (eager) call: without its norms the stream overflowed bf16
                self.weight.mul_(1 / 64)
                scaled.add(id(self))
            return torch.addmm(residual_stream[0], x, self.weight.t())
        return plain_forward(self, x)

    def layer_forward(self, x, residual, batch, attn):
        residual_stream[0] = x
        residual_stream[0] = self.self_attn(x, batch, attn)
        h = self.mlp(residual_stream[0])
        return h, h  # the final norm adds them: its rms is the same

    model.Linear.forward, model.DecoderLayer.forward = linear_forward, layer_forward


def apply(variant: str):
    name, _, value = variant.partition("=")
    if name in ("no-merge", "no-attention"):
        triton_attn._decode_merge_kernel = _Skipped()
    if name in ("no-store", "no-attention"):
        triton_attn._store_kv_kernel = _Skipped()
    if name == "no-attention":
        triton_attn._decode_split_kernel = _Skipped()
    if name == "no-long":
        triton_attn._decode_split_kernel = _ShortOnly(triton_attn._decode_split_kernel)
    if name == "residual-in-matmul":
        _residual_in_matmul()
    if name == "long-aside":
        triton_attn._decode_split_kernel = _LongAside(triton_attn._decode_split_kernel)
    if name == "no-rope":
        triton_ops.apply_rope_ = lambda *args, **kwargs: None
    if name == "no-silu":  # cuBLAS's gate/up as before, then its gate half as a strided view: no launch
        gated = triton_ops.linear_silu_and_mul
        triton_ops.linear_silu_and_mul = lambda x, w: (gated(x, w) if x.shape[0] == 1
                                                       else F.linear(x, w)[:, : w.shape[0] // 2])
    if name == "no-norm":
        triton_ops.fused_add_rms_norm = _no_norm
    if name == "no-latent-norm":  # rope's launch without its third program
        rope = triton_ops.apply_rope_
        triton_ops.apply_rope_ = lambda q, k, cos_sin, positions, q_out=None, norm=None: rope(q, k, cos_sin,
                                                                                             positions, q_out)
    if name == "no-router":
        _fixed_router()
    if name == "cublaslt-96":
        _cublaslt_where(lambda rows, shape: rows <= 96)
    if name == "cublaslt":  # cublaslt=OUTxIN@ROWS+...: those weights at those row counts
        pairs = {(int(rows), *(int(n) for n in shape.split("x"))) for shape, rows in
                 (pair.split("@") for pair in value.split("+"))}
        _cublaslt_where(lambda rows, shape: (rows, *shape) in pairs)
    if name == "lt-fastest":
        _lt_fastest()
    if name == "gqa-tile":
        tile, config = tuple(int(v) for v in value.split(".")), triton_attn._decode_config
        triton_attn._decode_config = lambda k_dim: (*tile, 8) if k_dim <= 128 else config(k_dim)
        triton_attn.SHORT_TILE = tile  # for every request
    if name not in ("none", "no-merge", "no-store", "no-attention", "no-long", "long-aside", "residual-in-matmul",
                    "no-rope", "no-silu", "no-norm", "no-latent-norm", "no-router", "cublaslt-96", "cublaslt",
                    "lt-fastest", "gqa-tile"):
        sys.exit(f"unknown variant {variant!r}")


def main(apply_variant=apply):
    """VARIANT[,VARIANT...] [--bench BENCH] -- BENCH_ARGS; apply_variant takes one variant (l2_prefetch.py
    brings its own)."""
    split = sys.argv.index("--")
    options, bench_args = sys.argv[1:split], sys.argv[split + 1:]
    bench = options[options.index("--bench") + 1] if "--bench" in options else "latency"
    variants = options[0].split(",")
    for variant in variants:
        apply_variant(variant)
    print(f"variants: {', '.join(variants)}", flush=True)
    if bench == "profile":  # profile_decode.py beside this file, with the arguments after "--"
        sys.argv = ["profile_decode.py", *bench_args]
        importlib.import_module("profile_decode").main()
    else:
        importlib.import_module(f"nano.bench_{bench}").main(bench_args)


if __name__ == "__main__":
    main()
