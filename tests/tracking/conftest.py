"""W&B kept inside each test's tmp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tracking.readback import isolate_wandb


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_wandb(tmp_path, monkeypatch)
