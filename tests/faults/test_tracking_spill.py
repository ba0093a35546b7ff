"""A long tracking outage keeps memory bounded: past `max_pending` queued metrics the oldest whole
steps move to a journal in the run dir, which is delivered first (exactly once, in step order)
when the store is back, taken over by a resume after a crash, or listed in
`undelivered_metrics.jsonl` at close. Fast: the switchable SQLite store of
test_tracking_delivery.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from bapo_cli.tracking import MlflowTracker, writer
from tests.faults.test_tracking_delivery import REFUSED, Switch, _metrics, _ours, _steps

CAP = 50  # metrics in memory; _metrics() gives 3 per step
KEYS = list(_metrics(1))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/m.db"


class Accepted:
    """The client's log_batch, recording what the store accepted; call numbers in `fail` (counted
    while the switch is up) raise as a refused connection would."""

    def __init__(self, switch: Switch, fail: tuple[int, ...] = ()) -> None:
        self.real = switch.client.log_batch
        self.fail = set(fail)
        self.calls = 0
        self.metrics: list[tuple[str, int]] = []
        switch.client.log_batch = self

    def __call__(self, run_id, metrics=(), **kwargs):
        self.calls += 1
        if self.calls in self.fail:
            raise MlflowException(REFUSED)
        out = self.real(run_id, metrics=metrics, **kwargs)
        self.metrics += [(m.key, m.step) for m in metrics]
        return out


def _tracker(uri: str, run_dir: Path, **kwargs) -> tuple[MlflowTracker, Switch]:
    kwargs = {"max_pending": CAP, **kwargs}
    tracker = MlflowTracker(uri, "faults", run_dir=run_dir, **kwargs)
    switch = Switch(tracker.client)
    tracker.client = switch
    return tracker, switch


def _log(tracker: MlflowTracker, steps: range) -> None:
    """Log `steps`, checking after each that memory holds at most the cap."""
    for step in steps:
        tracker.log_metrics(_metrics(step), step)
        assert len(tracker._pending) <= tracker.max_pending, step


def _journal(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / tracking.SPILL_FILE).read_text().splitlines()]


def _no_journal(run_dir: Path) -> bool:
    return (
        not (run_dir / tracking.SPILL_FILE).exists()
        and not (run_dir / tracking.SPILL_OFFSET_FILE).exists()
    )


def _every_step_once(uri: str, run_id: str, steps: range) -> None:
    client = MlflowClient(tracking_uri=uri)
    for key in KEYS:
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(steps), key  # a duplicate shows here
        assert all(m.value == _metrics(m.step)[key] for m in history), key


def test_a_long_outage_spills_whole_old_steps_and_delivers_each_once_in_order(
    store, tmp_path, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(writer, "MAX_BATCH_METRICS", 7)  # the journal goes in many chunks
    run_dir = tmp_path / "run"
    tracker, switch = _tracker(store, run_dir, flush_every=2)
    accepted = Accepted(switch)
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        _log(tracker, range(1, 5))
        switch.down = True
        _log(tracker, range(5, 61))  # 168 metrics queued: 50 in memory at most
        journal = _journal(run_dir)
        assert len(journal) + len(tracker._pending) == 3 * 56 and len(tracker._pending) <= CAP
        spilled = [r["step"] for r in journal]
        assert spilled == [s for s in range(5, spilled[-1] + 1) for _ in KEYS]  # whole, oldest
        assert [(r["key"], r["value"]) for r in journal[:3]] == list(_metrics(5).items())
        assert {r["run_id"] for r in journal} == {tracker.run_id}
        assert tracker._pending[0].step == spilled[-1] + 1  # memory: only newer steps
        assert _steps(store, tracker.run_id) == [1, 2, 3, 4]
        switch.down = False
        _log(tracker, range(61, 63))  # the flush after step 62 delivers all of it
        assert _no_journal(run_dir) and not tracker._pending
        _log(tracker, range(63, 71))
        tracker.close()
    delivered = [step for _, step in accepted.metrics]
    assert delivered == sorted(delivered)  # oldest first: journal, then memory
    assert sorted(accepted.metrics) == sorted((k, s) for s in range(1, 71) for k in KEYS)
    _every_step_once(store, tracker.run_id, range(1, 71))
    assert not (run_dir / tracking.UNDELIVERED_FILE).exists()
    lines = _ours(caplog)
    assert len(lines) == 3, lines  # down, spilling, back
    assert "not reachable" in lines[0] and "back after" in lines[2]
    assert f"more than {CAP} metrics waiting" in lines[1]
    assert str(run_dir / tracking.SPILL_FILE) in lines[1]


def test_spilled_metrics_whose_answer_was_lost_are_resent_without_duplicates(
    store, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(writer, "MAX_BATCH_METRICS", 10)
    run_dir = tmp_path / "run"
    tracker, switch = _tracker(store, run_dir, flush_every=100)
    switch.down = True
    _log(tracker, range(1, 31))  # 90 metrics, 40 or more on disk
    assert len(_journal(run_dir)) >= 40
    switch.down = False
    switch.lose_answers = True
    tracker.flush()  # the first journal chunk is stored, but the tracker saw a timeout
    assert len(_journal(run_dir)) >= 40 and not (run_dir / tracking.SPILL_OFFSET_FILE).exists()
    switch.lose_answers = False
    tracker.close()
    _every_step_once(store, tracker.run_id, range(1, 31))
    assert _no_journal(run_dir) and not (run_dir / tracking.UNDELIVERED_FILE).exists()


def test_store_never_back_lists_exactly_the_missing_metrics_once(store, tmp_path, caplog) -> None:
    run_dir = tmp_path / "run"
    tracker, switch = _tracker(store, run_dir, flush_every=3, delivery_timeout_s=0.2)
    _log(tracker, range(1, 4))
    switch.down = True
    _log(tracker, range(4, 41))
    assert len(_journal(run_dir)) > 0
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        tracker.close()
    path = run_dir / tracking.UNDELIVERED_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["key"], r["step"]) for r in rows] == [(k, s) for s in range(4, 41) for k in KEYS]
    assert all(r["value"] == _metrics(r["step"])[r["key"]] for r in rows)
    assert {r["run_id"] for r in rows} == {tracker.run_id}
    assert _steps(store, tracker.run_id) == [1, 2, 3]
    assert _no_journal(run_dir) and not tracker._pending
    last = _ours(caplog)[-1]
    assert "111 metrics of steps 4-40 (37 steps) not delivered" in last and str(path) in last


def test_a_crash_mid_delivery_then_a_resume_delivers_the_rest_once(
    store, tmp_path, monkeypatch, caplog
) -> None:
    """The journal outlives a crash: the resumed tracker delivers it from the saved offset
    (resending a chunk whose offset was not saved, which the store drops), a partial last line
    is cut off, and steps the journal holds are not logged again when training replays them."""
    monkeypatch.setattr(writer, "MAX_BATCH_METRICS", 9)
    run_dir = tmp_path / "run"
    tracker, switch = _tracker(store, run_dir, flush_every=2)
    _log(tracker, range(1, 3))
    switch.down = True
    _log(tracker, range(3, 41))
    journal = _journal(run_dir)
    last_spilled = journal[-1]["step"]
    switch.down = False
    accepted = Accepted(switch, fail=(4,))  # journal chunks 1-3 go, the 4th fails
    tracker.flush()
    assert accepted.metrics == [(r["key"], r["step"]) for r in journal[:27]]
    offsets = [len(line) + 1 for line in (run_dir / tracking.SPILL_FILE).read_text().split("\n")]
    assert int((run_dir / tracking.SPILL_OFFSET_FILE).read_text()) == sum(offsets[:27])
    # the crash: the process dies before saving the offset after chunk 3, mid-append, and with
    # the metrics of steps after `last_spilled` in memory only
    (run_dir / tracking.SPILL_OFFSET_FILE).write_text(f"{sum(offsets[:18])}\n")
    with (run_dir / tracking.SPILL_FILE).open("a") as f:
        f.write('{"run_id": "' + tracker.run_id + '", "key": "reward/me')
    run_id = tracker.run_id
    del tracker

    checkpoint = 10  # training resumes after its last checkpoint and replays from step 11
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        resumed, switch = _tracker(store, run_dir, flush_every=2, run_id=run_id)
    assert resumed.logged_until == last_spilled
    assert resumed._spilled == len(journal) - 18
    accepted = Accepted(switch)
    _log(resumed, range(checkpoint + 1, 41))
    resumed.close()
    assert accepted.metrics[:9] == [(r["key"], r["step"]) for r in journal[18:27]]  # resent
    assert sorted(accepted.metrics) == sorted(
        [(r["key"], r["step"]) for r in journal[18:]]
        + [(k, s) for s in range(last_spilled + 1, 41) for k in KEYS]
    )
    _every_step_once(store, resumed.run_id, range(1, 41))
    assert _no_journal(run_dir) and not (run_dir / tracking.UNDELIVERED_FILE).exists()
    assert f"{len(journal) - 18} metrics an earlier process spilled" in _ours(caplog)[0]


def test_a_journal_left_by_another_run_goes_to_the_undelivered_file(store, tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [
        {"run_id": "0" * 32, "key": k, "value": v, "step": 7, "timestamp": 1}
        for k, v in _metrics(7).items()
    ]
    (run_dir / tracking.SPILL_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / tracking.SPILL_OFFSET_FILE).write_text(f"{len(json.dumps(rows[0])) + 1}\n")
    tracker, _ = _tracker(store, run_dir)
    assert _no_journal(run_dir) and tracker.logged_until == -1
    path = run_dir / tracking.UNDELIVERED_FILE
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[1:]
    tracker.close()


def test_without_a_run_dir_memory_grows_and_one_warning_says_so(store, tmp_path, caplog) -> None:
    tracker, switch = _tracker(store, tmp_path / "run", max_pending=10, delivery_timeout_s=0)
    tracker.run_dir = None
    switch.down = True
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        for step in range(1, 21):
            tracker.log_metrics(_metrics(step), step)
        assert len(tracker._pending) == 60
        tracker.close()
    unbounded = [line for line in _ours(caplog) if "no run dir to spill" in line]
    assert len(unbounded) == 1 and "they stay in memory, without a cap" in unbounded[0]
    assert "60 metrics of steps 1-20 (20 steps)" in _ours(caplog)[-1]
    assert not (tmp_path / "run").exists()


def test_the_default_cap() -> None:
    assert tracking.MAX_PENDING_METRICS == 100_000
    assert MlflowTracker.__init__.__kwdefaults__["max_pending"] is None


class _DiskFullAfterHalf:
    """An append that writes half its bytes, then fails as a full disk does."""

    def __init__(self, f) -> None:
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def seek(self, *args):
        return self.f.seek(*args)

    def truncate(self, size):
        return self.f.truncate(size)

    def flush(self) -> None:
        self.f.flush()

    def write(self, data: bytes) -> int:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")


def test_a_failed_append_keeps_its_metrics_in_memory_and_no_partial_record(
    store, tmp_path, monkeypatch, caplog
) -> None:
    run_dir = tmp_path / "run"
    tracker, switch = _tracker(store, run_dir, flush_every=100)
    switch.down = True
    _log(tracker, range(1, 18))  # the first spill: step 1
    assert [r["step"] for r in _journal(run_dir)] == [1, 1, 1]
    real_open = Path.open

    def full_disk(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return _DiskFullAfterHalf(f) if self.name == tracking.SPILL_FILE and mode == "ab" else f

    monkeypatch.setattr(Path, "open", full_disk)
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        tracker.log_metrics(_metrics(18), 18)
    monkeypatch.undo()
    assert len(tracker._pending) == CAP + 1 and tracker._pending[0].step == 2  # nothing lost
    assert "cannot spill metrics" in _ours(caplog)[-1]
    assert not (run_dir / tracking.SPILL_FILE).read_text().endswith("\n")  # half a record
    _log(tracker, range(19, 21))  # the next append cuts it off first
    assert [r["step"] for r in _journal(run_dir)] == [s for s in range(1, 5) for _ in KEYS]
    switch.down = False
    tracker.close()
    _every_step_once(store, tracker.run_id, range(1, 21))
    assert _no_journal(run_dir)


def test_a_journal_removed_under_the_tracker_is_reported_and_the_rest_delivered(
    store, tmp_path, caplog
) -> None:
    run_dir = tmp_path / "run"
    tracker, switch = _tracker(store, run_dir, flush_every=100)
    switch.down = True
    _log(tracker, range(1, 21))
    on_disk = {r["step"] for r in _journal(run_dir)}
    (run_dir / tracking.SPILL_FILE).unlink()
    switch.down = False
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        tracker.close()  # does not raise
    [line] = [line for line in _ours(caplog) if "cannot be read" in line]
    assert f"{3 * len(on_disk)} spilled metrics in" in line and "lost (the file is gone)" in line
    _every_step_once(store, tracker.run_id, range(max(on_disk) + 1, 21))
    assert MlflowClient(tracking_uri=store).get_run(tracker.run_id).info.status == "FINISHED"


def test_a_run_dir_that_cannot_be_written_keeps_metrics_in_memory(store, tmp_path, caplog) -> None:
    (tmp_path / "file").write_text("")
    tracker, switch = _tracker(store, tmp_path / "file" / "run", max_pending=10)
    switch.down = True
    with caplog.at_level(logging.WARNING, logger="bapo_cli.tracking"):
        for step in range(1, 11):
            tracker.log_metrics(_metrics(step), step)  # does not raise
    assert len(tracker._pending) == 30
    [line] = [line for line in _ours(caplog) if "cannot spill" in line]
    assert "they stay in memory, without a cap" in line
    switch.down = False
    tracker.close()
    _every_step_once(store, tracker.run_id, range(1, 11))
