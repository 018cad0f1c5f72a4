#!/usr/bin/env bash
# The GPU session behind BENCHMARKS.md: run on a GPU machine from the repo root, with $OUT the
# folder for logs. `bash scripts/gpu_run.sh tests bench-llama ...` runs the parts named (all by
# default). The whole test suite runs in one pytest call (-rP prints the match rates the GPU
# tests report); tests that need the fetched SmolLM2
# weights skip themselves where there is no network.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nano_out}; mkdir -p "$OUT"
parts="${*:-tests bench-llama bench-deepseek overlap bench-attention tune-mla profile throughput serve tune-moe prefix}"
want() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
sweep="--batch-size 1 8 32 64 128 160 --input-len 128 --output-len 16"

want tests && python3 -m pytest -q -rsP tests 2>&1 | tee "$OUT/pytest.log" | tail -25
want bench-llama && python3 -m nano.bench_latency --model llama-3-8b --load-format dummy $sweep 2>&1 | tee "$OUT/bench_llama.log"
want bench-deepseek && python3 -m nano.bench_latency --model deepseek-v2-lite --load-format dummy $sweep 2>&1 | tee "$OUT/bench_deepseek.log"
if want overlap; then  # decode passes overlapped (the default) against one at a time
  for model in llama-3-8b deepseek-v2-lite; do
    for flag in "" --disable-overlap; do
      python3 -m nano.bench_latency --model $model --load-format dummy --batch-size 1 64 --input-len 128 --output-len 32 $flag
    done
  done 2>&1 | tee "$OUT/overlap.log"
fi
want bench-attention && python3 scripts/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log"
want tune-mla && python3 scripts/tune_mla_decode.py 2>&1 | tee "$OUT/tune_mla.log"
if want profile; then
  for model in llama-3-8b deepseek-v2-lite; do
    for bs in 1 8 64 160; do python3 scripts/profile_decode.py $model $bs; done
  done 2>&1 | tee "$OUT/profile.log"
fi
want throughput && python3 -m nano.bench_throughput --model llama-3-8b --load-format dummy --num-prompts 256 2>&1 | tee "$OUT/throughput.log"
if want serve; then  # the server against the engine alone on the same lengths (needs fastapi and uvicorn)
  python3 -m nano.bench_throughput --model llama-3-8b --num-prompts 1000 --input-len 128 1024 --output-len 128 512 \
    --peer-prompts 0 2>&1 | tee "$OUT/serve_offline.log"
  OUT="$OUT/serve" NUM_PROMPTS_AT_RATE=200 SERVER_ARGS="--model llama-3-8b" bash scripts/serve_bench.sh rate-inf rate-4
fi
want tune-moe && python3 scripts/tune_fused_moe.py 2>&1 | tee "$OUT/tune_moe.log"
if want prefix; then
  for model in llama-3-8b deepseek-v2-lite; do python3 scripts/prefix_bench.py --model $model; done 2>&1 | tee "$OUT/prefix.log"
fi
want prefix-deepseek-long && python3 scripts/prefix_bench.py --model deepseek-v2-lite --only b 2>&1 | tee "$OUT/prefix_deepseek_long.log"
exit 0
