"""Encoder-only models through the Transformers backend (transformers_backend/encoder.py):
tiny random-weight DistilBERT, ELECTRA, ModernBERT and (forced) XLM-R / BERT run packed
prompts of several lengths in one forward and give transformers' own hidden states, pooled
embeddings and classifier logits, each prompt run alone by transformers (float32, 1e-4):
bidirectional attention within each prompt only, positions restarting per prompt (XLM-R's
after its padding index), segment ids, ModernBERT's local sliding windows and mean-pooling
head, BERT's pooler, a masked-LM checkpoint's base model. Through the public API, a
DistilBERT folder embeds with its sentence-transformers pooling (runner "auto" picks
pooling) and an ELECTRA classifier classifies. What the backend cannot run is refused
naming the class and the reason."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from backend_encoders import PROMPTS, backend_encoder, packed_states, random_encoder
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
)

from shoal import LLM
from shoal.models.registry import is_pooling_only, resolve_model_class
from shoal.pooling.pooler import pool

_SMALL = dict(vocab_size=128, max_position_embeddings=64)
_BERTLIKE = dict(_SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4)
FAMILIES = {
    "distilbert": dict(_SMALL, dim=32, hidden_dim=64, n_layers=2, n_heads=4),
    "electra": dict(_BERTLIKE, embedding_size=16),  # embeddings projected to hidden_size
    # one global layer, two local ones whose window (|i - j| <= 2) is shorter than prompts
    "modernbert": dict(_BERTLIKE, num_hidden_layers=3, local_attention=4, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                       layer_types=["full_attention", "sliding_attention",
                                    "sliding_attention"]),
    "xlm-roberta": _BERTLIKE,  # positions numbered from padding_idx + 1 (forced: native)
    "bert": _BERTLIKE,  # (forced: native)
}


def _hf(model_type: str, auto: type = AutoModel, **fields) -> torch.nn.Module:
    return random_encoder(model_type, {**FAMILIES[model_type], **fields}, auto)


_backend, _packed = backend_encoder, packed_states


def _bounds(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts])
    return torch.cumsum(lens, 0) - lens, lens


@pytest.mark.parametrize("model_type, pooling", [
    ("distilbert", "CLS"), ("electra", "MEAN"), ("modernbert", "MEAN"), ("xlm-roberta", "CLS"),
    ("bert", "CLS"),  # a masked-LM checkpoint: its base model embeds, its MLM head is dropped
])
def test_packed_embeddings_match_transformers(model_type, pooling) -> None:
    if model_type == "bert":
        hf = _hf(model_type, AutoModelForMaskedLM)
        # (older checkpoints also store the position_ids buffer the model computes itself)
        model = _backend(hf, {"bert.embeddings.position_ids": torch.arange(64)[None]})
        assert not any(n.startswith(("cls.", "bert.")) for n, _ in model.named_parameters())
        hf = hf.base_model
    else:
        hf = _hf(model_type)
        model = _backend(hf)
    assert not model.is_causal and model.pooling_tasks == ("embed", "token_embed", "score")
    hidden = _packed(model, PROMPTS)
    got = F.normalize(pool(hidden, *_bounds(PROMPTS), pooling), dim=-1)
    start = 0
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0]
        torch.testing.assert_close(hidden[start:start + len(p)], ref, atol=1e-4, rtol=1e-4)
        pooled = ref[0] if pooling == "CLS" else ref.mean(0)
        torch.testing.assert_close(got[i], F.normalize(pooled, dim=-1), atol=1e-4, rtol=1e-4)
        start += len(p)


def test_segment_ids_of_pairs_reach_the_embeddings() -> None:
    hf = _hf("electra")
    model = _backend(hf)
    types = [[0] * 7 + [1] * 5, [0, 1], [0, 0], [0, 0, 1, 1, 1]]
    hidden = _packed(model, PROMPTS, types)
    start = 0
    for p, t in zip(PROMPTS, types):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), token_type_ids=torch.tensor([t])).last_hidden_state[0]
        torch.testing.assert_close(hidden[start:start + len(p)], ref, atol=1e-4, rtol=1e-4)
        start += len(p)
    assert not torch.allclose(hidden, _packed(model, PROMPTS), atol=1e-3)


@pytest.mark.parametrize("model_type, fields, reads", [
    ("distilbert", {}, "CLS"),
    ("modernbert", dict(classifier_pooling="mean"), "MEAN"),
    ("bert", {}, "CLS"),  # its head reads the pooler's output (dense + tanh of [CLS])
])
def test_classifier_heads_match_transformers(model_type, fields, reads) -> None:
    hf = _hf(model_type, AutoModelForSequenceClassification, num_labels=3, **fields)
    model = _backend(hf)
    assert model.pooling_tasks == ("classify",) and model.classifier_pooling_type == reads
    hidden = _packed(model, PROMPTS)
    with torch.no_grad():
        logits = model.classify(pool(hidden, *_bounds(PROMPTS), reads))
    for p, got in zip(PROMPTS, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _sentence_transformers_mean(path) -> None:
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True}))


def test_public_api_embeds_and_classifies(tmp_path) -> None:
    """DistilBERT has no class of shoal's own: runner "auto" makes it a pooling model, its
    sentence-transformers files make the pooling MEAN + normalize; a classifier classifies
    with softmax over its own head's logits."""
    hf = _hf("distilbert")
    hf.save_pretrained(tmp_path / "embed")
    _sentence_transformers_mean(tmp_path / "embed")
    assert is_pooling_only(hf.config)
    llm = LLM(model=str(tmp_path / "embed"), dtype="float32", device="cpu", max_model_len=64)
    try:
        assert llm.llm_engine.config.model_config.runner == "pooling"
        got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    for p, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = F.normalize(hf(torch.tensor([p])).last_hidden_state[0].mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4,
                                   rtol=1e-4)

    cls = _hf("electra", AutoModelForSequenceClassification, num_labels=3)
    cls.save_pretrained(tmp_path / "classify")
    llm = LLM(model=str(tmp_path / "classify"), dtype="float32", device="cpu", max_model_len=64)
    try:
        got = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    for p, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = cls(torch.tensor([p])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-4, rtol=1e-4)


def test_modernbert_windows_need_no_short_max_model_len(tmp_path) -> None:
    """ModernBERT's local layers attend within a window (here 4 tokens, prompts up to 12):
    the backend applies it, so the engine takes a max_model_len past it."""
    hf = _hf("modernbert")
    hf.save_pretrained(tmp_path / "m")
    llm = LLM(model=str(tmp_path / "m"), dtype="float32", device="cpu", max_model_len=64,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    try:
        got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    for p, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0].mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4,
                                   rtol=1e-4)


def _config(model_type: str, arch: str, **fields):
    base = FAMILIES.get(model_type, _BERTLIKE)
    cfg = AutoConfig.for_model(model_type, **{**base, **fields})
    cfg.architectures = [arch]
    return cfg


@pytest.mark.parametrize("model_type, arch, runner, reason", [
    # (MPNet, DeBERTa, ... run over padded batches: test_transformers_backend_encoders_padded.py)
    ("perceiver", "PerceiverModel", "pooling", r"PerceiverModel: its modeling code "
     r"\(PerceiverModel\) does not support custom attention functions, and its base model "
     "PerceiverModel takes no input_ids"),
    ("distilbert", "DistilBertForTokenClassification", "pooling",
     "DistilBertForTokenClassification: its checkpoint class DistilBertForTokenClassification "
     "has a per-token or span head"),
    ("electra", "ElectraModel", "generate", "ElectraModel: it is an encoder-only model "
     r"\(bidirectional attention\): it cannot generate text; use runner='pooling'"),
])
def test_what_cannot_run_is_refused_by_name(model_type, arch, runner, reason) -> None:
    with pytest.raises(ValueError, match=f"the Transformers backend cannot run {reason}"):
        resolve_model_class(_config(model_type, arch), runner, "transformers")


def test_a_head_that_reads_more_than_the_pooled_token_is_refused() -> None:
    """ALBERT's classifier reads a pooler the base model applies inline (a bare Linear):
    the head's output shape shows it, at construction."""
    cfg = _config("albert", "AlbertForSequenceClassification", embedding_size=16,
                  num_labels=3)
    cls = resolve_model_class(cfg, "pooling", "transformers")
    with pytest.raises(ValueError, match="cannot run AlbertForSequenceClassification: its "
                                         r"classification head gives logits of shape \(2, 1, 3\)"):
        cls(cfg, torch.float32)
