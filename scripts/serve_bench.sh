#!/usr/bin/env bash
# Serving benchmark on a GPU machine: nano.serve on the Llama-3-8B shape with dummy weights, then
# bench_serving with 1,000 random prompts (inputs of 128-1024 tokens, outputs of 128-512) sent
#   rate-inf: all at once (throughput), and
#   rate-4:   as a Poisson process at 4 requests/s (latency: median TTFT and ITL).
# Usage, from the repo root: OUT=/some/folder scripts/serve_bench.sh [rate-inf] [rate-4] (default: both).
# Logs in $OUT: server.log, bench_rate-inf.log, bench_rate-4.log. SERVER_ARGS and NUM_PROMPTS
# override the model and the count (a CPU smoke test: SERVER_ARGS="--model DIR" NUM_PROMPTS=8);
# NUM_PROMPTS_AT_RATE the count at a finite rate (1,000 at 4/s take over four minutes to arrive);
# SERVER_CMD the command that starts the server (default: python3 -m nano.serve).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nano_out}; mkdir -p "$OUT"
PORT=${PORT:-30000}
URL=http://127.0.0.1:$PORT
runs="${*:-rate-inf rate-4}"
SERVER_ARGS=${SERVER_ARGS:---model llama-3-8b --load-format dummy}

${SERVER_CMD:-python3 -m nano.serve} $SERVER_ARGS --port "$PORT" > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server; echo "server exit status $?" >> "$OUT/server.log"' EXIT
for _ in $(seq 900); do  # loading dummy weights and capturing CUDA graphs takes a minute or two
  python3 -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=1)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "the server died:"; tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
python3 -c "import urllib.request; print(urllib.request.urlopen('$URL/health').read().decode())" | tee "$OUT/health.txt"

seed=0
for run in $runs; do  # each run its own prompts: the server's prefix cache holds the last run's
  rate=${run#rate-}; seed=$((seed + 1))
  n=${NUM_PROMPTS:-1000}; [[ $rate != inf ]] && n=${NUM_PROMPTS_AT_RATE:-$n}
  python3 -m nano.bench_serving --base-url "$URL" --num-prompts "$n" --dataset random \
    --random-input-len 1024 --random-range-ratio 0.125 --random-output-len 512 --random-output-range-ratio 0.25 \
    --request-rate "$rate" --seed "$seed" 2>&1 | tee "$OUT/bench_$run.log"
  # the engine's own account so far: seconds and tokens of prefill and decode steps
  python3 -c "import urllib.request; print(urllib.request.urlopen('$URL/health').read().decode())" | tee -a "$OUT/bench_$run.log"
done
