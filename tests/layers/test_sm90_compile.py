"""The decode step's Triton kernels compile for sm_90 as a GPU launches them (PDL on, no
interpreter rounding), checked on the CPU: tests/sm90_compile.py records the launches of the
kernels' own interpreter tests and compiles them with Triton's compiler and ptxas.

The interpreter runs a kernel that Triton's compiler refuses (session 21: the MoE gate
routing rebound a name to another shape in a branch; every interpreter test passed and the
first GPU launch failed), and never runs the PDL branches."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from sm90_compile import compile_recorded

pytest.importorskip("triton.backends.nvidia.compiler")

TESTS = Path(__file__).resolve().parents[1]
# the interpreter tests of the kernels a decode step launches with PDL (shoal/pdl.py), the
# quantized GEMVs and the paged attention kernels
KERNEL_TESTS = [
    "layers/test_gate_routing.py", "layers/test_linear_decode_fused.py",
    "layers/test_sigmoid_gate.py", "layers/test_half_gemv.py",
    "layers/test_half_decode_experts.py", "layers/test_pdl.py",
    "attention/test_rope_kv_write.py", "attention/test_triton_kernels.py",
    "quantization/test_decode_gemv.py", "quantization/test_int4_wide_gemv.py",
    "layers/test_linear_state_decode.py", "layers/test_layer_kernels.py",
    "quantization/test_int4_mma_gemv.py",
]
# each must have been recorded and compiled (a kernel renamed or no longer launched by its
# tests shows here, rather than silently leaving the check)
KERNELS = {
    "_gate_routing_kernel", "_topk_routing_kernel", "_decode_kernel", "_conv_step_kernel",
    "_sigmoid_gate_kernel", "_half_gemv_kernel", "sum_splits_kernel", "_gate_up_kernel",
    "_down_kernel", "_rms_norm_kernel", "_silu_mul_kernel", "_rope_kv_write_kernel",
    "_paged_decode_kernel", "_split_reduce_kernel", "_fp8_gemv_kernel", "_int4_wide_kernel",
    "_delta_rule_kernel", "_rotary_kernel", "_paged_prefill_kernel", "_kv_cache_write_kernel",
    "_int4_gemv_kernel", "_grouped_gemm_kernel", "_int4_mma_kernel",
}


# the other kernels' tests (MLA and sparse attention, grouped and MXFP4 experts, DeepSeek
# routing, LoRA, FP8 block GEMM, ...): make sm90-compile (the grouped GEMMs and MLA kernels
# take seconds each to compile)
OTHER_KERNEL_TESTS = [
    "layers/test_deepseek_routing_kernel.py", "layers/test_mxfp4_decode_words.py",
    "lora/test_lora_triton_sgmv.py", "quantization/test_fast_kernels.py",
    "layers/test_fp8_moe.py", "layers/test_gate_logits.py", "layers/test_int4_moe.py",
    "layers/test_hyper_connection_mix.py", "layers/test_v4_decode_attention_triton.py",
    "attention/test_mla_kernels.py", "attention/test_mla_sparse.py",
    "layers/test_mla_inputs.py", "layers/test_delta_rule_rows_triton.py",
    "layers/test_mxfp4_decode_experts.py", "attention/test_fp8_index_scores.py",
    "attention/test_fp8_kv_kernels.py",
]
OTHER_KERNELS = {
    "_deepseek_routing_kernel", "_index_scores_kernel", "_mla_prefill_kernel",
    "_int4_grouped_gemm_kernel", "_mla_decode_kernel", "_mla_cache_write_kernel",
    "_fp8_grouped_gemm_kernel", "_shrink_kernel", "_expand_kernel", "_group_quant_kernel",
    "_rows_kernel", "_mla_sparse_kernel", "_v4_decode_kernel", "_combine_kernel",
    "_gate_up_words_kernel", "_down_words_kernel", "_gate_logits_kernel", "_mla_inputs_kernel",
    "_w4a16_kernel", "_mla_split_reduce_kernel", "_hc_mix_kernel", "_fp8_block_kernel",
    "_sum_splits_kernel", "_mxfp4_grouped_gemm_kernel",
}


def test_every_kernel_is_in_a_list() -> None:
    """Each @triton.jit function of shoal named *kernel* (what shoal launches: its helpers
    are named otherwise) is compiled by one of the two checks, so a new kernel is added to
    one (with a test of it in that list's files) rather than left out unseen."""
    kernels = set()
    for path in (TESTS.parent / "shoal").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and "kernel" in node.name and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                kernels.add(node.name)
    assert len(kernels) >= 40
    assert kernels <= KERNELS | OTHER_KERNELS, sorted(kernels - KERNELS - OTHER_KERNELS)


def _record_and_compile(tmp_path: Path, tests: list[str], kernels: set[str]) -> None:
    """Runs `tests` in the interpreter recording their launches, checks that each of
    `kernels` was launched, and compiles for sm_90 launches that show every constexpr value
    each kernel ran with (sm90_compile.covering)."""
    record = tmp_path / "launches.jsonl"
    env = {**os.environ, "SHOAL_RECORD_TRITON_LAUNCHES": str(record), "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         *[str(TESTS / t) for t in tests]],
        env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:]
    names = {json.loads(line)["name"] for line in record.read_text().splitlines()}
    assert kernels <= names, f"not launched by their tests: {sorted(kernels - names)}"
    compiled, failures = compile_recorded(record, timeout=600)
    assert compiled >= len(kernels)
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs these kernels for real")
def test_decode_kernels_compile_for_sm90(tmp_path: Path) -> None:
    _record_and_compile(tmp_path, KERNEL_TESTS, KERNELS)


@pytest.mark.sm90_all
@pytest.mark.timeout(1200)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs these kernels for real")
def test_the_other_kernels_compile_for_sm90(tmp_path: Path) -> None:
    _record_and_compile(tmp_path, OTHER_KERNEL_TESTS, OTHER_KERNELS)


BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def rebinds_kernel(x_ptr, out_ptr, N: tl.constexpr, REBIND: tl.constexpr):
    w = tl.load(x_ptr + tl.arange(0, N))
    acc = tl.sum(w, 0)
    if tl.load(x_ptr) > 0:  # (a branch taken at run time, as the gate routing's last program)
        if REBIND:
            w = tl.load(x_ptr + tl.arange(0, 2))  # (another shape: the compiler refuses)
        else:
            w2 = tl.load(x_ptr + tl.arange(0, 2))
            acc += 0.0 * tl.sum(w2, 0)
        acc += tl.sum(tl.load(x_ptr + tl.arange(0, 2)), 0)
    tl.store(out_ptr, acc + 0.0 * tl.sum(w, 0))
'''


def test_the_check_fails_where_the_interpreter_passes(tmp_path: Path, monkeypatch) -> None:
    """A kernel the interpreter runs correctly and Triton's compiler refuses (the bug this
    check is for) is reported; a correct one is not."""
    (tmp_path / "broken_kernels.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path),
                                                      os.environ.get("PYTHONPATH", "")]))
    import broken_kernels

    x, out = torch.arange(1, 9, dtype=torch.float32), torch.zeros(1)
    broken_kernels.rebinds_kernel[(1,)](x, out, N=8, REBIND=True)
    assert out.item() == 36.0 + 3.0  # (the interpreter: fine)

    def line(rebind: bool) -> str:
        return json.dumps({"module": "broken_kernels", "name": "rebinds_kernel",
                           "args": {"x_ptr": {"ptr": "fp32"}, "out_ptr": {"ptr": "fp32"},
                                    "N": {"value": 8}, "REBIND": {"value": rebind}},
                           "options": {"num_warps": 1}})

    record = tmp_path / "launches.jsonl"
    record.write_text(line(True) + "\n" + line(False) + "\n")
    compiled, failures = compile_recorded(record)
    assert compiled == 2
    assert len(failures) == 1 and "broken_kernels.rebinds_kernel" in failures[0], failures
