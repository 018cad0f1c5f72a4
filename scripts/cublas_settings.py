"""Do cuBLAS's settings change the kernel it picks for Llama-3-8B's decode matmuls? Times torch.mm at
8-160 rows for each weight (cold L2, matmul_probe.py's harness), under whatever the environment sets:
    python scripts/cublas_settings.py default
    CUBLASLT_WORKSPACE_SIZE=262144 CUBLAS_WORKSPACE_CONFIG=:262144:2 python scripts/cublas_settings.py ws256M
    NO_BF16_RED=1 python scripts/cublas_settings.py nobf16red   # allow_bf16_reduced_precision_reduction off
    LT=1 CUBLASLT_WORKSPACE_SIZE=262144 python scripts/cublas_settings.py lt_ws256M   # cuBLASLt
Prints microseconds per call."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from matmul_probe import LLAMA_SHAPES, cold_weights, time_per_call  # noqa: E402

if __name__ == "__main__":
    if os.environ.get("NO_BF16_RED"):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if os.environ.get("LT"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
    tag = sys.argv[1] if len(sys.argv) > 1 else "default"
    torch.manual_seed(0)
    for name, (n, k) in LLAMA_SHAPES.items():
        weights = cold_weights(n, k)
        line = f"{tag:10s} {name:8s}"
        for m in (8, 32, 64, 96, 128, 160):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            line += f"  M={m} {time_per_call(lambda x, w, o: torch.mm(x, w.t(), out=o), weights, x, outs):6.1f}"
        print(line, flush=True)
        del weights
