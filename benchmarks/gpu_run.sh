#!/usr/bin/env bash
# One device call: install the carried wheels (.whl/), then run the chosen GPU parts, each in
# its own process with its own time limit (`timeout` kills the part's whole process group: a
# server it started goes too); logs and JSON under $OUT.
#
#   bash benchmarks/gpu_run.sh kernels correctness w2 w7 w1        # this checkout, $OUT/<part>.*
#   bash benchmarks/gpu_run.sh --trees before=.before,after=. w1 w2 w7   # before/after sweep
#
# --trees LABEL=DIR,...: every part runs once per tree, back to back in the order given (so
# the two figures of a part are taken minutes apart on the same machine), with cd DIR,
# PYTHONPATH=<wheels>:DIR, SHOAL_COMMIT from DIR/.commit (else git, else "unknown") and
# SHOAL_BENCH_PUBLIC_ONLY=1: the scripts, always this checkout's benchmarks/, then use shoal's
# public API alone (shoal.LLM, SamplingParams, `shoal serve`, `shoal bench`), so an older tree
# and a refactored one are measured the same way; output in $OUT/LABEL/<part>.json and .log.
# Compare two such folders with benchmarks/compare_results.py.
# An older commit's tree for it (untracked, so it travels with the working tree), and this
# checkout's commit (the GPU machine's copy has no .git):
#   mkdir .before && git archive ffd2572 shoal | tar -x -C .before && echo ffd2572 > .before/.commit
#   git rev-parse --short HEAD > .commit
# Carry (git-ignored) .whl, .commit, bench-work/qwen3-0.6b-smol (w8, structured, serving: made
# by benchmarks/export_hf_folder.py --shape qwen3-0.6b, 3.4 MB) and, for embeddings,
# bench-work/minilm-shape.
#
# The sweep's parts (public API only; time per tree on an H200 estimated from the results of
# 2026-12-02..04 in benchmarks/results: process start ~10 s, Qwen3-0.6B ready ~13 s, an 8B or
# DeepSeek-V2-Lite shape ready 21-29 s):
#   w1          W1, Qwen3-0.6B shape, 256 requests, 2 runs; tok/s, ready_s, process_ready_s  ~40 s
#   w2          W2, Llama-3.1-8B shape, batch 1, 128/256; tok/s, ready                       ~50 s
#   w7          W7 ready from process start: Llama-3.1-8B (~45 s) and Qwen3-0.6B (~25 s)     ~70 s
#   w8          W8 serve/offline: offline 2 runs, serve 2x streaming + 1x non-streaming,
#               256 connections from 4 client processes                                    ~100 s
#   w9          W9 forced acceptance a=0, 0.8, k=4, batch 1 and 32: 3 engines (plain, one per
#               rate), each running both batch sizes                                       ~120 s
#   structured  W1 requests free vs JSON schema, one engine, async scheduling               ~45 s
#   w10         DeepSeek-V2-Lite shape batch 1 (median of 3) and the W1 requests            ~75 s
# So before+after fits in three calls of under 10 minutes each (if every part ran to its time
# limit the first call would not: parts that finished keep their files under $OUT), e.g.
#   --trees before=.before,after=. w1 w2 w7        (~5.5 min)
#   --trees before=.before,after=. w8 structured   (~5 min)
#   --trees before=.before,after=. w9 w10          (~6.5 min)
# SMOKE=1 runs the sweep's parts with --smoke (tiny models on the CPU: a check of the driver);
# PYTHON=... picks the interpreter (default python3).
set -u
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
BENCH=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$BENCH")
W8_MODEL=$REPO/bench-work/qwen3-0.6b-smol
SITE=""
$PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$REPO"/.whl/*.whl >/dev/null 2>&1 && SITE=/tmp/site
TREES="" PUBLIC=""
if [ "${1:-}" = --trees ]; then TREES=$2 PUBLIC=1; shift 2; fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
PYTHONPATH=$SITE $PYTHON -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

run() {  # name, limit, command...: in the current tree, output under $DIR
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$DIR/$name.log" 2>&1
  local rc=$?
  echo "== ${LABEL:+$LABEL }$name rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 4 "$DIR/$name.log"
}

part() {
  local py="$PYTHON $BENCH" cli="$PYTHON -m shoal.cli" S=${SMOKE:+--smoke}
  [ -f shoal/cli.py ] || cli="$PYTHON -m shoal.entrypoints.cli"  # trees before the seams refactor
  case $1 in
    # the sweep's parts (see above)
    w1) run w1 120 $py/gpu_suite.py w1 --num-runs 2 $S --out "$DIR/w1.json" ;;
    w2) run w2 120 $py/gpu_suite.py w2 ${PUBLIC:+--no-profile} $S --out "$DIR/w2.json" ;;
    w7) run w7-llama 90 $py/gpu_suite.py w7 --w7-model llama $S --out "$DIR/w7-llama.json"
        run w7-qwen3 90 $py/gpu_suite.py w7 --w7-model qwen3 $S --out "$DIR/w7-qwen3.json" ;;
    w8) run w8 300 $py/w8_serving.py --model "$W8_MODEL" $S --out "$DIR/w8.json" ;;
    w9) run w9 330 $py/spec_decode_gpu.py --rates 0.0,0.8 --repeats 1 $S --out "$DIR/w9.json" ;;
    structured) run structured 220 $py/structured_outputs_gpu.py --tokenizer "$W8_MODEL" $S \
                  --out "$DIR/structured.json" ;;
    w10) run w10 200 $py/deepseek_gpu.py batch1,w1 $S --out "$DIR/w10.json" ;;
    # more parts of this checkout (some reach engine internals: see engine_internals.py)
    kernels) run kernels 150 $PYTHON -m pytest -q -p no:cacheprovider tests/attention/test_triton_kernels.py tests/attention/test_rope_kv_write.py tests/layers/test_fused_moe.py ;;
    correctness) run correctness 280 $py/gpu_correctness.py --out "$DIR/correctness.json" ;;
    ds-correctness) run ds_correctness 150 $py/gpu_correctness.py --shapes deepseek-v2-lite --out "$DIR/ds_correctness.json" ;;
    w3) run w3 300 $cli bench throughput --preset W3 --disable-tqdm --output-json "$DIR/w3.json" ;;
    w3-hf) run w3hf 150 $py/gpu_suite.py w3-hf --out "$DIR/w3hf.json" ;;
    w1mp) run w1mp 90 $py/gpu_suite.py w1 --executor mp --out "$DIR/w1mp.json" ;;
    w2mp) run w2mp 120 $py/gpu_suite.py w2 --executor mp --out "$DIR/w2mp.json" ;;
    w1sync) run w1sync 90 $py/gpu_suite.py w1 --async-scheduling off --out "$DIR/w1sync.json" ;;
    w2sync) run w2sync 120 $py/gpu_suite.py w2 --async-scheduling off --out "$DIR/w2sync.json" ;;
    syncs) run syncs 90 $py/gpu_suite.py syncs --out "$DIR/syncs.json" ;;
    w1split) run w1split 150 $py/gpu_suite.py w1 --split-time --out "$DIR/w1split.json" ;;
    w5) run w5 200 $py/w5_prefix_reuse.py --gpu --out "$DIR/w5.json" ;;
    spec) run spec 240 $py/spec_decode_gpu.py --rates "${SPEC_RATES:-0.0,0.5,0.8,1.0}" --repeats 1 --out "$DIR/spec.json" ;;
    draftgraphs) run draftgraphs 200 $PYTHON -m pytest -q -p no:cacheprovider tests/spec_decode/test_draft_graphs_gpu.py tests/attention/test_verify_graph_buffers.py ;;
    mla-tests) run mla_tests 90 $PYTHON -m pytest -q -p no:cacheprovider tests/attention/test_mla_kernels.py tests/attention/test_mla_backends.py tests/attention/test_verify_graph_buffers.py tests/attention/test_mla_engine.py ;;
    deepseek) run deepseek 250 $py/deepseek_gpu.py all --out "$DIR/deepseek.json" ;;
    embeddings) run embeddings 70 $py/embeddings.py --device cuda --model "$REPO/bench-work/minilm-shape" --load-format dummy --out "$DIR/embeddings.json" ;;
    # W8 in full (issue 20): 3 streaming runs with the step trace, batch-1 over HTTP on the 8B
    serving) run serving 500 $py/w8_serving.py --model "$W8_MODEL" --stream-runs 3 --step-trace --batch1-model meta-llama/Llama-3.1-8B --out "$DIR/serving.json" ;;
    # the later issues' sweeps (30 hybrid, 34 images, 35 LoRA, 36 disaggregation, 37 RL);
    # on an H100 on 2026-12-05: vl 134 s; rl (--cycles 4) 86 s, 10 cycles passed 140 s;
    # hybrid-batch1 81 s (Qwen3.5-27B, Qwen3-Next-24layers failing fast: no KV room on
    # 80 GB); hybrid-correctness did not finish one model in 110 s (give it a call of its
    # own, --stage-timeout 300); disagg passed 470 s (layout b's slow transfers)
    # transformers 5.25 (Qwen3.5, Kimi Linear classes) from bench-work/tf525: its wheel plus
    # huggingface_hub 2.4 and that one's dependencies (httpx2, httpcore2, hf_xet, ...): 5.25
    # refuses the image's hub 1.x; a fresh folder, so no older hub stays behind on a warm machine
    hybrid-correctness)
      TF=/tmp/tf525; rm -rf $TF; $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target $TF "$REPO"/bench-work/tf525/*.whl >/dev/null 2>&1 || TF=""
      PYTHONPATH=${TF:+$TF:}$PYTHONPATH run hybrid_correctness ${HC_LIMIT:-190} $py/hybrid_gpu.py \
        correctness --stage-timeout ${HC_STAGE_TIMEOUT:-110} $S \
        ${HYBRID_MODELS:+--models $HYBRID_MODELS} \
        --out "$DIR/hybrid_correctness.json" ;;
    hybrid-engine) run hybrid_engine ${HE_LIMIT:-560} $py/hybrid_gpu.py batch1,w1,long_context \
        --stage-timeout ${HE_STAGE_TIMEOUT:-250} $S ${HYBRID_MODELS:+--models $HYBRID_MODELS} \
        --out "$DIR/hybrid_engine.json" ;;
    quant) run quant ${QUANT_LIMIT:-330} $py/quant_gpu.py ${QUANT_PARTS:-all} --timeout 110 $S \
        ${QUANT_SERVE:+--serve} ${QUANT_VARIANTS:+--variants $QUANT_VARIANTS} --out "$DIR/quant.json" ;;
    quantw3) run quantw3 ${QUANTW3_LIMIT:-330} $py/quant_throughput_gpu.py ${QUANTW3_CASES:+--cases $QUANTW3_CASES} --timeout 150 $S --out "$DIR/quantw3.json" ;;
    # the INT4 GEMV at one row: read patterns, GPTQ vs tile_codes' layout, programs a
    # multiprocessor, L2-warm vs cold timing (benchmarks/int4_read_probe.py; ~3 min estimated)
    int4-probe) run int4_probe ${I4P_LIMIT:-300} $py/int4_read_probe.py \
        ${I4P_SHAPES:+--shapes $I4P_SHAPES} --out "$DIR/int4_probe.json" ;;
    gptoss) run gptoss ${GPTOSS_LIMIT:-240} $py/gpt_oss_gpu.py ${GPTOSS_PARTS:-all} $S --out "$DIR/gptoss.json" ;;
    # the GPU tests of code not yet run on a GPU (2026-12-06 late: the one-launch MoE and
    # DeepSeek routing, the MXFP4 decode experts' word tiles); the dense decode GEMV
    # (half_gemv.py) is not in the default list: its file times F.linear against each
    # tile, ~5 min: GPUTESTS_FILES=tests/layers/test_half_gemv.py GPUTESTS_LIMIT=500. Nine
    # files at 120 s each may pass one call's 600 s: split them with GPUTESTS_FILES. One
    # pytest process per file, since a CUDA
    # fault poisons the rest of its process (the first run of 2026-12-06 hid 37 results
    # behind one); transformers 5.25 for V3.2/V4 as in `v4`; logs gputests-<file>.log
    gputests) TF=/tmp/tf525; rm -rf $TF; $PYTHON -m pip install -q --no-index --no-deps --no-compile \
          --no-cache-dir --upgrade --target $TF "$REPO"/bench-work/tf525/*.whl >/dev/null 2>&1 || TF=""
        for f in ${GPUTESTS_FILES:-tests/layers/test_topk_routing.py \
            tests/layers/test_deepseek_routing_kernel.py tests/layers/test_mxfp4_decode_words.py \
            tests/layers/test_mxfp4_decode_experts.py tests/layers/test_mxfp4_moe.py \
            tests/attention/test_fp8_index_scores.py tests/attention/test_fp8_kv_kernels.py \
            tests/layers/test_v4_fp8_decode_kernels.py tests/models/test_deepseek_sparse_fp8_kv.py}; do
          PYTHONPATH=${TF:+$TF:}$PYTHONPATH run "gputests-$(basename "$f" .py)" \
            ${GPUTESTS_LIMIT:-120} $PYTHON -m pytest -q -s -p no:cacheprovider "$f"
        done ;;
    stepprof) run stepprof ${STEPPROF_LIMIT:-300} $py/step_profile_gpu.py ${STEPPROF_MODEL:+--model "$STEPPROF_MODEL"} $S --out "$DIR/stepprof.json" ;;
    w8pool) run w8pool 300 $py/w8_serving.py --model "$W8_MODEL" --api-server-count 2 \
        --concurrency 1024 --offline-runs 1 --stream-runs 1 $S --out "$DIR/w8pool.json" ;;
    w8one) run w8one 260 $py/w8_serving.py --model "$W8_MODEL" --api-server-count 1 \
        --concurrency 1024 --offline-runs 1 --stream-runs 1 $S --out "$DIR/w8one.json" ;;
    # batch 1 through `shoal serve` (streaming, 6 requests one at a time) of HS_MODEL (default
    # Qwen3.5-35B-A3B): its inter-token latency, to set beside hybrid-batch1's offline step of
    # the same model (HYBRID_MODELS=Qwen/Qwen3.5-35B-A3B), ~90 s; SMOKE: the tiny smoke model
    hybrid-serve) run hybrid_serve ${HS_LIMIT:-200} $py/w8_serving.py --model "$W8_MODEL" \
        ${S:---batch1-model "${HS_MODEL:-Qwen/Qwen3.5-35B-A3B}"} --batch1-only $S \
        --out "$DIR/hybrid_serve.json" ;;
    # (each model in a child process of its own, --stage-timeout each; issue 30's three H200
    # hybrids: HYBRID_MODELS=Qwen/Qwen3.5-35B-A3B,Qwen/Qwen3-Next-80B-A3B-Instruct-24layers,
    # moonshotai/Kimi-Linear-48B-A3B-Instruct HB_LIMIT=360, ~300 s)
    hybrid-batch1) run hybrid_batch1 ${HB_LIMIT:-230} $py/hybrid_gpu.py batch1 --stage-timeout 115 $S \
        ${S:---models "${HYBRID_MODELS:-Qwen/Qwen3.5-27B,moonshotai/Kimi-Linear-48B-A3B-Instruct}"} \
        --out "$DIR/hybrid_batch1.json" ;;
    # the fused linear decode's column split (SHOAL_LINEAR_DECODE_SPLIT) off, then chosen from
    # the batch and the SMs, on the same machine: batch 1 of each model, ~45 s a run
    hybrid-split) for sp in 1 0; do
          SHOAL_LINEAR_DECODE_SPLIT=$sp run hybrid_split$sp 150 $py/hybrid_gpu.py batch1 \
            --stage-timeout 140 $S ${S:---models "${HYBRID_MODELS:-Qwen/Qwen3.5-35B-A3B}"} \
            --out "$DIR/hybrid_split$sp.json"
        done ;;
    # W2 batch 1 with SHOAL_PDL=0 and 1 (the default, shoal/pdl.py), on the same machine,
    # ~60 s a run for FP8; PDL_MODES picks the modes (and SHOAL_DENSE_GEMV=0 in the
    # environment keeps cuBLAS for the dense bf16 layers)
    quant-pdl) for mode in ${PDL_MODES:-0 1}; do
          SHOAL_PDL=$mode run quant_pdl$mode 150 $py/quant_gpu.py decode --timeout 140 $S \
            --variants ${QUANT_VARIANTS:-fp8_channel} --out "$DIR/quant_pdl$mode.json"
        done ;;
    # W2 batch 1 with the launch tuner timing warm (SHOAL_QUANT_TUNING_COLD=0, the default)
    # and cold (1: each candidate after a read past the L2), back to back; ~60-90 s a run;
    # COLD_MODES picks the modes, QUANT_VARIANTS the formats (e.g. int4_g128,fp8_channel,bf16)
    quant-cold) for mode in ${COLD_MODES:-0 1}; do
          SHOAL_QUANT_TUNING_COLD=$mode run quant_cold$mode 200 $py/quant_gpu.py decode \
            --timeout 190 $S --variants ${QUANT_VARIANTS:-int4_g128} \
            --out "$DIR/quant_cold$mode.json"
        done ;;
    # W2 batch 1, INT4 g128, without and with the tiled copy of the codes (SHOAL_INT4_TILED:
    # the tuner also times the tensor-core GEMV reading tile_codes' layout), back to back
    quant-tiled) for mode in ${TILED_MODES:-0 1}; do
          SHOAL_INT4_TILED=$mode run quant_tiled$mode 200 $py/quant_gpu.py decode \
            --timeout 190 $S --variants int4_g128 --out "$DIR/quant_tiled$mode.json"
        done ;;
    # PDL on the hybrid and MoE decode kernels (SHOAL_PDL=1, the default) beside none (0),
    # on the same machine: batch 1 of each model, ~90 s a run (Qwen3.5-35B-A3B
    # ready in 66 s on an H200); equal first_run_token_ids say the outputs agree; PDL_MODES
    # as in quant-pdl
    hybrid-pdl) for mode in ${PDL_MODES:-0 1}; do
          SHOAL_PDL=$mode run hybrid_pdl$mode 170 $py/hybrid_gpu.py batch1 \
            --stage-timeout 160 $S ${S:---models "${HYBRID_MODELS:-Qwen/Qwen3.5-35B-A3B}"} \
            --out "$DIR/hybrid_pdl$mode.json"
        done ;;
    # issue 38: W9 with EAGLE-3 and confidence beside the forced method at a = 0 and 1, batch
    # 1 and 32 (~150 s on an H100 at a = 0 alone: W9E_RATES=0.0)
    w9-eagle3) run w9_eagle3 ${W9E_LIMIT:-420} $py/spec_decode_gpu.py \
        --methods forced,eagle3,eagle3_confidence --rates ${W9E_RATES:-0.0,1.0} \
        --batch-sizes 1,32 --repeats 1 $S --out "$DIR/w9_eagle3.json" ;;
    # issue 38's a = 0 cost: EAGLE-3's phases a step (forced acceptance 0 and 1, batch 1 and
    # 32) and the step loop's host slack (a busy-wait added to each step's finish)
    eagle3-phases) run eagle3_phases ${E3P_LIMIT:-240} $py/eagle3_step_profile.py $S \
        ${E3P_RATES:+--rates $E3P_RATES} \
        --out "$DIR/eagle3_phases.json" ;;
    host-slack) run host_slack 240 $py/host_slack.py $S --out "$DIR/host_slack.json" ;;
    rl) run rl 200 $py/rl_gpu.py --cycles 6 $S --out "$DIR/rl.json" ;;
    lora) run lora 270 $py/lora_gpu.py all --num-requests 128 $S --out "$DIR/lora.json" ;;
    vl) run vl 320 $py/vl_gpu.py --sections throughput,ttft,encoder,serve --runs 1 \
        --timeout 150 $S --out "$DIR/vl.json" ;;
    disagg) run disagg 470 $py/disagg_gpu.py --budget-s 430 $S --out "$DIR/disagg.json" ;;
    # issue 32: DeepSeek-V4's 4-layer cut (51 GiB) and MLA at its width, eager V4; transformers
    # 5.25 (its DeepseekV4 config and class) from bench-work/tf525; estimated ~220 s on an H200
    v4) TF=/tmp/tf525; rm -rf $TF; $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --upgrade --target $TF "$REPO"/bench-work/tf525/*.whl >/dev/null 2>&1 || TF=""
        PYTHONPATH=${TF:+$TF:}$PYTHONPATH run v4 ${V4_LIMIT:-330} $py/deepseek_v4_gpu.py \
          ${V4_PARTS:-all} --stage-timeout ${V4_STAGE_TIMEOUT:-170} $S --out "$DIR/v4.json" ;;
    *) echo "unknown part $1" ;;
  esac
}

for p in "$@"; do
  IFS=, read -ra specs <<< "${TREES:-main=$REPO}"
  for spec in "${specs[@]}"; do
    LABEL=${TREES:+${spec%%=*}}
    TREE=$(cd "${spec#*=}" && pwd) || { echo "no tree ${spec#*=}"; continue; }
    DIR=$OUT${LABEL:+/$LABEL}
    mkdir -p "$DIR"
    COMMIT=$(cat "$TREE/.commit" 2>/dev/null || git -C "$TREE" rev-parse HEAD 2>/dev/null || echo unknown)
    # TRITON_CACHE_BASE=DIR: each tree compiles into DIR/LABEL, so the first part of each
    # tree (put w7 first) starts from an empty Triton cache, and neither tree reuses the other's.
    (cd "$TREE" && export PYTHONPATH=${SITE:+$SITE:}$TREE SHOAL_COMMIT=$COMMIT \
       SHOAL_BENCH_PUBLIC_ONLY=$PUBLIC && \
       { [ -z "${TRITON_CACHE_BASE:-}" ] || export TRITON_CACHE_DIR=$TRITON_CACHE_BASE/${LABEL:-main}; } && \
       part "$p")
  done
done
