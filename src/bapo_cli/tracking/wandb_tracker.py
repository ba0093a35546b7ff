"""A W&B run (`tracking.backends` has wandb): the same params, metrics and files as the MLflow
run, through the same buffered delivery (writer.BufferedTracker).

- Params go to the run's config, masked (redact.params) and with numbers, booleans and null
  read back from their text so W&B can filter and group on them; tags become `key=value` tags.
- Metrics go with `run.log(row, step=step)`, one row per step, the last row committed at each
  flush. W&B keeps steps monotonic and drops a row for a step below the run's current one, so
  a row resent after a failed `run.log` whose data did arrive, or replayed after a resume, is
  not logged twice.
- The SDK queues rows in its own process and keeps them in the run's transaction log,
  `<run dir>/wandb/<run>/run-<id>.wandb`: while the W&B server is down training goes on and
  `wandb sync` uploads what the SDK could not. What the SDK itself refuses (its process gone)
  stays queued here and ends in `undelivered_metrics.wandb.jsonl`, as for MLflow.
- The SDK records the command line in the run's metadata: it is masked (redact.overrides)
  while the run starts, so `tracking.uri=http://user:pass@host` does not reach W&B. Console
  capture is off: only what bapo logs on purpose, masked, goes to W&B.
- The API key is W&B's own (`wandb login`, $WANDB_API_KEY); mode offline ($WANDB_MODE or
  `tracking.wandb.mode=offline`) needs none.
"""

from __future__ import annotations

import ast
import contextlib
import shutil
import sys
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

from bapo_cli import redact
from bapo_cli.tracking.server import describe_failure, logger
from bapo_cli.tracking.spill import Metric
from bapo_cli.tracking.writer import BufferedTracker

MAX_TAG = 64  # W&B's limit on a tag's length


def typed(value: str) -> Any:
    """A flattened param's text as the value it was ("0.4" -> 0.4, "None" -> None); other text,
    lists included, stays text."""
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value
    return parsed if parsed is None or isinstance(parsed, bool | int | float) else value


@contextlib.contextmanager
def masked_argv() -> Iterator[None]:
    """`sys.argv` with secrets masked while W&B reads it into the run's metadata."""
    real = sys.argv
    sys.argv = real[:1] + redact.overrides(list(real[1:]))
    try:
        yield
    finally:
        sys.argv = real


class WandbTracker(BufferedTracker):
    """One W&B run, created (or, with `run_id`, resumed) at construction; `wandb.init` raising
    means the run did not start."""

    backend = "wandb"

    def __init__(
        self,
        *,
        project: str,
        entity: str | None = None,
        mode: str | None = None,  # online | offline; None: $WANDB_MODE, else online
        run_name: str | None = None,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        run_dir: Path | None = None,  # the SDK's files go to <run_dir>/wandb unless $WANDB_DIR
        flush_every: int = 10,
        delivery_timeout_s: float | None = None,
        max_pending: int | None = None,
    ) -> None:
        import os

        import wandb

        shown = redact.params(tags or {})
        sdk_dir = None if run_dir is None or os.environ.get("WANDB_DIR") else str(run_dir)
        if sdk_dir is not None:
            Path(sdk_dir).mkdir(parents=True, exist_ok=True)
        init = dict(
            project=project,
            entity=entity,
            mode=mode,
            name=redact.text(run_name) if run_name else None,  # free-form fields
            id=run_id,
            resume="allow" if run_id is not None else None,
            tags=[f"{k}={v}"[:MAX_TAG] for k, v in shown.items()],
            dir=sdk_dir,
            reinit="create_new",  # several runs per process (a multirun), like MlflowClient
            settings=wandb.Settings(console="off"),
        )
        with masked_argv():
            try:
                self.run = wandb.init(**init)
            except Exception as exc:
                # The process's W&B service died under an earlier run (killed, OOM): the SDK
                # keeps its dead connection in its process-wide setup (and its address in
                # $WANDB_SERVICE) and every later init fails. Forget both (wandb.teardown
                # would talk to the dead service) so init starts a fresh service; once.
                if type(exc).__name__ not in ("MailboxClosedError", "WandbServiceConnectionError"):
                    raise
                from wandb.sdk import wandb_setup
                from wandb.sdk.lib.service import service_token

                service_token.clear_service_in_env()
                wandb_setup._singleton = None
                self.run = wandb.init(**init)
        self.run_id = self.run.id
        self._row_open = False  # a step's row sent but not committed yet
        where = f"{entity}/" if entity else ""
        self.uri = f"W&B {where}{project}"  # as shown in warnings
        self._start_buffer(
            flush_every=flush_every,
            run_dir=run_dir,
            delivery_timeout_s=delivery_timeout_s,
            max_pending=max_pending,
        )

    def log_params(self, params: dict[str, str]) -> None:
        shown = redact.params(params)
        self.run.config.update({k: typed(v) for k, v in shown.items()}, allow_val_change=True)

    def _send(self, chunk: list[Metric]) -> None:
        for step, rows in groupby(chunk, key=lambda m: m.step):
            self.run.log({m.key: m.value for m in rows}, step=step)
            self._row_open = True

    def _deliver(self) -> bool:
        """Deliver what is queued, then commit the last row: W&B holds a step's row open until a
        later step arrives (a step split over two chunks still lands in one row), and a row
        still open when the SDK's process dies is lost with it. Never raises."""
        delivered = super()._deliver()
        if delivered and self._row_open:
            with contextlib.suppress(Exception):  # the SDK is gone: the next send says so
                self.run.log({}, commit=True)
                self._row_open = False
        return delivered

    def _end(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)

    def log_text(self, text: str, artifact_file: str) -> None:
        """A file in the run's files (`<run>/files/<artifact_file>`), uploaded with the run."""
        try:
            self._save(artifact_file, lambda dest: dest.write_text(text, encoding="utf-8"))
        except Exception as exc:  # an artifact W&B missed is not worth the training run
            logger.warning(
                "tracking: %s not saved to W&B (%s)", artifact_file, describe_failure(exc)
            )

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """A copy of the file in the run's files (under `artifact_path` if given)."""
        name = Path(path).name
        where = f"{artifact_path.strip('/')}/{name}" if artifact_path else name
        try:
            self._save(where, lambda dest: shutil.copyfile(path, dest))
        except Exception as exc:  # the file stays in the run dir
            logger.warning("tracking: %s not saved to W&B (%s)", path, describe_failure(exc))

    def _save(self, relative: str, write: Any) -> None:
        dest = Path(self.run.dir) / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        write(dest)
        self.run.save(str(dest), base_path=self.run.dir, policy="now")
