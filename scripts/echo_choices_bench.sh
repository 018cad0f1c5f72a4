#!/usr/bin/env bash
# An echo with n choices (BENCHMARKS.md, 2026-12-08): nano.serve on the embedded SmolLM2, one
# completion of a PROMPT_LEN-token prompt with echo, logprobs 20, max_tokens 0 and n N, timed twice;
# then whether every choice echoed the same logprobs. Run from the repository root:
#   bash scripts/echo_choices_bench.sh [PROMPT_LEN=1000] [N=8]
set -euo pipefail
PROMPT_LEN=${1:-1000} N=${2:-8} PORT=30111
python -m nano.serve --port $PORT > /tmp/echo_choices_serve.log 2>&1 &
server=$!
trap 'kill $server; wait $server 2>/dev/null' EXIT
until curl -s localhost:$PORT/health > /dev/null; do sleep 1; done
body=$(python -c "import json, random; r = random.Random(0); print(json.dumps(dict(echo=True, logprobs=20,
    max_tokens=0, n=$N, prompt=[r.randrange(100, 40000) for _ in range($PROMPT_LEN)])))")
for run in 1 2; do
  started=$(date +%s.%N)
  curl -s -o /tmp/echo_choices.json -H 'Content-Type: application/json' -d "$body" localhost:$PORT/v1/completions
  python -c "import json; c = json.load(open('/tmp/echo_choices.json'))['choices']
print(f'run $run: {$(date +%s.%N) - $started:.2f} s, {len(c)} choices of {len(c[0][\"logprobs\"][\"tokens\"])} entries,',
      'all alike' if all(x['logprobs'] == c[0]['logprobs'] for x in c) else 'choices differ')"
done
