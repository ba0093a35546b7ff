"""SLURM for real (issue 48): jobs submitted to a single-node cluster on this machine
(scripts/slurm_local.sh; conftest.py starts it or says in one line why it cannot).

- `bapo train -m launcher=slurm`: each sweep job is a SLURM job (hydra-submitit-launcher), one
  MLflow parent run, a FINISHED child per job.
- the script `bapo train --slurm-script` writes (CPU form: no GPU line; this node has none), run
  as written, and each fault a job meets on a cluster, with what it promises:
  - requeue (`scontrol requeue`, what preemption does): SIGTERM to every process, the step
    finishes and is saved, and the requeued attempt resumes from that checkpoint in the same run
    dir, the same MLflow run, every step's samples once;
  - the time-limit warning (`--signal=B:USR1@N`): the script passes SIGUSR1 on, the run saves,
    the script requeues the job, and the next attempt resumes likewise;
  - `scancel`: saved, the MLflow run KILLED, the job not requeued; submitting the same script
    again continues the run;
  - a SIGTERM to every process of a job SLURM does not end (preemption with a GraceTime):
    saved, the run KILLED (srun, which turns a SIGTERM into a SIGKILL of its step, is not in a
    one-node script any more).
  No torchrun traceback in any job log.

Before: the script asked for `--gpus-per-node=1` whatever the node (sbatch refused it here),
and a requeued job started a new run from step 0 in a new run dir, its first attempt left
KILLED; torchrun's agent logged a SignalException traceback at every stop.

The time-limit warning is sent by `scancel --signal=USR1 --batch`, which is what SLURM does at
`--signal=B:USR1@N` (a signal to the batch shell only), at a moment the test picks: a real
`--time` limit counts in minutes and SLURM's timer checks it every 30-60 s, so the warning would
cost a minute or two of waiting and land at a step nobody chose.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from bapo_cli import tracking
from bapo_cli.trainer import checkpoint
from tests.conftest import run_bapo
from tests.slurm.conftest import (
    cancelled_at_exit,
    job,
    sbatch,
    skip_module_unless_possible,
    wait_done,
    wait_until,
)
from tests.train.test_ctrl_c import TRACKED, _runs, _store

skip_module_unless_possible()
pytestmark = pytest.mark.slow

STEPS = 30
JOB_S = 300  # one attempt: process start-up and 30 tiny steps, on a loaded 2-core machine


def test_a_launcher_slurm_sweep_runs_each_job_under_slurm_one_parent_two_children(
    slurm: None, _output_root: Path, tmp_path: Path
) -> None:
    result = run_bapo(
        "train",
        "-m",
        "launcher=slurm",
        "hydra.launcher.gpus_per_node=0",  # this node has no GPU
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1",
        "algo=grpo,bapo",
        "trainer.max_steps=2",
        *TRACKED,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = _store(_output_root)
    (parent,) = [r for r in _runs(_output_root) if r.data.tags.get(tracking.ROLE_TAG) == "sweep"]
    assert parent.info.status == "FINISHED"
    children = tracking.child_runs(client, parent.info.run_id)
    assert len(children) == 2 and len(_runs(_output_root)) == 3
    (sweep_dir,) = (_output_root / "sweeps").glob("*/*")
    (array,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.name.isdigit()]
    for num, (child, algo) in enumerate(zip(children, ("grpo", "bapo"), strict=True)):
        assert child.info.status == "FINISHED"
        assert f"algo={algo}" in child.data.tags[tracking.OVERRIDES_TAG].split()
        assert len(client.get_metric_history(child.info.run_id, "reward/mean")) == 2
        # each child trained in a SLURM job of its own: the array task's log names its run
        task = f"{array}_{num}"
        log = (sweep_dir / ".submitit" / task / f"{task}_0_log.out").read_text()
        assert f"JobEnvironment(job_id={task}, hostname=" in log
        assert f"run {child.info.run_id}" in " ".join(log.split())
        # submitit's parent returns once a job has written its result, before its batch script
        # ends: the controller may still say RUNNING then (CI's first pass, 2026-12-05)
        ended = lambda: job(task)["JobState"] not in ("RUNNING", "COMPLETING")  # noqa: B023, E731
        wait_until(ended, 60, f"job {task} to end")
        assert job(task)["JobState"] == "COMPLETED"


def test_the_written_script_meets_requeue_the_time_limit_warning_and_scancel_as_one_run(
    slurm: None, _output_root: Path, tmp_path: Path
) -> None:
    """One job meets each fault in turn, each attempt resuming where the last one saved:
    `scontrol requeue` (preemption), the time-limit warning, `scancel`, then `sbatch` again."""
    script, run_dir = _write_script(tmp_path)
    text = script.read_text()
    assert "--gpus-per-node" not in text  # the CPU form: sbatch refused the old line here
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@80"):
        assert line in text.splitlines()
    with cancelled_at_exit([]) as jobs:
        jobs.append(job_id := sbatch(script, tmp_path))
        log = tmp_path / f"bapo-train-{job_id}.out"
        # 1. requeued (what preemption does): SIGTERM to every process, back in the queue
        wait_until(lambda: _saved(run_dir), JOB_S, "the first checkpoint")
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        first_saved, rows = _between_attempts(job_id, run_dir)
        (first,) = _attempts(log, 1)
        assert "SIGTERM: finishing this step" in first
        assert f"stopped by SIGTERM at step {first_saved}" in first
        # 2. the time-limit warning, once attempt 2 has saved a step of its own: what SLURM
        # sends at --signal=B:USR1@N, SIGUSR1 to the batch shell alone
        _attempts(log, 2, wait_s=JOB_S)
        wait_until(lambda: _saved(run_dir) > first_saved, JOB_S, "a checkpoint of attempt 2")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        second_saved, rows_2 = _between_attempts(job_id, run_dir)
        second = _attempts(log, 2)[1]
        _assert_continued(second, run_dir, first_saved, rows, _output_root, ended=False)
        assert "SIGUSR1: finishing this step" in second
        assert f"stopped by SIGUSR1 at step {second_saved}" in second
        assert f"bapo: saved at the time-limit warning; requeueing job {job_id}" in second
        # 3. scancel, once attempt 3 has saved a step of its own: SIGTERM, not requeued
        _attempts(log, 3, wait_s=JOB_S)
        wait_until(lambda: _saved(run_dir) > second_saved, JOB_S, "a checkpoint of attempt 3")
        subprocess.run(["scancel", job_id], check=True)
        info = wait_done(job_id, JOB_S, restarts=2)
        assert info["JobState"] == "CANCELLED", info
        third = _attempts(log, 3)[2]
        cancelled = _saved(run_dir)
        assert f"stopped by SIGTERM at step {cancelled}" in third, third[-3000:]
        (run,) = _runs(_output_root)
        assert run.info.status == "KILLED", third[-3000:]
        _assert_continued(third, run_dir, second_saved, rows_2, _output_root, ended=False)
        rows_3 = (run_dir / "samples.jsonl").read_text().splitlines()
        # 4. the same script submitted again: a new job, the same run, to its end
        jobs.append(again := sbatch(script, tmp_path))
        info = wait_done(again, JOB_S)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    (last,) = _attempts(tmp_path / f"bapo-train-{again}.out", 1)
    _assert_continued(last, run_dir, cancelled, rows_3, _output_root)
    (run,) = _runs(_output_root)
    assert run.info.status == "FINISHED"


def test_a_sigterm_to_a_job_slurm_does_not_end_is_saved_as_preemption_with_grace_time_needs(
    slurm: None, _output_root: Path, tmp_path: Path
) -> None:
    """SIGTERM to every process of a job that goes on (what a preemption with a GraceTime sends;
    here `scancel --signal=TERM --full`): the step ends, the checkpoint, the run KILLED.

    Before: srun, signalled with the batch shell, turned the SIGTERM into a SIGKILL of its step
    ("srun: forcing job termination") while the job was alive to take it: the ranks died
    mid-step, no checkpoint at the stop, the MLflow run left RUNNING."""
    script, run_dir = _write_script(tmp_path, steps=100_000)  # only the signal ends it
    with cancelled_at_exit([]) as jobs:
        jobs.append(job_id := sbatch(script, tmp_path))
        log = tmp_path / f"bapo-train-{job_id}.out"
        wait_until(lambda: _saved(run_dir), JOB_S, "the first checkpoint")
        subprocess.run(["scancel", "--signal=TERM", "--full", job_id], check=True)
        info = wait_done(job_id, JOB_S)
    (attempt,) = _attempts(log, 1)
    stopped = _saved(run_dir)
    assert f"stopped by SIGTERM at step {stopped}" in attempt, attempt[-3000:]
    assert info["ExitCode"] == "143:0", info  # the script exits with the run's 128 + 15
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"


# ------------------------------------------------------------------------------------- helpers


def _write_script(tmp_path: Path, steps: int = STEPS) -> tuple[Path, Path]:
    script = tmp_path / "job.sbatch"
    run = [*TRACKED, f"trainer.max_steps={steps}", "trainer.save_every=3"]
    args = ["--slurm-script", str(script), "--nproc", "1", *run]
    wrote = run_bapo("train", *args, cwd=tmp_path)  # the job's log is written there
    assert wrote.returncode == 0, wrote.stderr
    (run_dir,) = re.findall(r"^run_dir=(\S+)", script.read_text(), re.M)
    return script, Path(run_dir)


def _saved(run_dir: Path) -> int:
    """The newest complete checkpoint's step, 0 before the first."""
    found = checkpoint.latest_usable(run_dir / "checkpoints", lambda _line: None)
    return 0 if found is None else found[1]["state"]["step"]


def _between_attempts(job_id: str, run_dir: Path) -> tuple[int, list[str]]:
    """While the requeued job waits (SLURM holds it for AuthInfo's cred_expire): the step the
    first attempt saved last and its samples.jsonl rows."""
    wait_until(lambda: job(job_id)["JobState"] == "PENDING", JOB_S, "the job back in the queue")
    saved = _saved(run_dir)
    assert 0 < saved < STEPS
    return saved, (run_dir / "samples.jsonl").read_text().splitlines()


def _attempts(log: Path, count: int, wait_s: float = 0) -> list[str]:
    """The job log's text per attempt (the script's `bapo: job N, attempt K` line starts each),
    whitespace collapsed (rich wraps lines at 80 columns)."""

    def split() -> list[str] | None:
        text = " ".join(log.read_text().split()) if log.exists() else ""
        parts = re.split(r"bapo: job \d+, attempt \d+, run dir ", text)[1:]
        return parts if len(parts) == count else None

    parts = wait_until(split, wait_s, f"{count} attempts in {log}") if wait_s else split()
    assert parts is not None, log.read_text()
    assert "Traceback" not in log.read_text()
    return parts


def _assert_continued(
    attempt: str, run_dir: Path, saved: int, before: list[str], root: Path, ended: bool = True
) -> None:
    """`attempt` resumed the run in `run_dir` from step `saved`: its log says so and its first
    step is the next one, the rows of the steps up to it are those the earlier attempt wrote,
    every step's samples are there once, the same MLflow run and the run dir only one."""
    assert attempt.startswith(f"{run_dir} ")
    ckpt = run_dir / "checkpoints" / f"step_{saved:06d}"
    assert f"resumed from {ckpt} at step {saved}" in attempt
    first = re.search(rf"steps? (\d+)(?:-\d+)?/{STEPS} ", attempt)
    assert first is not None and int(first.group(1)) == saved + 1
    rows = (run_dir / "samples.jsonl").read_text().splitlines()
    kept = [r for r in before if json.loads(r)["step"] <= saved]
    assert rows[: len(kept)] == kept
    last = STEPS if ended else max(json.loads(r)["step"] for r in rows)
    assert Counter(json.loads(r)["step"] for r in rows) == {s: 4 for s in range(1, last + 1)}
    assert [p for p in (root / "runs").glob("*/*")] == [run_dir]
    (run,) = _runs(root)
    assert f"run {run.info.run_id}" in attempt
    history = _store(root).get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(1, last + 1))  # each step once
