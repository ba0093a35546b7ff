"""Runs never share a directory: run and sweep dirs are claimed exclusively (launch/rundir.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from bapo_cli.launch import rundir


def test_processes_claiming_the_same_dir_at_once_each_get_their_own(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "2026-01-01" / "12-00-00"
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        claimed = pool.map(rundir.claim, [base] * 6)
    assert sorted(p.name for p in claimed) == ["12-00-00"] + [f"12-00-00-{i}" for i in range(1, 6)]
    assert all(p.is_dir() and p.parent == base.parent for p in claimed)


def test_a_taken_second_gets_a_suffix(tmp_path: Path) -> None:
    now = datetime(2026, 1, 1, 12, 0, 0)
    first = rundir.claim_timestamped(tmp_path, "runs", now)
    assert first == tmp_path / "runs" / "2026-01-01" / "12-00-00"
    (first / "checkpoints").mkdir()  # a run's files stay its own
    assert rundir.claim_timestamped(tmp_path, "runs", now).name == "12-00-00-1"
    assert rundir.claim_timestamped(tmp_path, "sweeps", now).name == "12-00-00"


# the real launch path (pre-flight, then Hydra creates the dir and calls the job), with a job that
# only reports its dir; every process leaves pre-flight at the same instant (the start of a second,
# once all are ready), like commands started together
LAUNCH = """
import os, sys, time
from pathlib import Path
from hydra.core.hydra_config import HydraConfig
from bapo_cli.launch import launcher

barrier, count = Path(sys.argv[1]), int(sys.argv[2])
multirun, overrides = sys.argv[3] == "1", sys.argv[4:]
checked = launcher.check

def in_step(*args, **kwargs):
    result = checked(*args, **kwargs)
    (barrier / f"ready-{os.getpid()}").touch()
    while len(list(barrier.glob("ready-*"))) < count:
        time.sleep(0.01)
    mine = barrier / f"at-{os.getpid()}"
    mine.write_text(str(int(time.time()) + 1.05))
    try:
        os.link(mine, barrier / "go")  # the first to get here picks the instant for all
    except FileExistsError:
        pass
    time.sleep(max(0.0, float((barrier / "go").read_text()) - time.time()))
    return result

def task(cfg):
    hydra = HydraConfig.get()
    print("DIR", hydra.sweep.dir if multirun else hydra.runtime.output_dir, flush=True)

launcher.check = in_step
launcher.launch("train", overrides, multirun, task)
"""


@pytest.mark.slow  # bapo subprocesses
def test_runs_and_sweeps_started_in_the_same_second_get_distinct_dirs(
    tmp_path: Path, _output_root: Path
) -> None:
    explicit = tmp_path / "earlier-run"
    explicit.mkdir()
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    jobs = [
        ("0", ["tracking=none"]),
        ("0", ["tracking=none"]),
        ("0", ["tracking=none"]),
        ("1", ["tracking=none", "algo.rho0=0.3"]),
        ("1", ["tracking=none", "algo.rho0=0.3"]),
        ("0", ["tracking=none", "trainer.resume=true", f"hydra.run.dir={explicit}"]),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(barrier), str(len(jobs)), multirun, *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for multirun, overrides in jobs
    ]
    dirs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        dirs.append(Path(next(line[4:] for line in out.splitlines() if line.startswith("DIR "))))
    runs, sweeps, resumed = dirs[:3], dirs[3:5], dirs[5]
    assert len(set(runs)) == 3 and len(set(sweeps)) == 2
    assert all(p.parent.parent == _output_root / "runs" for p in runs)
    assert all(p.parent.parent == _output_root / "sweeps" for p in sweeps)
    assert {p.name.split("-")[:3] == runs[0].name.split("-")[:3] for p in runs} == {True}
    assert resumed == explicit  # an explicit run dir (resume) is used as given


# ------------------------------------------------------------ a run dir that holds a run (issue 22)


def test_a_dir_that_holds_a_run_is_refused_without_resume(tmp_path: Path) -> None:
    """A second run there would overwrite the first one's checkpoints and `.hydra/` and append
    its samples to the first one's samples.jsonl."""
    from typer.testing import CliRunner

    from bapo_cli.cli import app

    used = tmp_path / "used"
    (used / ".hydra").mkdir(parents=True)
    (used / "samples.jsonl").write_text('{"step": 1}\n')
    result = CliRunner().invoke(app, ["train", "tracking=none", f"hydra.run.dir={used}"])
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()) == (
        f"error: hydra.run.dir={used} already holds a run (.hydra, samples.jsonl); add "
        "trainer.resume=true to continue it, or choose a new hydra.run.dir (or drop it: each "
        "run gets a fresh dir)"
    )
    assert (used / "samples.jsonl").read_text() == '{"step": 1}\n'
    sweep = tmp_path / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    result = CliRunner().invoke(
        app, ["train", "-m", "tracking=none", "algo.rho0=0.3,0.4", f"hydra.sweep.dir={sweep}"]
    )
    assert result.exit_code == 2, result.output
    assert f"hydra.sweep.dir={sweep} already holds a run (0/.hydra)" in " ".join(
        result.output.split()
    )


def test_reuse_rules() -> None:
    here = Path(__file__).parent / "no-such-dir"
    assert rundir.reuse_error("hydra.run.dir", here, resume=False) is None  # a new dir
    assert rundir.RUN_MARKERS == (".hydra", "checkpoints", "samples.jsonl", "multirun.yaml")


def test_resume_and_empty_dirs_pass(tmp_path: Path) -> None:
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    assert rundir.reuse_error("hydra.run.dir", used, resume=True) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert rundir.reuse_error("hydra.run.dir", empty, resume=False) is None
    assert "checkpoints" in rundir.reuse_error("hydra.run.dir", used, resume=False)
