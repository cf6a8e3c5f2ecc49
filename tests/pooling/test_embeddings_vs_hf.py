"""Pooling results against transformers: the default all-MiniLM-L6-v2 embeddings (mean
pooling + normalize, cosine >= 0.9999), tiny random-weight classifiers (logits), a decoder
used as an embedder (last token), the pooling types and Matryoshka dimensions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shoal import LLM
from shoal.pooling_params import PoolingParams

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         "Embeddings map text to vectors.", "a", "hello world",
         "Sentence transformers pool token states into one vector per sentence, " * 3]


def hf_hidden(model, tokenizer, texts, pairs=None):
    """transformers' last hidden states, one padded batch, and the attention mask."""
    enc = tokenizer(texts, pairs, padding=True, return_tensors="pt") if pairs else \
        tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    return out, enc["attention_mask"]


def mean_pool(hidden, mask):
    m = mask[..., None].float()
    return (hidden * m).sum(1) / m.sum(1)


@pytest.fixture(scope="module")
def minilm_llm():
    return LLM("all-MiniLM-L6-v2")


def test_minilm_defaults_come_from_sentence_transformers_files(minilm_llm):
    info = minilm_llm.llm_engine.core.limits.pooling
    assert info.pooling_type == "MEAN" and info.normalize
    assert minilm_llm.llm_engine.config.model_config.runner == "pooling"
    assert minilm_llm.llm_engine.core.limits.max_model_len == 256  # sentence_bert_config
    assert minilm_llm.llm_engine.core.limits.num_kv_blocks == 0


def test_minilm_matches_transformers_mean_pooling(minilm_llm, minilm_dir):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    model = AutoModel.from_pretrained(str(minilm_dir)).eval()
    out, mask = hf_hidden(model, tok, TEXTS)
    ref = F.normalize(mean_pool(out.last_hidden_state, mask), dim=-1)
    got = minilm_llm.embed(TEXTS, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in got] == mask.sum(1).tolist()
    for o, r in zip(got, ref):
        emb = torch.tensor(o.outputs.embedding)
        assert abs(float(emb.norm()) - 1) < 1e-5
        assert float(F.cosine_similarity(emb, r, dim=0)) >= 0.9999
    # one prompt alone (no packing) gives the same vector as in the batch
    alone = minilm_llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(alone, got[1].outputs.embedding, atol=1e-5)


def test_minilm_token_ids_and_unnormalized(minilm_llm, minilm_dir):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    model = AutoModel.from_pretrained(str(minilm_dir)).eval()
    ids = tok(TEXTS[2])["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    got = minilm_llm.embed({"prompt_token_ids": ids}, use_tqdm=False,
                           pooling_params=PoolingParams(normalize=False))[0]
    np.testing.assert_allclose(got.outputs.embedding, ref.numpy(), atol=2e-4)
    tokens = minilm_llm.encode(ids, pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    assert tokens.shape == (len(ids), 384)
    with torch.no_grad():
        ref_tokens = F.normalize(model(torch.tensor([ids])).last_hidden_state[0], dim=-1)
    torch.testing.assert_close(tokens, ref_tokens, atol=2e-4, rtol=1e-3)


def test_minilm_errors(minilm_llm):
    with pytest.raises(ValueError, match="matryoshka"):
        minilm_llm.embed("x", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        minilm_llm.embed("word " * 300, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        minilm_llm.embed("", use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate text"):
        minilm_llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="classify"):
        minilm_llm.classify("hello", use_tqdm=False)


def test_bert_classifier_logits_match_transformers(tiny_bert_classifier):
    path, hf = tiny_bert_classifier
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    out, _ = hf_hidden(hf, tok, TEXTS)
    llm = LLM(str(path))
    info = llm.llm_engine.core.limits.pooling
    assert info.tasks == ("classify",) and info.id2label == {0: "neg", 1: "neu", 2: "pos"}
    raw = llm.encode(TEXTS, PoolingParams(task="classify", use_activation=False),
                     use_tqdm=False)
    got = torch.stack([o.outputs.data for o in raw])
    torch.testing.assert_close(got, out.logits, atol=1e-4, rtol=1e-4)
    probs = llm.classify(TEXTS, use_tqdm=False)
    assert probs[0].outputs.num_classes == 3
    torch.testing.assert_close(torch.tensor([p.outputs.probs for p in probs]),
                               out.logits.softmax(-1), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="score"):
        llm.score("a", "b", use_tqdm=False)


def test_cross_encoder_scores_pairs_with_segment_ids(tiny_cross_encoder):
    path, hf = tiny_cross_encoder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    query, docs = "what is a fox", ["The quick brown fox.", "Paris is in France.", "fox"]
    out, _ = hf_hidden(hf, tok, [query] * 3, docs)
    llm = LLM(str(path))
    assert llm.llm_engine.core.limits.pooling.is_cross_encoder
    got = llm.score(query, docs, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([g.outputs.score for g in got]),
                               out.logits[:, 0].sigmoid(), atol=1e-5, rtol=1e-4)
    n2n = llm.score([query, "paris"], docs[:2], use_tqdm=False)
    assert len(n2n) == 2 and n2n[0].outputs.score == pytest.approx(got[0].outputs.score,
                                                                     abs=1e-6)
    with pytest.raises(ValueError, match="same number"):
        llm.score([query, "x"], docs, use_tqdm=False)


def test_llama_classifier_and_decoder_embedder(tiny_llama_classifier):
    path, hf = tiny_llama_classifier
    ids = [[5, 17, 99, 1003], [7, 8], [3000, 12, 12, 12, 12, 9]]
    llm = LLM(str(path))
    raw = llm.encode([{"prompt_token_ids": i} for i in ids],
                     PoolingParams(task="classify", use_activation=False), use_tqdm=False)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([i])).logits[0] for i in ids])
    torch.testing.assert_close(torch.stack([o.outputs.data for o in raw]), ref,
                               atol=1e-4, rtol=1e-4)


def test_causal_lm_as_embedder_takes_last_token(tiny_llama_dir):
    from transformers import AutoModel

    llm = LLM(str(tiny_llama_dir), runner="pooling")
    assert llm.llm_engine.core.limits.pooling.pooling_type == "LAST"
    hf = AutoModel.from_pretrained(str(tiny_llama_dir)).eval()
    ids = [[5, 17, 99, 100], [7, 8], [300, 12, 12, 12, 12, 9], [7, 8]]
    got = llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
    for i, o in zip(ids, got):
        with torch.no_grad():
            ref = F.normalize(hf(torch.tensor([i])).last_hidden_state[0, -1], dim=-1)
        assert float(F.cosine_similarity(torch.tensor(o.outputs.embedding), ref, dim=0)) > 0.9999
    with pytest.raises(ValueError, match="runner='generate'"):
        LLM(str(tiny_llama_dir), runner="generate", convert="embed")


@pytest.mark.parametrize("pooling_type", ["CLS", "MEAN", "LAST", "ALL"])
def test_pooling_types(tiny_bert, pooling_type):
    path, hf = tiny_bert
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), pooler_config={"pooling_type": pooling_type, "normalize": False})
    texts = TEXTS[:3]
    got = llm.encode(texts, pooling_task="embed", use_tqdm=False)
    for t, o in zip(texts, got):
        with torch.no_grad():
            h = hf(**tok(t, return_tensors="pt")).last_hidden_state[0]
        ref = {"CLS": h[0], "MEAN": h.mean(0), "LAST": h[-1], "ALL": h}[pooling_type]
        torch.testing.assert_close(o.outputs.data, ref, atol=1e-4, rtol=1e-4)


def test_matryoshka_dimensions(tmp_path, minilm_dir):
    from pooling_models import make_tiny

    make_tiny(tmp_path, minilm_dir, "bert", matryoshka_dimensions=[8, 16, 32])
    llm = LLM(str(tmp_path))
    full = llm.embed("hello world", use_tqdm=False,
                     pooling_params=PoolingParams(normalize=False))[0].outputs.embedding
    cut = llm.embed("hello world", use_tqdm=False,
                    pooling_params=PoolingParams(dimensions=16))[0].outputs.embedding
    assert len(cut) == 16
    np.testing.assert_allclose(cut, np.array(full[:16]) / np.linalg.norm(full[:16]), atol=1e-5)
    with pytest.raises(ValueError, match="matryoshka dimensions"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=12), use_tqdm=False)


@pytest.mark.slow
def test_smollm2_gguf_as_an_embedder(hf_smollm):
    """The embedded GGUF default under runner="pooling": its last token's final hidden
    state, normalized, as transformers computes it from the same file."""
    llm = LLM(runner="pooling", max_model_len=512)
    ids = [[1, 504, 3458, 282, 4649, 314], [1, 19556, 905]]
    got = llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
    for i, o in zip(ids, got):
        with torch.no_grad():
            h = hf_smollm.model(torch.tensor([i])).last_hidden_state[0, -1]
        cos = F.cosine_similarity(torch.tensor(o.outputs.embedding), h.float(), dim=0)
        assert float(cos) > 0.9999


@pytest.mark.parametrize("kind", ["xlmr", "xlmr-cls"])
def test_xlm_roberta_encoder_and_classifier(tmp_path, minilm_dir, kind):
    """RoBERTa positions start after the padding index; its head is dense + tanh + proj."""
    from pooling_models import make_tiny
    from transformers import AutoTokenizer

    hf = make_tiny(tmp_path, minilm_dir, kind, num_labels=2)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert llm.llm_engine.core.limits.max_model_len == 128  # 130 positions, offset by 2
    for text in TEXTS[:3]:
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            out = hf(**enc)
        if kind == "xlmr":
            got = llm.encode(text, pooling_task="embed", use_tqdm=False)[0].outputs.data
            torch.testing.assert_close(got, out.last_hidden_state[0].mean(0), atol=1e-4,
                                       rtol=1e-4)
        else:
            got = llm.encode(text, PoolingParams(task="classify", use_activation=False),
                             use_tqdm=False)[0].outputs.data
            torch.testing.assert_close(got, out.logits[0], atol=1e-4, rtol=1e-4)


def test_bge_m3_dense_sparse_and_colbert_outputs(tmp_path, minilm_dir):
    """BGE-M3's three outputs on a tiny random XLM-RoBERTa with random heads, against the
    same computation (FlagEmbedding's) on transformers' hidden states."""
    from pooling_models import make_tiny
    from transformers import AutoTokenizer

    hf = make_tiny(tmp_path, minilm_dir, "xlmr")
    torch.manual_seed(3)
    colbert, sparse = torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    torch.save(colbert.state_dict(), tmp_path / "colbert_linear.pt")
    torch.save(sparse.state_dict(), tmp_path / "sparse_linear.pt")
    llm = LLM(str(tmp_path), hf_overrides={"architectures": ["BgeM3EmbeddingModel"]})
    assert "token_classify" in llm.llm_engine.core.limits.pooling.tasks
    text = TEXTS[1]
    with torch.no_grad():
        h = hf(**AutoTokenizer.from_pretrained(str(tmp_path))(text, return_tensors="pt")
               ).last_hidden_state[0]
        ref_dense = F.normalize(h[0], dim=-1)
        ref_colbert = F.normalize(colbert(h[1:]), dim=-1)
        ref_sparse = torch.relu(sparse(h)).squeeze(-1)
    dense = torch.tensor(llm.embed(text, use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(dense, ref_dense, atol=1e-4, rtol=1e-4)
    col = llm.encode(text, pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(col, ref_colbert, atol=1e-4, rtol=1e-4)
    sp = llm.encode(text, pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(sp, ref_sparse, atol=1e-4, rtol=1e-4)
    (tmp_path / "sparse_linear.pt").unlink()
    with pytest.raises(FileNotFoundError, match="sparse_linear.pt"):
        LLM(str(tmp_path), hf_overrides={"architectures": ["BgeM3EmbeddingModel"]})
