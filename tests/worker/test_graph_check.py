"""CUDA graphs on trial for the Transformers backend (shoal/worker/graph_check.py), on the CPU:
the runner's capture path with replays emulated eagerly (worker/eager_graphs.py) and the
Triton backend under TRITON_INTERPRET=1. A model whose graphs replay its eager steps keeps
them and gives the eager tokens; one whose capture raises, or whose replay gives the step it
was captured on, runs eagerly with one log line naming why. The GPU run of the same is
tests/models/test_transformers_backend_graphs_gpu.py."""

from __future__ import annotations

import functools
import logging
import os

import torch

# triton.jit reads TRITON_INTERPRET when a kernel is defined: set it before the engine
# imports the kernel modules (it does so lazily, when the Triton backend is chosen).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from oracle import TINY_COMMON, write_tiny_checkpoint  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.engine.engine_args import EngineArgs  # noqa: E402
from shoal.worker.graph_check import describe_error, logits_mismatch  # noqa: E402
from shoal.worker.model_graphs import ModelGraphs  # noqa: E402

LOGGER = "shoal.worker.graph_check"
# The engine tests emulate graphs on the CPU (interpreted kernels); on a GPU the real ones run
# in tests/models/test_transformers_backend_graphs_gpu.py.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU emulation (the GPU test is its CUDA run)")
PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42, 9, 77, 8]}, {"prompt_token_ids": [11, 3, 250]}]
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class StaleGraphTable(EagerGraphTable):
    """Replays give the outputs of the step captured (zeros over no context), whatever was
    staged since: what a graph that froze its capture-time inputs does."""

    def replay(self, shape):
        return self.outputs[shape]


class SyncingGraphTable(EagerGraphTable):
    """Capture fails as CUDA's does on a host sync (`.item()`) inside the forward: the error,
    then the capture's end failing over it."""

    def capture(self, body, pool=None, what="step", before_each=None):
        try:
            _model_code_that_syncs()
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture")


def _model_code_that_syncs():
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA "
                       "kernel errors might be asynchronously reported at some other API call")


@pytest.fixture(scope="module")
def backend_llm(tmp_path_factory):
    """A one-layer Llama through the Transformers backend on the CPU (interpreted kernels:
    one layer, decode graphs of 1 and 2 rows only), with its eager tokens."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("llama-1"), "llama",
                                 num_hidden_layers=1)
    llm = LLM(model=str(path), model_impl="transformers", dtype="float32",
              attention_backend="triton", block_size=4, num_gpu_blocks_override=64,
              max_model_len=64, max_num_seqs=2, max_num_batched_tokens=12)
    eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return llm, eager


def _capture(llm, table_type, monkeypatch):
    """The runner's start-up capture, replays emulated by `table_type`."""
    runner = llm.llm_engine.core.runner
    monkeypatch.setattr("shoal.worker.graph_capture.ModelGraphs",
                        functools.partial(ModelGraphs, table_type=table_type))
    runner.graphs = None
    runner._capture_graphs()
    # At start-up the check runs before any request; here requests ran before it, and its
    # writes went into their cached blocks.
    llm.llm_engine.core.reset_prefix_cache()
    return runner


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@cpu_only
def test_checked_graphs_are_kept_and_give_the_eager_tokens(backend_llm, monkeypatch, caplog):
    llm, eager = backend_llm
    runner = llm.llm_engine.core.runner
    assert runner.graphs is None  # on the CPU the runner captures nothing: every step eager
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = _capture(llm, EagerGraphTable, monkeypatch)
    assert runner.graphs is not None
    assert _said(caplog) == ["LlamaForCausalLM (TransformersForCausalLM): CUDA graphs checked "
                             "(a replayed decode step gives the eager step's logits)"]
    replays = []
    real_run = runner.graphs.run
    runner.graphs.run = lambda shape, *a: replays.append(shape) or real_run(shape, *a)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        runner.graphs = None
    assert got == eager
    assert any(s.q == 1 and s.rows == 2 for s in replays)  # the decodes replayed their graph


@cpu_only
def test_a_replay_of_the_captured_step_runs_eagerly_with_the_reason(backend_llm, monkeypatch,
                                                                    caplog):
    llm, _ = backend_llm
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = _capture(llm, StaleGraphTable, monkeypatch)
    assert runner.graphs is None
    (said,) = _said(caplog)
    assert said.startswith("LlamaForCausalLM (TransformersForCausalLM) runs without CUDA graphs "
                           "(eagerly, as with enforce_eager): a replayed decode step's logits "
                           "differ from the eager step's by ")
    assert "the graph kept values of the step it was captured on" in said


@cpu_only
def test_a_capture_that_syncs_runs_eagerly_naming_the_error(backend_llm, monkeypatch, caplog):
    llm, _ = backend_llm
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = _capture(llm, SyncingGraphTable, monkeypatch)
    assert runner.graphs is None
    (said,) = _said(caplog)
    assert said.startswith("LlamaForCausalLM (TransformersForCausalLM) runs without CUDA graphs "
                           "(eagerly, as with enforce_eager): capturing its forward raised "
                           "RuntimeError: CUDA error: operation not permitted when stream is "
                           "capturing (at worker/test_graph_check.py:")
    assert said.endswith(" in _model_code_that_syncs)")


def test_logits_mismatch_tolerates_rounding_not_other_logits():
    g = torch.Generator().manual_seed(0)
    eager = torch.randn(2, 50, generator=g) * 4
    assert logits_mismatch(eager, eager.clone(), torch.float32) is None
    assert logits_mismatch(eager, eager * (1 + 1e-4), torch.float32) is None
    assert "by 0.01 of" in logits_mismatch(eager, eager * 1.01, torch.float32)
    assert logits_mismatch(eager, eager * 1.01, torch.bfloat16) is None  # 16-bit rounding
    other = torch.randn(2, 50, generator=g) * 4  # another step's logits
    assert "tolerance 0.05" in logits_mismatch(eager, other, torch.bfloat16)
    nan = eager.clone()
    nan[1, 3] = float("nan")
    assert "non-finite" in logits_mismatch(eager, nan, torch.float32)
    assert "not finite" in logits_mismatch(nan, eager, torch.float32)
    assert "shape (1, 50)" in logits_mismatch(eager, eager[:1], torch.float32)


def test_describe_error_without_a_chain():
    try:
        _model_code_that_syncs()
    except RuntimeError as e:
        said = describe_error(e)
    assert said.startswith("RuntimeError: CUDA error: operation not permitted when stream is "
                           "capturing (at worker/test_graph_check.py:")


def test_the_backend_keeps_cuda_graphs_in_the_engine_config(caplog):
    """Start-up no longer forces enforce_eager for the backend (the runner tries its graphs);
    the backend's refusals still come before anything is built."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY_COMMON, architectures=["LlamaForCausalLM"])
    with caplog.at_level(logging.INFO, logger="shoal.engine.graph_support"):
        config = EngineArgs(device="cuda", model_impl="transformers").create_engine_config(cfg)
    assert not config.enforce_eager
    assert not [r for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    enc = LlamaConfig(**TINY_COMMON, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="has a task head"):
        EngineArgs(device="cuda", model_impl="transformers").create_engine_config(enc)
