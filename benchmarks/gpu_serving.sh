#!/usr/bin/env bash
# W8 and batch-1 serving on the GPU, in one device call (../shared/BENCHMARKS.md):
#   1. the W1 requests offline through `shoal bench throughput` (two runs in one process: the
#      first full batch after ready against the second), on MODEL_DIR;
#   2. the same requests through `shoal serve` on the same folder and engine arguments, from
#      256 concurrent clients (`shoal bench serve --preset W8`): streaming three times (the
#      first batch after ready, then steady), then non-streaming, with per-request timings
#      and the engine core's step trace (SHOAL_STEP_TRACE) to line the two sides up;
#   3. batch-1 streaming over HTTP on the Llama-3.1-8B shape (W2-style: 128 in / 256 out),
#      whose inter-token latency compares with gpu_suite.py w2's offline decode step.
# Usage (repo root or a snapshot of it, wheels installed as gpu_run.sh does):
#   bash benchmarks/gpu_serving.sh MODEL_DIR
set -u
M=${1:?model folder: Qwen3-0.6B shape with the SmolLM2 vocabulary and tokenizer}
export PYTHONUNBUFFERED=1
wait_healthy() {  # port, seconds
  for _ in $(seq 1 "$2"); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=1)" \
      2>/dev/null && return 0
    sleep 1
  done
  return 1
}
stage() { echo "== $1 $(date +%T)"; }

stage offline
timeout 200 python3 -m shoal.cli bench throughput --preset W8 --model "$M" \
  --tokenizer "$M" --load-format dummy --num-runs 2 --disable-tqdm \
  --output-json "$OUT/w8-offline.json" > "$OUT/w8-offline.log" 2>&1
echo "rc=$?"; grep -E "^run " "$OUT/w8-offline.log"

stage serve
SHOAL_STEP_TRACE="$OUT/w8-step-trace.jsonl" python3 -m shoal.cli serve "$M" --load-format dummy --dtype bfloat16 --no-enable-prefix-caching --port 8000 \
  --disable-uvicorn-access-log > "$OUT/w8-server.log" 2>&1 &
SERVER=$!
if wait_healthy 8000 150; then
  for run in stream-1 stream-2 stream-3 nonstream; do
    extra=""; [ "$run" = nonstream ] && extra="--non-streaming"
    timeout 120 python3 -m shoal.cli bench serve --port 8000 --preset W8 $extra \
      --tokenizer "$M" \
      --disable-tqdm --num-client-processes 4 --save-result --save-detailed --result-dir "$OUT" \
      --result-filename "w8-serve-$run.json" > "$OUT/w8-serve-$run.log" 2>&1
    echo "$run rc=$?"; grep -E "Output token throughput|Mean ITL|Mean TTFT" "$OUT/w8-serve-$run.log"
  done
else
  echo "server did not start"; tail -20 "$OUT/w8-server.log"
fi
kill -TERM $SERVER; wait $SERVER  # the python process itself, not a shell function

stage batch1
python3 -m shoal.cli serve meta-llama/Llama-3.1-8B --load-format dummy --dtype bfloat16 --tokenizer "$M" \
  --max-model-len 4096 --max-num-seqs 16 --port 8001 --disable-uvicorn-access-log \
  > "$OUT/b1-server.log" 2>&1 &
SERVER=$!
if wait_healthy 8001 180; then
  timeout 120 python3 -m shoal.cli bench serve --port 8001 --dataset-name random \
    --tokenizer "$M" \
    --random-input-len 128 --random-output-len 256 --token-id-prompts --ignore-eos \
    --temperature 0 --num-prompts 6 --num-warmups 1 --max-concurrency 1 --disable-tqdm \
    --save-result --result-dir "$OUT" --result-filename b1-serve-stream.json \
    > "$OUT/b1-serve.log" 2>&1
  echo "batch1 rc=$?"; grep -E "Mean ITL|Median ITL|Mean TPOT|Mean TTFT" "$OUT/b1-serve.log"
else
  echo "8B server did not start"; tail -20 "$OUT/b1-server.log"
fi
kill -TERM $SERVER; wait $SERVER  # the python process itself, not a shell function
stage done
