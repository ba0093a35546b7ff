"""`bapo train` with the vLLM engine: auto picks it, weights stay in sync step after step (the
mismatch metric says so), partial rollouts span versions, the TIS correction runs.

Each run starts its own engine inside `train()` (no engine of the other module is alive)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.trainer.train import TrainResult, train
from tests.train.conftest import FAST

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

MISMATCH = ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max")


def run(tmp_path: Path, *overrides: str) -> tuple[TrainResult, str]:
    out = io.StringIO()
    fast = [o for o in FAST if not o.startswith("rollout=")]  # tests/train pin rollout=hf
    cfg = preflight("train", [*fast, *overrides]).config
    result = train(cfg, tmp_path / "run", Console(file=out, width=200))
    return result, out.getvalue()


def test_weights_stay_in_sync_across_steps(tmp_path) -> None:
    # rollout=auto picks transformers on CPU (tests/rollout/test_engine_choice.py): force vLLM
    result, printed = run(
        tmp_path, "rollout=vllm", "algo=grpo", "staleness=2", "trainer.max_steps=3"
    )
    assert "rollout engine: vllm (rollout=vllm)" in printed
    assert len(result.history) == 3
    for h in result.history:
        # steps 2 and 3 sample from synced weights (embedding and tied lm_head trained)
        assert h["rollout/logprob_abs_diff_mean"] < 1e-5, h
        assert h["rollout/logprob_abs_diff_max"] < 1e-4, h
        assert 0.0 < h["perf/weight_sync_s"] < 5.0
        assert h["perf/rollout_tokens_per_s"] > 0
    first = result.updates[0]
    assert first["ratio_max"] == 1.0 and first["clipfrac_low"] == 0.0 == first["clipfrac_high"]
    for s in result.last_batch:
        assert len(s.engine_logprobs) == len(s.logprobs) == len(s.response_ids)


def test_partial_rollout_with_vllm_spans_versions(tmp_path) -> None:
    result, _ = run(
        tmp_path,
        "rollout=vllm",
        "staleness=2",
        "staleness.regime=partial",
        "rollout.max_tokens=4",
        "trainer.max_steps=5",
    )
    assert max(h["staleness/max"] for h in result.history) >= 1
    for h in result.history:
        assert h["rollout/logprob_abs_diff_max"] < 1e-4
    for s in result.last_batch:
        assert s.versions == sorted(s.versions)
        assert len(s.engine_logprobs) == len(s.logprobs) == len(s.versions) == len(s.response_ids)


def test_truncated_importance_sampling_trains(tmp_path) -> None:
    result, _ = run(
        tmp_path, "rollout=vllm", "rollout.tis_cap=2", "algo=bapo", "trainer.max_steps=2"
    )
    for h in result.history:
        assert all(math.isfinite(v) for v in h.values())
        assert h["actor/skipped_steps"] == 0
