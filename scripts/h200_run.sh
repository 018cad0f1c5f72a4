#!/usr/bin/env bash
# The GPU session behind BENCHMARKS.md and the GPU test results in the issue notes: run on the
# device machine from the repo root, with $OUT the folder whose files come back.
# The tests that need the fetched SmolLM2 weights (no network there) stay on the CPU side.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nano_out}; mkdir -p "$OUT"
whats="${*:-all}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [[ $whats == all || $whats == *tests* ]]; then
  python3 -m pytest -q -rs tests --ignore=tests/test_default_model.py --ignore=tests/test_tokenizer.py \
    --ignore=tests/test_cli.py --ignore=tests/test_triton_e2e.py --ignore=tests/test_cuda_graph_runner.py 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [[ $whats == all || $whats == *tests* ]]; then
  python3 -m pytest -q -rP tests/test_triton_e2e.py tests/test_cuda_graph_runner.py 2>&1 | grep -E "identical|passed|failed|Error|error" | tee "$OUT/match_rates.log"
fi
if [[ $whats == all || $whats == *bench-llama* ]]; then
  {
    python3 -m nano.bench_attention
    python3 -m nano.bench_latency --model llama-3-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 8 --disable-cuda-graph
    python3 -m nano.bench_latency --model llama-3-8b --load-format dummy --batch-size 1 8 32 64 128 160 --input-len 128 --output-len 8
  } 2>&1 | tee "$OUT/bench_llama.log"
fi
if [[ $whats == all || $whats == *bench-deepseek* ]]; then
  {
    for flags in "--disable-cuda-graph" "--disable-mla" "--disable-mla --disable-cuda-graph"; do
      python3 -m nano.bench_latency --model deepseek-v2-lite --load-format dummy --batch-size 1 --input-len 128 --output-len 8 $flags
    done
    python3 -m nano.bench_latency --model deepseek-v2-lite --load-format dummy --batch-size 1 8 32 64 128 160 --input-len 128 --output-len 8
  } 2>&1 | tee "$OUT/bench_deepseek.log"
fi
if [[ $whats == all || $whats == *profile* ]]; then
  { python3 scripts/profile_decode.py llama-3-8b 1; python3 scripts/profile_decode.py deepseek-v2-lite 1; } 2>&1 | tee "$OUT/profile.log"
fi
