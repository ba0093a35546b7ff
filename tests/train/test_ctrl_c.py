"""Ctrl-C is safe: a real SIGINT to a real `bapo train` process.

The first SIGINT finishes the step in progress, saves a checkpoint, closes the MLflow run KILLED
(not FAILED), prints the summary and the exact command that resumes the run, and exits 130; a
second SIGINT stops at once. Also under `staleness.regime=async` (its generation worker does not
outlive the trainer) and in a `-m` sweep (the sweep stops, its parent run is KILLED too).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from bapo_cli.trainer import checkpoint
from tests.train.conftest import FAST

pytestmark = pytest.mark.slow

TRACKED = [o for o in FAST if o != "tracking=none"]  # the default MLflow store under the root
LONG = "trainer.max_steps=100000"  # never ends by itself: only the signal stops it


class Bapo:
    """`python -m bapo_cli ...` with its stdout read line by line as it comes (a pipe)."""

    def __init__(self, *args: str, cwd: Path) -> None:
        env = {**os.environ, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bapo_cli", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # a test run started in the background inherits SIGINT ignored (POSIX shells do that
            # to background jobs), and so would the child: it must see Ctrl-C as a terminal does
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no line with {text!r}; output:\n" + self.output())
            time.sleep(0.05)

    def finish(self, timeout_s: float = 120) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # a failed test leaves no training process behind
            raise
        self._reader.join(10)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)

    def line(self, prefix: str) -> str:
        (found,) = [line for line in self.lines if line.startswith(prefix)]
        return found


def _store(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")


def _runs(root: Path) -> list:
    client = _store(root)
    return client.search_runs([client.get_experiment_by_name("bapo").experiment_id])


def test_first_ctrl_c_saves_closes_killed_and_prints_the_command_that_resumes(
    _output_root: Path, tmp_path: Path
) -> None:
    bapo = Bapo("train", *TRACKED, LONG, cwd=tmp_path)
    bapo.wait_for("step 1/")
    bapo.proc.send_signal(signal.SIGINT)
    assert bapo.finish() == 130, bapo.output()
    out = bapo.output()
    assert "Ctrl-C: finishing this step, then saving a checkpoint" in out
    assert "Traceback" not in out and "Aborted" not in out
    (run_dir,) = (_output_root / "runs").glob("*/*")
    step = checkpoint.latest_usable(run_dir / "checkpoints", print)[1]["state"]["step"]
    assert step >= 1
    assert f"bapo train: summary (stopped by Ctrl-C at step {step})" in out
    assert bapo.line("run dir: ") == f"run dir: {run_dir}"  # whole, though 80 columns
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"
    assert bapo.line("open the results: ") == "open the results: bapo ui"
    resume = bapo.line("resume: ").removeprefix("resume: ")
    words = shlex.split(resume)
    assert words[:2] == ["bapo", "train"]
    assert words[-2:] == ["trainer.resume=true", f"hydra.run.dir={run_dir}"]
    assert set(TRACKED + [LONG]) <= set(words)
    # the run dir's log holds the run's lines (Hydra's job log, 0 bytes before)
    log = (run_dir / "train.log").read_text()
    assert "step 1/" in log and "bapo train: summary" in log and f"resume: {resume}" in log

    # the printed command continues the run: same dir, same MLflow run, from the checkpoint
    shorter = [f"trainer.max_steps={step + 1}" if w == LONG else w for w in words[1:]]
    again = Bapo(*shorter, cwd=tmp_path)
    assert again.finish() == 0, again.output()
    assert f"at step {step}" in again.output()
    (run,) = _runs(_output_root)
    assert run.info.status == "FINISHED"
    assert int(run.data.metrics["actor/updates"]) > 0
    history = _store(_output_root).get_metric_history(run.info.run_id, "reward/mean")
    assert max(m.step for m in history) == step + 1


def test_second_ctrl_c_stops_at_once(_output_root: Path, tmp_path: Path) -> None:
    # a slow grader (0.5 s per response, 32 responses on 4 workers: ~4 s a step) keeps the
    # step running while the second signal arrives
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import time\n\ndef score(response, reference, record):\n"
        "    time.sleep(0.5)\n    return float(response.strip() == reference)\n"
    )
    bapo = Bapo("train", *TRACKED, LONG, "reward=python", f"reward.fn={slow}:score", cwd=tmp_path)
    bapo.wait_for("step 1/")
    bapo.proc.send_signal(signal.SIGINT)
    bapo.wait_for("Ctrl-C: finishing this step")
    bapo.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert bapo.finish() == 130, bapo.output()
    assert time.monotonic() - sent < 15
    out = bapo.output()
    assert "Ctrl-C again: stopping now" in out
    assert "checkpoint saved" not in out
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"


def test_ctrl_c_under_async_leaves_no_worker_behind(_output_root: Path, tmp_path: Path) -> None:
    bapo = Bapo("train", *TRACKED, LONG, "staleness.regime=async", "staleness=2", cwd=tmp_path)
    bapo.wait_for("step 1/")
    children = psutil.Process(bapo.proc.pid).children(recursive=True)
    assert children  # the generation worker (and grading workers)
    bapo.proc.send_signal(signal.SIGINT)
    assert bapo.finish() == 130, bapo.output()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    (run_dir,) = (_output_root / "runs").glob("*/*")
    assert checkpoint.latest_usable(run_dir / "checkpoints", print) is not None
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"
    assert "resume: bapo train" in bapo.output()


def test_ctrl_c_in_a_sweep_stops_the_sweep_and_kills_its_runs(
    _output_root: Path, tmp_path: Path
) -> None:
    bapo = Bapo("train", "-m", "algo.rho0=0.3,0.5", *TRACKED, LONG, cwd=tmp_path)
    bapo.wait_for("step 1/")
    bapo.proc.send_signal(signal.SIGINT)
    assert bapo.finish() == 130, bapo.output()
    runs = _runs(_output_root)
    (parent,) = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) == "sweep"]
    children = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert parent.info.status == "KILLED"
    assert [c.info.status for c in children] == ["KILLED"]  # job 1 never started
    assert children[0].info.run_name.endswith("-rho0=0.3")
    (job,) = (_output_root / "sweeps").glob("*/*/0")
    assert checkpoint.latest_usable(job / "checkpoints", print) is not None
    words = shlex.split(bapo.line("resume: ").removeprefix("resume: "))
    assert "algo.rho0=0.3" in words and f"hydra.run.dir={job}" in words
    assert "sweep killed:" in bapo.output()
