"""MLflow, the one tracking interface: writing a run (trainer) and reading runs back (`bapo runs`).

Metric keys are namespaced with `/` (design.md: reward/mean, actor/entropy, bapo/c_low, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bapo_cli.tracking import redact

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRow:
    run_id: str
    experiment: str
    name: str
    status: str
    start: str
    metrics: dict[str, float]


def sqlite_path(uri: str) -> Path | None:
    """The file behind a `sqlite:///...` URI, else None."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


ARTIFACTS_DIR = "mlartifacts"  # next to a SQLite store: outputs/mlflow.db -> outputs/mlartifacts


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite store, never in the cwd of
    whichever run created the experiment (MLflow's default, ./mlruns). None (the store decides)
    for a file store, which keeps them inside itself, and for a server, which has its own root."""
    path = sqlite_path(uri)
    return None if path is None else str(path.resolve().parent / ARTIFACTS_DIR)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Held while a process opens a SQLite store: the first to open a fresh store creates its
    tables (MLflow's schema migration), and two doing it at once fail ("table ... already
    exists"). The lock file sits beside the store; other URIs need no lock."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield


def open_experiment(uri: str, experiment: str) -> tuple[Any, str]:
    """(client, experiment id) with the store and the experiment created if missing, under the
    store's lock: what every writer (a single run, a sweep's launcher) does first."""
    from mlflow.tracking import MlflowClient

    with store_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        return client, ensure_experiment(client, experiment, artifact_location(uri))


def store_exists(uri: str) -> bool:
    """False for a local store that was never written (reading it would create it)."""
    path = sqlite_path(uri)
    if path is not None:
        return path.is_file()
    if uri.startswith("file:") or "://" not in uri:
        return Path(uri.removeprefix("file://").removeprefix("file:")).is_dir()
    return True


def list_runs(uri: str, experiment: str | None = None, limit: int = 50) -> list[RunRow]:
    """Newest runs first, across experiments unless one is named."""
    from datetime import datetime

    from mlflow.tracking import MlflowClient

    if not store_exists(uri):
        return []
    client = MlflowClient(tracking_uri=uri)
    experiments = client.search_experiments()
    if experiment is not None:
        experiments = [e for e in experiments if e.name == experiment]
    names = {e.experiment_id: e.name for e in experiments}
    if not names:
        return []
    runs = client.search_runs(
        list(names), order_by=["attributes.start_time DESC"], max_results=limit
    )
    return [
        RunRow(
            run_id=r.info.run_id,
            experiment=names[r.info.experiment_id],
            name=r.info.run_name or "",
            status=r.info.status,
            start=datetime.fromtimestamp(r.info.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S"),
            metrics=dict(r.data.metrics),
        )
        for r in runs
    ]


# ------------------------------------------------------------------------------------ writing


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
    """What the trainer logs through. `MlflowTracker` is real; `NullTracker` logs nothing."""

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


STEP_KEY = "reward/mean"  # logged every step; its history tells where a resumed run left off
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value (characters)
MAX_BATCH_PARAMS = 100  # MLflow's limit of params per log_batch call
MAX_BATCH_METRICS = 1000  # MLflow's limit of metrics per log_batch call

# ----------------------------------------------------------------------- delivery and outages
# A tracking outage must not stop training. A failed `log_batch` keeps its metrics (in order, with
# their original timestamps) and the next flush sends them again; MLflow's SQL store drops exact
# duplicates, so a batch that did arrive but whose answer was lost is not logged twice. `close`
# keeps trying for `DELIVERY_TIMEOUT_S`, then writes what is left to `UNDELIVERED_FILE` in the
# run dir and says how many metrics that is in one warning line.
DELIVERY_TIMEOUT_S = 30.0  # close(): how long to keep retrying a store that is down
RETRY_INTERVAL_S = 1.0  # close(): pause between attempts
UNDELIVERED_FILE = "undelivered_metrics.jsonl"  # one JSON object per metric never delivered
# A long outage must not grow memory without bound either: past `MAX_PENDING_METRICS` queued
# metrics, the oldest (whole steps) move to `SPILL_FILE` in the run dir, same records as
# `UNDELIVERED_FILE`, and are delivered from there first once the store answers (see
# `MlflowTracker._spill` for why that is exactly-once). Without a run dir they stay in memory.
MAX_PENDING_METRICS = 100_000  # metrics held in memory while the store is down (~25 MB)
SPILL_FILE = "pending_metrics.jsonl"  # append-only journal of spilled metrics, oldest first
SPILL_OFFSET_FILE = "pending_metrics.offset"  # byte offset of the journal's first undelivered line
JOURNAL_KEYS = {"run_id", "key", "value", "step", "timestamp"}  # a record, in both files
# MLflow's REST client retries a refused connection 7 times with exponential backoff and waits
# 120 s for an answer: minutes of stalled training per flush while a server is down. These apply
# to http(s) URIs unless the user set the variable (read by mlflow.utils.rest_utils on each call).
FAIL_FAST_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def fail_fast_http(uri: str) -> None:
    """Short HTTP retries and timeouts for a tracking server (the user's own settings win)."""
    if uri.startswith(("http://", "https://")):
        for name, value in FAIL_FAST_HTTP.items():
            os.environ.setdefault(name, value)
    hide_run_links(uri)


QUIET_LINKS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def hide_run_links(uri: str) -> None:
    """MLflow prints "View run ... at: <uri>/#/..." when a run on a server ends, credentials
    and all: not for a URI that holds any (the summary table names the run, masked)."""
    if redact.text(uri) != uri:
        os.environ[QUIET_LINKS] = "true"


def describe_failure(exc: BaseException) -> str:
    """One short line for a store error (MLflow's connection errors run to 400 characters, and
    name the URL, credentials included: masked here)."""
    text = redact.text(str(exc))
    for needle, short in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
    ):
        if needle in text:
            return short
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__


class MlflowTracker:
    """One MLflow run through `MlflowClient` (no global fluent state, so several runs can live in
    one process, as in a Hydra multirun). Metrics are buffered and sent with `log_batch` every
    `flush_every` steps: on SQLite that was ~13x faster than one call per step."""

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
        self.run_dir = run_dir
        self.delivery_timeout_s = (
            DELIVERY_TIMEOUT_S if delivery_timeout_s is None else delivery_timeout_s
        )
        self.failed_flushes = 0  # log_batch calls that failed (the store was down)
        self._down_since: float | None = None  # monotonic time of the first failure, while down
        self.uri = redact.text(uri)  # as shown in warnings; the client has the real one
        self.flush_every = flush_every
        self._pending: list[Any] = []  # queued metrics in memory, oldest first
        self.max_pending = MAX_PENDING_METRICS if max_pending is None else max_pending
        self._journal: Path | None = None  # SPILL_FILE while it holds undelivered metrics
        self._journal_offset = 0  # bytes of the journal already delivered
        self._journal_size = 0  # bytes of the journal that are whole records
        self._spilled = 0  # metrics in the journal past the offset (all older than _pending)
        self._warned_unbounded = False
        self._steps_since_flush = 0
        self.logged_until = -1  # steps at or below this are already in the store
        if run_id is not None:  # resume: the same run, reopened
            with store_lock(uri):
                self.client = MlflowClient(tracking_uri=uri)
                self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            history = self.client.get_metric_history(run_id, STEP_KEY)
            self.logged_until = max((m.step for m in history), default=-1)
        else:
            self.client, exp_id = open_experiment(uri, experiment)
            run = self.client.create_run(exp_id, run_name=run_name, tags=redact.params(tags or {}))
            self.run_id = run.info.run_id
        if run_dir is not None:
            self._recover_journal()

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        shown = redact.params(params)
        items = [Param(k, v[:MAX_PARAM_VALUE]) for k, v in shown.items()]
        for start in range(0, len(items), MAX_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_BATCH_PARAMS])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import math
        import time

        from mlflow.entities import Metric

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
            from_journal = self._spilled > 0
            if from_journal:
                read = self._read_journal(MAX_BATCH_METRICS)
                if read is None:  # unreadable: set aside, the rest goes on
                    continue
                chunk, end = read
            else:
                chunk = self._pending[:MAX_BATCH_METRICS]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
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
            if from_journal:
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

    # ---- the spill journal
    def _spill(self) -> None:
        """Move the oldest queued metrics to the journal so that at most `max_pending` stay in
        memory. Whole steps move (a step is never split between journal and memory), so the
        journal holds only steps older than any in memory.

        Why delivery from the journal is exactly-once, also across a crash:
        - The journal is append-only: `<run_dir>/pending_metrics.jsonl`, one record per line
          (the `undelivered_metrics.jsonl` format, original timestamps kept). Metrics leave
          memory only after their lines are written, so a failed write loses nothing.
        - `pending_metrics.offset` holds the byte offset of the first line not yet delivered. It
          is advanced (atomically: temporary file, then `os.replace`) only after `log_batch`
          accepted the chunk before it. A crash before the advance resends that chunk: exact
          duplicates (same key, value, step, timestamp), which MLflow's SQL store drops, as for
          any resent batch. A crash after it resends nothing; nothing is skipped either, since the
          offset never passes a line that was not accepted.
        - Fully delivered, the journal is deleted, then the offset file; a new journal ignores
          an offset file left from a crash between the two (`_start_journal` deletes it).
        - A crash mid-append leaves at most a partial last line: those metrics were still in
          memory (and are lost with it, as any metric queued in memory at a crash); it is cut
          off when the journal is read back (`_recover_journal`).
        A tracker that resumes the same run in the same run dir (`trainer.resume=true`) takes the
        journal over and delivers it first; its steps then count as logged, so the steps that
        training replays are not logged twice. A journal of another run goes to
        `undelivered_metrics.jsonl`. Not covered: a power cut (nothing is fsynced).
        """
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
        path = self._journal or Path(self.run_dir) / SPILL_FILE  # type: ignore[arg-type]
        data = "".join(json.dumps(self._record(m)) + "\n" for m in self._pending[:n]).encode()
        try:
            if self._journal is None:
                self._start_journal(path)
            with path.open("ab") as f:
                if f.seek(0, os.SEEK_END) != self._journal_size:
                    f.truncate(self._journal_size)  # the rest of an append that failed
                f.write(data)
                f.flush()
            self._journal_size += len(data)
        except OSError as exc:  # these metrics stay in memory; the next append cuts any rest
            if not self._warned_unbounded:
                self._warned_unbounded = True
                logger.warning(
                    "tracking: cannot spill metrics to %s (%s); they stay in memory, without a cap",
                    path,
                    exc.strerror or exc,
                )
            if self._spilled == 0:
                self._journal = None
            return
        if self._journal is None:
            self._journal = path
            logger.warning(
                "tracking: more than %d metrics waiting for %s; the oldest go to %s until it "
                "answers",
                self.max_pending,
                self.uri,
                path,
            )
        del self._pending[:n]
        self._spilled += n

    def _start_journal(self, path: Path) -> None:
        self._journal_offset = self._journal_size = 0  # the first append empties the file
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / SPILL_OFFSET_FILE).unlink(missing_ok=True)  # left by a crash: not ours

    def _record(self, m: Any) -> dict[str, Any]:
        record = {"run_id": self.run_id, "key": m.key, "value": m.value}
        record.update(step=m.step, timestamp=m.timestamp)
        return record

    @staticmethod
    def _journal_lines(path: Path, offset: int) -> Iterator[tuple[dict[str, Any], int]]:
        """(record, end offset) for each complete line from `offset` on."""
        with path.open("rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):  # a partial last line (a crash mid-append)
                    return
                offset += len(line)
                record = json.loads(line)
                if not isinstance(record, dict) or not record.keys() >= JOURNAL_KEYS:
                    raise ValueError(f"not a metric record at byte {offset - len(line)}")
                yield record, offset

    def _read_journal(self, limit: int) -> tuple[list[Any], int] | None:
        """Up to `limit` metrics from the journal's offset, and the offset after them; None (and
        one warning) if it cannot be read."""
        from mlflow.entities import Metric

        assert self._journal is not None
        chunk: list[Any] = []
        end = self._journal_offset
        error: BaseException = ValueError("it ends early")
        try:
            for r, line_end in self._journal_lines(self._journal, self._journal_offset):
                chunk.append(Metric(r["key"], float(r["value"]), int(r["timestamp"]), r["step"]))
                end = line_end
                if len(chunk) >= min(limit, self._spilled):
                    break
        except (OSError, ValueError, KeyError, TypeError) as exc:
            error = exc  # the lines before it still go; the next read stops here
        if chunk:
            return chunk, end
        self._set_journal_aside(error)
        return None

    def _set_journal_aside(self, error: BaseException) -> None:
        """Stop using a journal that cannot be read: renamed aside if it is still there (the
        metrics in memory go on), with one warning."""
        assert self._journal is not None
        aside = self._journal.with_name(f"{SPILL_FILE}.unreadable.{int(time.time())}")
        try:
            self._journal.replace(aside)
            where = f"moved to {aside}"
        except FileNotFoundError:
            where = "lost (the file is gone)"
        except OSError:
            where = "left there"
        with contextlib.suppress(OSError):
            (self._journal.parent / SPILL_OFFSET_FILE).unlink()
        logger.warning(
            "tracking: %d spilled metrics in %s cannot be read (%s); %s",
            self._spilled,
            self._journal,
            describe_failure(error),
            where,
        )
        self._journal, self._journal_offset, self._journal_size, self._spilled = None, 0, 0, 0

    def _advance_journal(self, end: int, delivered: int) -> None:
        """Record that the journal is delivered up to byte `end`; delete it once all is."""
        assert self._journal is not None
        self._journal_offset = end
        self._spilled -= delivered
        offset_file = self._journal.parent / SPILL_OFFSET_FILE
        try:
            if self._spilled == 0:
                self._journal.unlink(missing_ok=True)
                offset_file.unlink(missing_ok=True)
            else:
                tmp = offset_file.with_name(offset_file.name + ".tmp")
                tmp.write_text(f"{end}\n", encoding="utf-8")
                os.replace(tmp, offset_file)
        except OSError:  # the offset stays in memory; after a crash, resent chunks are dropped
            pass
        if self._spilled == 0:
            self._journal, self._journal_offset, self._journal_size = None, 0, 0

    def _recover_journal(self) -> None:
        """A journal left in the run dir by a process that crashed: taken over if it is this
        run's (a resume), else its metrics go to `undelivered_metrics.jsonl`."""
        assert self.run_dir is not None
        path = Path(self.run_dir) / SPILL_FILE
        offset_file = path.parent / SPILL_OFFSET_FILE
        if not path.is_file():
            with contextlib.suppress(OSError):  # a stale one, or a run dir that cannot exist
                offset_file.unlink(missing_ok=True)
            return
        try:
            offset = int(offset_file.read_text(encoding="utf-8"))
            if not 0 <= offset <= path.stat().st_size:
                raise ValueError(offset)
        except (OSError, ValueError):
            offset = 0  # from the start: delivered chunks are resent and dropped by the store
        count, last_step, end, run_ids = 0, -1, offset, set()
        try:
            for r, line_end in self._journal_lines(path, offset):
                count, last_step, end = count + 1, max(last_step, int(r["step"])), line_end
                run_ids.add(r["run_id"])
            with path.open("r+b") as f:
                f.truncate(end)  # a partial last line: its metrics died with that process
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._journal, self._spilled = path, count
            self._set_journal_aside(exc)
            return
        self._journal, self._journal_offset, self._spilled = path, offset, count
        self._journal_size = end
        if count == 0:
            self._advance_journal(end, 0)
        elif run_ids == {self.run_id}:
            self.logged_until = max(self.logged_until, last_step)
            logger.warning(
                "tracking: %d metrics an earlier process spilled to %s are delivered first",
                count,
                path,
            )
        else:
            self._write_undelivered()

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
                        self.client.set_terminated(self.run_id, status=status)
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
                lines = self._journal_lines(self._journal, self._journal_offset)
                for n, (record, _) in enumerate(lines):
                    if n >= self._spilled:
                        break
                    yield record
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._set_journal_aside(exc)
        for m in self._pending:
            yield self._record(m)

    def _write_undelivered(self) -> None:
        """Append every undelivered metric (the journal's, then memory's) to `UNDELIVERED_FILE`
        once, delete the journal, and say so in one warning."""
        steps = sorted({r["step"] for r in self._queued_records()})
        count = self._spilled + len(self._pending)  # after an unreadable journal was set aside
        journal = self._journal
        run_dir = self.run_dir if self.run_dir is not None else journal and journal.parent
        where = "lost (no run dir given)"
        if run_dir and count:
            path = Path(run_dir) / UNDELIVERED_FILE
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a", encoding="utf-8") as f:
                    for record in self._queued_records():
                        f.write(json.dumps(record) + "\n")
                where = f"written to {path}"
                if journal is not None:
                    self._advance_journal(self._journal_size, self._spilled)  # deletes it
            except OSError as exc:
                where = f"lost: cannot write {path} ({exc.strerror or exc})"
                if journal is not None:
                    where += f"; {self._spilled} of them stay in {journal}"
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
        self._journal, self._journal_offset, self._journal_size, self._spilled = None, 0, 0, 0


def ensure_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created if missing (tolerating a concurrent creator)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


# ------------------------------------------------------------------------------------- sweeps
# A multirun is one parent MLflow run (created by the launching process) with one child run per
# job. The parent's id reaches every job through this environment variable, which the CLI sets
# with `hydra.job.env_set`, so it works for every launcher (in-process, joblib workers, SLURM).
PARENT_RUN_ENV = "BAPO_PARENT_RUN_ID"
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests runs by
OVERRIDES_TAG = "bapo.overrides"  # the job's Hydra overrides, space-separated
SWEEP_DIR_TAG = "bapo.sweep_dir"  # absolute sweep directory (parent and children)
JOB_NUM_TAG = "bapo.job_num"
ROLE_TAG = "bapo.role"  # "sweep" on a parent run


def job_tags(
    overrides: list[str], sweep_dir: str | None, job_num: int | None, parent_run_id: str | None
) -> dict[str, str]:
    """Tags that place one job's run in its sweep (the job's overrides label it in reports,
    secrets masked)."""
    tags = {OVERRIDES_TAG: " ".join(redact.overrides(overrides))}
    if sweep_dir is not None:
        tags[SWEEP_DIR_TAG] = sweep_dir
    if job_num is not None:
        tags[JOB_NUM_TAG] = str(job_num)
    if parent_run_id:
        tags[PARENT_TAG] = parent_run_id
    return tags


def start_parent_run(uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """Create the store, the experiment and the sweep's parent run, before any job starts.

    Jobs that start at once on a fresh SQLite store race in MLflow's schema migration and fail;
    once this process has created the store and the experiment they only add rows. Tag values
    are masked (`redact.params`): `bapo.command` holds the command line as typed.
    """
    hide_run_links(uri)
    client, exp_id = open_experiment(uri, experiment)
    run = client.create_run(
        exp_id, run_name=run_name, tags=redact.params({ROLE_TAG: "sweep", **tags})
    )
    return run.info.run_id


def finish_parent_run(uri: str, run_id: str, status: str = "FINISHED") -> str | None:
    """Close the parent run; tag it with the sweep dir its children recorded (returned)."""
    from mlflow.tracking import MlflowClient

    hide_run_links(uri)
    client = MlflowClient(tracking_uri=uri)
    sweep_dirs = {r.data.tags.get(SWEEP_DIR_TAG) for r in child_runs(client, run_id)} - {None}
    sweep_dir = sorted(sweep_dirs)[0] if sweep_dirs else None
    if sweep_dir is not None:
        client.set_tag(run_id, SWEEP_DIR_TAG, sweep_dir)
    client.set_terminated(run_id, status=status)
    return sweep_dir


def child_runs(client: Any, parent_run_id: str) -> list[Any]:
    """The runs whose `mlflow.parentRunId` is this run, by job number."""
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        max_results=10_000,
    )
    return sorted(runs, key=lambda r: int(r.data.tags.get(JOB_NUM_TAG, "0") or 0))


def make_tracker(backend: str, uri: str, experiment: str, **kwargs: Any) -> Tracker:
    if backend == "none":
        return NullTracker()
    return MlflowTracker(uri, experiment, **kwargs)
