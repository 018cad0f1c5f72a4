"""The Triton attention kernels against the torch reference backend, on the same KV pool.

Every test builds a pool of random K/V (slot 0, which no request owns, is filled with NaN, and so
are table entries past a request's length, which point at slot 0), gives each request a random row
of req_to_token and shuffled slots, and runs both backends on the same batch. The Triton backend's
partial-result buffers and fresh allocations are poisoned with NaN first, so anything a kernel
reads that it did not write, or fails to write, shows up. On CPU the kernels run in Triton's
interpreter at small sizes in float32/float16; the GPU tests run at real sizes in bfloat16 and
check that the decode path replays in a CUDA graph.
"""

import contextlib
import os
import random
from dataclasses import dataclass

import pytest
import torch

from nano.config import ModelConfig
from nano.forward_batch import ForwardBatch, batch_bucket
from nano.kv_cache import KVPool
from nano.torch_attn import TorchAttnBackend
from nano.triton_attn import TritonAttnBackend
from tests.helpers import gpu, nan_allocations

LAYER = 1  # pools have two layers: the kernels must read the one they are given
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Compiled Triton kernels cannot read CPU tensors: the small tests need the interpreter, which
# conftest switches on where there is no GPU (on a GPU machine the gpu tests cover the kernels).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    k_dim: int
    v_dim: int
    mla: bool = False

    def __str__(self):
        return f"{self.num_heads}q{self.num_kv_heads}kv-{self.k_dim}x{self.v_dim}{'-mla' if self.mla else ''}"


def model_config(shape: Shape) -> ModelConfig:
    """A config whose KV pool has this shape: Llama for k_dim == v_dim, else DeepSeek-V2."""
    deepseek = shape.k_dim != shape.v_dim
    cfg = ModelConfig(
        architecture="DeepseekV2ForCausalLM" if deepseek else "LlamaForCausalLM",
        vocab_size=256, hidden_size=256, num_layers=2, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.k_dim, intermediate_size=512, rms_norm_eps=1e-6,
        max_position_embeddings=65536, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
        bos_token_id=None,
    )
    if deepseek:  # DeepSeek caches every head (expanded) or one [latent | rope] row (MLA)
        cfg.v_head_dim = shape.v_dim
        cfg.kv_lora_rank, cfg.qk_rope_head_dim = shape.v_dim, shape.k_dim - shape.v_dim
    return cfg


@dataclass
class Scene:
    """A filled pool, a batch over it, and the new tokens' q/k/v."""
    shape: Shape
    pool: KVPool
    req_to_token: torch.Tensor
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def scale(self) -> float:
        return self.shape.k_dim ** -0.5

    def reference(self, v_proj: torch.Tensor | None = None) -> torch.Tensor:
        ref = TorchAttnBackend(self.pool, self.req_to_token)
        return ref.forward(self.q, self.k, self.v, LAYER, self.batch, self.scale, v_proj)

    def triton_backend(self, max_batch_size: int | None = None) -> TritonAttnBackend:
        bs = self.batch.seq_lens.shape[0]
        return TritonAttnBackend(self.pool, self.req_to_token, max_batch_size or bs, self.shape.num_heads)


def build_scene(shape: Shape, dtype, device, prefix_lens: list[int], extend_lens: list[int], decode: bool,
                seed: int = 0) -> Scene:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    num_slots = 1 + sum(seq_lens) + 37  # the spare slots hold random K/V that no request owns
    pool = KVPool(model_config(shape), num_slots, dtype, device, shape.mla)
    for buf in pool.k_buffers + ([] if shape.mla else pool.v_buffers):
        buf.normal_()
        buf[0] = float("nan")  # slot 0 is reserved: reading it unmasked poisons the output

    num_rows = len(seq_lens) + 5
    req_to_token = torch.zeros(num_rows, max(seq_lens) + 9, dtype=torch.int32, device=device)
    rows = rng.sample(range(num_rows), len(seq_lens))
    slots = (torch.randperm(num_slots - 1, device=device) + 1).to(torch.int32)  # never slot 0
    new_slots, used = [], 0
    for row, prefix, seq_len in zip(rows, prefix_lens, seq_lens):
        req_to_token[row, :seq_len] = slots[used : used + seq_len]
        new_slots.append(req_to_token[row, prefix:seq_len])
        used += seq_len
    out_cache_loc = torch.cat(new_slots)

    num_tokens = sum(extend_lens)
    if decode:
        batch = ForwardBatch.decode([0] * num_tokens, seq_lens, rows, out_cache_loc, device)
    else:
        batch = ForwardBatch.extend([0] * num_tokens, prefix_lens, extend_lens, rows, out_cache_loc, device)

    def rand(heads, dim):
        return torch.randn(num_tokens, heads, dim, dtype=dtype, device=device)

    k = rand(shape.num_kv_heads, shape.k_dim)
    v = k[..., : shape.v_dim] if shape.mla else rand(shape.num_kv_heads, shape.v_dim)  # MLA: a view, as deepseek.py's
    return Scene(shape, pool, req_to_token, batch, rand(shape.num_heads, shape.k_dim), k, v)


def run_triton(scene: Scene, backend: TritonAttnBackend, v_proj: torch.Tensor | None = None) -> torch.Tensor:
    backend.partial_out.fill_(float("nan"))
    backend.partial_lse.fill_(float("nan"))
    # (on CPU, switching deterministic mode on costs seconds of imports; fresh CPU pages are zeros)
    with nan_allocations() if scene.q.is_cuda else contextlib.nullcontext():
        backend.init_forward_metadata(scene.batch)
        return backend.forward(scene.q, scene.k, scene.v, LAYER, scene.batch, scene.scale, v_proj)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, tol: float):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "the kernel left or produced NaN"
    err = (out.float() - ref.float()).abs().max().item()
    size = ref.float().abs().max().item()
    assert err <= tol * size, f"max abs error {err:.3g} vs max |ref| {size:.3g}: relative {err / size:.3g} > {tol}"


def check(shape, dtype, device, prefix_lens, extend_lens, decode, seed=0, max_batch_size=None):
    scene = build_scene(shape, dtype, device, prefix_lens, extend_lens, decode, seed)
    # What the pool must hold afterwards: the new K/V in their slots, every other slot untouched.
    loc = scene.batch.out_cache_loc.long()
    caches = [(scene.pool.k_buffers[LAYER], scene.k)] + ([] if shape.mla else [(scene.pool.v_buffers[LAYER], scene.v)])
    expected = []
    for cache, new in caches:
        expected.append(cache.clone())
        expected[-1][loc] = new

    out = run_triton(scene, scene.triton_backend(max_batch_size))
    for (cache, _), want in zip(caches, expected):
        assert torch.equal(cache[1:], want[1:])  # slot 0 holds NaN, which never compares equal
    assert_matches(out, scene.reference(), TOLERANCE[dtype])


def random_lens(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(n)]


# ---------------------------------------------------------------- CPU (interpreter), small sizes

# GQA ratios 1, 3, 4 and 8, head dims 64/128, DeepSeek's 192-wide keys with 128-wide values, and
# MLA: 16 heads on one 576-wide latent row whose first 512 channels are the value. The interpreter
# pays per operation, so sizes are small and each shape runs one kernel in float32 and the other
# in float16.
CPU_SHAPES = [
    Shape(2, 2, 64, 64), Shape(6, 2, 64, 64), Shape(8, 2, 128, 128), Shape(8, 1, 64, 64),
    Shape(2, 2, 192, 128), Shape(16, 1, 576, 512, mla=True),
]
EXTEND_DTYPES = [torch.float16, torch.float32] * 3
EXTEND_CASES = list(zip(CPU_SHAPES, EXTEND_DTYPES))
DECODE_CASES = list(zip(CPU_SHAPES, reversed(EXTEND_DTYPES)))


@interpreted
@pytest.mark.parametrize("shape, dtype", EXTEND_CASES, ids=str)
def test_extend(shape, dtype):
    # A prefix longer than a key tile, a request without prefix, a one-token extend.
    check(shape, dtype, "cpu", prefix_lens=[40, 0, 5], extend_lens=[30, 9, 1], decode=False)


@interpreted
@pytest.mark.parametrize("shape, dtype", [(Shape(2, 2, 64, 64), torch.float32), (Shape(2, 2, 192, 128), torch.float16)],
                         ids=str)
def test_extend_across_query_blocks(shape, dtype):
    check(shape, dtype, "cpu", prefix_lens=[0, 70], extend_lens=[140, 150], decode=False, seed=1)


@interpreted
@pytest.mark.parametrize("shape, dtype", DECODE_CASES, ids=str)
def test_decode(shape, dtype):
    # Several splits, one, and a split edge (splits are 64 KB of K/V per KV head: 64 to 256
    # tokens here); the backend is sized for a larger batch than this one.
    seq_lens = [600, 1, 129]
    check(shape, dtype, "cpu", [n - 1 for n in seq_lens], [1] * len(seq_lens), decode=True, max_batch_size=8)


@interpreted
def test_decode_with_most_splits():
    # 8196 tokens: 64 splits of 129, each a whole 128-token tile and a one-token tile
    check(Shape(8, 1, 128, 128), torch.float32, "cpu", [8195], [1], decode=True, seed=2)


@interpreted
@pytest.mark.parametrize("cap", [1, 2])
@pytest.mark.parametrize("shape, dtype", [(Shape(8, 2, 128, 128), torch.float16), (CPU_SHAPES[-1], torch.float32)],
                         ids=str)
def test_decode_of_a_batch_that_fills_the_gpu(shape, dtype, cap):
    # A split cap of 1 or 2, as a large batch has (forced here by lowering the programs wanted):
    # with 1 each program writes the output itself, without the merge, and (128-wide heads) requests
    # of up to SHORT_CONTEXT (256) tokens run in a launch of their own. The partial buffers hold NaN.
    scene = build_scene(shape, dtype, "cpu", [599, 0, 255, 256], [1] * 4, decode=True)
    backend = scene.triton_backend()
    backend.target_programs = cap * batch_bucket(4) * shape.num_kv_heads
    assert backend.split_cap(4) == cap
    assert_matches(run_triton(scene, backend), scene.reference(), TOLERANCE[dtype])


def check_value_projection(dtype, device, seq_lens: list[int], decode: bool, cap: int | None = None):
    """MLA's W_UV, each head's [P, 512] matrix times its output: in the merge (decode at batch 1,
    split) or after attention (the rest), against the torch backend's batched matmul. P = 24 rows:
    one whole block of the merge's rows and a part of one."""
    shape = CPU_SHAPES[-1] if device == "cpu" else MLA
    extend_lens = [1] * len(seq_lens) if decode else [min(n, 7) for n in seq_lens]
    scene = build_scene(shape, dtype, device, [n - e for n, e in zip(seq_lens, extend_lens)], extend_lens, decode)
    v_proj = torch.randn(shape.num_heads, 24 + 2, shape.v_dim, dtype=dtype, device=device)[:, 1:-1]  # strided rows
    v_proj /= shape.v_dim**0.5
    backend = scene.triton_backend(max_batch_size=16)
    if cap is not None:  # as a batch that fills the GPU: no merge, so the matmul after it
        backend.target_programs = cap * batch_bucket(len(seq_lens)) * shape.num_kv_heads
    assert_matches(run_triton(scene, backend, v_proj), scene.reference(v_proj), TOLERANCE[dtype])


@interpreted
@pytest.mark.parametrize("decode, seq_lens, cap", [(True, [300], None), (True, [300], 1),
                                                   (True, [60, 1, 40], None), (False, [50, 7], None)],
                         ids=["in the merge", "no merge", "a batch past the merge's", "extend"])
def test_value_projection(decode, seq_lens, cap):
    check_value_projection(torch.float32, "cpu", seq_lens, decode, cap)


def test_num_kv_splits_grow_with_length_and_shrink_with_batch():
    shape = Shape(32, 8, 128, 128)
    seq_lens = [1, 128, 129, 1000, 5000]
    scene = build_scene(shape, torch.float16, "cpu", [n - 1 for n in seq_lens], [1] * 5, decode=True)
    backend = scene.triton_backend(max_batch_size=256)
    backend.init_forward_metadata(scene.batch)
    # one split per 128-token tile, capped at 8 * 132 SM programs // (8 * 8 KV heads) = 16:
    # the batch of 5 counts as 8, the power of two a CUDA graph would pad it to at most
    assert backend.num_kv_splits[:5].tolist() == [1, 1, 2, 8, 16]

    many = ForwardBatch.decode([0] * 256, [5000] * 256, [0] * 256, torch.zeros(256, dtype=torch.int32), "cpu")
    backend.init_forward_metadata(many)
    assert backend.num_kv_splits.tolist() == [1] * 256  # 256 * 8 programs fill the GPU twice over

    # MLA: one 32-token tile a split at least, and splits that fill one wave of 2 * 132 programs
    mla = build_scene(Shape(16, 1, 576, 512, mla=True), torch.float16, "cpu", [n - 1 for n in seq_lens], [1] * 5,
                      decode=True).triton_backend(max_batch_size=256)
    mla.init_forward_metadata(scene.batch)
    assert mla.num_kv_splits[:5].tolist() == [1, 4, 5, 32, 33]  # cap 264 // 8 = 33
    assert [mla.split_cap(bs) for bs in (1, 32, 128, 160)] == [64, 8, 2, 1]


def poison_unowned_slots(scene):
    """NaN into every pool slot that no request of the batch owns (another request's, or one that
    overflowed): attention must read a request's own slots only, lanes past a key included."""
    owned = torch.zeros(scene.pool.k_buffers[0].shape[0], dtype=torch.bool)
    for row, seq_len in zip(scene.batch.req_pool_indices.tolist(), scene.batch.seq_lens.tolist()):
        owned[scene.req_to_token[row, :seq_len].long()] = True
    for buf in scene.pool.k_buffers + ([] if scene.shape.mla else scene.pool.v_buffers):
        buf[~owned] = float("nan")
    assert (~owned[1:]).any()


def nan_padded(t: torch.Tensor) -> torch.Tensor:
    """t as a view of a wider tensor whose extra channels hold NaN (q and k are views into wider
    projections in the models): lanes past a head must never be read."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), float("nan"), dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


@interpreted
@pytest.mark.parametrize("shape", [Shape(4, 4, 24, 16), Shape(4, 1, 24, 16, mla=True)], ids=str)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_narrow_rope_keys_read_only_their_own_channels_and_slots(shape, decode):
    """Keys whose rope part is narrower than its 16-lane tile (the tiny DeepSeek's 24 = 16 + 8), beside
    other requests' pool slots and channels past the head that hold NaN: neither may be read."""
    seq_lens, extend_lens = [70, 9, 33], ([1] * 3 if decode else [5, 9, 2])
    scene = build_scene(shape, torch.float32, "cpu", [n - e for n, e in zip(seq_lens, extend_lens)], extend_lens,
                        decode, seed=3)
    poison_unowned_slots(scene)
    scene.q, scene.k = nan_padded(scene.q), nan_padded(scene.k)
    scene.v = scene.k[..., : shape.v_dim] if shape.mla else nan_padded(scene.v)
    assert_matches(run_triton(scene, scene.triton_backend()), scene.reference(), TOLERANCE[torch.float32])


# ---------------------------------------------------------------- GPU, real sizes, bfloat16

GPU_SHAPES = [
    Shape(32, 32, 128, 128), Shape(9, 3, 64, 64), Shape(32, 8, 128, 128), Shape(32, 4, 128, 128),
    Shape(16, 16, 192, 128), Shape(16, 1, 576, 512, mla=True),
]
LLAMA_3_8B, MLA = GPU_SHAPES[2], GPU_SHAPES[5]


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_extend(shape):
    rng = random.Random(7)
    prefix_lens = [0] + random_lens(rng, 4, 1, 2048)
    check(shape, torch.bfloat16, "cuda", prefix_lens, random_lens(rng, 5, 1, 2048), decode=False)


@gpu
@pytest.mark.parametrize("batch_size", [1, 13, 64])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_decode(shape, batch_size):
    seq_lens = random_lens(random.Random(batch_size), batch_size, 1, 4096)
    check(shape, torch.bfloat16, "cuda", [n - 1 for n in seq_lens], [1] * batch_size, decode=True, max_batch_size=64)


@gpu
@pytest.mark.parametrize("batch_size", [1, 2, 13])
def test_gpu_value_projection(batch_size):
    check_value_projection(torch.bfloat16, "cuda", random_lens(random.Random(batch_size), batch_size, 1, 4096), True)


@gpu
@pytest.mark.parametrize("shape", [LLAMA_3_8B, MLA], ids=str)
def test_gpu_decode_long(shape):
    seq_lens = [20000, 3, 17000]
    check(shape, torch.bfloat16, "cuda", [n - 1 for n in seq_lens], [1] * 3, decode=True)


@gpu
@pytest.mark.parametrize("shape", [LLAMA_3_8B, MLA], ids=str)
def test_gpu_decode_replays_in_cuda_graph(shape):
    """Capture decode once, then replay it with other requests copied into the same tensors."""
    bs, rounds = 8, 3
    rng = random.Random(3)
    seq_lens = random_lens(rng, bs * rounds, 1, 3000)
    seq_lens[-1] = 9000  # the last round has a long request: more splits than at capture
    scene = build_scene(shape, torch.bfloat16, "cuda", [n - 1 for n in seq_lens], [1] * len(seq_lens), decode=True)
    full = scene.batch

    def round_of(t: torch.Tensor | None, r: int):
        return None if t is None else t[r * bs : (r + 1) * bs]

    static = {name: round_of(t, 0).clone() for name, t in
              [("q", scene.q), ("k", scene.k), ("v", scene.v), ("seq_lens", full.seq_lens),
               ("rows", full.req_pool_indices), ("loc", full.out_cache_loc)] if t is not None}
    zeros = torch.zeros(bs, dtype=torch.int64, device="cuda")
    # seq_lens_cpu=None: the decode path must not read host copies, or replays would go stale.
    batch = ForwardBatch(is_decode=True, input_ids=zeros, positions=zeros, out_cache_loc=static["loc"],
                         req_pool_indices=static["rows"], seq_lens=static["seq_lens"], seq_lens_cpu=None)
    backend = TritonAttnBackend(scene.pool, scene.req_to_token, max_batch_size=16, num_heads=shape.num_heads)

    def step():
        backend.init_forward_metadata(batch)
        return backend.forward(static["q"], static["k"], static.get("v"), LAYER, batch, scene.scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    for r in range(rounds):
        for name, t in [("q", scene.q), ("k", scene.k), ("v", scene.v), ("seq_lens", full.seq_lens),
                        ("rows", full.req_pool_indices), ("loc", full.out_cache_loc)]:
            if t is not None:
                static[name].copy_(round_of(t, r))
        graph.replay()
        replayed = graph_out.clone()
        torch.cuda.set_sync_debug_mode("error")  # any host sync in the eager decode path raises
        try:
            eager = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(replayed, eager)

        lens = seq_lens[r * bs : (r + 1) * bs]
        part = Scene(shape, scene.pool, scene.req_to_token,
                     ForwardBatch.decode([0] * bs, lens, full.req_pool_indices[r * bs : (r + 1) * bs].tolist(),
                                         round_of(full.out_cache_loc, r), "cuda"),
                     round_of(scene.q, r), round_of(scene.k, r), round_of(scene.v, r))
        assert_matches(replayed, part.reference(), TOLERANCE[torch.bfloat16])


@interpreted
@pytest.mark.parametrize("shape", [Shape(6, 2, 64, 64), Shape(2, 2, 192, 128)], ids=str)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_q_k_v_as_views_of_a_fused_qkv_output(shape, decode):
    """In model.py q, k and v are [T, heads, D] views of one qkv projection output, so a token's row
    stride is (H + 2 Hkv) D, not heads * D: the kernels must take the token stride they are given
    (a row read at heads * D lands in another view's channels, or in the NaN after the last)."""
    seq_lens, extend_lens = [70, 9, 33], ([1] * 3 if decode else [5, 9, 2])
    scene = build_scene(shape, torch.float32, "cpu", [n - e for n, e in zip(seq_lens, extend_lens)], extend_lens,
                        decode, seed=4)
    parts = [scene.q, scene.k, scene.v]
    widths = [t.shape[1] * t.shape[2] for t in parts]
    fused = torch.full((scene.q.shape[0], sum(widths) + 16), float("nan"))  # [T, q | k | v | NaN]
    views, at = [], 0
    for t, w in zip(parts, widths):
        fused[:, at : at + w] = t.flatten(1)
        views.append(fused[:, at : at + w].unflatten(-1, t.shape[1:]))
        at += w
    scene.q, scene.k, scene.v = views
    assert scene.q.stride(0) != scene.q.shape[1] * scene.q.stride(1)
    assert_matches(run_triton(scene, scene.triton_backend()), scene.reference(), TOLERANCE[torch.float32])


@interpreted
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_head_width_not_a_power_of_two(decode):
    """Heads 100 wide (OpenLLaMA-3B): keys 64 + 36 over a 64-lane rope tile, values over 128 lanes of
    which 28 lie past the head; the lanes past it must be neither written (pool, output) nor
    mistaken for the rope part's start. check() also holds every other pool slot unchanged."""
    seq_lens = [300, 1, 40]
    extend_lens = [1] * 3 if decode else [30, 1, 9]
    check(Shape(6, 2, 100, 100), torch.float32, "cpu", [n - e for n, e in zip(seq_lens, extend_lens)], extend_lens,
          decode)


@interpreted
@pytest.mark.parametrize("shape", [Shape(8, 2, 64, 64), Shape(16, 1, 576, 512, mla=True)], ids=str)
def test_decode_merge_of_splits_whose_log_sum_exp_overflows_exp2(shape):
    """Every score shifted by +100 (channel 0 of every key is 1, of every query 100 / scale): softmax
    does not change, but a split's base-2 LSE passes 128, where float32 exp2 overflows; the merge
    must weigh the splits relative to their largest LSE, as stage 1 does within a split."""
    seq_lens = [600, 200, 1]
    scene = build_scene(shape, torch.float32, "cpu", [n - 1 for n in seq_lens], [1] * 3, decode=True, seed=5)
    cache = scene.pool.k_buffers[1]
    cache[1:, :, 0] = 1.0  # slot 0 keeps its NaN
    scene.k[..., 0] = 1.0
    scene.q[..., 0] = 100.0 / scene.scale
    backend = scene.triton_backend(max_batch_size=3)
    backend.init_forward_metadata(scene.batch)
    assert backend.num_kv_splits[0] > 1
    # (a query channel of 100 / scale, 2400 for MLA, leaves scores about 5 significant digits in float32)
    assert_matches(run_triton(scene, backend), scene.reference(), 1e-4)
