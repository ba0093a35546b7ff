"""`check_servable`: what `bapo serve` checks before it starts a vLLM server, so that a model the
server cannot load is one `error:` line in seconds, not a minute of vLLM's start and tracebacks
(tests/servers/test_serve_lifecycle.py runs the command on a missing directory)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bapo_cli.models import loading as models
from bapo_cli.models import tiny
from tests.models.test_offline import unreachable_hub  # noqa: F401  (a fixture)

TINY = tiny.SHIPPED_ROOT / "tiny"


def _copy_without(tmp_path: Path, *names: str) -> Path:
    target = tmp_path / "model"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(*names))
    return target


def test_the_tiny_model_is_servable() -> None:
    models.check_servable(TINY)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "no such directory"),
        ("file", "no such directory"),
        ("no-config", "not a HF model directory (no config.json)"),
        ("bad-json", "its config cannot be loaded ("),
        ("unknown-architecture", "its config cannot be loaded (The checkpoint you are trying"),
        ("no-tokenizer", "its tokenizer is empty (no tokenizer.json, vocab.json or tokenizer"),
        ("no-weights", "no weight files (*.safetensors, *.bin, *.pt); name a HF model directory"),
    ],
)
def test_a_model_dir_vllm_cannot_load_is_one_line(tmp_path: Path, case: str, says: str) -> None:
    path = tmp_path / "model"
    if case == "file":
        path.write_text("")
    elif case == "no-config":
        path = _copy_without(tmp_path, "config.json")
    elif case == "bad-json":
        path = _copy_without(tmp_path)
        (path / "config.json").write_text("{not json")
    elif case == "unknown-architecture":
        path = _copy_without(tmp_path)
        (path / "config.json").write_text('{"model_type": "no_such_architecture"}')
    elif case == "no-tokenizer":
        path = _copy_without(tmp_path, "tokenizer*")
    elif case == "no-weights":
        path = _copy_without(tmp_path, "*.safetensors")
    with pytest.raises(models.ModelLoadError) as info:
        models.check_servable(path)
    line = str(info.value)
    assert line.startswith(f"model.path={path}: {says}"), line
    assert "\n" not in line


def test_a_hub_id_out_of_reach_is_one_line(unreachable_hub: str) -> None:  # noqa: F811
    with pytest.raises(models.ModelLoadError) as info:
        models.check_servable("no-such-org/no-such-model")
    assert str(info.value) == (
        "model.path=no-such-org/no-such-model: not in the HF cache, and the HF hub cannot be "
        f"used (cannot connect to {unreachable_hub}: Connection refused)"
    )
