"""One small tiny model built per test session (40 warm-up steps: seconds), for the build tests.

Tests that need the warmed-up presets load the shipped ones (`models/weights/<name>/`) instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bapo_cli.config.schema import TinyModelConfig
from bapo_cli.models.tiny import ensure_tiny

BUILD_STEPS = 40


def _tiny_settings(**overrides) -> TinyModelConfig:
    """The default shape with the prototype's 0.31M parameters and a test-sized warm-up."""
    return TinyModelConfig(**{"intermediate_size": 256, "sft_steps": BUILD_STEPS, **overrides})


@pytest.fixture(scope="session")
def tiny_settings() -> Callable[..., TinyModelConfig]:
    return _tiny_settings


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bapo-cache")


@pytest.fixture(scope="session")
def tiny_build(tiny_cache: Path) -> tuple[TinyModelConfig, Path, dict]:
    cfg = _tiny_settings()
    directory = ensure_tiny(cfg, cache_dir=tiny_cache, progress=False)
    return cfg, directory, json.loads((directory / "build_info.json").read_text())
