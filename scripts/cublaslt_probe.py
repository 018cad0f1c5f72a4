"""Every algorithm cuBLASLt's heuristic offers for Llama-3-8B's decode matmuls, timed as matmul_probe.py
times cuBLAS (a CUDA graph over cold copies of the weight), with the kernel each one launches and its
waves (programs over what the GPU runs at once). The question: at 160 rows cuBLAS's own pick leaves 20
(gate/up) or 36 (q/k/v) of the H200's 132 multiprocessors idle (BENCHMARKS.md, sixteenth round); does
cuBLASLt have a kernel that fills them and runs faster? torch asks cuBLASLt for its first pick only.
Two orientations of the same product: "w-as-m" is torch's (the weight's rows are the GEMM's M, the
output [T, N]); "w-as-n" swaps them (the batch is M, the output [N, T], transposed).
cuBLASLt is called through ctypes on the library torch has loaded; nothing is compiled. On an H200
no listed kernel beats cuBLAS's pick at 160 rows (BENCHMARKS.md, seventeenth round).

    python scripts/cublaslt_probe.py [ROWS ...] [--shapes qkv,gate_up,lm_head] [--count 32] [--forms m,n]
"""

import argparse
import ctypes

import torch
import torch.nn.functional as F

from matmul_probe import LLAMA_SHAPES, cold_weights, time_per_call

# cuBLAS's enum values (cublasLt.h, library_types.h)
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, OP_N, OP_T = 3, 4, 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
          "inner": 7, "cluster": 8}
WORKSPACE_BYTES = 32 << 20
P, U64, I64, SZ, INT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int


class Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", U64 * 8), ("workspace", SZ), ("state", INT), ("waves", ctypes.c_float), ("reserved", INT * 4)]


def load_cublaslt() -> ctypes.CDLL:
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # torch loads its cuBLAS(Lt)
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "libcublasLt.so" in line)
    lt = ctypes.CDLL(path)
    lt.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(P), INT, U64, U64, I64]
    lt.cublasLtMatmulAlgoGetHeuristic.argtypes = [P, P, P, P, P, P, P, INT, ctypes.POINTER(Heuristic),
                                                  ctypes.POINTER(INT)]
    lt.cublasLtMatmul.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, P, P, SZ, P]
    lt.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [P, INT, P, SZ, ctypes.POINTER(SZ)]
    for setter in (lt.cublasLtMatmulDescSetAttribute, lt.cublasLtMatmulPreferenceSetAttribute):
        setter.argtypes = [P, INT, P, SZ]
    return lt


def check(status: int, what: str):
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


class Problem:
    """D = op(A) op(B), column-major as cuBLAS sees it, for x [T, K] and w [N, K]."""

    def __init__(self, lt, handle, t: int, n: int, k: int, w_as_m: bool):
        self.lt, self.handle, self.w_as_m = lt, handle, w_as_m
        self.desc = P()
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):  # A^T B: both stored K-contiguous
            value = INT(op)
            check(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "trans")
        m_, n_ = (n, t) if w_as_m else (t, n)
        self.a, self.b, self.d = (self._layout(k, m_, k), self._layout(k, n_, k), self._layout(m_, n_, m_))

    def _layout(self, rows, cols, ld):
        layout = P()
        check(self.lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), R_16BF, rows, cols, ld), "layout")
        return layout

    def heuristics(self, count: int) -> list[Heuristic]:
        pref, size = P(), U64(WORKSPACE_BYTES)
        check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8), "ws")
        results, returned = (Heuristic * count)(), INT(0)
        check(self.lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, pref,
                                                     count, results, ctypes.byref(returned)), "heuristic")
        return [r for r in results[:returned.value] if r.state == 0]

    def runner(self, heuristic: Heuristic, workspace: torch.Tensor):
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        algo = ctypes.byref(heuristic.algo)

        def run(x, w, out):  # out: [T, N] (w-as-m) or [N, T] (w-as-n), contiguous
            a, b = (w, x) if self.w_as_m else (x, w)
            status = self.lt.cublasLtMatmul(
                self.handle, self.desc, ctypes.byref(alpha), a.data_ptr(), self.a, b.data_ptr(), self.b,
                ctypes.byref(beta), out.data_ptr(), self.d, out.data_ptr(), self.d, algo,
                workspace.data_ptr(), WORKSPACE_BYTES, torch.cuda.current_stream().cuda_stream)
            check(status, "matmul")
        return run


def describe(lt, heuristic: Heuristic) -> str:
    values = []
    for name, attr in CONFIG.items():
        value, size = ctypes.c_uint64(0), SZ(0)  # 16- or 32-bit: asked first, then read into the low bytes
        lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(heuristic.algo), attr, None, 0, ctypes.byref(size))
        status = lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(heuristic.algo), attr, ctypes.byref(value),
                                                         size.value, ctypes.byref(size))
        values.append(f"{name}={value.value if status == 0 else '?'}")
    return f"waves={heuristic.waves:.2f} ws={heuristic.workspace >> 10}K " + " ".join(values)


def kernel_name(run, x, w, out) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(x, w, out)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.profiler.DeviceType.CUDA]
    return "+".join(name[:60] for name in names) or "?"


SHAPES = {**LLAMA_SHAPES, "lm_head": (128256, 4096)}


def probe(lt, handle, name: str, n: int, k: int, rows: int, count: int, forms: str, workspace):
    weights = cold_weights(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x, weights[0])
    outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
    baseline = time_per_call(lambda x, w, out: torch.mm(x, w.t(), out=out), weights, x, outs)
    torch_kernel = kernel_name(lambda x, w, out: F.linear(x, w), x, weights[0], None)
    print(f"{name} rows={rows}: torch (cuBLAS) {baseline:.1f} us, {torch_kernel}", flush=True)
    for w_as_m in [form == "m" for form in forms.split(",")]:
        problem, form = Problem(lt, handle, rows, n, k, w_as_m), "w-as-m" if w_as_m else "w-as-n"
        outs = [torch.empty((rows, n) if w_as_m else (n, rows), device="cuda", dtype=torch.bfloat16) for _ in weights]
        timed = []
        for rank, heuristic in enumerate(problem.heuristics(count)):
            run = problem.runner(heuristic, workspace)
            try:
                run(x, weights[0], outs[0])
                got = outs[0] if w_as_m else outs[0].t()
                error = (got.float() - expected.float()).abs().max().item()
                us = time_per_call(run, weights, x, outs)
            except RuntimeError as e:  # one algorithm that fails (or will not be captured) is reported, not fatal
                print(f"  {form} #{rank:2d} failed: {e}", flush=True)
                continue
            timed.append(us)
            print(f"  {form} #{rank:2d} {us:6.1f} us  err {error:.3f}  {describe(lt, heuristic)}  "
                  f"{kernel_name(run, x, weights[0], outs[0])}", flush=True)
        if timed:
            print(f"  {form}: first pick {timed[0]:.1f} us, fastest {min(timed):.1f} us "
                  f"(#{timed.index(min(timed))} of {len(timed)}), torch {baseline:.1f} us", flush=True)
    del weights


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", nargs="*", type=int, default=[160, 128, 64])
    parser.add_argument("--shapes", default="qkv,gate_up,o,down")
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--forms", default="m,n", help="m: the weight's rows as the GEMM's M; n: as its N")
    args = parser.parse_args()
    lt = load_cublaslt()
    handle = P()
    check(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for rows in args.rows:
            probe(lt, handle, name, n, k, rows, args.count, args.forms, workspace)


if __name__ == "__main__":
    main()
