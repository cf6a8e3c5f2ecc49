"""shoal/envs.py lists every SHOAL_ environment variable once, and nothing else in shoal/ reads
one: the name of a variable appears as a string in envs.py only (an AST check over the
source, as tests/test_architecture.py does for imports). Each variable is parsed when read."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoal import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shoal"
# A variable's name, or the prefix alone (a loop over os.environ picking SHOAL_* names).
_NAME = re.compile(r"SHOAL_[A-Z0-9_]*")


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants (they may name a variable: they do not read it)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _variable_strings(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each string in code (not a docstring) that is a SHOAL_ name, or of an
    f-string whose text holds one."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs and _NAME.fullmatch(node.value.strip())):
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.JoinedStr) and any(
                isinstance(p, ast.Constant) and _NAME.search(str(p.value)) for p in node.values):
            found.append((node.lineno, "an f-string"))
    return sorted(found)


def test_only_envs_names_a_shoal_variable():
    found = [f"{path.relative_to(ROOT)}:{line} {what}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "envs.py"
             for line, what in _variable_strings(path)]
    assert not found, ("SHOAL_ variables are read through shoal/envs.py only (add the variable "
                       "there and call its get()):\n  " + "\n  ".join(found))


def test_the_check_sees_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Reads SHOAL_X (a docstring may say so)."""\nimport os\n'
                   'x = os.environ.get("SHOAL_X")\n'
                   'y = [k for k in os.environ if k.startswith("SHOAL_")]\n'
                   'z = f"SHOAL_Y={x}"\n')
    assert _variable_strings(bad) == [(3, "'SHOAL_X'"), (4, "'SHOAL_'"), (5, "an f-string")]


def test_every_variable_is_listed_once_with_its_help():
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names)) and len(names) >= 7
    for v in envs.ALL:
        assert v.name.startswith("SHOAL_") and getattr(envs, v.name) is v
        assert v.help and isinstance(v.help, str)


def test_parsed_when_read(monkeypatch):
    for v in envs.ALL:
        monkeypatch.delenv(v.name, raising=False)
        assert v.get() == v.default
    monkeypatch.setenv("SHOAL_CPU_DECODE_KERNEL", "0")
    assert envs.SHOAL_CPU_DECODE_KERNEL.get() is False
    monkeypatch.setenv("SHOAL_CPU_DECODE_KERNEL", "1")
    assert envs.SHOAL_CPU_DECODE_KERNEL.get() is True
    monkeypatch.setenv("SHOAL_DP_SYNC_TIMEOUT_S", "2.5")
    assert envs.SHOAL_DP_SYNC_TIMEOUT_S.get() == 2.5
    monkeypatch.setenv("SHOAL_DP_SYNC_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="SHOAL_DP_SYNC_TIMEOUT_S='soon' is invalid"):
        envs.SHOAL_DP_SYNC_TIMEOUT_S.get()
    monkeypatch.setenv("SHOAL_STEP_TRACE", "")
    assert envs.SHOAL_STEP_TRACE.get() is None  # set but empty: off, as before


def test_only_listed_variables_are_forwarded(monkeypatch):
    """What the Ray executor copies into its actors."""
    for v in envs.ALL:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("SHOAL_PP_LAYER_PARTITION", "13,17")
    monkeypatch.setenv("SHOAL_NOT_A_VARIABLE", "1")
    assert envs.set_variables() == {"SHOAL_PP_LAYER_PARTITION": "13,17"}


def test_envs_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys, shoal.envs; "
                           "print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
