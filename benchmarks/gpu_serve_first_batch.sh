#!/usr/bin/env bash
# The first full batch after `shoal serve` reports ready against the second (issue 20): the W8
# requests streamed twice with per-request timings (--save-detailed) and the engine core's
# per-step trace (SHOAL_STEP_TRACE), so the two runs can be compared step by step.
#   bash benchmarks/gpu_serve_first_batch.sh MODEL_DIR [serve flags...]
set -u
M=${1:?model folder}; shift
export PYTHONUNBUFFERED=1
SHOAL_STEP_TRACE="$OUT/step-trace.jsonl" python3 -m shoal.cli serve "$M" \
  --load-format dummy --dtype bfloat16 --no-enable-prefix-caching --port 8000 \
  --disable-uvicorn-access-log "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 150); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=1)" \
    2>/dev/null && break
  sleep 1
done
for run in 1 2 3; do
  echo "mark run $run $(python3 -c 'import time; print(time.monotonic())')" >> "$OUT/marks.txt"
  timeout 120 python3 -m shoal.cli bench serve --port 8000 --preset W8 \
    --tokenizer "$M" --disable-tqdm --num-client-processes 4 --save-result --save-detailed \
    --result-dir "$OUT" --result-filename "stream-$run.json" > "$OUT/stream-$run.log" 2>&1
  echo "run $run rc=$?"; grep -E "Output token throughput|Mean TTFT" "$OUT/stream-$run.log"
done
kill -TERM $SERVER; wait $SERVER
