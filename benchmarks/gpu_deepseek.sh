#!/usr/bin/env bash
# One device call for the DeepSeek family (issue 12): the MLA kernel and backend tests compiled
# on the GPU, the DeepSeek-V2-Lite shape against transformers (dense layer + one MoE layer at
# full width, bf16 and fp32), then benchmarks/deepseek_gpu.py (MLA kernel vs expanded form,
# KV bytes, batch-1 decode against the active-weight floor, W1-style throughput).
# Usage on the GPU machine, repo root, carrying .whl: bash benchmarks/gpu_deepseek.sh
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
run mla_tests 90 python3 -m pytest -q -p no:cacheprovider tests/attention/test_mla_kernels.py \
  tests/attention/test_mla_backends.py tests/attention/test_verify_graph_buffers.py \
  tests/attention/test_mla_engine.py
run ds_correctness 150 python3 benchmarks/gpu_correctness.py --shapes deepseek-v2-lite \
  --out "$OUT/ds_correctness.json"
run deepseek 250 python3 benchmarks/deepseek_gpu.py all --out "$OUT/deepseek.json"
