"""A real `mlflow server` goes away in the middle of `bapo train`: training goes on, and every
metric reaches the store exactly once when the server is back, or is listed in the run dir.

The server is stopped and started from inside the loop (a hook on `log_metrics` at fixed steps), so
the outage always falls between the same steps however fast the machine is. Slow: each server
start takes 15-50 s on a busy 2-core machine.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from bapo_cli.tracking import MlflowTracker, writer
from bapo_cli.trainer.train import TrainingError, TrainResult
from tests.faults.conftest import MlflowServer, free_port
from tests.train.conftest import run_train

STEPS = 12
STOP_AT = 5  # the server stops just before step 5 is logged (1-4 went out at the step-4 flush)
RESTART_AT = 9  # and answers again before step 9 is logged
TRAIN_TIMEOUT_S = 600.0


def _train(tmp_path: Path, uri: str) -> TrainResult:
    """The real loop on the tiny model, in a thread so a hang fails the test instead of CI."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["result"] = run_train(
                tmp_path,
                "tracking=mlflow",
                f"tracking.uri={uri}",
                "tracking.experiment=outage",
                f"trainer.max_steps={STEPS}",
                "trainer.save_every=2",  # a checkpoint (and a flush) every other step
            )
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TRAIN_TIMEOUT_S)
    assert not thread.is_alive(), f"training did not finish in {TRAIN_TIMEOUT_S} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]


def _hook(monkeypatch, actions: dict[int, object]) -> dict[str, list]:
    """Run `actions[step]()` just before `log_metrics(step)`; time every delivery attempt."""
    seen: dict[str, list] = {"steps": [], "deliveries": []}
    log_metrics, deliver = MlflowTracker.log_metrics, MlflowTracker._deliver

    def hooked_log(self, metrics, step):
        if step in actions:
            actions[step](self)
        seen["steps"].append(step)
        log_metrics(self, metrics, step)

    def timed_deliver(self):
        t0 = time.perf_counter()
        ok = deliver(self)
        seen["deliveries"].append((ok, time.perf_counter() - t0))
        return ok

    monkeypatch.setattr(MlflowTracker, "log_metrics", hooked_log)
    monkeypatch.setattr(MlflowTracker, "_deliver", timed_deliver)
    return seen


def _logged(result: TrainResult) -> dict[tuple[str, int], float]:
    """(key, step) → value of every finite metric the loop handed to the tracker."""
    return {
        (key, step): value
        for step, metrics in enumerate(result.history, start=1)
        for key, value in metrics.items()
        if math.isfinite(value)
    }


def _stored(uri: str, run_id: str, keys: set[str]) -> list[tuple[str, int, float]]:
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history
    return [(k, m.step, m.value) for k in sorted(keys) for m in history(run_id, k)]


@pytest.mark.slow
def test_server_stopped_and_restarted_mid_run_gets_every_step_exactly_once(
    tmp_path, mlflow_server: MlflowServer, monkeypatch
) -> None:
    before_stop: list[int] = []
    down_at = {}

    def stop(tracker: MlflowTracker) -> None:
        client = MlflowClient(tracking_uri=mlflow_server.uri)
        before_stop.extend(m.step for m in client.get_metric_history(tracker.run_id, "reward/mean"))
        mlflow_server.stop()
        down_at["t"] = time.monotonic()

    def restart(tracker: MlflowTracker) -> None:
        down_at["training_s"] = time.monotonic() - down_at["t"]
        mlflow_server.start()

    seen = _hook(monkeypatch, {STOP_AT: stop, RESTART_AT: restart})
    result = _train(tmp_path, mlflow_server.uri)

    assert len(result.history) == STEPS and seen["steps"] == list(range(1, STEPS + 1))
    assert before_stop == [1, 2, 3, 4]  # some metrics had arrived before the outage
    failed = [s for ok, s in seen["deliveries"] if not ok]
    assert len(failed) == 2  # the flushes at steps 6 and 8
    assert max(failed) < 5.0  # a flush to a down server gives up quickly
    logged = _logged(result)
    stored = _stored(mlflow_server.uri, result.run_id, {k for k, _ in logged})
    assert sorted((k, s) for k, s, _ in stored) == sorted(logged)  # every step, exactly once
    assert all(logged[(k, s)] == v for k, s, v in stored)
    run = MlflowClient(tracking_uri=mlflow_server.uri).get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert not (result.run_dir / tracking.UNDELIVERED_FILE).exists()
    print(
        f"\noutage: {len(logged)} metrics, {len(failed)} failed flushes of "
        f"{', '.join(f'{s:.2f}' for s in failed)} s, training went on "
        f"{down_at['training_s']:.1f} s with the server down; server starts took "
        f"{mlflow_server.start_s} s"
    )


@pytest.mark.slow
def test_server_down_until_the_end_lists_exactly_the_missing_metrics(
    tmp_path, mlflow_server: MlflowServer, monkeypatch
) -> None:
    monkeypatch.setattr(writer, "DELIVERY_TIMEOUT_S", 3.0)
    seen = _hook(monkeypatch, {STOP_AT: lambda tracker: mlflow_server.stop()})
    t0 = time.monotonic()
    result = _train(tmp_path, mlflow_server.uri)
    train_s = time.monotonic() - t0

    assert len(result.history) == STEPS and result.checkpoint is not None  # training finished
    assert result.checkpoint.name.endswith(str(STEPS)) or str(STEPS) in str(result.checkpoint)
    rows = [
        json.loads(line)
        for line in (result.run_dir / tracking.UNDELIVERED_FILE).read_text().splitlines()
    ]
    logged = _logged(result)
    missing = {(k, s): v for (k, s), v in logged.items() if s >= STOP_AT}
    assert len(rows) == len(missing)  # each one once
    assert {(r["key"], r["step"]): r["value"] for r in rows} == missing
    assert {r["run_id"] for r in rows} == {result.run_id}
    assert (result.run_dir / "samples.jsonl").is_file()  # the artifact upload failed; file kept

    mlflow_server.start()  # what did reach the store: exactly steps 1-4
    stored = _stored(mlflow_server.uri, result.run_id, {k for k, _ in logged})
    assert sorted((k, s) for k, s, _ in stored) == sorted(k for k in logged if k[1] < STOP_AT)
    failed = [s for ok, s in seen["deliveries"] if not ok]
    print(
        f"\ndown to the end: {len(rows)} of {len(logged)} metrics undelivered and listed; "
        f"{len(failed)} failed deliveries, longest {max(failed):.2f} s; train+close {train_s:.1f} s"
    )


def test_server_down_at_the_start_fails_before_training_in_one_line(tmp_path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as err:
        run_train(tmp_path, "tracking=mlflow", f"tracking.uri={uri}", "trainer.max_steps=2")
    message = str(err.value)
    assert "\n" not in message and len(message) < 300
    assert message.startswith(f"tracking: cannot start the MLflow run at {uri} (connection")
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert time.monotonic() - t0 < 120
