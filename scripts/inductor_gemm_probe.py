"""Does torch inductor's GEMM autotuning (max-autotune: its Triton templates, persistent TMA ones
included, against cuBLAS) find a faster kernel than cuBLAS for Llama-3-8B's o_proj and q/k/v at 160
rows? Inductor picks on its own timings; this times its pick and cuBLAS with the L2 cache cold
(matmul_probe.py's harness), each followed by a copy into the output buffer, as a compiled function
returns a new tensor. Usage: python scripts/inductor_gemm_probe.py"""

import os
import sys
import time

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, os.path.dirname(__file__))
from matmul_probe import LLAMA_SHAPES, cold_weights, time_per_call  # noqa: E402

inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
if hasattr(inductor_config.triton, "enable_persistent_tma_matmul"):
    inductor_config.triton.enable_persistent_tma_matmul = True

if __name__ == "__main__":
    torch.manual_seed(0)
    rows = 160
    for name in ("o", "qkv"):
        n, k = LLAMA_SHAPES[name]
        weights = cold_weights(n, k)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
        compiled = torch.compile(lambda x, w: torch.mm(x, w.t()), mode="max-autotune-no-cudagraphs", dynamic=False)
        started = time.time()
        compiled(x, weights[0])
        torch.cuda.synchronize()
        print(f"{name}: compiled in {time.time() - started:.0f} s", flush=True)
        cublas = time_per_call(lambda x, w, o: o.copy_(torch.mm(x, w.t())), weights, x, outs)
        picked = time_per_call(lambda x, w, o: o.copy_(compiled(x, w)), weights, x, outs)
        print(f"{name} M={rows}: cuBLAS + copy {cublas:.1f} us, inductor's pick + copy {picked:.1f} us", flush=True)
        del weights
