"""`bapo train -m 'algo=glob(*)'`: every algorithm preset trains through the real CLI (a Hydra
multirun of the tiny model on data=arith, off-policy: staleness=2) and logs the shared metric set
to a real MLflow store; each preset's own pieces show up in what it logged."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_cli.config import hydra_runner
from tests.conftest import run_bapo

SHARED = (
    "actor/c_low",
    "actor/c_high",
    "actor/rho",
    "actor/clipfrac_low",
    "actor/entropy",
    "actor/ess",
)
# shrunk as the test below: two steps of two updates each on the tiny model (a second step
# after the first one's weight sync; issue 45)
SHRUNK = (
    "staleness=2",
    "rollout.n=2",
    "rollout.max_tokens=8",
    "trainer.max_steps=2",
    "trainer.prompts_per_step=2",
    "trainer.micro_batch_size=32",
)


def _finished(root: Path) -> dict[str, object]:
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("bapo").experiment_id
    return {
        r.data.tags["algo"]: r
        for r in client.search_runs([experiment])
        if "algo" in r.data.tags and r.info.status == "FINISHED"
    }


@pytest.mark.slow  # a 23-job sweep in a bapo subprocess
def test_every_algo_trains_two_steps_from_the_cli(_output_root: Path) -> None:
    result = run_bapo("train", "-m", "algo=glob(*)", *SHRUNK, "algo.resample_rounds=2", timeout=900)
    algos = hydra_runner.group_options("algo")
    assert len(algos) == 23
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(algos)} jobs, every config validated" in result.stdout
    runs = _finished(_output_root)
    client = MlflowClient(tracking_uri=f"sqlite:///{_output_root}/mlflow.db")
    assert sorted(runs) == algos
    for name, run in runs.items():
        metrics = run.data.metrics
        assert all(key in metrics for key in SHARED), (name, sorted(metrics))
        assert metrics["actor/updates"] == 2.0, name  # staleness=2: two updates per batch
        assert len(client.get_metric_history(run.info.run_id, "actor/updates")) == 2, name
        assert ("dynamic/dropped_groups" in metrics) == (name == "dapo"), name
        assert ("reward/overlong_penalty_mean" in metrics) == (name == "dapo"), name
        assert ("bapo/search_steps" in metrics) == name.startswith("bapo"), name
    bounds = {
        name: (run.data.metrics["actor/c_low"], run.data.metrics["actor/c_high"])
        for name, run in runs.items()
    }
    assert bounds["grpo"] == bounds["ppo"] == bounds["drgrpo"] == (0.8, 1.2)
    assert bounds["dapo"] == bounds["clip_higher"] == (0.8, 1.28)
    assert bounds["gspo"] == (1 - 3e-4, 1 + 4e-4) and bounds["cispo"] == (0.0, 1.28)
    assert 0.6 <= bounds["bapo_recipe"][0] <= 0.8 and 1.2 <= bounds["bapo_recipe"][1] <= 2.0
    # the rivals: DPPO shows its thresholds as 1 -/+ delta, M2PO, Clip-Cov and CE-GPPO their
    # clip, M2PO and KL-Cov no bound (c_low 0, c_high the largest ratio they kept)
    assert bounds["dppo_tv"] == (1 - 0.15, 1 + 0.15) and bounds["dppo_kl"] == (1 - 0.05, 1 + 0.05)
    assert bounds["clip_cov"] == bounds["ce_gppo"] == (0.8, 1.2)
    assert bounds["kl_cov"][0] == bounds["m2po"][0] == 0.0 and bounds["m2po"][1] >= 1.0
    assert runs["dapo"].data.metrics["reward/overlong_penalty_mean"] <= 0.0
    # issue 34: MinPRO GRPO's clip, prime-rl's TV thresholds as 1 -/+ 0.2, VCPO its IS cap
    assert bounds["minpro"] == bounds["prime_default"] == (0.8, 1.2)
    assert bounds["vcpo"] == (0.0, 8.0) and "actor/lr_scale" in runs["vcpo"].data.metrics
    # issue 45: LUSPO GSPO's kind of bounds, TOPR and VESPO no bound (c_low 0), DCPO the mean of
    # its per-token bounds (a token of probability q gets [(1 + sqrt(1 - 0.8/q))/2, ...] >= 0.5)
    assert bounds["luspo"] == (1 - 2e-3, 1 + 2.5e-3)
    assert bounds["topr"][0] == bounds["vespo"][0] == 0.0
    assert 0.5 <= bounds["dcpo"][0] < 1.0 < bounds["dcpo"][1] <= 10.0
    assert all(0.0 <= run.data.metrics["actor/ess"] <= 1.0 for run in runs.values())


def test_loglinear_old_logprobs_train_from_the_cli(_output_root: Path) -> None:
    """`trainer.old_logprob=loglinear` (issue 34), shrunk as every preset above; issue 34's presets
    (vcpo, minpro, prime_default) are jobs of the sweep above, with their bounds checked there."""
    loglinear = run_bapo(
        "train",
        "algo=grpo",
        "trainer.old_logprob=loglinear",
        "tracking.run_name=loglinear",
        *SHRUNK,
        timeout=600,
    )
    assert loglinear.returncode == 0, loglinear.stderr[-3000:]
    runs = _finished(_output_root)
    assert sorted(runs) == ["grpo"]
    assert runs["grpo"].data.params["trainer.old_logprob"] == "loglinear"  # the option reached it
    metrics = runs["grpo"].data.metrics
    assert all(key in metrics for key in SHARED), sorted(metrics)
    assert metrics["actor/updates"] == 2.0
