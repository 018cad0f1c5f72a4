#!/usr/bin/env bash
# Tensor parallelism on a host with 2 GPUs (H200s): run from the repo root, with $OUT the folder
# whose files come back. Parts (default: all): tests, allreduce, bench-8b, bench-lite, bench-70b.
#   tests      tests/test_tp.py: the CPU tests, and CUDA graphs == eager at tp 2 (8B and V2-Lite shapes)
#   allreduce  NCCL all-reduce latency at decode sizes, eager and in a CUDA graph
#   bench-8b   Llama-3-8B batch-1 decode at tp 1 and tp 2 (target: tp 2 <= 0.6 x tp 1), tp 2 also
#              without overlap and without graphs
#   bench-lite DeepSeek-V2-Lite likewise
#   bench-70b  Llama-3-70B (Llama-3.1 shape) batch-1 decode at tp 2 (141 GB of bf16: two GPUs' worth)
# Batch-1 runs capture one CUDA graph (--cuda-graph-max-bs 1) to save start-up time; the graph of
# batch 1 is the same whatever the largest captured size. Bytes and floor lines are per GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nano_out}; mkdir -p "$OUT"
whats="${*:-all}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/tp_gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/tp_gpu.txt"
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}" | tee -a "$OUT/tp_gpu.txt"
nvidia-smi topo -m >> "$OUT/tp_gpu.txt" 2>&1

bench() {  # bench MODEL TP [extra flags]: batch-1 decode latency
  local model=$1 tp=$2; shift 2
  echo "=== $model, tp $tp $*"
  python3 -m nano.bench_latency --model "$model" --load-format dummy --batch-size 1 --input-len 128 \
    --output-len 32 --cuda-graph-max-bs 1 --tp-size "$tp" "$@"
}

if [[ $whats == all || $whats == *tests* ]]; then
  python3 -m pytest -q -rP -rs tests/test_tp.py 2>&1 | tee "$OUT/tp_tests.log" | grep -E "identical|passed|failed|skipped|Error|error"
fi
if [[ $whats == all || $whats == *allreduce* ]]; then
  python3 scripts/tp_allreduce.py 2 2>&1 | tee "$OUT/tp_allreduce.log"
fi
if [[ $whats == all || $whats == *bench-8b* ]]; then
  { bench llama-3-8b 1; bench llama-3-8b 2; bench llama-3-8b 2 --disable-overlap; bench llama-3-8b 2 --disable-cuda-graph; } \
    2>&1 | tee "$OUT/tp_bench_8b.log"
fi
if [[ $whats == all || $whats == *bench-lite* ]]; then
  { bench deepseek-v2-lite 1; bench deepseek-v2-lite 2; } 2>&1 | tee "$OUT/tp_bench_lite.log"
fi
if [[ $whats == all || $whats == *bench-70b* ]]; then
  bench llama-3-70b 2 2>&1 | tee "$OUT/tp_bench_70b.log"
fi
grep -hE "^===|Decode|Bytes read|error" "$OUT"/tp_bench_*.log 2>/dev/null | tee "$OUT/tp_summary.txt"
