"""The run's own lines in its log file: what the console prints also lands in `train.log`.

Hydra writes a job log into the run dir (`<run dir>/train.log`, its `hydra.job_logging` file
handler), but the trainer talks to a person through rich, not `logging`, so the file stayed empty.
`LoggedConsole` prints as rich does and hands a plain-text copy of each print (the plan box, status
and step lines, the summary, the resume hint) to the `bapo_cli.run` logger, which conf/train.yaml
routes to that file only (the console already showed it). Live progress-bar frames are not
copied: the step lines are the record.
"""

from __future__ import annotations

import io
import logging
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
