"""`bapo report`'s code, one module per thing it makes (bapo_cli/report/): each small, imported
one way, the evaluation stack only for `--failures`, and scripts/study_v3.py calling only the
report's public names. (What the report writes is tested in test_report.py and test_facets.py.)"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from bapo_cli import report
from bapo_cli.report import stats
from tests.conftest import REPO

PACKAGE = REPO / "src" / "bapo_cli" / "report"
ORDER = ("runs", "columns", "labels", "stats", "tables", "plots", "failures", "__init__")
"""The modules in the order they build on each other: each imports only those before it."""


def _report_imports(module: str) -> set[str]:
    """The report modules `module` imports, function bodies included."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    prefix = "bapo_cli.report."
    return {
        node.module.removeprefix(prefix)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix)
    }


def test_one_module_per_part_each_small_and_imported_one_way() -> None:
    assert sorted(p.stem for p in PACKAGE.glob("*.py")) == sorted(ORDER)
    for i, module in enumerate(ORDER):
        lines = len((PACKAGE / f"{module}.py").read_text(encoding="utf-8").splitlines())
        assert lines <= 400, f"report/{module}.py has {lines} lines"
        assert _report_imports(module) <= set(ORDER[:i]), module


def test_a_plain_report_loads_neither_torch_nor_the_evaluation_stack() -> None:
    code = (
        "import sys\n"
        "import bapo_cli.report\n"
        "heavy = ('torch', 'bapo_cli.evaluation', 'matplotlib')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_study_v3_calls_only_public_report_names() -> None:
    tree = ast.parse((REPO / "scripts" / "study_v3.py").read_text(encoding="utf-8"))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "report"
    }
    used |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "bapo_cli.report"
        for alias in node.names
    }
    assert used == {
        "ReportError",
        "RunData",
        "holm",
        "label_runs",
        "load_runs",
        "net_entropy_push",
        "permutation_p",
    }
    assert used <= set(report.__all__)


def test_holm_lives_in_the_reports_statistics() -> None:
    assert report.holm is stats.holm
    # thresholds 0.025 then 0.05 for the sorted p-values
    assert stats.holm({"a": 0.01, "b": 0.04}) == {"a": True, "b": True}
    assert stats.holm({"a": 0.03, "b": 0.04}) == {"a": False, "b": False}  # 0.03 > 0.025 stops
    assert stats.holm({"a": 0.03, "b": 0.04}, alpha=0.1) == {"a": True, "b": True}
