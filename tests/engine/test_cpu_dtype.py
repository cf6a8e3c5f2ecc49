"""dtype="auto" on the CPU: bfloat16 where the CPU multiplies bfloat16 natively (AVX-512 BF16
or AMX), float32 elsewhere, logged once with the reason (shoal/config/cpu_dtype.py). The CPU
flags are mocked: the suite itself pins auto to float32 (tests/conftest.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from shoal import envs
from shoal.config import cpu_dtype, resolve_dtype

INTEL_AMX = frozenset("sse4_2 avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16".split())
AMD_ZEN4 = frozenset("sse4_2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni".split())
AMD_ZEN3 = frozenset("sse4_2 avx avx2 fma".split())
SKYLAKE_X = frozenset("sse4_2 avx2 avx512f avx512bw avx512vl".split())  # AVX-512, no BF16


def test_the_choice_follows_the_flags():
    choose = cpu_dtype.choose_cpu_dtype
    assert choose(INTEL_AMX).name == "bfloat16"
    assert "amx_bf16" in choose(INTEL_AMX).reason
    assert choose(AMD_ZEN4).name == "bfloat16"
    assert choose(AMD_ZEN3).name == "float32"
    assert choose(SKYLAKE_X).name == "float32"
    assert "emulated" in choose(SKYLAKE_X).reason
    assert choose(None).name == "float32"  # flags unknown (no /proc/cpuinfo)
    assert choose(INTEL_AMX, pinned="float32").name == "float32"
    assert choose(AMD_ZEN3, pinned="bfloat16").name == "bfloat16"


@pytest.fixture
def host(monkeypatch):
    """Sets the mocked host's flags; auto decided afresh (the pin of the suite lifted)."""
    monkeypatch.delenv(envs.SHOAL_CPU_AUTO_DTYPE.name, raising=False)

    def set_flags(flags):
        monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: flags)
        cpu_dtype.auto_cpu_dtype.cache_clear()

    yield set_flags
    cpu_dtype.auto_cpu_dtype.cache_clear()


def test_resolve_auto_on_the_cpu_and_gpu(host):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    host(INTEL_AMX)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    host(AMD_ZEN3)
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16  # explicit dtypes stand
    host(INTEL_AMX)
    assert resolve_dtype("float32", cpu) == torch.float32


def test_logged_once_with_the_reason(host, caplog):
    host(AMD_ZEN4)
    with caplog.at_level(logging.INFO, logger=cpu_dtype.__name__):
        for _ in range(3):
            resolve_dtype("auto", torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.name == cpu_dtype.__name__]
    assert lines == ["dtype auto on the CPU: bfloat16, because the CPU multiplies bfloat16 "
                     "natively (avx512_bf16)"]


def test_the_pin_and_its_bad_values(monkeypatch, host):
    host(INTEL_AMX)
    monkeypatch.setenv(envs.SHOAL_CPU_AUTO_DTYPE.name, "float32")
    assert cpu_dtype.auto_cpu_dtype() == "float32"
    monkeypatch.setenv(envs.SHOAL_CPU_AUTO_DTYPE.name, "float16")
    cpu_dtype.auto_cpu_dtype.cache_clear()
    with pytest.raises(ValueError, match="SHOAL_CPU_AUTO_DTYPE.*float32 or bfloat16"):
        cpu_dtype.auto_cpu_dtype()


def test_the_engine_config_takes_it(host, tiny_llama_dir):
    from shoal.engine.engine_args import EngineArgs
    from shoal.loader import load_model

    hf = load_model(str(tiny_llama_dir), load_format="dummy").hf_config
    host(INTEL_AMX)
    assert EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config(
        hf).model_config.dtype == torch.bfloat16
    host(AMD_ZEN3)
    assert EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config(
        hf).model_config.dtype == torch.float32


def test_this_host_flags_are_read():
    flags = cpu_dtype.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert flags  # a Linux x86 or Arm host lists some
