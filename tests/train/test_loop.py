"""The RL loop end to end: every algorithm and regime trains, and the numbers mean what they say."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from bapo_cli.config import hydra_runner
from bapo_cli.models import loading as models
from bapo_cli.trainer import checkpoint
from tests.train.conftest import run_train

DESIGN_KEYS = [
    "reward/mean",
    "reward/acc",
    "response/length_mean",
    "actor/entropy",
    "actor/grad_norm",
    "actor/ppo_kl",
    "actor/clipfrac_low",
    "actor/clipfrac_high",
    "staleness/mean",
    "staleness/max",
    "perf/step_s",
    "perf/rollout_s",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/weight_sync_s",
    "perf/update_tokens_per_s",
]


@pytest.mark.parametrize("algo", hydra_runner.group_options("algo"))
def test_each_algo_trains_three_steps_and_changes_the_weights(tmp_path, algo) -> None:
    result = run_train(tmp_path, f"algo={algo}", "staleness=2", "trainer.max_steps=3")
    assert len(result.history) == 3
    for key in DESIGN_KEYS:
        assert all(math.isfinite(h[key]) for h in result.history), key
    assert not any("perf/update_mfu" in h for h in result.history)  # CPU: no peak, no MFU
    # every loss reports its bounds and the positive share of the active mass at them
    assert all(0.0 <= h["actor/rho"] <= 1.0 for h in result.history)
    assert all(h["actor/c_low"] < 1.0 < h["actor/c_high"] for h in result.history)
    if algo == "bapo":
        for key in (
            "bapo/c_low",
            "bapo/c_high",
            "bapo/rho_before",
            "bapo/rho",
            "bapo/search_steps",
        ):
            assert key in result.history[-1]
    assert any(k.startswith("tokens/quadrant_") for k in result.history[-1])
    start, _ = models.load_policy(preflight_model())
    end, _ = models.load_checkpoint(result.checkpoint)
    moved = [
        not torch.equal(a, b) for a, b in zip(start.parameters(), end.parameters(), strict=True)
    ]
    assert any(moved), "no parameter changed after 3 steps"


def preflight_model():
    from bapo_cli.config.preflight import preflight

    return preflight("train", []).config.model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: autocast over fp32
def test_on_policy_update_has_ratio_exactly_one(tmp_path, dtype) -> None:
    result = run_train(
        tmp_path, "algo=grpo", "staleness=4", "trainer.max_steps=1", f"model.dtype={dtype}"
    )
    first, later = result.updates[0], result.updates[1:]
    assert first["ratio_mean"] == 1.0 and first["ratio_max"] == 1.0
    assert first["ppo_kl"] == 0.0 and first["clipfrac_low"] == 0.0 == first["clipfrac_high"]
    assert first["staleness_max"] == 0.0
    assert any(u["ratio_max"] != 1.0 for u in later)  # later mini-batches are off-policy


@pytest.mark.parametrize(
    ("regime", "k", "expected_max"),
    [
        ("reuse", 4, [3, 3, 3]),  # 4 updates per batch: 0, 1, 2, 3 versions stale
        ("reuse", 0, [0, 0, 0]),
        ("replay", 2, [0, 0, 2, 2]),  # the batch of 2 steps ago joins from step 2 on
        ("lag", 2, [0, 1, 2, 2]),  # trains on weights of step t - 2 (queue filled at step 0)
    ],
)
def test_each_regime_has_the_staleness_it_claims(tmp_path, regime, k, expected_max) -> None:
    steps = len(expected_max)
    result = run_train(
        tmp_path, f"staleness={k}", f"staleness.regime={regime}", f"trainer.max_steps={steps}"
    )
    if regime == "reuse" and k == 4:
        assert [h["actor/updates"] for h in result.history] == [4, 4, 4]
        # Staleness counts policy versions, and an update without gradient (every token clipped
        # or A = 0, e.g. all groups zero-variance) makes none: the i-th mini-batch of a step is
        # as many versions old as the updates before it that stepped (3 at most: [3, 3, 3] and
        # a mean of 1.5 when all step). Such updates happen in this run, so both cases are seen.
        per_step = [result.updates[i : i + 4] for i in range(0, 4 * steps, 4)]
        for ups, h in zip(per_step, result.history, strict=True):
            behind = [sum(1 - u["no_grad"] for u in ups[:i]) for i in range(4)]
            assert [u["staleness_max"] for u in ups] == behind
            assert h["staleness/mean"] == sum(behind) / 4
        expected_max = [max(u["staleness_max"] for u in ups) for ups in per_step]
        assert 3 in expected_max and any(u["no_grad"] for u in result.updates)
    assert [h["staleness/max"] for h in result.history] == expected_max


def test_partial_rollout_spans_versions_and_keeps_each_tokens_record(tmp_path) -> None:
    # budget ceil(4 / 3) = 2 tokens per round: answers of 3+ tokens need two or three rounds
    result = run_train(
        tmp_path,
        "staleness=2",
        "staleness.regime=partial",
        "rollout.max_tokens=4",
        "trainer.max_steps=6",
    )
    maxima = [h["staleness/max"] for h in result.history]
    assert max(maxima) <= 2 and max(maxima) >= 1
    for sample in result.last_batch:
        assert sample.versions == sorted(sample.versions)
        assert len(set(sample.versions)) <= 3
        assert len(sample.logprobs) == len(sample.response_ids) == len(sample.versions)


def test_resume_from_a_checkpoint_ends_like_an_uninterrupted_run(tmp_path) -> None:
    args = ("algo=bapo", "staleness=2", "trainer.max_steps=4", "trainer.save_every=2")
    whole = run_train(tmp_path, *args, name="whole")
    # a run killed right after its step-2 checkpoint: only that checkpoint survives
    killed = tmp_path / "killed"
    step2 = checkpoint.step_dir(whole.run_dir / "checkpoints", 2)
    shutil.copytree(step2, checkpoint.step_dir(killed / "checkpoints", 2))
    resumed = run_train(tmp_path, *args, "trainer.resume=true", name="killed")
    assert len(resumed.history) == 4
    for a, b in zip(whole.history[2:], resumed.history[2:], strict=True):
        same = {k: a[k] for k in a if not k.startswith("perf/")}
        assert same == {k: b[k] for k in b if not k.startswith("perf/")}


def test_validation_during_training_logs_val_metrics(tmp_path) -> None:
    from tests.conftest import BENCHMARKS

    result = run_train(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.val_every=2",
        "trainer.val_n=2",
        "trainer.val_limit=3",
        f"trainer.val_benchmarks=[arith,{BENCHMARKS / 'aime24.jsonl'}]",
    )
    last = result.history[-1]
    assert 0.0 <= last["val/arith/avg_at_2"] <= last["val/arith/pass_at_2"] <= 1.0
    assert last["val/aime24/num_problems"] == 3.0
    assert "val/arith/avg_at_2" not in result.history[0]  # only every val_every steps


def test_recompute_old_logprob_makes_the_first_update_on_stale_data_ratio_one(tmp_path) -> None:
    # lag data is 1 version stale; decoupled PPO re-scores pi_old when the batch is first used
    result = run_train(
        tmp_path,
        "staleness=1",
        "staleness.regime=lag",
        "trainer.max_steps=3",
        "trainer.old_logprob=recompute",
    )
    assert [u["staleness_max"] for u in result.updates] == [0.0, 1.0, 1.0]
    assert all(u["ratio_max"] == 1.0 and u["ratio_mean"] == 1.0 for u in result.updates)


@pytest.mark.parametrize("precision", ["mixed", "pure"])
def test_bfloat16_keeps_small_updates_only_over_float32_weights(tmp_path, precision) -> None:
    """lr 1e-6 (the paper's): Adam's first step moves each weight by ~1e-6, far below bfloat16's
    resolution near a weight of 0.05 (~2e-4). Mixed precision keeps float32 weights and keeps the
    step; pure bfloat16 weights round it away."""
    result = run_train(
        tmp_path,
        "model.dtype=bfloat16",
        f"trainer.precision={precision}",
        "trainer.lr=1e-6",
        "trainer.grad_clip=null",
        "staleness=0",
        "trainer.max_steps=1",
    )
    start, _ = models.load_policy(preflight_model())  # float32 on CPU
    end, _ = models.load_checkpoint(result.checkpoint, dtype=torch.float32)
    stored = {"mixed": torch.float32, "pure": torch.bfloat16}[precision]
    changed = total = 0
    for a, b in zip(start.parameters(), end.parameters(), strict=True):
        changed += int((a.to(stored).float() != b).sum())
        total += a.numel()
    fraction = changed / total
    if precision == "mixed":
        assert fraction > 0.5, fraction
    else:
        assert fraction < 0.05, fraction


def test_math_grading_is_counted_per_step(tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    rows = [{"problem": f"{a}+{a}", "answer": str(2 * a)} for a in range(1, 9)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_train(
        tmp_path,
        "trainer.max_steps=2",
        "data.kind=dataset",
        f"data.path={prompts}",
        "data.template='{problem}='",
        "reward.timeout_s=2",
        "reward.step_budget_s=30",
    )
    for step in result.history:  # the tiny model writes no \\boxed{}: all on the fast path
        assert (step["reward/timeouts"], step["reward/over_budget"]) == (0.0, 0.0)
        assert 0.0 <= step["perf/grade_s"] < 30.0
