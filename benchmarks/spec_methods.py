"""The speculating methods W9 (spec_decode_gpu.py) times, each at a forced acceptance rate:

    forced             test_forced_acceptance: placeholder drafts (the last token repeated),
                       no drafter cost; the verify step's cost alone (W9's original figure)
    eagle3             a random EAGLE-3 head of the target's shape (load_format dummy; draft
                       vocabulary 32000 as the published Llama-3.1-8B heads) drafts for real,
                       its forward passes, KV cache and CUDA graphs paid; the test-only
                       speculative_config forced_acceptance_rate accepts a forced share
    eagle3_confidence  eagle3 with confidence-scheduled verification (confidence_threshold);
                       the overlay reports each draft's probability as the forced rate (a random
                       head's own are ~1/32000: it would verify nothing)

Confidence scheduling rides on eagle3 because the Llama-3.1-8B shape has no MTP layers (MTP
needs a DeepSeek/Qwen3-Next-shaped target); the scheduling rule is the same for every
drafter that reports probabilities."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs

METHODS = ("forced", "eagle3", "eagle3_confidence")
FORCED = "test_forced_acceptance"
DRAFT_VOCAB = 32000  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's draft vocabulary


def parse_methods(value: str) -> list[str]:
    methods = [m.strip() for m in value.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"--methods: unknown {bad or value!r} (choose from {', '.join(METHODS)})")
    return methods


def write_eagle3_head(model: str, folder: Path) -> Path:
    """An EAGLE-3 head's config.json for `model` (a folder or a shipped shape): the target's
    layer shape, one layer, a draft vocabulary of DRAFT_VOCAB (a quarter of a smaller one).
    load_format dummy gives it random weights (d2t zeros: draft id = target id)."""
    target = json.loads((offline_runs.shipped_folder(model) / "config.json").read_text())
    cfg = {k: v for k, v in target.items() if k not in ("eos_token_id", "bos_token_id")}
    vocab, layers = int(target["vocab_size"]), int(target["num_hidden_layers"])
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=min(DRAFT_VOCAB, max(vocab // 4, 1)))
    if layers < 6:  # the default layers 2, L // 2, L - 3 need six (the smoke model has two)
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def speculative_config(method: str, k: int, rate: float, model: str, tmp: Path,
                       confidence_threshold: float) -> dict[str, Any]:
    if method == "forced":
        return {"method": FORCED, "num_speculative_tokens": k, "acceptance_rate": rate}
    spec: dict[str, Any] = {"method": "eagle3", "num_speculative_tokens": k,
                            "model": str(write_eagle3_head(model, tmp / "eagle3-head")),
                            "forced_acceptance_rate": rate}
    if method == "eagle3_confidence":
        spec["confidence_threshold"] = confidence_threshold
    return spec


def set_rate(llm: Any, method: str, rate: float) -> bool:
    """The forced acceptance rate changed on a running engine; False where it cannot be."""
    if method == "forced":
        return engine_internals.set_forced_acceptance(llm, rate)
    overlay = getattr(getattr(engine_internals.runner(llm), "drafter", None),
                      "forced_acceptance", None)
    if overlay is None:
        return False
    overlay.rate = rate
    return True


def summary_prefix(method: str) -> str:
    """Summary keys of a method's figures: "spec" for forced (W9's keys of old), else its name."""
    return "spec" if method == "forced" else method


def engine_kwargs(args: Any, method: str | None, confidence_threshold: float = 0.5
                  ) -> dict[str, Any]:
    """A W9 engine's arguments from a script's args (model, load_format, dtype, input_len,
    output_len, batch_sizes, device, num_speculative_tokens, rates): a speculating engine's
    with `method` (its head written to a fresh temp folder), the plain engine's with None."""
    kw: dict[str, Any] = dict(load_format=args.load_format, dtype=args.dtype,
                              max_model_len=args.input_len + args.output_len + 64,
                              max_num_seqs=max(args.batch_sizes))
    if args.device:
        kw["device"] = args.device
    if args.device == "cpu":
        kw["kv_cache_memory_bytes"] = 64 << 20
    if method is not None:
        kw["speculative_config"] = speculative_config(
            method, args.num_speculative_tokens, args.rates[0], args.model,
            Path(tempfile.mkdtemp(prefix="w9-head-")), confidence_threshold)
    return kw
