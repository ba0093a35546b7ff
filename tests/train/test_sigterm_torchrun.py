"""Stop signals under torchrun: two real gloo ranks on loopback (`bapo train --nproc 2`).

A signal may reach one rank (a `kill` of one process) or all of them (SLURM signals every
process of a job step; torchrun's agent passes what it gets on to every rank): either way all
ranks stop at the same step and write one checkpoint together (they agree by an all-reduce
after each step), rank 0 closes the MLflow run KILLED and prints the resume command, which
names `--nproc 2` (a checkpoint resumes with as many ranks as wrote it). `bapo train --nproc`
passes SIGUSR1 (SLURM's `--signal=USR1@N`) on through torchrun's agent, whose default would have
let it end the agent and orphan the ranks, and exits 138 without a traceback.
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from bapo_cli.trainer import checkpoint
from tests.train.test_ctrl_c import LONG, TRACKED, Bapo, _runs

pytestmark = pytest.mark.slow

STEPS = "trainer.max_steps=20"  # a status line after every step


def _ranks(launcher: int, timeout_s: float = 60, count: int = 2) -> dict[int, psutil.Process]:
    """The training processes under `launcher` (bapo → torchrun's agent → ranks), by rank."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for proc in psutil.Process(launcher).children(recursive=True):
            try:
                env = proc.environ()
                if "bapo_cli" in proc.cmdline() and "RANK" in env:
                    found[int(env["RANK"])] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if len(found) == count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _checkpoint(run_dir: Path) -> dict:
    return checkpoint.latest_usable(run_dir / "checkpoints", print)[1]


def _samples(run_dir: Path) -> Counter:
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return Counter(json.loads(line)["step"] for line in lines)


def test_all_ranks_stop_at_one_step_whichever_rank_the_signal_reaches(
    _output_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bapo = Bapo("train", "--nproc", "2", *TRACKED, STEPS, cwd=tmp_path)
    bapo.wait_for("step 2/", timeout_s=300)
    ranks = _ranks(bapo.proc.pid)
    assert sorted(ranks) == [0, 1]
    ranks[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns it from the all-reduce
    assert bapo.finish(180) != 0, bapo.output()  # the ranks exit 143: torchrun reports it
    out = bapo.output()
    assert "SIGTERM on another rank: stopping after this step" in out
    (run_dir,) = (_output_root / "runs").glob("*/*")
    saved = _checkpoint(run_dir)
    step = saved["state"]["step"]
    assert step >= 3 and len(saved["ranks"]) == 2  # one checkpoint, both ranks' states in it
    assert f"(stopped by SIGTERM at step {step})" in out
    assert saved["ranks"][0]["prompts"] == saved["ranks"][1]["prompts"]  # the same position
    (run,) = _runs(_output_root)
    assert run.info.status == "KILLED"
    words = shlex.split(bapo.line("resume: ").removeprefix("resume: "))
    assert words[:4] == ["bapo", "train", "--nproc", "2"]
    assert words[-2:] == ["trainer.resume=true", f"hydra.run.dir={run_dir}"]

    # the printed command resumes both ranks; SIGUSR1 to it (as `scancel --signal=USR1
    # --batch` or a trap would send) reaches the ranks through torchrun's agent
    again = Bapo(*words[1:], cwd=tmp_path)
    again.wait_for(f"step {step + 2}/", timeout_s=300)
    again.proc.send_signal(signal.SIGUSR1)
    assert again.finish(180) == 128 + signal.SIGUSR1, again.output()
    out = again.output()
    assert "resumed from" in out and f"at step {step}" in out
    assert "Traceback" not in out and "SignalException" not in out
    saved = _checkpoint(run_dir)
    last = saved["state"]["step"]
    assert last >= step + 3 and len(saved["ranks"]) == 2
    assert f"(stopped by SIGUSR1 at step {last})" in out
    assert _samples(run_dir) == {s: 4 for s in range(1, last + 1)}  # each step once
    (run,) = _runs(_output_root)  # the same MLflow run, closed KILLED again
    assert run.info.status == "KILLED"
    rng = [r["rng"]["torch"] for r in saved["ranks"]]
    assert not torch.equal(rng[0], rng[1])  # each rank's own state, not one copied


def test_a_rank_whose_agent_is_killed_stops_as_a_sigterm_stops_it(
    _output_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's agent killed outright (kill -9 here; srun forcing a step's end, the OOM
    killer): the kernel sends its orphaned rank a SIGTERM (PR_SET_PDEATHSIG), and the rank ends
    its step, saves and closes the run KILLED. Before: it trained on unseen, outside the process
    tree SLURM signals (likely until a broken pipe closed its MLflow run FAILED; not seen)."""
    bapo, rank = _one_rank(tmp_path, monkeypatch)
    rank.parent().kill()  # the agent
    try:
        rank.wait(120)
    except psutil.TimeoutExpired:
        rank.kill()
        raise AssertionError("the rank outlived its agent:\n" + bapo.output()) from None
    bapo.finish(60)
    _assert_saved_and_killed(bapo, _output_root)


def test_torchrun_s_agent_waits_for_the_rank_s_save_however_often_it_is_signalled(
    _output_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM three times to the agent (SLURM signals every process of a job; the batch script
    passes the signal on; an impatient scancel): it acts on the first and waits for the rank.
    Before: each repeat raised torchrun's SignalException inside that wait, and the agent left
    while the rank was still saving and closing its run."""
    bapo, rank = _one_rank(tmp_path, monkeypatch)
    agent = rank.parent()
    for _ in range(3):
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    agent.wait(120)
    alive = _alive(rank)
    bapo.finish(60)
    assert not alive, "the agent left before its rank:\n" + bapo.output()
    _assert_saved_and_killed(bapo, _output_root)


def _one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Bapo, psutil.Process]:
    """`bapo train --nproc 1` that only a signal ends, once it has trained a step; its rank."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bapo = Bapo("train", "--nproc", "1", *TRACKED, LONG, cwd=tmp_path)
    bapo.wait_for("step 1/", timeout_s=300)  # the next status line comes minutes later
    (rank,) = _ranks(bapo.proc.pid, count=1).values()
    return bapo, rank


def _assert_saved_and_killed(bapo: Bapo, root: Path) -> None:
    out = bapo.output()
    (run_dir,) = (root / "runs").glob("*/*")
    step = _checkpoint(run_dir)["state"]["step"]
    assert f"(stopped by SIGTERM at step {step})" in out, out
    assert "Traceback" not in out
    (run,) = _runs(root)
    assert run.info.status == "KILLED"
