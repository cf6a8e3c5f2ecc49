"""EuroBERT as a pooling model against transformers' EuroBERT classes (the oracle), on tiny
random fp32 checkpoints written here (2 layers, grouped-query attention, all-MiniLM-L6-v2's
tokenizer): mean-pooled embeddings of a batch of prompts of different lengths, the
jina-embeddings-v5-text-nano layout (JinaEmbeddingsV5Model: last token, a task's LoRA adapter
merged, Matryoshka dimensions), the classifier's three poolings, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pooling_models import save_tiny
from safetensors.torch import save_file

from shoal import LLM
from shoal.attention.packed import PackedSeqs
from shoal.loader.resolve import MINILM, locate_embedded
from shoal.models.eurobert import (
    EuroBertForSequenceClassification,
    EuroBertModel,
    JinaEmbeddingsV5Model,
)
from shoal.pooling.pooler import pool
from shoal.pooling_params import PoolingParams

# Five prompts of four lengths ("hello world" / "hello there": one packed run of two).
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a",
         "Encoders read the whole sentence at once, in both directions.", "hello there"]
TINY = dict(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=101, eos_token_id=102, mask_token_id=103)
LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TOL = dict(rtol=1e-5, atol=1e-5)  # states after the final RMSNorm are O(1)


def _tiny(kind: str, **overrides):
    from transformers import (
        EuroBertConfig,
        EuroBertForMaskedLM,
        EuroBertForSequenceClassification,
        EuroBertModel,
    )

    cls = {"model": EuroBertModel, "mlm": EuroBertForMaskedLM,
           "cls": EuroBertForSequenceClassification}[kind]
    return cls(EuroBertConfig(**{**TINY, **overrides})).eval()


def _hf(model, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's output (hidden states or logits) over one right-padded batch, and its mask."""
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(str(locate_embedded(MINILM)))(
        texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state), \
        enc["attention_mask"]


def _embeddings(llm: LLM, texts, **kw) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, **kw)])


@pytest.fixture(scope="module")
def minilm() -> Path:
    return locate_embedded(MINILM)


def test_embeddings_match_transformers_mean_pooling(tmp_path, minilm):
    hf = _tiny("model")  # a bare EuroBertModel checkpoint: names without "model."
    save_tiny(tmp_path, hf, minilm)
    llm = LLM(str(tmp_path))
    info = llm.llm_engine.core.limits.pooling
    assert info.pooling_type == "MEAN" and info.tasks == ("embed", "token_embed", "score")
    hidden, mask = _hf(hf, TEXTS)
    m = mask[..., None].float()
    ref = (hidden * m).sum(1) / m.sum(1)
    torch.testing.assert_close(_embeddings(llm, TEXTS), F.normalize(ref, dim=-1), **TOL)
    raw = _embeddings(llm, TEXTS, pooling_params=PoolingParams(normalize=False))
    torch.testing.assert_close(raw, ref, **TOL)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed("word " * 80, use_tqdm=False)
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="classify"):
        llm.classify("x", use_tqdm=False)


def _write_adapter(folder: Path, scale_r: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter over every projection; returns {HF weight name: its delta}."""
    r, alpha = scale_r
    g = torch.Generator().manual_seed(5)
    tensors, deltas = {}, {}
    for layer in range(TINY["num_hidden_layers"]):
        for target in LORA_TARGETS:
            name = f"layers.{layer}.{target}"
            out_f, in_f = _shape(target)
            a, b = torch.randn(r, in_f, generator=g) * 0.2, torch.randn(out_f, r, generator=g) * 0.2
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            deltas[f"model.{name}.weight"] = (alpha / r) * b @ a
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"]}))
    return deltas


def _shape(target: str) -> tuple[int, int]:
    h, inter = TINY["hidden_size"], TINY["intermediate_size"]
    kv = TINY["num_key_value_heads"] * h // TINY["num_attention_heads"]
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}[target]


def test_jina_v5_nano_layout_merges_the_task_adapter(tmp_path, minilm):
    """JinaEmbeddingsV5Model (EuroBERT backbone, is_decoder false): last-token pooling, the
    adapter of hf_overrides' jina_task merged, Matryoshka truncation."""
    hf = _tiny("mlm")  # weights under "model.", an lm_head the embedder leaves unread
    save_tiny(tmp_path, hf, minilm)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["JinaEmbeddingsV5Model"], is_decoder=False,
               task_names=["retrieval", "text-matching"], matryoshka_dimensions=[8, 16, 32])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    deltas = _write_adapter(tmp_path / "adapters" / "text-matching", (4, 8))
    llm = LLM(str(tmp_path), hf_overrides={"jina_task": "text-matching"})
    assert llm.llm_engine.core.limits.pooling.pooling_type == "LAST"
    with torch.no_grad():  # the oracle: the same merge done by hand
        for name, param in hf.named_parameters():
            param += deltas.get(name, 0)
    hidden, mask = _hf(hf.model, TEXTS)
    ref = hidden[torch.arange(len(TEXTS)), mask.sum(1) - 1]
    raw = _embeddings(llm, TEXTS, pooling_params=PoolingParams(normalize=False))
    torch.testing.assert_close(raw, ref, **TOL)
    cut = _embeddings(llm, TEXTS, pooling_params=PoolingParams(dimensions=16))
    torch.testing.assert_close(cut, F.normalize(ref[:, :16], dim=-1), **TOL)
    with pytest.raises(ValueError, match="matryoshka dimensions"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=12), use_tqdm=False)


def test_classifier_late_pooling_matches_transformers(tmp_path, minilm):
    hf = _tiny("cls", num_labels=3)  # classifier_pooling "late": transformers' default
    save_tiny(tmp_path, hf, minilm)
    llm = LLM(str(tmp_path))
    assert llm.llm_engine.core.limits.pooling.tasks == ("classify",)
    logits, _ = _hf(hf, TEXTS)
    raw = llm.encode(TEXTS, PoolingParams(task="classify", use_activation=False),
                     use_tqdm=False)
    torch.testing.assert_close(torch.stack([o.outputs.data for o in raw]), logits, **TOL)
    probs = llm.classify(TEXTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([p.outputs.probs for p in probs]),
                               logits.softmax(-1), **TOL)


def _shoal(cls, hf) -> torch.nn.Module:
    model = cls(hf.config, torch.float32, use_triton_ops=False)
    model.load_weights(hf.state_dict().items())
    return model.eval()


@pytest.mark.parametrize("pooling", ["bos", "mean"])
def test_classifier_bos_and_mean_pooling(pooling):
    """The model and the runner's pooler on packed token ids (no engine), one batch."""
    hf = _tiny("cls", num_labels=2, classifier_pooling=pooling)
    model = _shoal(EuroBertForSequenceClassification, hf)
    ids = [[101, 7592, 102], [101, 7592, 2088, 999, 102], [101, 1037, 102]]
    lens = torch.tensor([len(i) for i in ids])
    with torch.no_grad():
        hidden = model(torch.tensor(sum(ids, [])), torch.cat([torch.arange(n) for n in lens]),
                       PackedSeqs.build(lens.tolist(), model.is_causal, torch.device("cpu")))
        got = model.classify(pool(hidden, torch.cumsum(lens, 0) - lens, lens,
                                  model.classifier_pooling_type))
        ref = torch.cat([hf(torch.tensor([i])).logits for i in ids])
    torch.testing.assert_close(got, ref, **TOL)


def test_bad_configs_and_missing_adapter(tmp_path):
    hf = _tiny("model")
    with pytest.raises(ValueError, match="hidden_act"):
        EuroBertModel(_tiny("model", hidden_act="gelu").config, torch.float32)
    with pytest.raises(ValueError, match="classifier_pooling must be one of bos, mean, late"):
        EuroBertForSequenceClassification(_tiny("model", classifier_pooling="max").config,
                                          torch.float32)
    cfg = hf.config
    cfg.task_names = ["retrieval", "text-matching"]
    cfg.jina_task = "summarize"
    with pytest.raises(ValueError, match="jina_task must be one of retrieval, text-matching"):
        JinaEmbeddingsV5Model(cfg, torch.float32)
    cfg.jina_task, cfg.is_decoder = None, True
    with pytest.raises(ValueError, match="EuroBERT-encoder variant"):
        JinaEmbeddingsV5Model(cfg, torch.float32)
    cfg.is_decoder = False
    model = _shoal(JinaEmbeddingsV5Model, hf)
    with pytest.raises(FileNotFoundError, match="adapters/retrieval/adapter_config.json"):
        model.load_extra_files(tmp_path)
    (tmp_path / "adapters" / "retrieval").mkdir(parents=True)
    save_file({"base_model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(2, 32)},
              str(tmp_path / "adapters" / "retrieval" / "adapter_model.safetensors"))
    (tmp_path / "adapters" / "retrieval" / "adapter_config.json").write_text(
        json.dumps({"r": 2, "lora_alpha": 2}))
    with pytest.raises(ValueError, match="lacks its LoRA A or B"):
        model.load_extra_files(tmp_path)
