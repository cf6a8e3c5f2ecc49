"""Pooling fixtures: the embedded all-MiniLM-L6-v2 and tiny random-weight BERT / Llama
pooling checkpoints (tests/pooling_models.py makes them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pooling_models import make_tiny

from shoal.loader.resolve import MINILM, locate_embedded


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return locate_embedded(MINILM)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, minilm_dir):
    path = tmp_path_factory.mktemp("tiny-bert")
    return path, make_tiny(path, minilm_dir, "bert")


@pytest.fixture(scope="session")
def tiny_bert_classifier(tmp_path_factory, minilm_dir):
    path = tmp_path_factory.mktemp("tiny-bert-cls")
    return path, make_tiny(path, minilm_dir, "bert-cls", num_labels=3,
                           id2label={0: "neg", 1: "neu", 2: "pos"},
                           label2id={"neg": 0, "neu": 1, "pos": 2})


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory, minilm_dir):
    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    return path, make_tiny(path, minilm_dir, "bert-cls", num_labels=1)


@pytest.fixture(scope="session")
def tiny_llama_classifier(tmp_path_factory, minilm_dir):
    path = tmp_path_factory.mktemp("tiny-llama-cls")
    return path, make_tiny(path, minilm_dir, "llama-cls", num_labels=2)
