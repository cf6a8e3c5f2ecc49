"""Pooling through the Transformers backend (runner="pooling"): a decoder shoal has no class
for (Gemma, model_impl="auto") and one forced through the backend (Qwen3) embed as
transformers' base model's final hidden states pooled the same way (last token, or mean with
pooler_config), over packed prompts of several lengths; no LM head is built. An encoder-only
model cannot generate, and a decoder's classification checkpoint, whose head the backend
does not build, is refused by name (encoders: test_transformers_backend_encoders.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import TINY_COMMON, write_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM
from shoal.models.registry import resolve_model_class

PROMPTS = [[(7 * i) % 500 + 3 for i in range(13)], [7, 9, 11], [40, 41, 42], [300]]


@pytest.mark.parametrize("model_type, fields, impl, pooling", [
    ("gemma", dict(head_dim=16), "auto", "LAST"),  # no class of shoal's own
    ("qwen3", {}, "transformers", "MEAN"),  # shoal's Qwen3 bypassed
])
def test_embeddings_match_transformers_hidden_states(model_type, fields, impl, pooling,
                                                     tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path, model_type, seed=1, **fields)
    llm = LLM(model=str(path), runner="pooling", model_impl=impl, dtype="float32",
              device="cpu", max_model_len=64, pooler_config=f'{{"pooling_type": "{pooling}"}}')
    try:
        model = llm.llm_engine.core.runner.model
        assert type(model).__name__ == "TransformersForCausalLM" and model.is_causal
        assert not any(n.startswith("lm_head.") for n, _ in model.named_parameters())
        got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, got):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        pooled = hidden[-1] if pooling == "LAST" else hidden.mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                                   F.normalize(pooled, dim=-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["distilbert", "modernbert"])
def test_encoder_only_models_cannot_generate(model_type) -> None:
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in TINY_COMMON.items()
                                              if k != "num_key_value_heads"})
    cfg.architectures = [f"{type(cfg).__name__.removesuffix('Config')}Model"]
    with pytest.raises(ValueError, match="the Transformers backend cannot run it: it is an "
                                         "encoder-only model .*: it cannot generate text; use "
                                         "runner='pooling'"):
        resolve_model_class(cfg, "generate")


def test_a_classification_head_is_refused_by_name() -> None:
    cfg = AutoConfig.for_model("gemma", **TINY_COMMON)
    cfg.architectures = ["GemmaForSequenceClassification"]
    with pytest.raises(ValueError, match="its checkpoint class GemmaForSequenceClassification "
                                         "has a task head, which the backend does not build"):
        resolve_model_class(cfg, "pooling")
