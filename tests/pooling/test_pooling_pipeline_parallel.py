"""Decoder pooling models with pipeline parallelism (runner="pooling",
pipeline_parallel_size=2 on the CPU: two processes joined by gloo, the mp executor): each
stage builds and runs its decoder layers, the last sends its final hidden states back to
stage 0, which pools (shoal/worker/pooling_runner.py). A Llama embedder (last token,
normalized) and a Llama classifier give on two stages what one gives (float32, 1e-5).
Encoders have no stages and stay refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from shoal import LLM
from shoal.engine.engine_args import EngineArgs
from shoal.models.llama import PPMissingLayer

# lengths 6, 2, 6, 3: a run of two equal lengths beside single ones (ids below both tiny
# vocabularies)
PROMPTS = [{"prompt_token_ids": p} for p in
           ([101, 7, 300, 42, 99, 102], [101, 102], [101, 256, 3, 11, 400, 102], [101, 23, 102])]


def _on_stages(path: Any, pp: int, run: Callable[[LLM], torch.Tensor],
               **kwargs: Any) -> torch.Tensor:
    """`run`'s results of an engine of `pp` stages (stage 0 holding only layer 0 at pp 2)."""
    llm = LLM(model=str(path), pipeline_parallel_size=pp, device="cpu", dtype="float32",
              max_model_len=64, runner="pooling", **kwargs)
    try:
        runner = llm.llm_engine.core.runner
        if pp > 1:
            assert type(runner).__name__ == "MultiprocExecutor" and runner.world == pp
            assert type(runner.driver).__name__ == "PoolingModelRunner"
            assert runner.pipelined
            model = runner.driver.model.model
            assert (model.start_layer, model.end_layer) == (0, 1)
            assert isinstance(model.layers[1], PPMissingLayer)
            assert isinstance(model.norm, PPMissingLayer)  # the last stage's
        return run(llm)
    finally:
        llm.shutdown()


def _same_on_two_stages(path: Any, run: Callable[[LLM], torch.Tensor]) -> None:
    one = _on_stages(path, 1, run)
    two = _on_stages(path, 2, run)
    assert one.shape == two.shape
    assert len({tuple(row.tolist()) for row in one.reshape(len(one), -1)}) == len(one)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def test_llama_last_token_embeddings_on_two_stages(tiny_llama_dir) -> None:
    def run(llm: LLM) -> torch.Tensor:
        out = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)])
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(PROMPTS)))  # normalized
        return out

    _same_on_two_stages(tiny_llama_dir, run)


def test_llama_classifier_on_two_stages(tiny_llama_classifier) -> None:
    """The score head over the last token (every stage holds it; stage 0 applies it)."""
    path, _ = tiny_llama_classifier

    def run(llm: LLM) -> torch.Tensor:
        return torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)])

    _same_on_two_stages(path, run)


def test_encoders_are_refused_by_name() -> None:
    bert = AutoConfig.for_model("bert", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=64)
    bert.architectures = ["BertModel"]
    message = ("pipeline_parallel_size > 1 splits a decoder's layers into stages; BertModel is "
               "an encoder-only model, which runs in one stage: use tensor_parallel_size")
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match=message):
            EngineArgs(device="cpu", pipeline_parallel_size=2, max_model_len=64,
                       model_impl=impl).create_engine_config(bert)
