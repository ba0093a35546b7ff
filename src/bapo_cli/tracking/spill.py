"""The spill journal: where a tracker's oldest undelivered metrics wait on disk during a long
outage, so memory stays bounded, and the file of metrics that were never delivered.

Why delivery from the journal is exactly-once, also across a crash:
- The journal is append-only: `<run_dir>/pending_metrics.jsonl`, one record per line (the
  `undelivered_metrics.jsonl` format, original timestamps kept). Metrics leave the tracker's
  memory only after their lines are written, so a failed write loses nothing.
- `pending_metrics.offset` holds the byte offset of the first line not yet delivered. It is
  advanced (atomically: temporary file, then `os.replace`) only after `log_batch` accepted the
  chunk before it. A crash before the advance resends that chunk: exact duplicates (same key,
  value, step, timestamp), which MLflow's SQL store drops, as for any resent batch. A crash
  after it resends nothing; nothing is skipped either, since the offset never passes a line
  that was not accepted.
- Fully delivered, the journal is deleted, then the offset file; a new journal ignores an
  offset file left from a crash between the two (`SpillJournal.start` deletes it).
- A crash mid-append leaves at most a partial last line: those metrics were still in memory
  (and are lost with it, as any metric queued in memory at a crash); it is cut off when the
  journal is read back (`SpillJournal.recover`).
A tracker that resumes the same run in the same run dir (`trainer.resume=true`) takes the
journal over and delivers it first; its steps then count as logged, so the steps that training
replays are not logged twice. A journal of another run goes to `undelivered_metrics.jsonl`.
Not covered: a power cut (nothing is fsynced).

Each backend keeps its own files (`spill_files`): MLflow the names above, W&B
`pending_metrics.wandb.jsonl` / `.offset` and `undelivered_metrics.wandb.jsonl`, and so on, so
two backends that are down at once never share a journal.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from bapo_cli.tracking.server import describe_failure, logger

UNDELIVERED_FILE = "undelivered_metrics.jsonl"  # one JSON object per metric never delivered
SPILL_FILE = "pending_metrics.jsonl"  # append-only journal of spilled metrics, oldest first
SPILL_OFFSET_FILE = "pending_metrics.offset"  # byte offset of the journal's first undelivered line
JOURNAL_KEYS = {"run_id", "key", "value", "step", "timestamp"}  # a record, in both files
# what reading a journal can fail with: the lines before the failure still count
READ_ERRORS = (OSError, ValueError, KeyError, TypeError)


class Metric(NamedTuple):
    """One queued metric, whatever the backend (the fields of MLflow's `Metric`)."""

    key: str
    value: float
    timestamp: int  # ms since the epoch, when it was logged (kept through every resend)
    step: int


def spill_files(backend: str) -> tuple[str, str]:
    """(journal, undelivered file) names of one backend in a run dir: MLflow's keep the names
    they always had; every other backend's carry its name (`pending_metrics.wandb.jsonl`)."""
    if backend == "mlflow":
        return SPILL_FILE, UNDELIVERED_FILE
    return f"pending_metrics.{backend}.jsonl", f"undelivered_metrics.{backend}.jsonl"


def record(run_id: str | None, metric: Any) -> dict[str, Any]:
    """A queued `Metric` as a journal line's JSON object."""
    out = {"run_id": run_id, "key": metric.key, "value": metric.value}
    out.update(step=metric.step, timestamp=metric.timestamp)
    return out


def write_undelivered(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append records to `path` (`<run_dir>/undelivered_metrics.jsonl`); raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def journal_lines(path: Path, offset: int) -> Iterator[tuple[dict[str, Any], int]]:
    """(record, end offset) for each complete line from `offset` on."""
    with path.open("rb") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith(b"\n"):  # a partial last line (a crash mid-append)
                return
            offset += len(line)
            r = json.loads(line)
            if not isinstance(r, dict) or not r.keys() >= JOURNAL_KEYS:
                raise ValueError(f"not a metric record at byte {offset - len(line)}")
            yield r, offset


class SpillJournal:
    """One journal file in use: `count` undelivered records from byte `offset` on, `size` bytes
    of whole records. The tracker owns at most one and drops it once `count` is 0."""

    def __init__(self, path: Path, *, offset: int = 0, size: int = 0, count: int = 0) -> None:
        self.path = path
        self.offset = offset  # bytes already delivered
        self.size = size  # bytes that are whole records
        self.count = count  # records past the offset (all older than the tracker's memory)

    @property
    def offset_file(self) -> Path:
        """`pending_metrics.offset` beside `pending_metrics.jsonl` (`SPILL_OFFSET_FILE`)."""
        return self.path.with_suffix(".offset")

    def start(self) -> None:
        """Make this the run dir's new journal (its first append empties any old file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.offset_file.unlink(missing_ok=True)  # left by a crash: not ours
        self.offset = self.size = 0

    def append(self, records: list[dict[str, Any]]) -> None:
        """Write whole records after the last whole one (cutting off the rest of an append that
        failed); raises OSError, and then nothing counts as written."""
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        with self.path.open("ab") as f:
            if f.seek(0, os.SEEK_END) != self.size:
                f.truncate(self.size)  # the rest of an append that failed
            f.write(data)
            f.flush()
        self.size += len(data)
        self.count += len(records)

    def read(self, limit: int) -> tuple[list[Any], int] | None:
        """Up to `limit` metrics from the offset, and the offset after them; None (and the
        journal set aside, with one warning) if it cannot be read."""
        chunk: list[Any] = []
        end = self.offset
        error: BaseException = ValueError("it ends early")
        try:
            for r, line_end in journal_lines(self.path, self.offset):
                chunk.append(Metric(r["key"], float(r["value"]), int(r["timestamp"]), r["step"]))
                end = line_end
                if len(chunk) >= min(limit, self.count):
                    break
        except READ_ERRORS as exc:
            error = exc  # the lines before it still go; the next read stops here
        if chunk:
            return chunk, end
        self.set_aside(error)
        return None

    def records(self) -> Iterator[dict[str, Any]]:
        """The undelivered records, oldest first (raises one of READ_ERRORS)."""
        for n, (r, _) in enumerate(journal_lines(self.path, self.offset)):
            if n >= self.count:
                break
            yield r

    def set_aside(self, error: BaseException) -> None:
        """Stop using a journal that cannot be read: renamed aside if it is still there (the
        metrics in memory go on), with one warning."""
        aside = self.path.with_name(f"{self.path.name}.unreadable.{int(time.time())}")
        try:
            self.path.replace(aside)
            where = f"moved to {aside}"
        except FileNotFoundError:
            where = "lost (the file is gone)"
        except OSError:
            where = "left there"
        with contextlib.suppress(OSError):
            self.offset_file.unlink()
        logger.warning(
            "tracking: %d spilled metrics in %s cannot be read (%s); %s",
            self.count,
            self.path,
            describe_failure(error),
            where,
        )
        self.offset, self.size, self.count = 0, 0, 0

    def advance(self, end: int, delivered: int) -> None:
        """Record that the journal is delivered up to byte `end`; delete it once all is."""
        self.offset = end
        self.count -= delivered
        try:
            if self.count == 0:
                self.path.unlink(missing_ok=True)
                self.offset_file.unlink(missing_ok=True)
            else:
                tmp = self.offset_file.with_name(self.offset_file.name + ".tmp")
                tmp.write_text(f"{end}\n", encoding="utf-8")
                os.replace(tmp, self.offset_file)
        except OSError:  # the offset stays in memory; after a crash, resent chunks are dropped
            pass
        if self.count == 0:
            self.offset, self.size = 0, 0

    @classmethod
    def recover(
        cls, run_dir: Path, name: str = SPILL_FILE
    ) -> tuple[SpillJournal, int, set[str]] | None:
        """A journal (`name`) left in the run dir by a process that crashed: (journal, its last
        step, the run ids in it), cut to whole records; None if there is none with records (one
        that cannot be read is set aside, with one warning)."""
        path = Path(run_dir) / name
        offset_file = path.with_suffix(".offset")
        if not path.is_file():
            with contextlib.suppress(OSError):  # a stale one, or a run dir that cannot exist
                offset_file.unlink(missing_ok=True)
            return None
        try:
            offset = int(offset_file.read_text(encoding="utf-8"))
            if not 0 <= offset <= path.stat().st_size:
                raise ValueError(offset)
        except (OSError, ValueError):
            offset = 0  # from the start: delivered chunks are resent and dropped by the store
        count, last_step, end, run_ids = 0, -1, offset, set()
        try:
            for r, line_end in journal_lines(path, offset):
                count, last_step, end = count + 1, max(last_step, int(r["step"])), line_end
                run_ids.add(r["run_id"])
            with path.open("r+b") as f:
                f.truncate(end)  # a partial last line: its metrics died with that process
        except READ_ERRORS as exc:
            cls(path, count=count).set_aside(exc)
            return None
        journal = cls(path, offset=offset, size=end, count=count)
        if count == 0:
            journal.advance(end, 0)  # deletes it
            return None
        return journal, last_step, run_ids
