"""The wrapper around Hydra's private API, exercised directly (it is what may break on upgrade)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from bapo_cli.config import hydra_runner


def test_config_dir_is_the_checkout_conf_in_an_editable_install() -> None:
    here = hydra_runner.config_dir()
    assert (here / "train.yaml").is_file() and (here / "eval.yaml").is_file()


def test_numeric_group_choices_are_quoted_for_hydra() -> None:
    out = hydra_runner.normalize_overrides(["staleness=4", "algo.rho0=0.4"])
    assert out[:2] == ["staleness='4'", "algo.rho0=0.4"]
    assert hydra_runner.normalize_overrides(["staleness=0,4,8"])[0] == "staleness='0','4','8'"
    assert (
        hydra_runner.normalize_overrides(["staleness=choice(0,8)"])[0]
        == "staleness=choice('0','8')"
    )
    # already quoted values and other keys are left alone
    assert hydra_runner.normalize_overrides(["staleness='2'"])[0] == "staleness='2'"
    assert hydra_runner.normalize_overrides(["trainer.max_steps=4"])[0] == "trainer.max_steps=4"


def test_output_root_is_pinned_once(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("BAPO_OUTPUT_ROOT", str(tmp_path / "o"))
    out = hydra_runner.normalize_overrides(["algo=bapo"])
    assert out[-1] == f"paths.output_root={tmp_path / 'o'}"
    mine = hydra_runner.normalize_overrides([f"paths.output_root={tmp_path}/x"])
    assert mine == [f"paths.output_root={tmp_path}/x"]


def test_expand_sweep_enumerates_the_basic_sweepers_jobs() -> None:
    jobs = hydra_runner.expand_sweep(
        ["algo=grpo,bapo", "trainer.lr=1e-3", "trainer.seed=range(0,3)"]
    )
    assert len(jobs) == 6
    assert all("trainer.lr=0.001" in job for job in jobs)  # Hydra normalises values
    assert {tuple(sorted(j for j in job if j.startswith("algo="))) for job in jobs} == {
        ("algo=grpo",),
        ("algo=bapo",),
    }
    assert (
        hydra_runner.expand_sweep(["hydra/sweeper=optuna", "algo.rho0=interval(0.3,0.5)"]) is None
    )
    assert hydra_runner.expand_sweep(["algo.rho0=interval(0.3,0.5)"]) is None


def _record(store: list):
    def task(cfg: DictConfig) -> None:
        store.append(
            (cfg.algo.rho0, HydraConfig.get().runtime.output_dir, HydraConfig.get().mode.name)
        )

    return task


def test_run_single(tmp_path: Path) -> None:
    seen: list = []
    overrides = hydra_runner.normalize_overrides(["algo.rho0=0.35", "tracking=none"])
    hydra_runner.run(overrides, config_name="train", task_function=_record(seen))
    assert len(seen) == 1
    rho, out_dir, mode = seen[0]
    assert (rho, mode) == (0.35, "RUN")
    assert Path(out_dir).is_absolute() and Path(out_dir).is_relative_to(
        tmp_path / "outputs" / "runs"
    )


def test_run_multirun_with_intermixed_flag(tmp_path: Path) -> None:
    seen: list = []
    overrides = hydra_runner.normalize_overrides(["tracking=none", "algo.rho0=0.3,0.5"])
    argv = [overrides[0], "--multirun", *overrides[1:]]
    hydra_runner.run(argv, config_name="train", task_function=_record(seen))
    assert [s[0] for s in seen] == [0.3, 0.5]
    assert {s[2] for s in seen} == {"MULTIRUN"}
    assert [Path(s[1]).name for s in seen] == ["0", "1"]
    assert all(Path(s[1]).is_relative_to(tmp_path / "outputs" / "sweeps") for s in seen)


def test_run_reports_task_errors_like_hydra(tmp_path: Path) -> None:
    def boom(cfg: DictConfig) -> None:
        raise RuntimeError("boom")

    with pytest.raises(SystemExit) as info:
        hydra_runner.run(
            hydra_runner.normalize_overrides(["tracking=none"]),
            config_name="train",
            task_function=boom,
        )
    assert info.value.code == 1
