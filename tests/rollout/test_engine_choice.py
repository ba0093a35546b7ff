"""What `rollout=auto` runs: vLLM on CUDA when it imports, transformers otherwise (on CPU vLLM is
the slower engine for the models a CPU trains). No engine starts here but the transformers one."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.launch.plan import train_rows
from bapo_cli.rollout.base import EngineChoice, choose, choose_engine
from tests.train.conftest import FAST

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")


@pytest.mark.parametrize(
    ("cuda", "vllm", "engine"),
    [(True, True, "vllm"), (True, False, "hf"), (False, True, "hf"), (False, False, "hf")],
)
def test_choose_engine_table(cuda, vllm, engine) -> None:
    assert choose_engine(device_is_cuda=cuda, vllm_available=vllm) == engine


@cpu_only
def test_auto_resolves_to_transformers_on_this_cpu_machine(tmp_path: Path) -> None:
    # the real resolution: vllm(-cpu) may well be installed here, the device is what decides
    for device in (None, "auto", "cpu", torch.device("cpu")):
        assert choose("auto", device).name == "hf"
    assert choose("vllm", "cpu").name == "vllm"  # forcing it still works
    assert choose("auto", "auto") == EngineChoice(
        "hf", "auto: transformers on CPU, where it is faster than vllm"
    )
    assert choose("vllm", "auto") == EngineChoice("vllm", "selected")
    cfg = preflight("train", []).config  # the default config: rollout=auto
    assert cfg.rollout.name == "auto"
    assert dict(train_rows(cfg, tmp_path))["rollout"].startswith("hf (auto: transformers on CPU")


@cpu_only
def test_default_training_step_runs_transformers_on_cpu(tmp_path: Path) -> None:
    from bapo_cli.trainer.train import train

    fast = [o for o in FAST if not o.startswith("rollout=")]  # tests/train pin rollout=hf
    cfg = preflight("train", [*fast, "rollout=auto", "trainer.max_steps=1"]).config
    out = io.StringIO()
    result = train(cfg, tmp_path / "run", Console(file=out, width=200))
    assert "rollout engine: hf (rollout=auto)" in out.getvalue()
    assert len(result.history) == 1
    # the transformers engine reports no log-probs of its own (vLLM's would be kept per token)
    assert all(s.engine_logprobs == [] for s in result.last_batch)
