"""CUDA graphs of the Transformers backend on a GPU (skipped without one): Llama forced through
the backend and Gemma (no shoal class: the backend by default) capture their steps at start-up,
pass the replay check (shoal/worker/graph_check.py), replay decode batches (padded) and lone
prefill chunks, and give the tokens of the same engine with enforce_eager. A forward that
syncs with the host inside the capture, or whose graph computes something its eager pass
does not, runs eagerly with one log line saying why, and still gives the eager tokens.
The CPU emulation of the same is tests/worker/test_graph_check.py."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from engine_helpers import random_prompts, tiny_llm  # noqa: E402
from oracle import write_tiny_checkpoint  # noqa: E402

from shoal import SamplingParams  # noqa: E402

LOGGER = "shoal.worker.graph_check"
ENGINE = dict(attention_backend="triton", max_num_seqs=8, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# (checkpoint, model_impl, transformers' class)
CASES = [("llama", "transformers", "LlamaForCausalLM"), ("gemma", "auto", "GemmaForCausalLM")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"llama": write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=1),
            "gemma": write_tiny_checkpoint(tmp_path_factory.mktemp("gemma"), "gemma", seed=1,
                                           head_dim=16)}


def _batches() -> list[list[dict]]:
    """Five prompts (decode batches of 5 and fewer: padded rows), then, one at a time, two
    that extend the first ones (prefix-cache hits: their tails are lone prefill chunks)."""
    first = random_prompts(5, seed=7, lo=3, hi=40)
    return [first] + [[{"prompt_token_ids": p["prompt_token_ids"] + [17, 29, 31, 5, 88]}]
                      for p in first[:2]]


def _run(path, model_impl: str, enforce_eager: bool, dtype: str = "float32"):
    """(tokens of every batch, the shape of every step replayed from a graph)."""
    llm = tiny_llm(path, model_impl=model_impl, enforce_eager=enforce_eager, dtype=dtype,
                   **ENGINE)
    runner = llm.llm_engine.core.runner
    assert type(runner.model).__name__ == "TransformersForCausalLM"
    replays: list = []
    graphs = runner.graphs
    if graphs is not None:
        real_run = graphs.run
        graphs.run = lambda shape, *a: replays.append(shape) or real_run(shape, *a)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)]
              for batch in _batches()]
    llm.shutdown()
    del llm, runner, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("name,impl,arch", CASES, ids=[c[0] for c in CASES])
def test_backend_graphs_replay_and_give_the_eager_tokens(checkpoints, caplog, name, impl, arch):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        graphed, replays = _run(checkpoints[name], impl, enforce_eager=False)
    assert _said(caplog) == [f"{arch} (TransformersForCausalLM): CUDA graphs checked (a "
                             "replayed decode step gives the eager step's logits)"]
    eager, no_replays = _run(checkpoints[name], impl, enforce_eager=True)
    assert no_replays == [] and graphed == eager
    decodes = [s for s in replays if s.q == 1]
    assert any(s.rows == 8 for s in decodes)  # 5 requests padded to 8 rows
    assert len(decodes) >= 2 * (PARAMS.max_tokens - 1)  # (the lone requests' decodes)
    assert any(s.rows == 1 and s.q > 1 for s in replays)  # a lone prefill chunk


def test_bfloat16_graphs_pass_the_check(checkpoints, caplog):
    """The 16-bit tolerance holds for a bf16 model's replay against its eager step."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _, replays = _run(checkpoints["llama"], "transformers", False, dtype="bfloat16")
    assert [m for m in _said(caplog) if "CUDA graphs checked" in m] and replays


def _patched_layer(monkeypatch, forward) -> None:
    """LlamaDecoderLayer.forward replaced for every Llama built through the backend (shoal's
    own Llama class does not use transformers' modules). The layer, not its MLP: the backend
    runs a SwiGLU MLP whose forward gives shoal's result as shoal's fused module
    (fused_modules.py), so a fault put into LlamaMLP.forward would never run."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaDecoderLayer.forward
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward",
                        lambda self, *args, **kwargs: forward(real, self, *args, **kwargs))


def _layer_that_syncs(real, self, hidden_states, *args, **kwargs):
    if bool(torch.isnan(hidden_states).any()):  # a tensor's truth value: the host waits
        raise ValueError("nan in the layer input")
    return real(self, hidden_states, *args, **kwargs)


def _layer_captured_otherwise(real, self, *args, **kwargs):
    # What a graph that froze a Python value would do: compute, when replayed, other
    # values than the eager pass of the same step.
    out = real(self, *args, **kwargs)
    scale = 0.5 if torch.cuda.is_current_stream_capturing() else 1.0
    return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale


@pytest.mark.parametrize("forward,reason", [
    (_layer_that_syncs, "an eager decode step synchronizes with the host"),
    (_layer_captured_otherwise, "a replayed decode step's logits differ from the eager step's"),
], ids=["host-sync", "replay-differs"])
def test_an_uncapturable_forward_runs_eagerly_with_the_reason(checkpoints, monkeypatch, caplog,
                                                             forward, reason):
    path = checkpoints["llama"]
    eager, _ = _run(path, "transformers", enforce_eager=True)
    _patched_layer(monkeypatch, forward)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tokens, replays = _run(path, "transformers", enforce_eager=False)
    (said,) = _said(caplog)
    assert said.startswith("LlamaForCausalLM (TransformersForCausalLM) runs without CUDA graphs "
                           "(eagerly, as with enforce_eager): " + reason), said
    if forward is _layer_that_syncs:  # the line names where in the model code it synced
        assert "test_transformers_backend_graphs_gpu.py" in said and "_layer_that_syncs" in said
    assert replays == [] and tokens == eager
