"""TensorBoard event files (`tracking.backends` has tensorboard): the same params, metrics and
files as the MLflow run, through the same buffered delivery (writer.BufferedTracker).

- Metrics are scalars under their own keys (`reward/mean`: TensorBoard groups the charts by the
  part before `/`), at the training step, with the time they were logged (wall time).
- Params (masked: redact.params) and tags are one markdown table each in the Text tab
  (`params`, `tags`); text files (`config.yaml`) are text summaries too, and files
  (`samples.jsonl`) are copied beside the event files, so a log dir moved elsewhere keeps them.
- The writer is torch's `SummaryWriter`; it writes on a thread whose failure (a full disk, the
  directory gone) surfaces at the next flush, which `_send` calls: the chunk then stays queued,
  a new event file is opened at the next try, and what never gets written ends in
  `undelivered_metrics.tensorboard.jsonl`, as for MLflow. A chunk whose write failed half way
  may show some points twice when it is written again.
- A resume (`trainer.resume=true`, same run dir) finds the event files already there and, like
  MLflow, does not log again the steps they hold (read back with TensorBoard's own
  EventAccumulator). So `tracking.tensorboard.log_dir` must be one directory per run: the log
  dir names its run (checks.RUN_MARKER), and a run whose log dir holds another run's event files
  is refused (at config preflight, and here at start for jobs of one sweep).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from bapo_cli import redact
from bapo_cli.tracking import checks
from bapo_cli.tracking.server import describe_failure, logger
from bapo_cli.tracking.spill import Metric
from bapo_cli.tracking.writer import STEP_KEY, BufferedTracker


def last_step(log_dir: Path, key: str = STEP_KEY) -> int:
    """The last step of `key` in the event files of `log_dir` (not its subdirectories); -1 if
    there are none."""
    if not any(log_dir.glob("events.out.tfevents.*")):
        return -1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    if key not in events.Tags()["scalars"]:
        return -1
    return max(e.step for e in events.Scalars(key))


def markdown_table(values: dict[str, str]) -> str:
    """`| key | value |` rows, the way TensorBoard's Text tab shows a table."""
    rows = [f"| {k} | {str(v).replace('|', '&#124;')} |" for k, v in sorted(values.items())]
    return "\n".join(["| key | value |", "|---|---|", *rows])


class TensorBoardTracker(BufferedTracker):
    """Event files in `log_dir`; no run id (the directory is the run)."""

    backend = "tensorboard"

    def __init__(
        self,
        log_dir: Path,
        *,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        run_dir: Path | None = None,  # where undelivered metrics are written at close
        flush_every: int = 10,
        delivery_timeout_s: float | None = None,
        max_pending: int | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.uri = f"TensorBoard {self.log_dir}"  # as shown in warnings
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if run_dir is not None:
            self._claim(Path(run_dir))
        self.logged_until = last_step(self.log_dir)
        self._writer: Any = None
        self._open()  # fails here, before any step, if the directory cannot be written
        shown = redact.params({"run_name": run_name or "", **(tags or {})})
        self._write_text("tags", markdown_table(shown))
        self._start_buffer(
            flush_every=flush_every,
            run_dir=run_dir,
            delivery_timeout_s=delivery_timeout_s,
            max_pending=max_pending,
        )

    def _claim(self, run_dir: Path) -> None:
        """Refuse a log dir whose event files another run wrote (it would log nothing: their
        steps count as logged; config preflight says so before the model loads, this catches
        two jobs of one sweep), then name this run in it (checks.RUN_MARKER)."""
        owner = checks.run_of(self.log_dir)
        if checks.foreign_events_error(self.log_dir, run_dir, resume=True) is not None:
            raise FileExistsError(
                f"it holds the event files of the run in {owner}; one directory per run"
            )
        if owner is None or not checks.same_dir(owner, run_dir):
            (self.log_dir / checks.RUN_MARKER).write_text(f"{os.path.realpath(run_dir)}\n")

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def _write_text(self, tag: str, text: str) -> None:
        """A text summary at step 0, on disk when this returns (raises if it is not)."""
        writer = self._open()
        writer.add_text(tag, text, global_step=0)
        writer.flush()

    def log_params(self, params: dict[str, str]) -> None:
        self._write_text("params", markdown_table(redact.params(params)))

    def _send(self, chunk: list[Metric]) -> None:
        try:
            writer = self._open()
            for m in chunk:
                writer.add_scalar(m.key, m.value, global_step=m.step, walltime=m.timestamp / 1000)
            writer.flush()  # raises what the writer's thread failed with
        except Exception:
            self._drop_writer()  # a failed writer stays failed: the next try opens a new file
            raise

    def _drop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            # the same failure again; the events it held are still queued here
            with contextlib.suppress(Exception):
                writer.close()

    def _end(self, status: str) -> None:
        writer = self._open()
        writer.flush()
        writer.close()
        self._writer = None

    def close(self, status: str = "FINISHED") -> None:
        try:
            super().close(status)
        finally:
            self._drop_writer()

    def log_text(self, text: str, artifact_file: str) -> None:
        """A text summary named after the file, its lines indented (markdown code)."""
        try:
            self._write_text(artifact_file, "\n".join("    " + line for line in text.splitlines()))
        except Exception as exc:  # a file TensorBoard missed is not worth the training run
            self._drop_writer()
            logger.warning(
                "tracking: %s not written to %s (%s)",
                artifact_file,
                self.uri,
                describe_failure(exc),
            )

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """A copy of the file beside the event files (under `artifact_path` if given)."""
        dest_dir = self.log_dir / artifact_path if artifact_path else self.log_dir
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest_dir / Path(path).name)
        except OSError as exc:  # the file stays in the run dir
            logger.warning("tracking: %s not copied to %s (%s)", path, dest_dir, exc.strerror)
