"""Any working directory works, and user text is printed as text (issue 33 item 7).

The CLI pins `paths.output_root=<cwd>/outputs` and the run dir it claims on Hydra's command
line; from `/home/josé` or a dir named `q'"=,;&#` every command used to fail with `cannot parse
override`. They are now quoted for Hydra's override grammar (`hydra_runner.quote`). Error lines
and the plan box quote user text: `[/]` crashed rich's markup parser, `:-1:` became an emoji."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from bapo_cli.config import hydra_runner

JOSE = "josé (copy) [1]"
QUOTES = "q'\"=,;&#"


def _bapo(cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The real CLI, its output root left to the working directory (`<cwd>/outputs`)."""
    env = {k: v for k, v in os.environ.items() if k != "BAPO_OUTPUT_ROOT"}
    return subprocess.run(
        [sys.executable, "-m", "bapo_cli", *args],
        cwd=cwd,
        env={**env, "COLUMNS": "200", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(params=[JOSE, QUOTES])
def odd_cwd(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    cwd = tmp_path / request.param
    cwd.mkdir()
    return cwd


def test_config_composes_from_any_cwd(odd_cwd: Path) -> None:
    result = _bapo(odd_cwd, "config", "trainer.max_steps=1")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["paths"]["output_root"] == str(odd_cwd / "outputs")


# a sweep's jobs get their overrides re-serialized by Hydra's sweeper: the quoted root survives
SWEEP = """
import sys
from hydra.core.hydra_config import HydraConfig
from bapo_cli.launch import launcher

def task(cfg):
    print("JOB", cfg.paths.output_root, "|", HydraConfig.get().runtime.output_dir, flush=True)

launcher.launch("train", sys.argv[1:], True, task)
"""


def test_a_sweep_runs_from_any_cwd(odd_cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BAPO_OUTPUT_ROOT"}
    result = subprocess.run(
        [sys.executable, "-c", SWEEP, "tracking=none", "algo.rho0=0.3,0.4"],
        cwd=odd_cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    jobs = [line[4:].split(" | ") for line in result.stdout.splitlines() if line[:4] == "JOB "]
    root = odd_cwd / "outputs"
    assert [r for r, _ in jobs] == [str(root), str(root)]
    dirs = [Path(d) for _, d in jobs]
    assert [d.name for d in dirs] == ["0", "1"]
    assert all(d.parent.parent.parent == root / "sweeps" and d.is_dir() for d in dirs)


@pytest.mark.slow
def test_train_and_its_resume_from_a_home_named_jose(tmp_path: Path) -> None:
    """One real step from `josé (copy) [1]`, then a resume into its run dir named as the
    resume line names it; the plan box shows a `[/]:-1:` model name as typed."""
    cwd = tmp_path / JOSE
    cwd.mkdir()
    first = _bapo(cwd, "train", "trainer.max_steps=1", "tracking=none", "model.name='[/]:-1:'")
    assert first.returncode == 0, first.stderr
    assert "[/]:-1:" in first.stdout and "👎" not in first.stdout
    runs = list((cwd / "outputs" / "runs").glob("*/*"))
    assert len(runs) == 1 and f"run dir: {runs[0]}" in first.stdout
    rows = (runs[0] / "samples.jsonl").read_text().splitlines()
    assert {json.loads(row)["step"] for row in rows} == {1}
    again = _bapo(
        cwd,
        "train",
        "trainer.max_steps=2",
        "tracking=none",
        "trainer.resume=true",
        f"hydra.run.dir={hydra_runner.quote(str(runs[0]))}",
    )
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout
    rows = (runs[0] / "samples.jsonl").read_text().splitlines()
    assert sorted({json.loads(row)["step"] for row in rows}) == [1, 2]


@pytest.mark.slow
def test_eval_from_a_dir_named_with_quotes(tmp_path: Path) -> None:
    cwd = tmp_path / QUOTES
    cwd.mkdir()
    result = _bapo(cwd, "eval", "eval.limit=1", "eval.n=1", "tracking=none")
    assert result.returncode == 0, result.stderr
    written = list((cwd / "outputs" / "runs").glob("*/*/results.json"))
    assert len(written) == 1 and f"results: {written[0]}" in result.stdout
    assert list(json.loads(written[0].read_text())) == ["aime24"]


@pytest.mark.parametrize(
    ("value", "shown"),
    [("'a[/]'", "a[/]"), ("x:-1:", "x:-1:"), ("'[bold]b[/bold]'", "[bold]b[/bold]")],
)
def test_user_text_in_an_error_line_is_text(value: str, shown: str, tmp_path: Path) -> None:
    result = _bapo(tmp_path, "config", f"trainer.lr={value}")
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: trainer.lr={shown}: must be a number\n"


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1))
def test_quote_reads_back_as_the_same_string(value: str) -> None:
    """Through Hydra's override parser and OmegaConf's interpolation grammar: `${`, `\\`,
    quotes and any letter come back as they went in."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override("k=" + hydra_runner.quote(value)).value()
    assert OmegaConf.create({"k": parsed}).k == value


def test_quote_leaves_plain_paths_plain() -> None:
    assert hydra_runner.quote("/data/runs/2026-01-01/12-00-00") == "/data/runs/2026-01-01/12-00-00"
    assert hydra_runner.quote("/home/josé") == "'/home/josé'"
    assert hydra_runner.quote("/a/${x}") == "'/a/\\${x}'"
    assert hydra_runner.quote("true") == "'true'"
