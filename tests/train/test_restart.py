"""`trainer.resume=true` in a run dir whose earlier attempt saved no checkpoint (issue 48): a SLURM
job requeued, or a node lost, before the first `save_every`. The run starts again at step 0 in
the same dir: the attempt's samples.jsonl rows are dropped (each step once), and its unfinished
MLflow run is continued (one run per run dir, the steps it logged not logged twice).

Before: the rows of the lost attempt stayed and the new attempt appended its own (steps 1..k
twice), and a second MLflow run was started beside the first, which stayed RUNNING.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.train.test_ctrl_c import LONG, TRACKED, Bapo, _runs, _store

pytestmark = pytest.mark.slow


def test_a_restart_without_a_checkpoint_drops_the_attempts_samples_and_continues_its_run(
    _output_root: Path, tmp_path: Path
) -> None:
    first = Bapo("train", *TRACKED, LONG, cwd=tmp_path)  # save_every=0: no checkpoint yet
    first.wait_for("step 1/")
    (run_dir,) = (_output_root / "runs").glob("*/*")
    deadline = time.monotonic() + 120
    while max(_steps(run_dir), default=0) < 12:  # metrics of steps 1-10 delivered (every 10)
        assert time.monotonic() < deadline and first.proc.poll() is None, first.output()
        time.sleep(0.05)
    first.proc.kill()  # SIGKILL: nothing saved, the MLflow run left RUNNING
    first.finish()
    assert not list((run_dir / "checkpoints").glob("step_*"))
    (lost,) = _runs(_output_root)
    assert lost.info.status == "RUNNING"
    assert _steps(run_dir)[1] == 4

    again = Bapo(
        "train",
        *TRACKED,
        "trainer.max_steps=14",
        "trainer.resume=true",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert again.finish() == 0, again.output()
    out = " ".join(again.output().split())  # lines wrap at 80 columns
    assert _steps(run_dir) == {s: 4 for s in range(1, 15)}  # trainer.log_samples=4, each once
    assert [r.info.run_id for r in _runs(_output_root)] == [lost.info.run_id]
    assert "no usable checkpoint" in out and "starting fresh" in out
    assert f"continuing MLflow run {lost.info.run_id}, left unfinished in this run dir" in out
    (run,) = _runs(_output_root)
    assert run.info.run_id == lost.info.run_id and run.info.status == "FINISHED"
    history = _store(_output_root).get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(1, 15))  # each step once


def _steps(run_dir: Path) -> Counter:
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return Counter(json.loads(line)["step"] for line in lines)
