"""Ctrl-C during training: the first one stops cleanly, the second at once.

A demo or a study interrupted by Ctrl-C should leave something to continue from. The first SIGINT
only asks the loop to stop: the step in progress finishes, a checkpoint is written, the MLflow run
is closed KILLED, the summary and the command that resumes the run are printed. A second SIGINT
raises KeyboardInterrupt where the program is (the run is still closed KILLED and an async
generation worker stopped, by the trainer's `finally`).

Only the main thread of a process whose SIGINT handler is Python's default takes this over: a
launcher or a test harness that installed its own keeps it. Under torchrun the agent handles
signals for all ranks, so data-parallel runs keep the default as well (`enabled=False`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

FIRST = "Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again stops at once)"
SECOND = "Ctrl-C again: stopping now (this step is not saved)"


class GracefulStop:
    """A context that turns the first SIGINT into `requested = True` (and says so)."""

    def __init__(self, say: Callable[[str], None], *, enabled: bool = True) -> None:
        self.say = say
        self.enabled = enabled
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> GracefulStop:
        if (
            self.enabled
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.__exit__()
            self.say(SECOND)
            raise KeyboardInterrupt
        self.requested = True
        self.say(FIRST)
