"""The configs and the shipped benchmarks are found from any working directory, by an editable and
by a wheel install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_bapo

BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")


def test_editable_install_works_from_another_directory(tmp_path: Path) -> None:
    result = run_bapo("config", "algo=clip_higher", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["algo"]["eps_high"] == 0.28


@pytest.mark.slow
def test_wheel_install_ships_configs_and_works_from_another_directory(tmp_path: Path) -> None:
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("bapo_cli-*.whl")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "bapo_cli" / "conf" / "train.yaml").is_file()
    for name in ("tiny", "tiny_pairs"):  # the shipped warmed-up models (launch/testbed.py)
        weights = target / "bapo_cli" / "models" / "weights" / name
        assert {"model.safetensors", "tokenizer.json", "build_info.json"} <= {
            p.name for p in weights.iterdir()
        }
    shipped = target / "bapo_cli" / "data" / "benchmarks"
    assert sorted(p.name for p in shipped.iterdir()) == [
        "SOURCES.md",
        *(f"{name}.jsonl" for name in BENCHMARKS),
    ]
    env = {**os.environ, "PYTHONPATH": str(target)}  # the wheel's copy shadows the editable one
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import bapo_cli; from bapo_cli.config.hydra_runner import config_dir; "
            "from bapo_cli.models import tiny; from bapo_cli.config.schema import TinyModelConfig; "
            "print(bapo_cli.__file__); print(config_dir()); "
            "print(tiny.ensure_tiny(TinyModelConfig()))",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(target)
    assert Path(where[1]) == target / "bapo_cli" / "conf"
    assert Path(where[2]) == target / "bapo_cli" / "models" / "weights" / "tiny"  # no build
    # a shipped benchmark loads from the installed wheel, by its preset, with no network
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "from bapo_cli.config.preflight import preflight; "
            "from bapo_cli.data import shipped; "
            "from bapo_cli.evaluation.evaluate import load_problems; "
            "problems, skipped = load_problems("
            "preflight('eval', ['benchmark=olympiadbench']).config.benchmark); "
            "print(shipped.path_of('shipped:olympiadbench'), len(problems), skipped)",
        ],
        cwd=tmp_path,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert loaded == [str(shipped / "olympiadbench.jsonl"), "675", "0"]
    result = run_bapo(
        "config", "algo=bapo", "staleness=8", cwd=tmp_path, env={"PYTHONPATH": str(target)}
    )
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert (cfg["algo"]["rho0"], cfg["staleness"]["k"]) == (0.4, 8)
    sweep = run_bapo(
        "train",
        "-m",
        "algo.rho0=0.3,0.5",
        "experiment=smoke",
        cwd=tmp_path,
        env={"PYTHONPATH": str(target)},
    )
    assert sweep.returncode == 0, sweep.stderr
    assert "2 jobs" in sweep.stdout
