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


@pytest.fixture(scope="session")
def lora_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base, adapter): a random model of the tiny shape with the tiny tokenizer saved as a HF
    dir, and a LoRA checkpoint on it (r=4, alpha=8, all-linear, B non-zero) as the trainer
    writes one: the adapter's two files beside the tokenizer. Tests copy them before changing."""
    import torch
    from transformers import Qwen2ForCausalLM

    from bapo_cli.config.schema import LoraConfig
    from bapo_cli.models import loading, lora, tiny

    root = tmp_path_factory.mktemp("lora-files")
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny.build_config(TinyModelConfig())).float().save_pretrained(root / "base")
    tiny.build_tokenizer().save_pretrained(root / "base")
    model, tokenizer = loading.load_checkpoint(root / "base")
    wrapped = lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    wrapped.save_pretrained(root / "adapter", safe_serialization=True)
    tokenizer.save_pretrained(root / "adapter")
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "base")  # as PEFT records it
    return root / "base", root / "adapter"
