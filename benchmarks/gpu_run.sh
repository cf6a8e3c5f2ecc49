#!/usr/bin/env bash
# One device call: install the carried wheels, run the chosen GPU parts, each with its own time
# limit, logs and JSON under $OUT. Usage (on the GPU machine, repo root):
#   bash benchmarks/gpu_run.sh kernels correctness w2 w7 w1
# (structured and structured-host need bench-work/qwen3-0.6b-smol carried: SmolLM2's tokenizer)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD
export SHOAL_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
run() {  # name, limit, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 4 "$OUT/$name.log"
}
for part in "$@"; do
  case $part in
    kernels) run kernels 150 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_kernels.py tests/attention/test_rope_kv_write.py tests/layers/test_fused_moe.py ;;
    correctness) run correctness 280 python3 benchmarks/gpu_correctness.py --out "$OUT/correctness.json" ;;
    w1) run w1 90 python3 benchmarks/gpu_suite.py w1 --out "$OUT/w1.json" ;;
    w2) run w2 120 python3 benchmarks/gpu_suite.py w2 --out "$OUT/w2.json" ;;
    w3) run w3 300 python3 benchmarks/gpu_suite.py w3 --out "$OUT/w3.json" ;;
    w3-hf) run w3hf 150 python3 benchmarks/gpu_suite.py w3-hf --out "$OUT/w3hf.json" ;;
    w7) SHOAL_PROCESS_START=$(date +%s.%N) run w7 60 python3 benchmarks/gpu_suite.py w7 --out "$OUT/w7.json" ;;
    w1mp) run w1mp 90 python3 benchmarks/gpu_suite.py w1 --executor mp --out "$OUT/w1mp.json" ;;
    w2mp) run w2mp 120 python3 benchmarks/gpu_suite.py w2 --executor mp --out "$OUT/w2mp.json" ;;
    w1sync) run w1sync 90 python3 benchmarks/gpu_suite.py w1 --async-scheduling off --out "$OUT/w1sync.json" ;;
    w2sync) run w2sync 120 python3 benchmarks/gpu_suite.py w2 --async-scheduling off --out "$OUT/w2sync.json" ;;
    syncs) run syncs 90 python3 benchmarks/gpu_suite.py syncs --out "$OUT/syncs.json" ;;
    w1split) run w1split 150 python3 benchmarks/gpu_suite.py w1 --split-time --out "$OUT/w1split.json" ;;
    w5) run w5 200 python3 benchmarks/w5_prefix_reuse.py --gpu --out "$OUT/w5.json" ;;
    spec) run spec 240 python3 benchmarks/spec_decode_gpu.py --rates 0.0,0.5,0.8,1.0 --repeats 1 --out "$OUT/spec.json" ;;
    structured) run structured 220 python3 benchmarks/structured_outputs_gpu.py --tokenizer bench-work/qwen3-0.6b-smol --out "$OUT/structured.json" ;;
    structured-host) run structured_host 100 python3 benchmarks/structured_host_costs.py --tokenizer bench-work/qwen3-0.6b-smol --out "$OUT/structured_host.json" ;;
    draftgraphs) run draftgraphs 200 python3 -m pytest -q -p no:cacheprovider tests/spec_decode/test_draft_graphs_gpu.py tests/attention/test_verify_graph_buffers.py ;;
    *) echo "unknown part $part" ;;
  esac
done
