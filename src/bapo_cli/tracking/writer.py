"""Writing one run: the `Tracker` the trainer and `bapo eval` log through; `BufferedTracker`,
which keeps training going through a tracking outage whatever the backend; and `MlflowTracker`.
W&B and TensorBoard (wandb_tracker.py, tensorboard_tracker.py) are `BufferedTracker`s too, so an
outage of any of them behaves the same way.

A failed send (MLflow: `log_batch`; W&B: `run.log`; TensorBoard: the event file) keeps its
metrics (in order, with their original timestamps) and the next flush sends them again; MLflow's
SQL store drops exact duplicates, so a batch that did arrive but whose answer was lost is not
logged twice. `close` keeps trying for `DELIVERY_TIMEOUT_S`, then writes what is left to
`undelivered_metrics.jsonl` in the run dir and says how many metrics that is in one warning
line. A long outage must not grow memory without bound either: past `MAX_PENDING_METRICS` queued
metrics, the oldest (whole steps) move to the spill journal in the run dir (spill.py, which says
why that is exactly-once) and are delivered from there first once the store answers. Without a
run dir they stay in memory. Each backend has its own journal and undelivered file
(spill.py: `spill_files`).

Metric keys are namespaced with `/` (design.md: reward/mean, actor/entropy, bapo/c_low, ...).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from bapo_cli import redact
from bapo_cli.tracking.server import describe_failure, fail_fast_http, logger
from bapo_cli.tracking.spill import (
    READ_ERRORS,
    Metric,
    SpillJournal,
    record,
    spill_files,
    write_undelivered,
)
from bapo_cli.tracking.store import open_experiment, store_lock

STEP_KEY = "reward/mean"  # logged every step; its history tells where a resumed run left off
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value (characters)
MAX_BATCH_PARAMS = 100  # MLflow's limit of params per log_batch call
MAX_BATCH_METRICS = 1000  # MLflow's limit of metrics per log_batch call
DELIVERY_TIMEOUT_S = 30.0  # close(): how long to keep retrying a store that is down
RETRY_INTERVAL_S = 1.0  # close(): pause between attempts
MAX_PENDING_METRICS = 100_000  # metrics held in memory while the store is down (~25 MB)


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested config → {"algo.rho0": "0.4", ...}, the shape MLflow params take."""
    out: dict[str, str] = {}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    out[prefix.rstrip(".")] = str(tree)
    return out


class Tracker(Protocol):
    """What the trainer logs through: `MlflowTracker`, `WandbTracker`, `TensorBoardTracker`,
    several at once (`FanoutTracker`), or `NullTracker`, which logs nothing."""

    run_id: str | None

    def log_params(self, params: dict[str, str]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def flush(self) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    run_id: str | None = None

    def log_params(self, params: dict[str, str]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


class BufferedTracker:
    """Metrics queued and delivered in order, through any outage of the backend: a subclass
    says how to send a chunk (`_send`, raises while the backend is down) and how to end the run
    (`_end`); `backend` names it (journal files, warnings), `uri` is where it sends, as shown.
    A subclass's `__init__` sets `run_id`, may set `logged_until` (a resume), then calls
    `_start_buffer`."""

    backend = ""
    run_id: str | None = None
    uri = ""
    logged_until = -1  # steps at or below this are already in the backend (set on a resume)

    def _start_buffer(
        self,
        *,
        flush_every: int = 10,
        run_dir: Path | None = None,
        delivery_timeout_s: float | None = None,
        max_pending: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.delivery_timeout_s = (
            DELIVERY_TIMEOUT_S if delivery_timeout_s is None else delivery_timeout_s
        )
        self.failed_flushes = 0  # sends that failed (the backend was down)
        self._down_since: float | None = None  # monotonic time of the first failure, while down
        self.flush_every = flush_every
        self._pending: list[Any] = []  # queued metrics in memory, oldest first
        self.max_pending = MAX_PENDING_METRICS if max_pending is None else max_pending
        self._journal: SpillJournal | None = None  # while it holds undelivered metrics
        self._warned_unbounded = False
        self._steps_since_flush = 0
        self._spill_file, self._undelivered_file = spill_files(self.backend)
        if run_dir is not None:
            self._recover_journal()

    def _send(self, chunk: list[Metric]) -> None:
        """Deliver `chunk` (oldest first) or raise; what raised is sent again later."""
        raise NotImplementedError

    def _end(self, status: str) -> None:
        """End the run once every metric is delivered (`status`: FINISHED, FAILED, KILLED)."""
        raise NotImplementedError

    @property
    def _spilled(self) -> int:
        """Metrics in the journal (all older than any in memory)."""
        return self._journal.count if self._journal is not None else 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.logged_until:  # replayed after a resume: the store already has it
            return
        now = int(time.time() * 1000)
        self._pending += [
            Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))
        ]
        self._steps_since_flush += 1
        if self._steps_since_flush >= self.flush_every:
            self.flush()
        if len(self._pending) > self.max_pending:
            self._spill()

    def flush(self) -> None:
        """Send the buffered metrics; if the store is down, keep them for the next flush."""
        self._steps_since_flush = 0
        self._deliver()

    def _deliver(self) -> bool:
        """Send queued metrics oldest first (the journal, then memory); True once none is left.
        Never raises."""
        sent = 0
        while self._spilled or self._pending:
            journal = self._journal if self._spilled else None
            if journal is not None:
                read = journal.read(MAX_BATCH_METRICS)
                if read is None:  # unreadable: set aside, the rest goes on
                    self._journal = None
                    continue
                chunk, end = read
            else:
                chunk = self._pending[:MAX_BATCH_METRICS]
            try:
                self._send(chunk)
            except Exception as exc:  # any store failure: training goes on, metrics stay queued
                self.failed_flushes += 1
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning(
                        "tracking: %s not reachable (%s); keeping %d metrics and retrying at the "
                        "next flush, training goes on",
                        self.uri,
                        describe_failure(exc),
                        self._spilled + len(self._pending),
                    )
                return False
            if journal is not None:
                self._advance_journal(end, len(chunk))
            else:
                del self._pending[: len(chunk)]
            sent += len(chunk)
        if self._down_since is not None:
            logger.warning(
                "tracking: %s back after %.0f s; %d buffered metrics delivered",
                self.uri,
                time.monotonic() - self._down_since,
                sent,
            )
            self._down_since = None
        return True

    def _advance_journal(self, end: int, delivered: int) -> None:
        assert self._journal is not None
        self._journal.advance(end, delivered)
        if self._journal.count == 0:  # delivered in full: the files are gone
            self._journal = None

    def _spill(self) -> None:
        """Move the oldest queued metrics to the journal so that at most `max_pending` stay in
        memory. Whole steps move (a step is never split between journal and memory), so the
        journal holds only steps older than any in memory (spill.py: why exactly-once)."""
        excess = len(self._pending) - self.max_pending
        if excess <= 0:
            return
        if self.run_dir is None and self._journal is None:
            if not self._warned_unbounded:
                self._warned_unbounded = True
                logger.warning(
                    "tracking: %d metrics waiting for %s and no run dir to spill them to; they "
                    "stay in memory, without a cap",
                    len(self._pending),
                    self.uri,
                )
            return
        n = excess
        while n < len(self._pending) and self._pending[n].step == self._pending[n - 1].step:
            n += 1
        journal = self._journal or SpillJournal(Path(self.run_dir) / self._spill_file)  # type: ignore[arg-type]
        try:
            if self._journal is None:
                journal.start()
            journal.append([record(self.run_id, m) for m in self._pending[:n]])
        except OSError as exc:  # these metrics stay in memory; the next append cuts any rest
            if not self._warned_unbounded:
                self._warned_unbounded = True
                logger.warning(
                    "tracking: cannot spill metrics to %s (%s); they stay in memory, without a cap",
                    journal.path,
                    exc.strerror or exc,
                )
            if self._spilled == 0:
                self._journal = None
            return
        if self._journal is None:
            self._journal = journal
            logger.warning(
                "tracking: more than %d metrics waiting for %s; the oldest go to %s until it "
                "answers",
                self.max_pending,
                self.uri,
                journal.path,
            )
        del self._pending[:n]

    def _recover_journal(self) -> None:
        """A journal left in the run dir by a process that crashed: taken over if it is this
        run's (a resume), else its metrics go to `undelivered_metrics.jsonl`."""
        assert self.run_dir is not None
        found = SpillJournal.recover(self.run_dir, self._spill_file)
        if found is None:
            return
        self._journal, last_step, run_ids = found
        if run_ids == {self.run_id}:
            self.logged_until = max(self.logged_until, last_step)
            logger.warning(
                "tracking: %d metrics an earlier process spilled to %s are delivered first",
                self._journal.count,
                self._journal.path,
            )
        else:
            self._write_undelivered()

    def close(self, status: str = "FINISHED") -> None:
        """Deliver what is pending and end the run, retrying a down store for a bounded time;
        what is still undelivered then goes to `<run_dir>/undelivered_metrics.jsonl` (also on
        Ctrl-C). The run is ended only once all its metrics are in."""
        deadline = time.monotonic() + self.delivery_timeout_s
        error: BaseException | None = None
        try:
            while True:
                if self._deliver():
                    try:
                        self._end(status)
                        return
                    except Exception as exc:
                        error = exc
                if time.monotonic() >= deadline:
                    break
                time.sleep(max(min(RETRY_INTERVAL_S, deadline - time.monotonic()), 0.0))
            if not (self._pending or self._spilled) and error is not None:
                logger.warning(
                    "tracking: run %s could not be ended in %s (%s); it stays RUNNING there",
                    self.run_id,
                    self.uri,
                    describe_failure(error),
                )
        finally:
            if self._pending or self._spilled:
                self._write_undelivered()

    def _queued_records(self) -> Iterator[dict[str, Any]]:
        """Every undelivered metric as a record, oldest first: the journal's, then memory's. A
        journal that cannot be read is set aside (one warning) and the rest still comes."""
        if self._journal is not None and self._spilled:
            try:
                yield from self._journal.records()
            except READ_ERRORS as exc:
                self._journal.set_aside(exc)
                self._journal = None
        for m in self._pending:
            yield record(self.run_id, m)

    def _write_undelivered(self) -> None:
        """Append every undelivered metric (the journal's, then memory's) to
        `undelivered_metrics.jsonl` once, delete the journal, and say so in one warning."""
        steps = sorted({r["step"] for r in self._queued_records()})
        count = self._spilled + len(self._pending)  # after an unreadable journal was set aside
        journal = self._journal
        run_dir = self.run_dir if self.run_dir is not None else journal and journal.path.parent
        where = "lost (no run dir given)"
        if run_dir and count:
            path = Path(run_dir) / self._undelivered_file
            try:
                write_undelivered(path, self._queued_records())
                where = f"written to {path}"
                if journal is not None:
                    self._advance_journal(journal.size, journal.count)  # deletes it
            except OSError as exc:
                where = f"lost: cannot write {path} ({exc.strerror or exc})"
                if journal is not None:
                    where += f"; {journal.count} of them stay in {journal.path}"
        if count:
            logger.warning(
                "tracking: %d metrics of steps %d-%d (%d steps) not delivered to %s; %s; the run "
                "stays RUNNING there",
                count,
                steps[0],
                steps[-1],
                len(steps),
                self.uri,
                where,
            )
        self._pending = []
        self._journal = None


class MlflowTracker(BufferedTracker):
    """One MLflow run through `MlflowClient` (no global fluent state, so several runs can live in
    one process, as in a Hydra multirun). Metrics are buffered and sent with `log_batch` every
    `flush_every` steps: on SQLite that was ~13x faster than one call per step."""

    backend = "mlflow"

    def __init__(
        self,
        uri: str,
        experiment: str,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        flush_every: int = 10,
        run_dir: Path | None = None,  # where undelivered metrics are written at close
        delivery_timeout_s: float | None = None,  # None: DELIVERY_TIMEOUT_S
        max_pending: int | None = None,  # metrics kept in memory; None: MAX_PENDING_METRICS
    ) -> None:
        from mlflow.tracking import MlflowClient

        fail_fast_http(uri)
        self.uri = redact.text(uri)  # as shown in warnings; the client has the real one
        if run_id is not None:  # resume: the same run, reopened
            with store_lock(uri):
                self.client = MlflowClient(tracking_uri=uri)
                self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            history = self.client.get_metric_history(run_id, STEP_KEY)
            self.logged_until = max((m.step for m in history), default=-1)
        else:
            self.client, exp_id = open_experiment(uri, experiment)
            shown = redact.text(run_name) if run_name else run_name  # made of free-form fields
            run = self.client.create_run(exp_id, run_name=shown, tags=redact.params(tags or {}))
            self.run_id = run.info.run_id
        self._start_buffer(
            flush_every=flush_every,
            run_dir=run_dir,
            delivery_timeout_s=delivery_timeout_s,
            max_pending=max_pending,
        )

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        shown = redact.params(params)
        items = [Param(k, v[:MAX_PARAM_VALUE]) for k, v in shown.items()]
        for start in range(0, len(items), MAX_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_BATCH_PARAMS])

    def _send(self, chunk: list[Metric]) -> None:
        from mlflow.entities import Metric as MlflowMetric

        metrics = [MlflowMetric(m.key, m.value, m.timestamp, m.step) for m in chunk]
        self.client.log_batch(self.run_id, metrics=metrics)

    def _end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    def log_text(self, text: str, artifact_file: str) -> None:
        try:
            self.client.log_text(self.run_id, text, artifact_file)
        except Exception as exc:  # an artifact the store missed is not worth the training run
            logger.warning("tracking: %s not uploaded (%s)", artifact_file, describe_failure(exc))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as exc:  # the file stays in the run dir
            logger.warning("tracking: %s not uploaded (%s)", path, describe_failure(exc))
