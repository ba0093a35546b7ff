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
