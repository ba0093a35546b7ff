"""Real asynchronous RL (`staleness.regime=async`): a worker process generates while training runs.

Real processes throughout: the trainer in this process or a `bapo train` subprocess, the worker
spawned by it. What must hold whatever the timing: no token is trained more than staleness.k
versions after it was sampled; every prompt group drawn is trained exactly once (none lost, none
twice), also across a kill -9 of the trainer and a resume; the worker never outlives its trainer.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout.base import Sample, SamplingParams
from bapo_cli.staleness.regimes import admission_capacity
from bapo_cli.staleness.worker import GenerationWorker, WorkerError, WorkerSpec
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.rollout.conftest import perturb_embedding, score_with
from tests.train.conftest import FAST, run_train, train_in_background, wait_for

F_GETPIPE_SZ = 1032  # fcntl: a pipe's capacity in bytes (Linux)
PROMPTS, N = 8, 4  # FAST: prompts_per_step=8, rollout.n=4
ASYNC = ("staleness.regime=async", f"trainer.log_samples={PROMPTS * N}")


def _workers(pid: int | None = None) -> list[psutil.Process]:
    """Live generation workers started by `pid` (default: this process)."""
    found = []
    for child in psutil.Process(pid or os.getpid()).children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != "zombie":
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def _assert_each_group_once(records: list[dict], steps: int) -> None:
    """Steps 1..steps each trained PROMPTS whole groups, and the groups are 0..steps*PROMPTS-1,
    each with its N samples: none lost, none twice."""
    assert sorted({r["step"] for r in records}) == list(range(1, steps + 1))
    counts = Counter(r["group"] for r in records)
    assert sorted(counts) == list(range(steps * PROMPTS))
    assert set(counts.values()) == {N}


def test_admission_rule_is_areals() -> None:
    # nothing trained yet, k=2, batches of 8: three batches may start, no more
    assert (
        admission_capacity(k=2, version=0, batch=8, accepted=0, running=0, max_concurrent=24) == 24
    )
    assert (
        admission_capacity(k=2, version=0, batch=8, accepted=0, running=24, max_concurrent=24) == 0
    )
    # one batch trained (version 1): one more batch may start
    assert (
        admission_capacity(k=2, version=1, batch=8, accepted=8, running=16, max_concurrent=24) == 8
    )
    # max_concurrent binds when it is the smaller
    assert admission_capacity(k=4, version=0, batch=8, accepted=0, running=4, max_concurrent=6) == 2


@pytest.mark.parametrize(("k", "interrupt"), [(1, False), (2, False), (2, True)])
def test_staleness_never_exceeds_k_and_each_group_is_trained_once(tmp_path, k, interrupt) -> None:
    steps = 8
    result = run_train(
        tmp_path,
        f"staleness={k}",
        *ASYNC,
        f"trainer.max_steps={steps}",
        f"staleness.interrupt={interrupt}",
    )
    assert len(result.history) == steps
    stale = [u["staleness_max"] for u in result.updates]
    assert max(stale) <= k, stale
    assert stale[0] == 0.0  # the first batch comes from the starting weights
    # the worker scored its samples with the weights that sampled them: the first update, on
    # those same weights, sees a ratio of exactly 1
    assert result.updates[0]["ratio_max"] == 1.0 == result.updates[0]["ratio_mean"]
    for sample in result.last_batch:
        assert len(sample.logprobs) == len(sample.response_ids) == len(sample.versions)
        if interrupt:  # continued by newer weights at most: versions only go up
            assert sample.versions == sorted(sample.versions)
        else:
            assert len(set(sample.versions)) == 1  # one unit, one set of weights
    _assert_each_group_once(_records(result.run_dir), steps)
    assert _workers() == []  # the worker is gone once train() returns


def _worker_spec(*, interrupt: bool, max_tokens: int) -> tuple[WorkerSpec, Any, Any]:
    """A worker spec for the tiny model as the trainer would make it; (spec, model, tokenizer)."""
    run = ["staleness=2", "staleness.regime=async", f"staleness.interrupt={interrupt}"]
    cfg = preflight("train", [*FAST, "trainer.micro_batch_size=64", *run]).config
    model, tokenizer = models.load_policy(cfg.model)
    spec = WorkerSpec(
        engine="hf",
        cfg=cfg,  # also the worker's micro-batch layout and staleness.interrupt
        dtype=torch.float32,
        autocast=None,
        params=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0),
        seed=0,
        threads=1,
    )
    return spec, model, tokenizer


def _unit(tokenizer: Any, first_group: int, prompts: int, n: int) -> list[Sample]:
    unit = []
    for g in range(first_group, first_group + prompts):
        ids = tokenizer(models.format_prompt(tokenizer, f"{g % 50}+{g % 7}="))["input_ids"]
        unit += [Sample(prompt_ids=list(ids), group=g, problem=None) for _ in range(n)]
    return unit


def test_the_worker_runs_ahead_of_a_trainer_that_does_not_read(tmp_path) -> None:
    # units far larger than a pipe's buffer: sent from the generating thread, the second would
    # wait for the trainer to read the first, and the third would never start
    spec, model, tokenizer = _worker_spec(interrupt=False, max_tokens=8)
    worker = GenerationWorker(spec, model, version=0)
    try:
        units = [_unit(tokenizer, 128 * i, 128, 4) for i in range(3)]
        for unit in units:
            worker.submit(unit)
        wait_for(lambda: worker.generated.value == 3, 120, "three units generated, none read")
        sizes = []
        for unit in units:
            got = worker.receive()
            assert [s.group for s in got] == [s.group for s in unit]
            assert all(s.done and len(s.logprobs) == len(s.response_ids) for s in got)
            sizes.append(len(pickle.dumps(got)))
        # the premise: the first two units overfill the pipe, so the third could not start if
        # the generating thread had to wait for its sends
        assert sum(sizes[:2]) > fcntl.fcntl(worker.results.fileno(), F_GETPIPE_SZ)
    finally:
        worker.close()
    assert _workers() == []


def test_new_weights_interrupt_the_worker_and_each_token_keeps_its_versions_logprob() -> None:
    spec, model, tokenizer = _worker_spec(interrupt=True, max_tokens=16)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    worker = GenerationWorker(spec, model, version=0)
    try:
        # one unit at version 0 first: the worker is built and waiting before any publishing
        # starts (publishing through its seconds-long start made thousands of versions)
        worker.submit(_unit(tokenizer, 0, 16, 4))
        worker.receive()
        # up to 3 units, new weights every ~2 ms while each is generated: the check is that
        # interruption happens, not that one unit of tens of milliseconds saw a publish on a
        # loaded machine (CI once saw no response interrupted; the interleaving was not found)
        version, units = 0, []
        for attempt in range(3):
            worker.submit(_unit(tokenizer, 16 * (attempt + 1), 16, 4))
            while not worker.results.poll(0.002):  # publish new weights until the unit is back
                version += 1
                _load_version(model, base, version)
                worker.publish(model, version)
            units.append(worker.receive())
            if any(len(set(s.versions)) > 1 for s in units[-1]):
                break
    finally:
        worker.close()
    assert any(len(set(s.versions)) > 1 for s in units[-1]), "no response was interrupted"
    # each token's behaviour log-prob is its own version's (up to float32 summation order: the
    # worker scored another batch layout on one thread), and clearly not the first version's
    got = [s for unit in units for s in unit]
    for s in got:
        assert len(s.versions) == len(s.logprobs) == len(s.response_ids)
        assert s.versions == sorted(s.versions)
    model.load_state_dict(base)
    at_start = _rescore(model, tokenizer, got)
    checked, moved = 0, 0.0
    for v in sorted({v for s in got for v in s.versions}):
        _load_version(model, base, v)
        rescored = _rescore(model, tokenizer, got)
        for s, r, r0 in zip(got, rescored, at_start, strict=True):
            for i, token_version in enumerate(s.versions):
                if token_version == v:
                    assert s.logprobs[i] == pytest.approx(r.logprobs[i], abs=1e-4)
                    moved = max(moved, abs(s.logprobs[i] - r0.logprobs[i]))
                    checked += 1
    assert checked == sum(len(s.response_ids) for s in got)
    assert moved > 1e-2  # the versions' weights differ far beyond the tolerance


def _load_version(model: Any, base: dict, version: int) -> None:
    """The test's weights of `version`: the starting weights plus version-seeded noise on the
    embedding (each version as far from the start as any other; none kept in memory)."""
    model.load_state_dict(base)
    if version:
        perturb_embedding(model, scale=0.02, seed=version)


def _rescore(model: Any, tokenizer: Any, samples: list[Sample]) -> list[Sample]:
    """`samples`' tokens scored again with `model`'s current weights."""
    rescored = [
        Sample(s.prompt_ids, s.group, None, list(s.response_ids), versions=list(s.versions))
        for s in samples
    ]
    score_with(model, tokenizer, 1.0)(rescored)
    return rescored


@pytest.mark.vllm
def test_a_vllm_worker_samples_and_the_trainer_keeps_its_logprobs_for_the_mismatch(
    tmp_path,
) -> None:
    pytest.importorskip("vllm")
    steps, k = 6, 2
    cfg = preflight(
        "train",
        [o for o in FAST if not o.startswith("rollout=")]  # FAST pins rollout=hf
        + ["rollout=vllm", f"staleness={k}", *ASYNC, f"trainer.max_steps={steps}"],
    ).config
    result = train(cfg, tmp_path / "run")
    assert max(u["staleness_max"] for u in result.updates) <= k
    # behaviour log-probs are still the worker's own forward in the trainer's layout
    assert result.updates[0]["ratio_max"] == 1.0 == result.updates[0]["ratio_mean"]
    for sample in result.last_batch:  # vLLM's own log-probs travel with the samples (TIS)
        assert len(sample.engine_logprobs) == len(sample.response_ids) == len(sample.logprobs)
    # the worker syncs vLLM to the weights it scores with: engine and trainer agree
    mismatch = [h["rollout/logprob_abs_diff_max"] for h in result.history]
    assert len(mismatch) == steps
    assert max(mismatch) < 1e-3
    _assert_each_group_once(_records(result.run_dir), steps)
    assert _workers() == []


@pytest.mark.vllm
def test_a_vllm_worker_is_closed_cleanly_when_training_ends(tmp_path) -> None:
    # killed instead of closed, the worker's vLLM engine leaves its semaphores behind and
    # Python's resource tracker warns about "leaked semaphore objects" as `bapo train` exits
    pytest.importorskip("vllm")
    fast = [o for o in FAST if not o.startswith("rollout=")]
    done = subprocess.run(
        [sys.executable, "-m", "bapo_cli", "train", *fast, "rollout=vllm", "staleness=2"]
        # units big enough that the worker is still generating admitted ones when training ends
        + ["trainer.prompts_per_step=32", "rollout.n=8", "trainer.micro_batch_size=256"]
        + ["staleness.regime=async", "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
    assert _workers() == []


@pytest.mark.slow  # bapo train subprocesses
def test_kill_9_of_the_trainer_then_resume_trains_every_group_exactly_once(tmp_path) -> None:
    steps, k = 40, 2
    args = (f"staleness={k}", *ASYNC, f"trainer.max_steps={steps}", "trainer.save_every=2")
    run_dir = tmp_path / "killed"
    trainer = train_in_background(run_dir, *args)
    root = run_dir / "checkpoints"
    wait_for(lambda: (checkpoint.step_dir(root, 4) / "trainer_state.pt").exists(), 120, "step 4")
    workers = _workers(trainer.pid)
    assert len(workers) == 1
    trainer.send_signal(signal.SIGKILL)
    assert trainer.wait(30) == -signal.SIGKILL
    # no orphan: the worker dies with its trainer
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []
    found = checkpoint.latest_usable(root, print)
    assert found is not None
    resumed_from = found[1]["state"]["step"]
    assert resumed_from < steps, "the run finished before it was killed: kill it earlier"
    in_flight = found[1]["ranks"][0]["regime"]["in_flight"]
    assert in_flight  # groups were submitted but not trained when the checkpoint was written

    resumed = run_train(tmp_path, *args, "trainer.resume=true", name="killed")
    assert len(resumed.history) == steps
    assert max(u["staleness_max"] for u in resumed.updates) <= k
    records = _records(run_dir)
    after = (steps - resumed_from) * PROMPTS * N  # the resumed run's records come last
    first_run = [r for r in records[:-after] if r["step"] <= resumed_from]
    _assert_each_group_once(first_run + records[-after:], steps)
    # the groups in flight at the checkpoint were generated again from the same prompts
    prompt_of = {r["group"]: r["id"] for r in records[:-after]}
    regenerated = {s["group"]: s["problem"]["id"] for unit in in_flight for s in unit}
    for r in records[-after:]:
        if r["group"] in regenerated:
            assert r["id"] == regenerated[r["group"]]
        if r["group"] in prompt_of:
            assert r["id"] == prompt_of[r["group"]]
    assert _workers() == []


def test_a_dead_worker_stops_training_with_one_line(tmp_path) -> None:
    trainer = train_in_background(
        tmp_path / "run", "staleness=1", *ASYNC, "trainer.max_steps=100000"
    )
    wait_for(lambda: bool(_workers(trainer.pid)), 120, "the worker")
    (worker,) = _workers(trainer.pid)
    wait_for(lambda: (tmp_path / "run" / "samples.jsonl").exists(), 120, "a trained step")
    worker.send_signal(signal.SIGKILL)
    _, err = trainer.communicate(timeout=60)
    assert trainer.returncode == 1
    assert err.strip().splitlines()[-1] == (
        f"error: the generation worker (pid {worker.pid}) exited with code -9 without an error "
        "report"
    ), err


def test_a_worker_killed_holding_the_weights_lock_fails_publish_instead_of_hanging() -> None:
    # the lock a killed worker held while copying weights in is never released; this process
    # takes it here to stand in for that worker (a way CI's dead-worker test could hang)
    spec, model, _ = _worker_spec(interrupt=False, max_tokens=4)
    worker = GenerationWorker(spec, model, version=0)
    try:
        assert worker.lock.acquire(timeout=5)
        worker.proc.kill()
        outcome: list[BaseException | None] = []

        def publish() -> None:
            try:
                worker.publish(model, 1)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001  (inspected below)
                outcome.append(exc)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "publish() waited on a dead worker's lock"
        (exc,) = outcome
        assert isinstance(exc, WorkerError)
        assert str(exc) == (
            f"the generation worker (pid {worker.pid}) exited with code -9 without an error report"
        )
    finally:
        worker.lock.release()
        worker.close()


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["rollout=vllm", "staleness.interrupt=true"],
            "staleness.interrupt=True: pauses responses between tokens, which the vLLM engine "
            "cannot do (it generates each call to the end): use rollout=hf, or drop "
            "staleness.interrupt",
        ),
        (
            ["trainer.strategy=fsdp2"],
            "trainer.strategy=fsdp2: staleness.regime=async without rollout.servers is one "
            "process beside its generation worker: use trainer.strategy=ddp, or vLLM servers "
            "(rollout.servers=[URL,...], docs/engines.md)",
        ),
        (
            ["staleness.ppo_epochs=2"],
            "staleness.ppo_epochs=2: staleness.regime=async makes one update per batch: needs "
            "ppo_epochs=1",
        ),
        (
            ["model.device=cuda"],
            "model.device=cuda: staleness.regime=async on CUDA generates on vLLM servers: needs "
            "rollout.servers=[URL,...] and staleness.weights=filesystem (bapo serve, "
            "docs/engines.md), or model.device=cpu",
        ),
        (
            ["algo=dapo"],
            "algo.dynamic_sampling=True: refills a batch with new prompts once its rewards are "
            "known, which a worker that generates ahead does not do: use "
            "staleness.regime=reuse, replay or lag",
        ),
        (
            ["staleness.regime=lag", "staleness.interrupt=true"],
            "staleness.interrupt=True: pauses the responses a generation worker is sampling when "
            "new weights arrive; only staleness.regime=async has a worker (in one process, "
            "staleness.regime=partial continues responses with newer weights)",
        ),
        (
            ["staleness.k=0"],
            "staleness.regime=async: needs staleness.k >= 1 (k=0 is on-policy: use reuse)",
        ),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides, line) -> None:
    with pytest.raises(PreflightError) as info:
        preflight("train", ["staleness=2", "staleness.regime=async", *overrides])
    assert str(info.value) == line


def test_nproc_with_async_is_refused_before_torchrun_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bapo_cli", "train", "--nproc", "2", "staleness.regime=async"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: --nproc with staleness.regime=async: that regime trains in one process (its "
        "generation worker is the second); drop --nproc, or generate on vLLM servers "
        "(rollout.servers=[URL,...] staleness.weights=filesystem)"
    )
