"""`bapo train -m 'algo=glob(*)'`: every algorithm preset trains through the real CLI (a Hydra
multirun of the tiny model on data=arith, off-policy: staleness=2) and logs the shared metric set
to a real MLflow store; each preset's own pieces show up in what it logged."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from bapo_cli.config import hydra_runner
from tests.conftest import run_bapo

SHARED = ("actor/c_low", "actor/c_high", "actor/rho", "actor/clipfrac_low", "actor/entropy")


def test_every_algo_trains_one_step_from_the_cli(_output_root: Path) -> None:
    result = run_bapo(
        "train",
        "-m",
        "algo=glob(*)",
        "staleness=2",
        "rollout.n=2",
        "rollout.max_tokens=8",
        "trainer.max_steps=1",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=32",
        "algo.resample_rounds=2",
        timeout=600,
    )
    algos = hydra_runner.group_options("algo")
    assert len(algos) == 16
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(algos)} jobs, every config validated" in result.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{_output_root}/mlflow.db")
    experiment = client.get_experiment_by_name("bapo").experiment_id
    runs = {
        r.data.tags["algo"]: r
        for r in client.search_runs([experiment])
        if "algo" in r.data.tags and r.info.status == "FINISHED"
    }
    assert sorted(runs) == algos
    for name, run in runs.items():
        metrics = run.data.metrics
        assert all(key in metrics for key in SHARED), (name, sorted(metrics))
        assert metrics["actor/updates"] == 2.0, name  # staleness=2: two updates per batch
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
