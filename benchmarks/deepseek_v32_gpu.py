"""DeepSeek-V3.2 on one 80 GB H100 at the engine level: the KV bytes a token of context costs,
batch-1 decode against the active-weight read floor, W1-style throughput, and decode step time
at 1k / 32k / 128k tokens of context against DeepSeek-V3's dense latent attention (MLA) at the
same width (the sparse path should stay flat where the dense one grows). Every engine runs the
shipped shape deepseek-ai/DeepSeek-V3.2-Exp-4layers (shoal/model_configs/
deepseek-v3.2-exp-4layers: V3's width, 3 dense layers then one MoE layer, index_topk 2048) on
random weights (load_format="dummy"): prompts are token ids.

    python benchmarks/deepseek_v32_gpu.py all --out bench-work/v32-h100.json
    python benchmarks/deepseek_v32_gpu.py kv,long_context,batch1,w1 --out FILE \
        [--contexts 1024,32768] [--num-requests N] [--stage-timeout S]
    python benchmarks/deepseek_v32_gpu.py all --smoke --out /tmp/v32.json   # CPU, tiny configs

The shape in bf16 (counted on the built models): 15,166,939,392 parameters, 30.33 GB (28.25
GiB): embedding and LM head 2 x 129,280 x 7,168 = 1.853B; per layer MLA 187.1M and the
indexer 14.0M (55.8M in all); 3 dense MLPs of 3 x 7,168 x 18,432 = 396.4M; the MoE layer's
256 routed experts of 3 x 7,168 x 2,048 = 44.0M (11.27B) plus one shared expert and the
router. Active a decode token: 4,244,971,776 (8.49 GB; 8 of 256 experts), a floor of 2.83 ms
(353 tok/s) at the H100's 3.0 TB/s copy bandwidth. The MLA engine is the same config with the
indexer removed: 15,111,101,696 parameters.

Parts (one JSON record each, the file rewritten after every one):

- kv (kv_bytes): from the engine's cache specs (runner.kv_specs, deepseek_v4_gpu.v4_layout):
  a token of context keeps, per layer, the latent row (kv_lora_rank 512 + rope 64) and the
  indexer's key (index_head_dim 128): 4 x (576 + 128) x 2 B = 5,632 B, against MLA's
  4 x 576 x 2 B = 4,608 B (the indexer adds 22%; no window or state rows).
- long_context: for contexts 1k, 32k, 128k (--contexts), one request prefilled to that length
  (chunks of 8192 tokens), then 64 greedy tokens: prefill (TTFT) and decode ms a token from
  RequestOutput.metrics (long_context_runs.measure_contexts), and the bytes the sequence keeps.
  The same requests on the MLA engine (stage mla: DeepseekV3ForCausalLM, every query reading
  every cached token; deepseek_v4_gpu.mla_contexts): long_context_mla. A long_context_summary
  record pairs the two, context by context (decode ms, their ratio, prefill s, bytes), and
  each engine's decode growth from the first context to the last.
- batch1: deepseek_gpu.batch1 (128 prompt ids, 256 greedy tokens, median of 3) with its
  active-weight floor (deepseek_gpu.weight_floor: routed experts counted k = 8 of 256).
- w1: deepseek_gpu.w1 (W1 requests: inputs and outputs U[100, 1024], temperature 0.6,
  max_num_seqs 256; --num-requests for fewer).

Engines. Long (v32 and mla stages): max_model_len the largest context + decode + 128 (131,264
at 128k; --max-model-len sets it), max_num_seqs 8 (one request at a time runs there; fewer
decode graphs to capture). W1 (v32_w1 stage: batch1, w1): max_model_len 4096 as deepseek_gpu's
W1 engine (whatever --max-model-len says), max_num_seqs 256. Why two V3.2 engines: W1
is measured as every other model's W1 is, at 4k tables; the long engine captures decode graphs
per table width from index_topk (deepseek_v32.py decode_table_buckets_from), so its 1k decode
replays a graph whose indexer is skipped and its 128k decode scores 128k positions a row. All: kv_cache_memory_bytes 4 GiB (762k tokens of V3.2 context: the
131k request, or W1's worst case of 256 x 2,048 = 524k), max_num_batched_tokens 8192.
Memory on the H100 (79 GiB): 28.25 GiB of weights + 4 GiB of KV + an 8192-token chunk's
activations (absorbed queries [8192, 128, 576] 1.1 GiB, the attention output 1.0 GiB, the
dense MLP's gate/up 0.56 GiB, indexer scores at most 256 MiB a piece (+ top-k outputs), picks
[8192, 2048]), under 6 GiB, + graph pools: about 40 GiB.

Stages run in child processes (benchmarks/staged_gpu.py), each with --stage-timeout (default
200 s), in this order: v32 (kv, long_context), mla (long_context), then the summary is
written, then v32_w1 (batch1, w1), so a W1 stage that runs out of time keeps the comparison.
Estimated on the H100 (not measured yet; from the V4 cut's H100 runs of 2026-12-06: process
start to ready ~20 s, its MLA engine at 64 heads prefilled 128k tokens in 34.9 s):
v32 ~60 s (ready ~30 s; the 128k prefill's indexer scores 131k^2/2 x 64 heads x 128 x 2 x 4
layers = 5.6e14 FLOPs plus top-2048 of every row, ~20 s; 32k ~2 s), mla ~110 s (ready ~30 s;
the dense 128k prefill at 128 heads, 131k^2/2 x 128 x 1,088 x 2 x 4 = 9.6e15 FLOPs, ~70 s),
v32_w1 ~75 s (ready ~30 s, batch1 ~8 s, w1 ~35 s): about 245 s in all. A child that dies or
outlasts its timeout leaves error records with its stderr tail; exit status 1 when any record
has an error. --no-isolate runs them in this process. --smoke writes tiny V3.2 and MLA configs
(4 layers, hidden 64, index_topk 128: the 64-token context reads every key, 256 and 480 only
the picks) to a temp folder and runs every part on the CPU in float32 at small sizes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import deepseek_gpu
import staged_gpu
from deepseek_v4_gpu import (
    engine_eager,
    mla_bytes_per_token,
    mla_contexts,
    read_config,
    v4_layout,
)
from long_context_runs import context_max_model_len, contexts_for, measure_contexts
from results_file import record, shoal_source, write
from staged_gpu import LazyEngine, append, engine_kw, read_records

MODEL = "deepseek-ai/DeepSeek-V3.2-Exp-4layers"
CONFIG_FOLDER = "deepseek-v3.2-exp-4layers"
PARTS = ("kv", "batch1", "long_context", "w1")
# (stage, its parts), each one child process; the mla stage writes long_context_mla. The
# summary is written between the long stages and the W1 one.
LONG_STAGES = (("v32", ("kv", "long_context")), ("mla", ("long_context",)))
W1_STAGES = (("v32_w1", ("batch1", "w1")),)
STAGES = LONG_STAGES + W1_STAGES
WORKLOADS = {"kv": "kv_bytes"}
MLA_WORKLOAD = "long_context_mla"
INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")
LONG_MAX_NUM_SEQS = 8  # the long engines run one request at a time

FULL = dict(dtype="bfloat16", b1_in=128, b1_out=256, w1_in=(100, 1024), w1_out=(100, 1024),
            num_requests=256, kv_cache_memory_bytes=4 << 30, contexts=[1024, 32768, 131072],
            decode_tokens=64, max_num_batched_tokens=8192, max_model_len=None,
            w1_max_model_len=4096, device=None)
SMOKE = dict(dtype="float32", b1_in=16, b1_out=12, w1_in=(8, 40), w1_out=(4, 16),
             num_requests=6, kv_cache_memory_bytes=32 << 20, contexts=[64, 256, 480],
             decode_tokens=8, max_num_batched_tokens=128, max_model_len=512,
             w1_max_model_len=512, device="cpu")

# The tiny config of --smoke: the cut's structure (q_lora, 3 dense layers then a MoE one,
# V3's routing, the indexer) at toy sizes.
SMOKE_V32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 64, "index_head_dim": 32, "index_n_heads": 8,
    "index_topk": 128, "intermediate_size": 128, "kv_lora_rank": 32,
    "max_position_embeddings": 512, "moe_intermediate_size": 32, "n_group": 4,
    "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 4, "q_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 2,
    "v_head_dim": 16, "vocab_size": 512}


def v32_folder(args: argparse.Namespace) -> Path:
    """The V3.2 model folder: --model, else the shipped cut in the shoal tree `import shoal`
    loads (a data file, not an engine API)."""
    if args.model:
        return Path(args.model)
    return Path(shoal_source() or ".", "shoal", "model_configs", CONFIG_FOLDER)


def mla_config(v32: dict[str, Any]) -> dict[str, Any]:
    """Dense MLA at the same width: the V3.2 config without its indexer, as DeepSeek-V3."""
    if missing := [k for k in INDEXER_FIELDS if k not in v32]:
        raise ValueError(f"not a DeepSeek-V3.2 config: it has no {', '.join(missing)}")
    base = {k: v for k, v in v32.items() if k not in INDEXER_FIELDS}
    return base | {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}


def element_bytes(sizes: dict[str, Any]) -> int:
    return 2 if sizes["dtype"] == "bfloat16" else 4


def long_max_num_seqs(args: argparse.Namespace) -> int:
    return min(args.max_num_seqs, LONG_MAX_NUM_SEQS)


# ---- engines -------------------------------------------------------------------------------

class EngineStage(LazyEngine):
    """The V3.2 cut on one engine (built on first use): the long engine (kv, long_context) or
    the W1 one (batch1, w1). It has what deepseek_gpu's batch1 and w1 read of their Bench
    (llm, args, sizes, hf_config, vocab, common)."""

    def __init__(self, args: argparse.Namespace, sizes: dict[str, Any], w1_engine: bool):
        self.args, self.sizes, self.w1_engine = args, sizes, w1_engine
        folder = v32_folder(args)
        self.cfg = read_config(folder)
        self.hf_config = SimpleNamespace(**self.cfg)
        if w1_engine:
            self.max_model_len = int(sizes["w1_max_model_len"])
            kw = engine_kw(args, sizes, self.max_model_len)
        else:
            self.max_model_len = context_max_model_len(args, sizes,
                                                       self.cfg.get("max_position_embeddings"))
            kw = engine_kw(args, sizes, self.max_model_len) | dict(
                max_num_seqs=long_max_num_seqs(args))
        super().__init__(str(folder), kw)

    def vocab(self) -> int:
        return int(self.cfg["vocab_size"])

    def common(self) -> dict[str, Any]:
        return dict(model=self.args.model or MODEL, dtype=self.sizes["dtype"],
                    smoke=self.args.smoke, stage_engine="w1" if self.w1_engine else "long",
                    **self.ready_fields(), max_num_seqs=self.kw["max_num_seqs"],
                    max_model_len=self.max_model_len,
                    kv_cache_memory_bytes=self.sizes["kv_cache_memory_bytes"],
                    max_num_batched_tokens=self.kw["max_num_batched_tokens"],
                    enforce_eager=engine_eager(self._engine))


# ---- parts ---------------------------------------------------------------------------------

def kv_bytes(st: EngineStage) -> dict[str, Any]:
    lay = v4_layout(st.llm)
    cfg, elem = st.cfg, element_bytes(st.sizes)
    mla = mla_bytes_per_token(mla_config(cfg), elem)
    from_config = cfg["num_hidden_layers"] * (
        cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["index_head_dim"]) * elem
    out: dict[str, Any] = dict(
        layout=lay, mla_bytes_per_token=mla, bytes_per_token_from_config=from_config,
        indexer_bytes_per_token=cfg["num_hidden_layers"] * cfg["index_head_dim"] * elem,
        rule="V3.2: layers x (kv_lora_rank + qk_rope_head_dim + index_head_dim) x element "
             "bytes; MLA: layers x (kv_lora_rank + qk_rope_head_dim) x element bytes")
    if lay:
        per = lay["context_bytes_per_token"]
        out |= dict(context_bytes_per_token=per, matches_config=per == from_config,
                    v32_over_mla_per_token=per / mla,
                    at_contexts=[dict(context=c, v32_bytes=int(per * c), mla_bytes=mla * c)
                                 for c in contexts_for(st.args, st.sizes)])
    return record("kv_bytes", "shoal", **st.common(), **out)


def long_context(st: EngineStage) -> dict[str, Any]:
    lay = v4_layout(st.llm)
    per_token = mla_bytes_per_token(mla_config(st.cfg), element_bytes(st.sizes))

    def seq_bytes(c: int) -> dict[str, Any]:
        return dict(kv_bytes=int(lay["context_bytes_per_token"] * c) if lay else None)

    rows = measure_contexts(st.llm, contexts_for(st.args, st.sizes), st.max_model_len,
                            st.sizes, st.vocab(), st.args.seed, seq_bytes)
    for r in rows:
        r["mla_kv_bytes"] = per_token * r["context"]
    return record("long_context", "shoal", **st.common(), index_topk=st.cfg["index_topk"],
                  layout=lay, contexts=rows,
                  bytes_rule="kv_bytes: context_bytes_per_token x tokens (latent rows and "
                  "indexer keys); mla_kv_bytes: layers x latent row x tokens")


def batch1(st: EngineStage) -> dict[str, Any]:
    rec = deepseek_gpu.batch1(st)
    rec["kv_read_note"] = (
        "kv_bytes_read_per_token_at_mean_context counts the latent rows only; the indexer's "
        "keys add index_head_dim x element bytes a position and layer; its decode graphs "
        "score the positions of their table width (from index_topk, doubling), none within "
        "index_topk")
    return rec


def long_context_mla(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    raw = mla_config(read_config(v32_folder(args)))
    return mla_contexts(args, sizes, raw, "DeepseekV3ForCausalLM: the V3.2 cut without its "
                        "indexer", max_num_seqs=long_max_num_seqs(args))


# ---- stages, the child processes and the summary -------------------------------------------

def run_stage(args: argparse.Namespace, sizes: dict[str, Any], stage: str,
              parts: list[str]) -> None:
    """The stage's parts, each record appended to --out as it comes."""
    if stage == "mla":
        staged_gpu.run_part(args.out, MLA_WORKLOAD, MODEL, long_context_mla, args, sizes)
        return
    fns = {"kv": kv_bytes, "batch1": batch1, "long_context": long_context,
           "w1": deepseek_gpu.w1}
    staged_gpu.run_engine_parts(args.out, MODEL,
                                lambda: EngineStage(args, sizes, stage == "v32_w1"),
                                [(WORKLOADS.get(p, p), fns[p]) for p in parts])


def run_child(args: argparse.Namespace, stage: str, parts: list[str]) -> None:
    """run_stage in a child process; a child that dies leaves error records."""
    wanted = [MLA_WORKLOAD] if stage == "mla" else [WORKLOADS.get(p, p) for p in parts]
    staged_gpu.run_child(args, __file__, stage, parts, workloads=wanted, model=MODEL,
                         extra=["--model", args.model] if args.model else [])


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summary(path: Path) -> dict[str, Any] | None:
    """V3.2 against MLA, context by context, from the two long-context records."""
    recs = {r.get("workload"): r for r in read_records(path)}
    v32, mla = recs.get("long_context"), recs.get(MLA_WORKLOAD)
    if not v32 or "contexts" not in v32:
        return None
    by_ctx = {r["context"]: r for r in (mla or {}).get("contexts", [])}
    rows = []
    for s in v32["contexts"]:
        d = by_ctx.get(s["context"], {})
        sd, dd = s.get("decode_ms_per_token"), d.get("decode_ms_per_token")
        sb, db = s.get("kv_bytes"), d.get("kv_bytes") or s.get("mla_kv_bytes")
        rows.append(dict(context=s["context"], v32_decode_ms=sd, mla_decode_ms=dd,
                         v32_over_mla_decode=ratio(sd, dd), v32_prefill_s=s.get("prefill_s"),
                         mla_prefill_s=d.get("prefill_s"),
                         v32_over_mla_prefill=ratio(s.get("prefill_s"), d.get("prefill_s")),
                         v32_kv_bytes=sb, mla_kv_bytes=db, v32_over_mla_bytes=ratio(sb, db)))

    def growth(key: str) -> float | None:  # decode ms at the last context over the first
        timed = [r[key] for r in rows if r[key]]
        return timed[-1] / timed[0] if len(timed) > 1 else None

    return record("long_context_summary", "shoal", model=MODEL, smoke=v32.get("smoke"),
                  v32_enforce_eager=v32.get("enforce_eager"),
                  mla_enforce_eager=(mla or {}).get("enforce_eager"),
                  v32_decode_growth=growth("v32_decode_ms"),
                  mla_decode_growth=growth("mla_decode_ms"),
                  growth_rule="decode ms at the largest timed context over the smallest",
                  contexts=rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = staged_gpu.staged_parser(
        __doc__.split("\n\n")[0], PARTS, STAGES, stage_timeout=200,
        smoke="CPU, float32, tiny V3.2 and MLA configs in a temp folder",
        enforce_eager="every engine without CUDA graphs")
    ap.add_argument("--model", default=None,
                    help=f"a V3.2 model folder (default: the shipped {MODEL})")
    args, parts, sizes = staged_gpu.parse_staged(ap, argv, PARTS, FULL, SMOKE)
    if args.stage:  # a child: one stage
        run_stage(args, sizes, args.stage, parts)
        return read_records(args.out)
    tmp = staged_gpu.smoke_model(args, SMOKE_V32, "tiny-deepseek-v32")
    write([], args.out)

    def run(stages: staged_gpu.Stages) -> None:
        staged_gpu.run_stages(args, stages, parts,
                              lambda stage, todo: run_stage(args, sizes, stage, todo),
                              lambda stage, todo: run_child(args, stage, todo))

    run(LONG_STAGES)
    if "long_context" in parts and (rec := summary(args.out)) is not None:
        print(json.dumps(rec, default=str), flush=True)
        append(rec, args.out)
    run(W1_STAGES)
    if tmp is not None:
        tmp.cleanup()
    return read_records(args.out)


if __name__ == "__main__":
    # Exit status 1 when a part failed (its record holds the error); the file has them all.
    sys.exit(1 if any("error" in r for r in main()) else 0)
