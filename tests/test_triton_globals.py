"""Triton kernels read no plain module globals.

Compiled for a GPU, a @triton.jit function may only read globals that are tl.constexpr (or
functions, modules, classes); a plain `BYTES = 16` read inside a kernel is a NameError at
compile time. Triton's CPU interpreter, which runs the kernels in this suite, accepts it, so
such a kernel passes every CPU test and fails on the first GPU launch (it happened:
mxfp4_decode_experts.py's BYTES, found on an H100). This test reads each kernel's source for
the names it loads that are neither its own locals nor allowed globals."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

SHOAL = Path(__file__).resolve().parent.parent / "shoal"


def _kernel_modules() -> list[str]:
    """The shoal modules whose source defines a @triton.jit function."""
    names = []
    for path in sorted(SHOAL.rglob("*.py")):
        if "@triton.jit" in path.read_text():
            rel = path.relative_to(SHOAL.parent).with_suffix("")
            names.append(".".join(rel.parts))
    return names


def _kernels(module: types.ModuleType) -> list[tuple[str, types.FunctionType]]:
    """(name, Python function) of each jit function the module defines (compiled or the
    interpreter's wrapper: both keep the function as .fn)."""
    out = []
    for name, value in vars(module).items():
        fn = getattr(value, "fn", None)
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__ \
                and type(value).__name__ in ("JITFunction", "InterpretedFunction"):
            out.append((name, fn))
    return out


def _loaded_globals(fn: types.FunctionType) -> set[str]:
    """Names fn's body loads that it never binds itself."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    fdef = tree.body[0]
    assert isinstance(fdef, ast.FunctionDef)
    bound = {a.arg for a in fdef.args.args + fdef.args.kwonlyargs}
    for node in ast.walk(fdef):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return {node.id for node in ast.walk(fdef)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
            and node.id not in bound}


def _allowed(value: object) -> bool:
    return isinstance(value, (types.ModuleType, tl.constexpr, type)) or callable(value)


def test_kernels_read_only_constexpr_globals():
    modules = _kernel_modules()
    assert len(modules) > 20  # (the scan finds the kernels at all)
    bad = []
    for name in modules:
        module = importlib.import_module(name)
        for kernel, fn in _kernels(module):
            for g in sorted(_loaded_globals(fn)):
                if g in fn.__globals__ and not _allowed(fn.__globals__[g]):
                    bad.append(f"{name}.{kernel} reads {g} "
                               f"({type(fn.__globals__[g]).__name__})")
    assert not bad, ("globals a GPU compile rejects (make them tl.constexpr(...)):\n  "
                     + "\n  ".join(bad))
