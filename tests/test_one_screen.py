"""One function on one screen (issue 44): in trainer/, staleness/ and algos/ no function is
longer than 60 lines or takes more than 7 parameters (self and cls not counted, *args and
**kwargs counted as one each)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bapo_cli

PACKAGE = Path(bapo_cli.__file__).parent
MAX_LINES, MAX_PARAMS = 60, 7
CHECKED = sorted(
    str(p.relative_to(PACKAGE))
    for package in ("trainer", "staleness", "algos")
    for p in (PACKAGE / package).glob("*.py")
)


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, lines, parameters) of every function and method in the module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            params = len([n for n in names if n not in ("self", "cls")])
            params += (a.vararg is not None) + (a.kwarg is not None)
            out.append((node.name, node.end_lineno - node.lineno + 1, params))
    return out


@pytest.mark.parametrize("module", CHECKED)
def test_functions_fit_on_one_screen(module: str) -> None:
    too_long = [
        f"{name}: {n} lines" for name, n, _ in _functions(PACKAGE / module) if n > MAX_LINES
    ]
    too_wide = [
        f"{name}: {p} parameters" for name, _, p in _functions(PACKAGE / module) if p > MAX_PARAMS
    ]
    assert not too_long and not too_wide, (module, too_long + too_wide)


def test_the_check_sees_long_and_wide_functions(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    source = f"def long(a, b):\n{body}\n\ndef wide(self, a, b, c, d, e, f, g, *h, **i):\n    pass\n"
    (tmp_path / "m.py").write_text(source)
    assert _functions(tmp_path / "m.py") == [("long", 61, 2), ("wide", 2, 9)]
    assert {"trainer/train.py", "staleness/worker.py", "algos/core.py"} <= set(CHECKED)
