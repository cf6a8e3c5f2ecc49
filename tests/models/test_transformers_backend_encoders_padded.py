"""Encoders whose modeling code takes no custom attention function run through the
Transformers backend over padded batches (transformers_backend/encoder_padded.py): tiny
random-weight MPNet and DeBERTa-v2 embed and classify through LLM.embed / LLM.classify with
transformers' results for each prompt alone (float32, 1e-4), prompts of several lengths in
one step; DeBERTa-v2's segment ids reach its embeddings; families whose padding would change
the results (FNet takes no mask, ConvBERT's convolutions ignore it) run in chunks of one
length; the chunking caps padded slots and attention scores and still gives the same states.
What the padded path cannot run is refused naming the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backend_encoders import PROMPTS, backend_encoder, packed_states, random_encoder
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

import shoal.models.transformers_backend.encoder_padded as padded
from shoal import LLM
from shoal.models.registry import resolve_model_class
from shoal.models.transformers_backend.encoder_padded import PaddedChunk, plan_chunks

_BERTLIKE = dict(vocab_size=128, max_position_embeddings=64, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "mpnet": _BERTLIKE,  # relative position buckets, positions after the padding index
    # DeBERTa-v3's layout: relative attention (c2p and p2c), no absolute positions
    "deberta-v2": dict(_BERTLIKE, relative_attention=True, position_biased_input=False,
                       pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                       position_buckets=8, norm_rel_ebd="layer_norm", share_att_key=True,
                       pooler_hidden_size=32),
    "fnet": dict(_BERTLIKE, use_tpu_fourier_optimizations=False),
    "convbert": _BERTLIKE,
    # local attention in chunks of 4 tokens: the padding shifts what a chunk holds
    "reformer": dict(vocab_size=128, hidden_size=32, num_attention_heads=4,
                     axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16],
                     attn_layers=["local", "local"], local_attn_chunk_length=4,
                     feed_forward_size=64, attention_head_size=8,
                     max_position_embeddings=64),
}


def _hf(model_type: str, auto: type = AutoModel, **fields) -> torch.nn.Module:
    return random_encoder(model_type, {**FAMILIES[model_type], **fields}, auto)


def _backend(hf: torch.nn.Module) -> torch.nn.Module:
    model = backend_encoder(hf)
    assert model.padded is not None  # (the padded path, chosen by capability)
    return model


_packed = packed_states


def _check_states(model, hf, prompts=PROMPTS) -> None:
    hidden, start = _packed(model, prompts), 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p]))[0][0]
        torch.testing.assert_close(hidden[start:start + len(p)], ref, atol=1e-4, rtol=1e-4)
        start += len(p)


@pytest.mark.parametrize("model_type, pooling", [("mpnet", "MEAN"), ("deberta-v2", "CLS")])
def test_padded_families_embed_and_classify_through_the_api(tmp_path, model_type,
                                                             pooling) -> None:
    hf = _hf(model_type)
    hf.save_pretrained(tmp_path / "embed")
    llm = LLM(model=str(tmp_path / "embed"), dtype="float32", device="cpu", max_model_len=64,
              pooler_config={"pooling_type": pooling, "normalize": True})
    try:
        got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    for p, out in zip(PROMPTS, got):
        with torch.no_grad():
            states = hf(torch.tensor([p])).last_hidden_state[0]
        ref = F.normalize(states[0] if pooling == "CLS" else states.mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4,
                                   rtol=1e-4)

    cls = _hf(model_type, AutoModelForSequenceClassification, num_labels=3)
    cls.save_pretrained(tmp_path / "classify")
    llm = LLM(model=str(tmp_path / "classify"), dtype="float32", device="cpu",
              max_model_len=64)
    try:
        got = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    for p, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = cls(torch.tensor([p])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-4, rtol=1e-4)


def test_segment_ids_reach_deberta_embeddings() -> None:
    hf = _hf("deberta-v2", type_vocab_size=2)
    model = _backend(hf)
    types = [[0] * 7 + [1] * 5, [0, 1], [0, 0], [0, 0, 1, 1, 1]]
    hidden, start = _packed(model, PROMPTS, types), 0
    for p, t in zip(PROMPTS, types):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), token_type_ids=torch.tensor([t])).last_hidden_state[0]
        torch.testing.assert_close(hidden[start:start + len(p)], ref, atol=1e-4, rtol=1e-4)
        start += len(p)
    assert not torch.allclose(hidden, _packed(model, PROMPTS), atol=1e-3)


@pytest.mark.parametrize("model_type", ["fnet", "convbert", "reformer"])
def test_families_whose_padding_leaks_run_one_length_per_batch(model_type) -> None:
    hf = _hf(model_type)
    # (why: transformers' own padded batch changes the short prompt's states)
    with torch.no_grad():
        alone = hf(torch.tensor([PROMPTS[3]]))[0][0]
        batch = hf(torch.tensor([PROMPTS[0], PROMPTS[3] + [0] * 7]),
                   attention_mask=torch.tensor([[1] * 12, [1] * 5 + [0] * 7]))[0][1, :5]
    assert not torch.allclose(alone, batch, atol=1e-3)
    model = _backend(hf)
    assert not model.padded.pads
    _check_states(model, hf)


def test_chunks_cap_padded_slots_and_attention_scores(monkeypatch) -> None:
    lens = [12, 2, 2, 5]
    assert plan_chunks(lens, pad=True, num_heads=4, max_slots=100) == [
        PaddedChunk([1, 2, 3, 0], 12)]
    # 21 real tokens: a fourth row of 12 would be 48 slots
    assert plan_chunks(lens, pad=True, num_heads=4, max_slots=31) == [
        PaddedChunk([1, 2, 3], 5), PaddedChunk([0], 12)]
    # 4 heads x 5^2 = 100 scores a row of 5; 12 alone is over the cap and runs alone
    assert plan_chunks(lens, pad=True, num_heads=4, max_slots=100, max_scores=250) == [
        PaddedChunk([1, 2], 2), PaddedChunk([3], 5), PaddedChunk([0], 12)]
    assert plan_chunks(lens, pad=False, num_heads=4, max_slots=100) == [
        PaddedChunk([1, 2], 2), PaddedChunk([3], 5), PaddedChunk([0], 12)]
    with pytest.raises(ValueError, match="num_heads, max_slots and max_scores must be >= 1"):
        plan_chunks(lens, pad=True, num_heads=0, max_slots=10)

    hf = _hf("mpnet")
    model = _backend(hf)
    monkeypatch.setattr(padded, "MAX_SCORE_ELEMENTS", 4 * 5 * 5 * 2)  # rows of 2: a pair
    calls = []
    model.padded.base.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    _check_states(model, hf)
    assert calls == [(2, 2), (1, 5), (1, 12)]


@pytest.mark.parametrize("model_type, arch, fields, reason", [
    # landmarks over a fixed segment length: transformers' forward needs inputs of that length
    ("nystromformer", "NystromformerModel", dict(num_landmarks=4, segment_means_seq_len=8),
     "NystromformerModel: its forward fails on a batch of 2 prompts padded to 3 tokens"),
    # its head builds a global attention mask from input_ids, which the pooled token lacks
    ("longformer", "LongformerForSequenceClassification", dict(attention_window=4),
     "LongformerForSequenceClassification: its classification head does not run over the "
     "pooled token alone"),
])
def test_what_the_padded_path_cannot_run_is_refused(model_type, arch, fields, reason) -> None:
    cfg = AutoConfig.for_model(model_type, **{**_BERTLIKE, **fields})
    cfg.architectures = [arch]
    cls = resolve_model_class(cfg, "pooling", "transformers")
    with pytest.raises(ValueError, match=f"the Transformers backend cannot run {reason}"):
        cls(cfg, torch.float32)
