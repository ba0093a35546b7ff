"""Sweeps grouped in MLflow (parent and child runs), launcher and sweeper presets, the study."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from bapo_cli.config import hydra_runner
from bapo_cli.config.preflight import preflight
from tests.conftest import run_bapo

# experiment=smoke (2 tiny steps) with tracking on; the transformers engine (quick to start)
TINY = ("experiment=smoke", "tracking=mlflow", "rollout=hf")
ENV = {"OMP_NUM_THREADS": "1"}  # two jobs at once on a 2-core machine: no thread oversubscription


def _store(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")


def _sweep_runs(root: Path) -> tuple[object, list[object]]:
    client = _store(root)
    runs = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) == "sweep"]
    children = tracking.child_runs(client, parent.info.run_id)
    return parent, children


@pytest.mark.slow
def test_multirun_makes_parent_and_children_and_report_compares_them(_output_root: Path) -> None:
    result = run_bapo("train", "-m", "algo.rho0=0.3,0.5", *TINY, env=ENV)
    assert result.returncode == 0, result.stderr
    parent, children = _sweep_runs(_output_root)
    assert parent.info.status == "FINISHED"
    assert len(children) == 2
    client = _store(_output_root)
    for child, rho0 in zip(children, ("0.3", "0.5"), strict=True):
        assert child.info.status == "FINISHED"
        assert f"algo.rho0={rho0}" in child.data.tags[tracking.OVERRIDES_TAG].split()
        assert len(client.get_metric_history(child.info.run_id, "reward/mean")) == 2
        assert "bapo/c_high" in child.data.metrics
    (sweep_dir,) = (_output_root / "sweeps").glob("*/*")
    assert parent.data.tags[tracking.SWEEP_DIR_TAG] == str(sweep_dir)
    assert f"bapo report --sweep {sweep_dir}" in " ".join(result.stdout.split())

    report = run_bapo("report", "--sweep", str(sweep_dir))
    assert report.returncode == 0, report.stderr
    out = sweep_dir / "report"
    for name in ("reward", "entropy", "clip_bounds", "rho", "clip_fractions", "grad_norm"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert str(png) in report.stdout
    with (out / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == [
        "algo.rho0=0.3",
        "algo.rho0=0.5",
    ]  # shared overrides dropped
    assert all(float(r["final reward"]) >= 0 and r["mean rho"] for r in rows)
    assert "| algo.rho0=0.3 |" in (out / "runs.md").read_text()
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/runs.md" in logged and "report/reward.png" in logged


@pytest.mark.slow
def test_joblib_two_workers_on_one_fresh_store(_output_root: Path) -> None:
    assert not (_output_root / "mlflow.db").exists()
    result = run_bapo("train", "-m", "launcher=joblib", "algo.rho0=0.3,0.5", *TINY, env=ENV)
    assert result.returncode == 0, result.stderr
    assert "n_jobs=2" in result.stdout + result.stderr
    parent, children = _sweep_runs(_output_root)
    assert parent.info.status == "FINISHED"
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED"]
    assert [c.data.tags[tracking.JOB_NUM_TAG] for c in children] == ["0", "1"]


@pytest.mark.slow
def test_optuna_preset_runs_two_trials_maximizing_reward(_output_root: Path) -> None:
    result = run_bapo("train", "-m", "sweeper=optuna", "hydra.sweeper.n_trials=2", *TINY, env=ENV)
    assert result.returncode == 0, result.stderr
    assert "a sampled number of jobs" in result.stdout
    (sweep_dir,) = (_output_root / "sweeps").glob("*/*")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0", "1"]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert 0.2 <= best["best_params"]["algo.rho0"] <= 0.7
    assert 0.0 <= best["best_value"] <= 1.0
    parent, children = _sweep_runs(_output_root)
    assert len(children) == 2 and parent.info.status == "FINISHED"


@pytest.mark.slow
def test_glob_over_a_group_runs_one_job_per_option(_output_root: Path) -> None:
    # four of the algo options (every one of them: tests/cli/test_every_algo.py)
    result = run_bapo(
        "train", "-m", "algo=glob([b*,ci*,clip_h*])", *TINY, "trainer.max_steps=1", env=ENV
    )
    assert result.returncode == 0, result.stderr
    assert "4 jobs, every config validated" in result.stdout
    (sweep_dir,) = (_output_root / "sweeps").glob("*/*")
    jobs = sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    configs = [yaml.safe_load((j / ".hydra" / "config.yaml").read_text()) for j in jobs]
    algos = ["bapo", "bapo_recipe", "cispo", "clip_higher"]
    assert [c["algo"]["name"] for c in configs] == algos
    assert [c["algo"]["loss"] for c in configs] == ["bapo", "bapo", "cispo", "clip_higher"]
    assert [c["algo"]["advantage"] for c in configs] == ["grpo", "grpo", "grpo", "grpo"]
    assert all(c["trainer"]["max_steps"] == 1 for c in configs)
    for job, algo in zip(jobs, algos, strict=True):
        assert f"algo={algo}" in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    parent, children = _sweep_runs(_output_root)
    assert parent.data.tags["bapo.command"].startswith("bapo train -m algo=glob([b*,ci*,clip_h*]) ")
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    assert [c.data.tags[tracking.JOB_NUM_TAG] for c in children] == ["0", "1", "2", "3"]
    for child, algo in zip(children, algos, strict=True):
        assert f"algo={algo}" in child.data.tags[tracking.OVERRIDES_TAG].split()
        assert "reward/mean" in child.data.metrics
    assert ("bapo/c_high" in children[0].data.metrics) and (
        "bapo/c_high" not in children[2].data.metrics
    )


def test_slurm_preset_composes_to_submitit() -> None:
    from hydra import compose, initialize_config_dir

    from bapo_cli.config import schema

    schema.register()
    with initialize_config_dir(config_dir=str(hydra_runner.config_dir()), version_base="1.3"):
        cfg = compose(
            "train", ["launcher=slurm", "paths.output_root=/shared/out"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (1, 1, 1)
    assert str(cfg.hydra.launcher.submitit_folder).startswith("/shared/out/sweeps/")
    assert preflight("train", ["launcher=slurm", "algo.rho0=0.3,0.5"], multirun=True).num_jobs == 2


def test_optuna_preset_is_a_sampling_sweep_over_rho0() -> None:
    checked = preflight("train", ["sweeper=optuna"], multirun=True)
    assert checked.num_jobs is None and checked.config.algo.name == "bapo"


def test_study_grid_is_27_jobs_seed_outermost() -> None:
    root = ["paths.output_root=/tmp/x"]
    declared = hydra_runner.sweeper_params("train", ["experiment=staleness_study", *root])
    jobs = hydra_runner.expand_sweep(declared + ["experiment=staleness_study", *root])
    assert len(jobs) == 27
    cells = {tuple(o for o in job if o.startswith(("algo=", "staleness="))) for job in jobs[:9]}
    assert len(cells) == 9 and all("trainer.seed=0" in job for job in jobs[:9])
    cfg = preflight("train", ["experiment=staleness_study"]).config
    assert (cfg.trainer.lr, cfg.tracking.experiment) == (3e-4, "staleness_study")


def test_rho0_study_is_9_bapo_jobs_at_staleness_8() -> None:
    root = ["paths.output_root=/tmp/x"]
    declared = hydra_runner.sweeper_params("train", ["experiment=rho0_study", *root])
    jobs = hydra_runner.expand_sweep(declared + ["experiment=rho0_study", *root])
    assert len(jobs) == 9
    assert [next(o for o in job if o.startswith("algo.rho0=")) for job in jobs[:3]] == [
        "algo.rho0=0.4",
        "algo.rho0=0.6",
        "algo.rho0=0.8",
    ]
    cfg = preflight("train", ["experiment=rho0_study"]).config
    assert (cfg.algo.name, cfg.staleness.k, cfg.staleness.regime) == ("bapo", 8, "reuse")
    assert (cfg.trainer.lr, cfg.trainer.max_steps, cfg.rollout.name) == (3e-4, 100, "hf")


def test_invalid_value_in_a_preset_sweep_fails_before_any_job(_output_root: Path) -> None:
    result = run_bapo("train", "-m", "experiment=staleness_study", "trainer.lr=1e-4,-1")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: trainer.lr=-1.0: must be > 0"
    assert not (_output_root / "sweeps").exists()
    assert not (_output_root / "mlflow.db").exists()  # no parent run either
