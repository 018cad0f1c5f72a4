"""What programmatic dependent launch (PDL, triton_ops.py) saves per kernel in a CUDA graph of
small kernels, and whether the experts' down matrix (moe_kernels.py) reads faster contiguous than
as nano's strided view. Usage, from the repository root on a Hopper GPU: python scripts/pdl_probe.py

Two chains are replayed as one CUDA graph each, in up to four variants: PDL off; kernels launched
with PDL that wait first thing; that, plus the early trigger (`launch_dependents()` first thing);
that, plus the mat-vec's first weight tile loaded before the wait. Chain 1: 200 RMSNorm-like
kernels on one 2,048-wide row. Chain 2: 120 pairs of such a norm and a one-row mat-vec of 8 or
15 MB (DeepSeek-V2-Lite's o_proj and fused q/latent projection), every weight different, so cold
in L2. Every variant's result is checked equal to PDL off's first.
"""

import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, ".")
from nano import moe_kernels  # noqa: E402

HIDDEN = 2048
VARIANTS = [("off", False, False, False), ("pdl", True, False, False), ("pdl+early", True, True, False),
            ("pdl+early+prefetch", True, True, True)]  # (name, PDL, early trigger, first tile before the wait)


@triton.jit
def _norm(x_ptr, w_ptr, out_ptr, N: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    cols = tl.arange(0, N)
    if EARLY:
        gdc_launch_dependents()
    w = tl.load(w_ptr + cols).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + cols).to(tl.float32)
    tl.store(out_ptr + cols, (x * tl.rsqrt(tl.sum(x * x, 0) / N + 1e-6) * w).to(out_ptr.dtype.element_ty))


@triton.jit
def _matvec(x_ptr, w_ptr, out_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PDL: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    if EARLY:
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    start = 0
    if PREFETCH:
        first = tl.load(w_tile).to(tl.float32)
        gdc_wait()
        acc += first * tl.load(x_ptr + cols).to(tl.float32)[None, :]
        start = BLOCK_K
    elif PDL:
        gdc_wait()
    for k0 in range(start, K, BLOCK_K):
        acc += tl.load(w_tile + k0).to(tl.float32) * tl.load(x_ptr + k0 + cols).to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty))


def norm(x, w, out, pdl, early):
    _norm[(1,)](x, w, out, N=x.numel(), PDL=pdl, EARLY=early, launch_pdl=pdl)


def matvec(x, w, out, pdl, early, prefetch):
    _matvec[(w.shape[0] // 4,)](x, w, out, K=w.shape[1], BLOCK_N=4, BLOCK_K=1024, PDL=pdl, EARLY=early,
                                PREFETCH=prefetch, num_warps=4, launch_pdl=pdl)


def graph_us(run, per: int) -> float:
    """Microseconds per `per` of one graph replay of run(), the best of 5 rounds of 10 replays."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 10 * 1e3 / per)
    return best


def pdl_chains():
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    norm_weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2048, HIDDEN, device="cuda", dtype=torch.bfloat16) / 30
    results = []
    for _, pdl, early, prefetch in VARIANTS:
        out = torch.empty_like(x)
        matvec(x, weight, out, pdl, early, prefetch)
        norm(out, norm_weight, y, pdl, early)
        results.append(y.clone())
    assert all(torch.equal(r, results[0]) for r in results)

    for name, pdl, early, _ in VARIANTS[:3]:
        def chain(pdl=pdl, early=early):
            a, b = x, y
            for _ in range(200):
                norm(a, norm_weight, b, pdl, early)
                a, b = b, a
        print(f"norm chain x200, {name}: {graph_us(chain, 200):.2f} us a kernel")

    shapes = [(2048, HIDDEN), (3648, HIDDEN)]
    weights = [[torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 30 for shape in shapes] for _ in range(60)]
    buffers = [torch.randn(1, 3648, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for name, pdl, early, prefetch in VARIANTS:
        def chain(pdl=pdl, early=early, prefetch=prefetch):
            for layer in weights:
                for w in layer:  # a norm, then a mat-vec of its output, as a layer's attention input
                    norm(buffers[0][:, :HIDDEN], norm_weight, buffers[1][:, :HIDDEN], pdl, early)
                    matvec(buffers[1][:, :HIDDEN], w, buffers[0][:, :w.shape[0]], pdl, early, prefetch)
        print(f"norm + mat-vec chain x120, {name}: {graph_us(chain, 120):.2f} us a pair")


def down_layouts():
    """One token's down_matvec over 26 layers' experts (6 routed, 2 shared), by tile and layout."""
    experts, inter, layers = 66, 1408, 26
    strided = [torch.randn(HIDDEN, experts * inter, device="cuda", dtype=torch.bfloat16).view(
        HIDDEN, experts, inter).transpose(0, 1) / 30 for _ in range(layers)]
    contiguous = [w.contiguous() for w in strided]
    ids = torch.cat([torch.randperm(64, device="cuda")[:6], torch.tensor([64, 65], device="cuda")]).view(1, 8)
    pair_weights = torch.rand(1, 8, device="cuda")
    h = torch.randn(1, 8, inter, device="cuda", dtype=torch.bfloat16)
    megabytes = 8 * HIDDEN * inter * 2 / 1e6
    for tiles in [(16, 128), (8, 256), (4, 512), (16, 256), (8, 512), (2, 1024)]:
        moe_kernels.ONE_TOKEN_DOWN_TILE = (*tiles, 4)
        for label, stacks in (("strided", strided), ("contiguous", contiguous)):
            def run(stacks=stacks):
                for down in stacks:
                    moe_kernels.down_matvec(h, down, ids, pair_weights)
            us = graph_us(run, layers)
            print(f"down {tiles} {label}: {us:.2f} us ({megabytes / us:.2f} TB/s)")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    pdl_chains()
    down_layouts()
