#!/usr/bin/env bash
# One device call for the feature issues' GPU figures, each part with its own time limit:
# embeddings (all-MiniLM-L6-v2 shape, random weights), structured outputs (step time with and
# without the grammar bitmask, Qwen3-0.6B shape) and speculative decoding's cost side (W9,
# Llama-3.1-8B shape, forced acceptance). Usage on the GPU machine, repo root, carrying .whl,
# bench-work/minilm-shape (MiniLM's files without model.safetensors) and
# bench-work/qwen3-0.6b-smol (for SmolLM2's tokenizer):
#   bash benchmarks/gpu_features.sh [SPEC_RATES]
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD
export SHOAL_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
run() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"; tail -n 3 "$OUT/$name.log"
}
run embeddings 70 python3 benchmarks/embeddings_gpu.py --model bench-work/minilm-shape \
  --load-format dummy --out "$OUT/embeddings.json"
run structured 110 python3 benchmarks/structured_outputs_gpu.py \
  --tokenizer bench-work/qwen3-0.6b-smol --out "$OUT/structured.json"
run spec 120 python3 benchmarks/spec_decode_gpu.py --rates "${1:-0.8}" --repeats 1 \
  --out "$OUT/spec.json"
