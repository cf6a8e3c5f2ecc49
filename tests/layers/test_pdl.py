"""The PDL switch on the CPU (shoal/pdl.py; its GPU test: test_pdl_gpu.py): with
SHOAL_PDL=1 a launch off CUDA takes no PDL arguments, so the interpreter's kernels run as
without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shoal import pdl  # noqa: E402
from shoal.layers.ops.rms_norm import rms_norm  # noqa: E402


def test_no_pdl_off_cuda(monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_PDL", "1")
    assert not pdl.launch(torch.device("cpu")) and pdl.kwargs(torch.device("cpu")) == {}
    monkeypatch.setenv("SHOAL_PDL", "0")
    assert pdl.kwargs(torch.device("cpu")) == {}


def test_no_pdl_under_the_interpreter(monkeypatch) -> None:
    """TRITON_INTERPRET runs kernels of CUDA tensors too, and has no griddepcontrol: the
    check comes before any question to a GPU (there is none here)."""
    monkeypatch.setenv("SHOAL_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.launch(torch.device("cuda", 0)) and pdl.kwargs(torch.device("cuda")) == {}


@pytest.mark.parametrize("mode, on", [("0", False), (" 0 ", False), ("1", True),
                                      ("all", True)])  # (all: session 19's trial mode)
def test_the_switch(monkeypatch, mode, on) -> None:
    """SHOAL_PDL=0 off, anything else (unset: the default) on, on a GPU that can (stood in
    for here)."""
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SHOAL_PDL", mode)
    gpu = torch.device("cuda", 0)
    assert pdl.launch(gpu) == on
    assert pdl.kwargs(gpu) == ({"PDL": True, "launch_pdl": True} if on else {})
    monkeypatch.delenv("SHOAL_PDL")
    assert pdl.launch(gpu)


def test_kernels_run_with_the_switch_on(monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_PDL", "1")
    x, w = torch.randn(3, 64), torch.rand(64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want)
