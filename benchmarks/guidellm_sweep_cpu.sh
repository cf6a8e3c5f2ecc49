#!/usr/bin/env bash
# Issue 17 ("the laptop path"): a guidellm sweep against `shoal serve` started with its
# defaults (as `make serve` starts it: `shoal serve`, the embedded SmolLM2-135M, port 8000,
# no other flag), on the CPU, at W4's CPU shape (256 prompt / 64 output tokens, synthetic).
#
# guidellm lives in its own virtualenv (its dependencies do not mix with shoal's):
#     python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm==0.8.1 torch==2.13.0
# (torch pinned so that pip does not pull a CUDA build.)
# The tokenizer is the Hugging Face folder that benchmarks/export_hf_folder.py makes from the
# embedded GGUF (bench-work/smollm2-hf); nothing is fetched from a model hub (HF_HUB_OFFLINE=1).
#
#     benchmarks/guidellm_sweep_cpu.sh [OUT_DIR]     # default bench-work/guidellm-<time>
#
# SHOAL_SRC=<folder> serves from that source tree instead of the work tree (e.g. a git archive
# of HEAD, as benchmarks/w4_cpu_compare.py makes under bench-work/, so that edits in progress
# are not measured); SHOAL_EXTENSIONS_DIR then points at the built C++ CPU kernels
# (default: this tree's shoal/csrc/build, which `make install` fills).
#
# Each of the sweep's 10 sub-benchmarks (synchronous, throughput, 8 constant rates between
# them) is bounded to 30 s, so the sweep takes about 8-9 minutes. The machine must be
# otherwise quiet; run one benchmark at a time.
#
# max_concurrency=8 (PROFILE): with guidellm's default 512, the throughput phase sends 512
# requests at once; shoal on 2 cores (1 model thread, prefill ~150-250 tok/s in float32) is
# still prefilling the first 64 of them after 30 s, so none finishes, the sweep takes 0 req/s
# as the throughput rate and interpolates constant rates from the synchronous rate (0.13 req/s)
# down to 0; at 0.03 req/s no request falls inside the 30 s window and guidellm 0.8.1 aborts
# ("ValueError: Cannot compile GenerativeMetrics: No measurement start or end times
# available"), writing no report. With 8, requests finish inside the window.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=$(realpath -m "${1:-bench-work/guidellm-$(date -u +%Y%m%d-%H%M%S)}")
PORT=8000
mkdir -p "$OUT"

export SHOAL_EXTENSIONS_DIR=${SHOAL_EXTENSIONS_DIR:-$REPO/shoal/csrc/build}
(cd "${SHOAL_SRC:-$REPO}" && exec "$REPO/.venv/bin/python" -m shoal.cli serve) \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
T0=$(date +%s.%N)
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { echo "server exited; see $OUT/server.log"; exit 1; }
    sleep 0.5
done
echo "server ready after $(echo "$(date +%s.%N) - $T0" | bc) s" | tee "$OUT/ready.txt"

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv-guidellm/bin/guidellm run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=/v1/completions" \
    --profile "${PROFILE:-kind=sweep,sweep_size=10,max_concurrency=8}" \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=64 \
    --tokenizer "kind=huggingface_auto,model=$REPO/bench-work/smollm2-hf" \
    --constraint kind=max_duration,seconds=30 \
    --output "kind=json,path=$OUT/guidellm.json" \
    --disable-console-interactive 2>&1 | tee "$OUT/guidellm.log"
