"""The tracker's delivery path against a store that fails: nothing raises, nothing is lost or
logged twice, and what never arrives is listed in the run dir. Fast: a SQLite store behind a
switch that makes every call fail as a refused HTTP connection does."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from bapo_cli.tracking import MlflowTracker, writer

REFUSED = (
    "API request to http://127.0.0.1:1/api/2.0/mlflow/runs/log-batch failed with exception "
    "HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded (Caused by "
    "NewConnectionError('Failed to establish a new connection: [Errno 111] Connection refused'))"
)


class Switch:
    """Wraps a client: while `down`, every call raises; `lose_answers` applies the call, then
    raises (the store got the batch, the answer was lost)."""

    def __init__(self, client: MlflowClient) -> None:
        self.client = client
        self.down = False
        self.lose_answers = False
        self.failures = 0

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)

        def call(*args, **kwargs):
            if self.down:
                self.failures += 1
                raise MlflowException(REFUSED)
            out = attr(*args, **kwargs)
            if self.lose_answers:
                self.failures += 1
                raise MlflowException("API request failed: Read timed out.")
            return out

        return call


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module (creating one costs seconds); each test has its own run."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/m.db"


def _tracker(uri: str, tmp_path: Path, **kwargs) -> tuple[MlflowTracker, Switch, str]:
    tracker = MlflowTracker(uri, "faults", run_dir=tmp_path / "run", **kwargs)
    switch = Switch(tracker.client)
    tracker.client = switch
    return tracker, switch, uri


def _metrics(step: int) -> dict[str, float]:
    return {"reward/mean": step / 10, "actor/entropy": 1.0 + step, "perf/step_s": 0.5}


def _ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bapo_cli.tracking"]


def _steps(uri: str, run_id: str, key: str = "reward/mean") -> list[int]:
    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def test_outage_mid_run_loses_nothing_and_logs_nothing_twice(store, tmp_path, caplog) -> None:
    tracker, switch, uri = _tracker(store, tmp_path, flush_every=2)
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        for step in range(1, 5):
            tracker.log_metrics(_metrics(step), step)
        switch.down = True
        for step in range(5, 12):  # the flushes after steps 6, 8, 10 fail; none raises
            tracker.log_metrics(_metrics(step), step)
        tracker.flush()
        assert switch.failures == 4 and tracker.failed_flushes == 4
        assert _steps(uri, tracker.run_id) == [1, 2, 3, 4]
        switch.down = False
        tracker.log_metrics(_metrics(12), 12)
        tracker.close()
    for key in _metrics(1):
        assert _steps(uri, tracker.run_id, key) == list(range(1, 13)), key
    history = MlflowClient(tracking_uri=uri).get_metric_history(tracker.run_id, "actor/entropy")
    assert {m.step: m.value for m in history} == {s: 1.0 + s for s in range(1, 13)}
    assert MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.status == "FINISHED"
    lines = _ours(caplog)
    assert len(lines) == 2, lines  # one when it went down, one when it came back
    assert "not reachable (connection refused)" in lines[0] and "back after" in lines[1]
    assert not (tmp_path / "run" / tracking.UNDELIVERED_FILE).exists()


def test_a_batch_whose_answer_was_lost_is_resent_without_duplicates(store, tmp_path) -> None:
    tracker, switch, uri = _tracker(store, tmp_path, flush_every=1)
    switch.lose_answers = True
    tracker.log_metrics(_metrics(1), 1)  # stored, but the tracker saw a timeout: kept
    switch.lose_answers = False
    tracker.log_metrics(_metrics(2), 2)  # resends step 1 with its original timestamp
    tracker.close()
    assert _steps(uri, tracker.run_id) == [1, 2]  # MLflow's SQL store dropped the exact copy


def test_chunks_go_in_order_and_a_failed_chunk_keeps_the_rest(store, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(writer, "MAX_BATCH_METRICS", 3)
    tracker, switch, uri = _tracker(store, tmp_path, flush_every=100)
    for step in range(1, 5):
        tracker.log_metrics(_metrics(step), step)  # 12 metrics: 4 chunks of 3
    sent: list[int] = []
    real = switch.client.log_batch

    def second_chunk_fails(run_id, metrics=(), **kwargs):
        if len(sent) == 1 and not getattr(second_chunk_fails, "failed", False):
            second_chunk_fails.failed = True
            raise MlflowException(REFUSED)
        sent.append(metrics[0].step)
        return real(run_id, metrics=metrics, **kwargs)

    switch.client.log_batch = second_chunk_fails
    tracker.flush()
    assert len(tracker._pending) == 9 and sent == [1]
    tracker.close()
    assert sent == [1, 2, 3, 4]
    assert _steps(uri, tracker.run_id) == [1, 2, 3, 4]


def test_store_down_at_close_writes_exactly_the_undelivered_metrics(
    store, tmp_path, caplog
) -> None:
    tracker, switch, uri = _tracker(store, tmp_path, flush_every=3, delivery_timeout_s=0.5)
    for step in range(1, 4):
        tracker.log_metrics(_metrics(step), step)
    switch.down = True
    for step in range(4, 9):
        tracker.log_metrics(_metrics(step), step)
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        t0 = time.perf_counter()
        tracker.close("FINISHED")
        close_s = time.perf_counter() - t0
    assert 0.5 <= close_s < 2.0
    path = tmp_path / "run" / tracking.UNDELIVERED_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["key"], r["step"]) for r in rows] == [
        (k, s) for s in range(4, 9) for k in _metrics(s)
    ]  # in the order they were logged
    assert all(r["value"] == _metrics(r["step"])[r["key"]] for r in rows)
    assert {r["run_id"] for r in rows} == {tracker.run_id}
    assert _steps(uri, tracker.run_id) == [1, 2, 3]  # delivered + undelivered = everything
    last = _ours(caplog)[-1]
    assert "15 metrics of steps 4-8 (5 steps) not delivered" in last and str(path) in last
    assert "\n" not in last


def test_store_back_during_close_delivers_and_ends_the_run(store, tmp_path, monkeypatch) -> None:
    tracker, switch, uri = _tracker(store, tmp_path, flush_every=100, delivery_timeout_s=10)
    tracker.log_metrics(_metrics(1), 1)
    switch.down = True
    calls = 0
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # the store comes back after the second retry
        nonlocal calls
        calls += 1
        switch.down = calls < 2
        real_sleep(min(seconds, 0.01))

    monkeypatch.setattr(writer.time, "sleep", sleep)
    tracker.close()
    assert calls == 2
    assert _steps(uri, tracker.run_id) == [1]
    assert MlflowClient(tracking_uri=uri).get_run(tracker.run_id).info.status == "FINISHED"
    assert not (tmp_path / "run" / tracking.UNDELIVERED_FILE).exists()


def test_without_a_run_dir_the_loss_is_still_counted(store, tmp_path, caplog) -> None:
    tracker, switch, _ = _tracker(store, tmp_path, delivery_timeout_s=0)
    tracker.run_dir = None
    tracker.log_metrics(_metrics(1), 1)
    switch.down = True
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        tracker.close()
    last = _ours(caplog)[-1]
    assert "3 metrics of steps 1-1 (1 steps) not delivered" in last
    assert "lost (no run dir given)" in last


def test_artifacts_that_cannot_be_uploaded_only_warn(store, tmp_path, caplog) -> None:
    tracker, switch, _ = _tracker(store, tmp_path)
    (tmp_path / "samples.jsonl").write_text("{}\n")
    switch.down = True
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        tracker.log_artifact(tmp_path / "samples.jsonl")
        tracker.log_text("a: 1\n", "config.yaml")
    assert [line.split(" not uploaded")[0] for line in _ours(caplog)] == [
        f"tracking: {tmp_path / 'samples.jsonl'}",
        "tracking: config.yaml",
    ]


@pytest.mark.parametrize("uri", ["http://127.0.0.1:1", "https://example.invalid"])
def test_fail_fast_http_fills_in_only_what_the_user_left_unset(uri, monkeypatch) -> None:
    from mlflow import environment_variables as mlflow_env

    for name in tracking.FAIL_FAST_HTTP:
        assert getattr(mlflow_env, name).name == name  # the names mlflow really reads
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the user's own choice
    tracking.fail_fast_http(uri)
    assert mlflow_env.MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 5
    assert mlflow_env.MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get() == 0
    assert mlflow_env.MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 10


def test_local_stores_keep_mlflow_defaults(monkeypatch) -> None:
    import os

    for name in tracking.FAIL_FAST_HTTP:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    tracking.fail_fast_http("sqlite:///x.db")
    tracking.fail_fast_http("file:/tmp/mlruns")
    assert not any(name in os.environ for name in tracking.FAIL_FAST_HTTP)


def test_a_refused_connection_fails_in_well_under_a_second(monkeypatch) -> None:
    """MLflow's defaults retry a refused connection for minutes; ours give up at once."""
    from mlflow.entities import Metric

    from tests.faults.conftest import free_port

    for name in tracking.FAIL_FAST_HTTP:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    uri = f"http://127.0.0.1:{free_port()}"
    tracking.fail_fast_http(uri)
    client = MlflowClient(tracking_uri=uri)
    t0 = time.perf_counter()
    with pytest.raises(MlflowException):
        client.log_batch("0" * 32, metrics=[Metric("a", 1.0, 0, 1)])
    assert time.perf_counter() - t0 < 2.0
