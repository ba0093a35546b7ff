"""What a person watches: the bar (steps/s, ETA), status lines at a readable cadence, the line that
says a first run builds the model, and the end that says how to open the results."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.trainer import progress
from bapo_cli.trainer.progress import TrainProgress, print_summary
from bapo_cli.trainer.train import train
from tests.train.conftest import FAST

M = {"reward/mean": 0.25, "actor/entropy": 0.8, "actor/c_low": 0.62, "actor/c_high": 1.35}


def _lines(console: Console) -> list[str]:
    return console.file.getvalue().splitlines()


def test_status_lines_come_at_a_readable_cadence_in_a_pipe() -> None:
    console = Console(file=io.StringIO(), width=80)  # not a terminal: no live bar
    with TrainProgress(100, 0, console) as bar:
        for step in range(1, 101):  # rewards 0.25, then 0.3, 0.4, 0.5, 0.4 (mean 0.4), ...
            reward = 0.25 if step == 1 else (0.3, 0.4, 0.5, 0.4)[(step - 2) % 4]
            bar.update(step, {**M, "reward/mean": reward})
    spans = [line.split()[1].split("/")[0] for line in _lines(console)]
    # the first step, then every 100 // 20 steps, each line the mean of the steps since the last
    assert spans == ["1", "2-5", *(f"{end - 4}-{end}" for end in range(10, 101, 5))]
    first, second = _lines(console)[:2]
    assert first.startswith("step 1/100  reward 0.250  entropy 0.800  clip [0.62, 1.35]  ")
    assert "steps/s  ETA " in first  # one line, though longer than 80 columns
    assert second.startswith("steps 2-5/100  reward 0.400  entropy 0.800  clip [0.62, 1.35]  ")


def test_the_terminal_bar_shows_steps_per_second_and_eta() -> None:
    console = Console(file=io.StringIO(), width=200, force_terminal=True)
    with TrainProgress(10, 0, console) as bar:
        for step in range(1, 4):
            bar.update(step, M)
        bar.progress.refresh()
    shown = console.file.getvalue()
    assert "3/10" in shown and "steps/s" in shown and "ETA" in shown
    assert "clip [0.62, 1.35]" in shown


def test_the_end_says_where_the_run_went_and_how_to_open_it(
    _output_root: Path, tmp_path: Path
) -> None:
    console = Console(file=io.StringIO(), width=80)
    run_dir = tmp_path / ("a-long-directory-name-" * 4) / "run"
    uri = f"sqlite:///{_output_root}/mlflow.db"  # the default store: plain `bapo ui`
    resume = "bapo train trainer.resume=true"
    print_summary(console, [M], progress.where_lines(run_dir, uri, "0" * 32, resume=resume))
    lines = _lines(console)
    assert f"run dir: {run_dir}" in lines  # whole, though longer than 80 columns
    assert f"MLflow: {uri}  run {'0' * 32}" in lines
    assert "open the results: bapo ui" in lines
    assert "resume: bapo train trainer.resume=true" in lines
    other = "sqlite:////elsewhere/store.db"
    assert progress.ui_command(other) == f"bapo ui --uri {other}"


@pytest.mark.slow  # builds a model (2 warm-up steps and its held-out check)
def test_a_first_run_says_it_builds_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BAPO_CACHE_DIR", str(tmp_path / "cache"))  # empty: nothing built yet
    console = Console(file=io.StringIO(), width=80)
    cfg_overrides = ("model.tiny.sft_steps=2", "trainer.max_steps=1")  # not shipped: 2-step build
    cfg = preflight("train", [*FAST, *cfg_overrides]).config
    train(cfg, tmp_path / "run", console)
    (line,) = [s for s in _lines(console) if "building the model" in s]
    assert line.startswith("first use of these tiny-model settings: building the model now")
    assert str(tmp_path / "cache") in line
    again = Console(file=io.StringIO(), width=80)
    train(cfg, tmp_path / "again", again)
    assert "building the model" not in again.file.getvalue()  # cached now
