"""The `bapo` command as users type it: help, config printing, errors, runs and sweeps."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from bapo_cli.cli import app
from tests.conftest import run_bapo

runner = CliRunner()


def test_root_help_lists_commands_and_examples() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in ("train", "eval", "config", "runs", "bapo train -m algo.rho0=0.3,0.4,0.5"):
        assert word in result.output


def test_each_command_has_help_with_examples() -> None:
    expected = {
        "train": "bapo train -m algo=grpo,clip_higher,bapo staleness=0,4,8",
        "eval": "bapo eval model.path=Qwen/Qwen2.5-Math-1.5B benchmark=aime24",
        "config": "bapo config --docs",
        "runs": "--experiment",
    }
    for command, text in expected.items():
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert text in result.output, (command, result.output)


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("bapo-cli ")


def test_config_prints_bapo_section_with_paper_values() -> None:
    result = run_bapo("config", "algo=bapo", "staleness=4")
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["algo"]["rho0"] == 0.4
    assert cfg["algo"]["low_range"] == [0.6, 0.9]
    assert cfg["algo"]["high_range"] == [1.2, 3.0]
    assert (cfg["algo"]["low_step"], cfg["algo"]["high_step"]) == (0.02, 0.05)
    assert cfg["staleness"] == {
        "k": 4,
        "regime": "reuse",
        "ppo_epochs": 1,
        "interrupt": False,
        "weights": "shm",
        "weights_dir": None,
        "weights_delta": False,
        "weights_full_every": 10,
        "nccl_master": "127.0.0.1:29555",
        "weights_timeout_s": 60.0,
        "probe_tolerance": None,
    }
    assert "hydra" not in cfg


def test_config_docs_show_each_losss_options_with_their_presets() -> None:
    result = runner.invoke(app, ["config", "--docs"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    # brackets are text, not rich markup: the preset tags and the range notation survive
    assert "[bapo, bapo_recipe] target share of positive-advantage tokens" in result.output
    assert "[bapo, bapo_recipe] [a-, b-]: where c_low may move" in result.output
    assert "[drgrpo, grpo, ppo] clip range" in result.output
    assert "list[float]" in result.output


def test_config_resolve_expands_interpolations(_output_root: Path) -> None:
    raw = runner.invoke(app, ["config"])
    resolved = runner.invoke(app, ["config", "--resolve"])
    assert "${paths.output_root}" in raw.output
    assert f"sqlite:///{_output_root}/mlflow.db" in resolved.output


def test_config_passes_hydra_syntax_through() -> None:
    result = runner.invoke(app, ["config", "~algo.dual_clip", "+extra_note=hi"])
    # removing a schema field or adding an unknown key is refused by the schema, in one line
    assert result.exit_code == 2
    ok = runner.invoke(app, ["config", "algo.dual_clip=null", "rollout.stop=[\\n,END]"])
    assert ok.exit_code == 0, ok.output
    cfg = yaml.safe_load(ok.output)
    assert cfg["algo"]["dual_clip"] is None
    assert cfg["rollout"]["stop"] == ["\\n", "END"]


def test_unknown_algo_exits_2_with_one_line() -> None:
    result = run_bapo("config", "algo=foo")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: algo=foo: unknown option")
    for name in ("ppo", "grpo", "clip_higher", "bapo"):
        assert name in lines[0]
    assert "Traceback" not in result.stderr


def test_train_single_run_creates_run_dir_and_says_what_runs(_output_root: Path) -> None:
    result = run_bapo("train", "algo=grpo", "staleness=8", "tracking=none", "trainer.max_steps=1")
    assert result.returncode == 0, result.stderr
    runs = list((_output_root / "runs").glob("*/*"))
    assert len(runs) == 1
    assert re.fullmatch(
        r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}",
        runs[0].relative_to(_output_root / "runs").as_posix(),
    )
    saved = yaml.safe_load((runs[0] / ".hydra" / "config.yaml").read_text())
    assert saved["algo"]["name"] == "grpo" and saved["staleness"]["k"] == 8
    assert "8 optimizer updates per rollout batch" in result.stdout
    assert "[0.8, 1.2]" in result.stdout
    assert "step 1/1" in result.stdout


def test_train_multirun_launches_two_jobs(_output_root: Path) -> None:
    result = run_bapo("train", "-m", "algo.rho0=0.3,0.5", "experiment=smoke")
    assert result.returncode == 0, result.stderr
    jobs = sorted((_output_root / "sweeps").glob("*/*/[0-9]*"))
    assert [j.name for j in jobs] == ["0", "1"]
    rhos = [
        yaml.safe_load((j / ".hydra" / "config.yaml").read_text())["algo"]["rho0"] for j in jobs
    ]
    assert rhos == [0.3, 0.5]
    overrides = [yaml.safe_load((j / ".hydra" / "overrides.yaml").read_text()) for j in jobs]
    assert "algo.rho0=0.3" in overrides[0] and "algo.rho0=0.5" in overrides[1]
    assert "2 jobs, every config validated" in result.stdout


def test_multirun_flag_may_follow_overrides_and_group_sweeps_work(_output_root: Path) -> None:
    result = run_bapo("train", "experiment=smoke", "staleness=0,4", "-m", "algo=grpo,bapo")
    assert result.returncode == 0, result.stderr
    jobs = sorted((_output_root / "sweeps").glob("*/*/[0-9]*"), key=lambda p: int(p.name))
    seen = set()
    for job in jobs:
        cfg = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        seen.add((cfg["algo"]["name"], cfg["staleness"]["k"]))
    assert seen == {("grpo", 0), ("grpo", 4), ("bapo", 0), ("bapo", 4)}


def test_invalid_sweep_value_fails_before_any_job(_output_root: Path) -> None:
    result = run_bapo("train", "-m", "algo.rho0=0.3,7", "tracking=none")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: algo.rho0=7.0: must be within [0, 1]"
    assert not (_output_root / "sweeps").exists()


def test_eval_composes_and_says_what_would_run(_output_root: Path) -> None:
    # the default benchmark (aime24) ships with the package: no network, no file to pass
    result = run_bapo("eval", "eval.limit=3", "tracking=none", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "aime24: shipped:aime24, first 3 problems" in " ".join(result.stdout.split())
    assert len(list((_output_root / "runs").glob("*/*/.hydra/config.yaml"))) == 1


def test_full_error_env_shows_traceback() -> None:
    result = run_bapo("config", "algo.rho0=2", env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_train_smoke_experiment_trains_for_real(_output_root: Path) -> None:
    result = run_bapo("train", "experiment=smoke")
    assert result.returncode == 0, result.stderr
    (run,) = (_output_root / "runs").glob("*/*")
    assert (run / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert (run / "samples.jsonl").is_file()
    assert "bapo train: summary" in result.stdout
    assert "step 2/2" in result.stdout


def test_train_with_a_missing_model_dir_fails_in_one_line(tmp_path: Path) -> None:
    result = run_bapo("train", f"model.path={tmp_path}/nope", "tracking=none")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: model.path={tmp_path}/nope: no such directory"
