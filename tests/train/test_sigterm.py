"""SIGTERM and SIGUSR1 to a real `bapo train` process (issue 33): how SLURM, docker, Kubernetes
and `timeout` stop a job, and what SLURM's `--signal=USR1@N` sends ahead of a time limit.

Before: SIGTERM killed the process in 1 s with the step lost, the newest checkpoint an older
`save_every` one, the MLflow run RUNNING forever and no resume line. Now, like the first Ctrl-C:
the step finishes (or is abandoned when it cannot end within `trainer.stop_grace_s`), a
checkpoint is written, the MLflow run is closed KILLED, the resume command is printed, exit
128 + the signal; and the resume finishes the run with every step's samples once.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from bapo_cli.config.preflight import preflight
from bapo_cli.rewards.guard import fan_out
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.interrupt import ROLLOUT, GracefulStop
from bapo_cli.trainer.train import train
from tests.tracking.readback import isolate_wandb, tb_scalars, wandb_history, wandb_records
from tests.train.test_ctrl_c import TRACKED, Bapo, _runs, _store
from tests.train.test_stop_grace import signal_entering

pytestmark = pytest.mark.slow

STEPS = "trainer.max_steps=20"  # 20 steps: a status line after every step (LINES_PER_RUN)
SLURM_KILL_WAIT_S = 30  # SLURM's default KillWait: SIGKILL this long after SIGTERM


def _run_dir(root: Path) -> Path:
    (run_dir,) = (root / "runs").glob("*/*")
    return run_dir


def _samples(run_dir: Path) -> Counter:
    """Rows of samples.jsonl per step."""
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return Counter(json.loads(line)["step"] for line in lines)


def _saved_step(run_dir: Path) -> int:
    return checkpoint.latest_usable(run_dir / "checkpoints", print)[1]["state"]["step"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_saves_the_step_closes_killed_and_the_resume_finishes_the_run(
    sig: signal.Signals, _output_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGUSR1's run logs to TensorBoard and W&B (offline) too: they are closed as well
    isolate_wandb(tmp_path, monkeypatch)
    others = ["tracking.backends=[mlflow,tensorboard,wandb]", "tracking.wandb.mode=offline"]
    others = others if sig == signal.SIGUSR1 else []
    bapo = Bapo("train", *TRACKED, STEPS, "trainer.save_every=5", *others, cwd=tmp_path)
    bapo.wait_for("step 2/")
    bapo.proc.send_signal(sig)
    assert bapo.finish() == 128 + sig, bapo.output()
    out = bapo.output()
    assert f"{sig.name}: finishing this step within 20 s (trainer.stop_grace_s)" in out
    assert "Traceback" not in out
    run_dir = _run_dir(_output_root)
    step = _saved_step(run_dir)  # the step in progress, not the last save_every one (none yet)
    assert 3 <= step < 20
    assert f"bapo train: summary (stopped by {sig.name} at step {step})" in out
    assert re.search(rf"checkpoint saved in \d+\.\d s: .*step_{step:06d}", out), out
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"
    assert _samples(run_dir) == {s: 4 for s in range(1, step + 1)}  # trainer.log_samples=4
    resume = bapo.line("resume: ").removeprefix("resume: ")
    words = shlex.split(resume)
    assert words[-2:] == ["trainer.resume=true", f"hydra.run.dir={run_dir}"]
    if sig != signal.SIGTERM:  # the resume is the same for both
        tensorboard = tb_scalars(run_dir / "tensorboard")["reward/mean"]
        assert [s for s, _ in tensorboard] == list(range(1, step + 1))
        records = wandb_records(run_dir)
        assert sorted(wandb_history(records)) == list(range(1, step + 1))
        (ended,) = [r for r in records if r["type"] == "exit"]  # the run was finished
        assert ended["exit"]["exit_code"] == 1, ended  # not 0: it did not complete
        return

    # the printed command finishes the run: same dir and MLflow run, each step's samples once
    shorter = [f"trainer.max_steps={step + 2}" if w == STEPS else w for w in words[1:]]
    again = Bapo(*shorter, cwd=tmp_path)
    assert again.finish() == 0, again.output()
    assert f"at step {step}" in again.output()
    (run,) = _runs(_output_root)
    assert run.info.status == "FINISHED"
    assert _samples(run_dir) == {s: 4 for s in range(1, step + 3)}
    history = _store(_output_root).get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(1, step + 3))  # each step once


def _slow_grader(tmp_path: Path) -> tuple[Path, Path]:
    """A reward function that takes 0.5 s per response (32 responses on 4 workers: ~4 s of
    grading per step, in the rollout) when SLOW is set, and counts its calls in a file."""
    calls = tmp_path / "calls"
    fn = tmp_path / "slow.py"
    fn.write_text(
        "import os, time\n\n"
        "def score(response, reference, record):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write('.')\n"
        "    time.sleep(float(os.environ.get('SLOW', '0')))\n"
        "    return float(response.strip() == reference)\n"
    )
    return fn, calls


def _slurm_stop(bapo: Bapo, kill_wait_s: float = SLURM_KILL_WAIT_S) -> tuple[float, bool]:
    """What slurmstepd does at a time limit: SIGTERM, then SIGKILL `kill_wait_s` later if the
    process is still there. (Seconds from the SIGTERM until the run was done: checkpoint
    saved, run closed, resume command printed; SIGKILLed?) The interpreter's own exit after
    that took up to 14 s on this loaded 2-core machine, for a run that finished normally too."""
    t0 = time.monotonic()
    bapo.proc.send_signal(signal.SIGTERM)
    done = None
    while bapo.proc.poll() is None and time.monotonic() - t0 < kill_wait_s:
        if done is None and any(line.startswith("resume: ") for line in bapo.lines):
            done = time.monotonic() - t0
        time.sleep(0.05)
    killed = bapo.proc.poll() is None
    if killed:
        bapo.proc.kill()
    bapo.finish()
    return done if done is not None else time.monotonic() - t0, killed


def test_slurm_time_limit_a_step_longer_than_the_grace_is_abandoned_and_the_last_one_saved(
    _output_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM then SIGKILL 30 s later, during a step that cannot end within the grace (steps
    of ~4 s of grading, trainer.stop_grace_s=2): the step is abandoned at the signal and the
    last completed one saved, well before the SIGKILL. That checkpoint is the one a run of
    exactly that many steps writes: same weights, optimizer and data position, same RNG."""
    grader, calls = _slow_grader(tmp_path)
    monkeypatch.setenv("BAPO_THREADS", "1")  # the same float results in both runs
    reward = ["reward=python", f"reward.fn={grader}:score"]
    monkeypatch.setenv("SLOW", "0.5")
    bapo = Bapo("train", *TRACKED, STEPS, *reward, "trainer.stop_grace_s=2", cwd=tmp_path)
    bapo.wait_for("step 2/")
    graded = len(calls.read_text())
    deadline = time.monotonic() + 60
    while len(calls.read_text()) <= graded:  # step 3 is grading (~4 s): in its rollout
        assert bapo.proc.poll() is None and time.monotonic() < deadline, bapo.output()
        time.sleep(0.05)
    done, killed = _slurm_stop(bapo)
    out = bapo.output()
    assert done < 10, done  # saved, closed and said how to resume well inside the kill wait
    assert not killed and bapo.proc.returncode == 143, out
    assert "SIGTERM: abandoning step 3 (the previous step took" in out, out
    assert "; saving step 2" in out and "Traceback" not in out
    run_dir = _run_dir(_output_root)
    assert _saved_step(run_dir) == 2
    assert _samples(run_dir) == {1: 4, 2: 4}  # the abandoned step wrote none
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"
    assert "resume: bapo train" in out and "(stopped by SIGTERM at step 2)" in out

    # the same config for exactly 2 steps, graded without the sleep (the same scores)
    monkeypatch.setenv("SLOW", "0")
    ref = Bapo("train", *TRACKED, "trainer.max_steps=2", *reward, cwd=tmp_path)
    assert ref.finish() == 0, ref.output()
    (ref_dir,) = [d for d in (_output_root / "runs").glob("*/*") if d != run_dir]
    a, b = (checkpoint.step_dir(d / "checkpoints", 2) for d in (run_dir, ref_dir))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (torch.load(d / "trainer_state.pt", weights_only=False) for d in (a, b))
    assert sa["ranks"][0]["prompts"] == sb["ranks"][0]["prompts"]
    assert sa["ranks"][0]["next_group"] == sb["ranks"][0]["next_group"]
    ra, rb = sa["ranks"][0]["rng"], sb["ranks"][0]["rng"]
    assert torch.equal(ra["torch"], rb["torch"]) and ra["python"] == rb["python"]
    assert sa["scheduler"] == sb["scheduler"]
    assert {k: v for k, v in sa["state"].items() if k != "history"} == {
        k: v for k, v in sb["state"].items() if k != "history"
    }
    for key, state in sa["optimizer"]["state"].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, sb["optimizer"]["state"][key][name]), (key, name)


@pytest.mark.parametrize("second", [False, True], ids=["sigterm", "second-ctrl-c"])
def test_a_stop_landing_in_threading_s_lock_still_stops_as_the_signal_meant(
    second: bool, _output_root: Path, tmp_path: Path
) -> None:
    """CI at 2f0a31d, the test above: the SIGTERM landed as the grading fan-out started a thread,
    in Condition.wait's reacquire; the StepAbandoned came out as RuntimeError "release unlocked
    lock", and the run ended FAILED with a traceback, exit 1, nothing saved at the stop. Here the
    signal lands at that very moment of step 2's grading, on purpose, in this process: a SIGTERM
    abandons the step and saves step 1; a second Ctrl-C stops at once (KeyboardInterrupt)."""
    grader, _ = _slow_grader(tmp_path)
    reward = ["reward=python", f"reward.fn={grader}:score", "reward.workers=2"]
    stop_fast = ["trainer.stop_grace_s=0.05", "trainer.max_steps=6"]
    cfg = preflight("train", [*TRACKED, *reward, *stop_fast]).config

    def in_a_later_steps_fan_out(frame: FrameType) -> bool:
        stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        if not (isinstance(stop, GracefulStop) and stop.phase == ROLLOUT and stop.last_step_s):
            return False
        while frame is not None and frame.f_code is not fan_out.__code__:
            frame = frame.f_back
        if frame is not None and second and not stop.requested:
            stop.request(signal.SIGINT)  # the first Ctrl-C came earlier in the step
        return frame is not None

    out = io.StringIO()
    reacquire = threading.Condition._acquire_restore.__code__
    landing = signal_entering(
        reacquire, signal.SIGINT if second else signal.SIGTERM, when=in_a_later_steps_fan_out
    )
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    try:
        with landing, contextlib.ExitStack() as expect:
            if second:
                expect.enter_context(pytest.raises(KeyboardInterrupt))
            result = train(cfg, tmp_path / "run", Console(file=out, width=300))
    finally:
        signal.signal(signal.SIGINT, previous)
    said = out.getvalue()
    assert "Traceback" not in said and "release unlocked lock" not in said, said
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"
    if second:
        assert "Ctrl-C again: stopping now" in said, said
        return
    assert result.interrupted and result.exit_code == 143, said
    assert "SIGTERM: abandoning step 2 (the previous step took" in said, said
    assert "; saving step 1" in said
    assert _saved_step(result.run_dir) == 1 and len(result.history) == 1
