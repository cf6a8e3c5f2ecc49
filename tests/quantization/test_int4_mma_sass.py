"""The INT4 tensor-core GEMV's K loop as ptxas compiles it for sm_90, checked on the CPU
(Triton's compiler and the NVIDIA tools it ships; no GPU).

Each dot takes its activation operand through shared memory behind a barrier, and ptxas moves
no load across a barrier: a load written after a dot waits for it. Before session 24 the
kernel loaded each pair set's activations inside the dot loop and the scales after the dots,
so a step made five global round trips one after another; the interpreter tests cannot see
that, a GPU only as lost bandwidth. Here: in the loop, every global load comes before the
first barrier and the first tensor-core instruction (one round trip a step), the words load
as 16-byte vectors, and nothing spills, at Llama-3.1-8B's gate_up shape for each GPU tile."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")  # (before shoal's kernels import triton)

from sm90_compile import sass_of_records  # noqa: E402

from shoal.layers.quantization.int4_mma_gemv import MAGIC, TILES  # noqa: E402

N, K, GROUP = 28672, 4096, 128  # Llama-3.1-8B's gate_up: codes [K / 8, N], g128


def _int(value: int) -> dict:
    return {"type": "i32", "div16": value % 16 == 0, "one": value == 1}


def _record(block_n: int, warps: int, rows: int, split: int, zeros: bool,
            tiled: bool = False, row_words: int | None = None) -> dict:
    """The launch as int4_mma_gemv makes it (row_words None: the codes' row stride as a
    constant, N; 0: a runtime stride, as before session 25)."""
    import torch

    span = K // split
    ptr = {"ptr": "bf16", "div16": True}
    args = {
        "x_ptr": ptr, "w_ptr": {"ptr": "i32", "div16": True}, "s_ptr": ptr,
        "z_ptr": {"ptr": "u8", "div16": True} if zeros else ptr, "out_ptr": ptr,
        "part_ptr": {"ptr": "fp32", "div16": True}, "count_ptr": {"ptr": "i32", "div16": True},
        "M": _int(rows), "N": _int(N), "K": _int(K), "K_SPLIT": _int(span),
        "SPLIT": _int(split), "stride_xm": _int(K), "stride_wk": _int(N), "stride_sg": _int(N),
        "GROUP": {"value": GROUP}, "HAS_ZERO": {"value": zeros},
        "BLOCK_N": {"value": block_n}, "WORDS": {"value": 16},
        "MAGIC16": {"value": MAGIC[torch.bfloat16]}, "BIAS": {"value": 128.0},
        "SPLIT_K": {"value": split > 1}, "PDL": {"value": True},  # (as a GPU launches it)
        "TILED": {"value": tiled},
        "ROW_WORDS": {"value": 0 if tiled else (N if row_words is None else row_words)},
    }
    return {"module": "shoal.layers.quantization.int4_mma_gemv", "name": "_int4_mma_kernel",
            "args": args, "options": {"num_warps": warps, "num_stages": 1}}


def _instructions(listing: str) -> list[tuple[int, str]]:
    """(address, instruction text) of each line of nvdisasm's listing, labels kept apart."""
    out = []
    for line in listing.splitlines():
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$", line)
        if found:
            out.append((int(found.group(1), 16), found.group(2)))
    return out


def _labels(listing: str) -> dict[str, int]:
    """Label -> address of the instruction after it."""
    labels, pending = {}, []
    for line in listing.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if found and pending:
            labels.update({name: int(found.group(1), 16) for name in pending})
            pending = []
    return labels


def _longest_loop(listing: str) -> list[str]:
    """The instructions of the longest backward branch's span: the K loop."""
    code, labels = _instructions(listing), _labels(listing)
    best = None
    for address, text in code:
        target = re.search(r"BRA\s.*?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), address + 1) <= address:
            span = (labels[target.group(1)], address)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    assert best is not None, "no loop in the kernel"
    return [text for address, text in code if best[0] <= address <= best[1]]


# (tile_codes' layout at one row too: one run of words a step)
CASES = [(block_n, warps, rows, split, zeros, tiled) for block_n, warps in TILES
         for rows, split, zeros, tiled in ((1, 2, False, False), (8, 1, True, False),
                                           (1, 2, False, True))]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return dict(zip(CASES, sass_of_records([_record(*case) for case in CASES])))


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "n{}w{}-rows{}-split{}-zeros{}-tiled{}".format(*c))
def test_a_step_loads_everything_before_its_first_barrier(compiled, case):
    out = compiled[case]
    assert out["local"] == 0, f"{out['local']} bytes a thread spilled"
    loop = _longest_loop(out["sass"])
    opcode = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in loop]
    loads = [i for i, op in enumerate(opcode) if op.startswith("LDG")]
    # the first barrier or tensor-core instruction (HGMMA on sm_90, HMMA where a compiler
    # takes mma.sync): loads after it wait for the dot before them
    fence = next((i for i, op in enumerate(opcode)
                  if op.startswith(("BAR", "HGMMA", "HMMA"))), len(opcode))
    assert any(op.startswith(("HGMMA", "HMMA")) for op in opcode), "no dot in the loop"
    late = [loop[i] for i in loads if i > fence]
    assert not late, f"global loads after the step's first barrier or dot: {late}"
    words = [op for op in opcode if op == "LDG.E.128"]
    block_n, warps = case[:2]
    # the [BLOCK_N, 16] words tile in 16-byte vectors (4 words each) over the program's threads
    assert len(words) == block_n * 16 // 4 // (32 * warps), opcode


@pytest.mark.parametrize("block_n,warps", TILES)
def test_a_constant_row_stride_takes_fewer_registers(compiled, block_n, warps):
    """The codes' row stride as a compile-time constant (ROW_WORDS): one base pointer and
    constant offsets where a runtime stride kept a 64-bit pointer a row (2026-12-07: 168 ->
    128 registers at n256 w4, four programs a multiprocessor where three fit; W2 INT4 on an
    H100 317-327 -> ~350 tok/s measured with the tiled layout, which has the same count)."""
    runtime = sass_of_records([_record(block_n, warps, 1, 2, False, row_words=0)])[0]
    launched = compiled[(block_n, warps, 1, 2, False, False)]["registers"]
    tiled = compiled[(block_n, warps, 1, 2, False, True)]["registers"]
    assert launched < runtime["registers"] and launched <= tiled + 2
