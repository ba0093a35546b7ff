"""The run's own lines in its log file: what the console prints also lands in `train.log`.

Hydra writes a job log into the run dir (`<run dir>/train.log`, its `hydra.job_logging` file
handler), but the trainer talks to a person through rich, not `logging`, so the file stayed empty.
`LoggedConsole` prints as rich does and hands a plain-text copy of each print (the plan box, status
and step lines, the summary, the resume hint) to the `bapo_cli.run` logger, which conf/train.yaml
routes to that file only (the console already showed it). Live progress-bar frames are not
copied: the step lines are the record.

Libraries talk on the console too, and only the tool's lines belong there (`quiet_libraries`):
MLflow's own loggers (`Creating initial MLflow database tables...` on a fresh store, through its
stderr handler) and the SQL migrations below it (alembic, SQLAlchemy), and warnings known to say
nothing a user can act on (torch's DDP deprecation of `broadcast_buffers`, which the trainer
passes on purpose: see bapo_cli.trainer.distributed) go to the run's log file only, as they
are, not dropped. Anything else still reaches the console.
"""

from __future__ import annotations

import io
import logging
import os
import re
import warnings
from typing import Any

from rich.console import Console
from rich.control import Control

LOGGER = "bapo_cli.run"
LOG_WIDTH = 120
"""Columns of the plain copy: tables as wide as a terminal; soft-wrapped lines stay whole."""

log = logging.getLogger(LOGGER)


class LoggedConsole(Console):
    """A rich Console whose every `print` also goes, as plain text, to the `bapo_cli.run` logger."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*objects, **kwargs)
        if self.quiet or not log.isEnabledFor(logging.INFO):
            return
        if objects and all(isinstance(o, Control) for o in objects):
            return  # a live display's cursor moves
        plain = Console(
            file=io.StringIO(), width=LOG_WIDTH, color_system=None, force_terminal=False
        )
        plain.print(*objects, **kwargs)
        for line in plain.file.getvalue().rstrip("\n").splitlines():
            log.info(line.rstrip())


NOISY_LOGGERS = {
    "mlflow": logging.INFO,
    "alembic": logging.INFO,  # the store's schema migrations
    "sqlalchemy": logging.WARNING,  # at INFO it would echo every SQL statement
    "huey": logging.WARNING,
}
"""The loggers MLflow sets up, and the level each is kept at: to the log file only."""

NOISY_WARNINGS = ((FutureWarning, re.compile(r"`broadcast_buffers` is deprecated")),)
"""(category, message pattern) of warnings that go to the log file only."""

LIBRARY_LOGGER = "bapo_cli.library"
"""Where those warnings are logged (to the run's log file only)."""


def _file_handlers() -> list[logging.Handler]:
    """The handlers of the root logger that write a file: Hydra's job log (`<run dir>/*.log`)."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def quiet_libraries() -> None:
    """Send `NOISY_LOGGERS` and `NOISY_WARNINGS` to this job's log file and not the console.

    Call it in the job, after Hydra has set up its logging. MLflow attaches its own stderr
    handler when it is imported (unless MLFLOW_CONFIGURE_LOGGING is false), so the variable is
    set first (a user's own setting wins) and the handlers are replaced as well, for an MLflow
    imported already. Idempotent."""
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    files = _file_handlers()
    for name, level in {**NOISY_LOGGERS, LIBRARY_LOGGER: logging.INFO}.items():
        logger = logging.getLogger(name)
        logger.handlers = list(files)  # none (no log file): dropped rather than shown
        logger.propagate = False
        logger.setLevel(level)
    if not getattr(warnings.showwarning, "bapo_quiet", False):
        warnings.showwarning = _show_warning(warnings.showwarning)


def _show_warning(shown: Any) -> Any:
    """`warnings.showwarning` that logs the known-noisy warnings and shows the rest as before."""

    def show(message: Any, category: type, filename: str, lineno: int, *rest: Any) -> None:
        if any(
            issubclass(category, kind) and pattern.search(str(message))
            for kind, pattern in NOISY_WARNINGS
        ):
            text = warnings.formatwarning(message, category, filename, lineno).rstrip()
            logging.getLogger(LIBRARY_LOGGER).warning(text)
            return
        shown(message, category, filename, lineno, *rest)

    show.bapo_quiet = True  # type: ignore[attr-defined]
    return show
