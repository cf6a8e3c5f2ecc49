"""Tiny random-weight pooling checkpoints (BERT, XLM-RoBERTa, Llama classifiers) with
all-MiniLM-L6-v2's tokenizer, so text inputs work (a module of its own: test files import it,
and `conftest` names several modules in one run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")
TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=128)
TINY_LLAMA = dict(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, pad_token_id=0)


def save_tiny(path: Path, model, minilm: Path) -> Path:
    torch.manual_seed(1)
    with torch.no_grad():  # larger than the default init so outputs are not flat
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(minilm / f, path / f)
    return path


def make_tiny(path: Path, minilm: Path, kind: str, **overrides):
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    if kind.startswith("xlmr"):
        from transformers import (
            XLMRobertaConfig,
            XLMRobertaForSequenceClassification,
            XLMRobertaModel,
        )

        cfg = XLMRobertaConfig(**{**TINY_BERT, "max_position_embeddings": 130,
                                  "type_vocab_size": 1, "pad_token_id": 1, **overrides})
        model = XLMRobertaModel(cfg, add_pooling_layer=False) if kind == "xlmr" else \
            XLMRobertaForSequenceClassification(cfg)
    elif kind.startswith("bert"):
        cfg = BertConfig(**{**TINY_BERT, **overrides})
        model = BertModel(cfg, add_pooling_layer=False) if kind == "bert" else \
            BertForSequenceClassification(cfg)
    else:
        cfg = LlamaConfig(**{**TINY_LLAMA, **overrides})
        model = LlamaForSequenceClassification(cfg)
    model.eval()
    save_tiny(path, model, minilm)
    return model
