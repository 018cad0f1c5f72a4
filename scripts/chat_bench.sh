#!/usr/bin/env bash
# Chat-shaped serving (scheduler.py) on a GPU machine: for each model shape, nano.serve with dummy
# weights, then bench_serving with 256 requests sent at once, twice:
#   exact:   each carries max_tokens = its output length (25-200 tokens, mean 110 at 256 requests:
#            drawn with the prompts' range ratio, 0.125, as no --random-output-range-ratio is given);
#   unknown: each asks for the whole context and the client hangs up after its output length
#            (bench_serving --unknown-output-len), as chat traffic without max_tokens.
# Usage, from the repo root: OUT=/some/folder scripts/chat_bench.sh [MODEL ...] (default: llama-3.1-8b
# deepseek-v2-lite). SERVER_DIR runs the server from another checkout (an older commit's tree), the
# client always from this one. Logs: $OUT/chat_<label>_<model>_{server,exact,unknown}.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nano_out}; mkdir -p "$OUT"
PORT=${PORT:-30000}
URL=http://127.0.0.1:$PORT
LABEL=${LABEL:-new}
ROOT=$PWD
models="${*:-llama-3.1-8b deepseek-v2-lite}"
for model in $models; do
  log="$OUT/chat_${LABEL}_${model}"
  (cd "${SERVER_DIR:-$ROOT}" && exec python3 -m nano.serve --model "$model" --load-format dummy --port "$PORT" \
     ${SERVER_ARGS:-}) > "${log}_server.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    python3 -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=1)" 2>/dev/null && break
    kill -0 $server 2>/dev/null || { echo "the server died:"; tail -20 "${log}_server.log"; break; }
    sleep 1
  done
  for mode in exact unknown; do
    flag=""; [[ $mode == unknown ]] && flag=--unknown-output-len
    python3 -m nano.bench_serving --base-url "$URL" --num-prompts ${NUM_PROMPTS:-256} --dataset random \
      --random-input-len 1024 --random-range-ratio 0.125 --random-output-len 200 --request-rate inf $flag \
      2>&1 | tee "${log}_${mode}.log" | grep -E "Successful|Failed|Output token throughput|Most requests|Median TTFT|Median ITL"
  done
  kill -TERM $server; wait $server
done
exit 0
