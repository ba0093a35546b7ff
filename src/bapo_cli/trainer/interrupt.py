"""Stopping a training run on a signal: Ctrl-C, SIGTERM and SIGUSR1 leave something to resume.

SIGTERM is how SLURM ends a job at its time limit (SIGKILL follows after KillWait, 30 s by
default), how `docker stop`, Kubernetes and `timeout` stop a process; SLURM's
`--signal=USR1@N` sends SIGUSR1 N seconds before the limit. All three ask the loop to stop as
the first Ctrl-C always did: the step in progress finishes, a checkpoint is written, the MLflow
run is closed KILLED, the summary and the command that resumes the run are printed, and the
process exits 128 + the signal (130, 143, 138).

Bounded: SIGTERM and SIGUSR1 start a grace (`trainer.stop_grace_s`, 20 s by default, so the
save still fits in SLURM's 30 s) for the step to end. A step that cannot end in time is
abandoned instead, by `StepAbandoned` raised where the step is:
- at the signal, when the step is still generating and the previous step's duration says it
  would not end within the grace (abandoning at once leaves the whole kill wait to the save);
- before the step's first optimizer update, for the same reason (the trainer asks
  `would_overrun`): up to there the weights and optimizer are those of the last completed step;
- when the grace runs out (SIGALRM), wherever the step is.
Abandoned before its updates, the step leaves the last completed step intact and the trainer
saves that; abandoned during its updates (half-applied: the weights are no step's), nothing more
is saved and the run resumes from the newest checkpoint on disk. Raised from a signal handler,
it can land inside library code that turns it into another error (`GracefulStop.meant` still
recognises it, as it does a second Ctrl-C's KeyboardInterrupt). Ctrl-C starts no grace: a
person at the terminal decides, and a second Ctrl-C raises KeyboardInterrupt at once (the run
is still closed KILLED by the trainer's `finally`). A repeated SIGTERM or SIGUSR1 changes
nothing: SLURM and torchrun's agent may each deliver one.

Phases (set by the trainer): SETUP (building the model: nothing to save yet, so a signal stops
at once), IDLE (between steps, saving, closing: never interrupted), ROLLOUT and UPDATE (the two
halves of a step). Only the main thread of a process whose handler for a signal is the default
takes that signal over: a launcher or a test harness that installed its own keeps it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1"}

SETUP, IDLE, ROLLOUT, UPDATE = "setup", "idle", "rollout", "update"

FIRST = "Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again stops at once)"
SECOND = "Ctrl-C again: stopping now (this step is not saved)"


def name(signum: int) -> str:
    return NAMES.get(signum, signal.Signals(signum).name)


class StepAbandoned(BaseException):
    """The step in progress is given up (it could not end within the grace); `phase` says how
    far it got (ROLLOUT: the last completed step is intact; UPDATE: half-applied)."""

    def __init__(self, phase: str, why: str) -> None:
        super().__init__(why)
        self.phase = phase
        self.why = why


class Stopped(KeyboardInterrupt):
    """A run stopped by a signal (saved and closed, or stopped before there was anything to
    save): `code` is the exit status, 128 + the signal. A KeyboardInterrupt, so a sweep stops
    too and its parent run is closed KILLED (bapo_cli.launch.sweep)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class GracefulStop:
    """A context that turns stop signals into `requested = True` (and says so), enforces the
    grace of SIGTERM/SIGUSR1, and restores the previous handlers on exit."""

    def __init__(
        self, say: Callable[[str], None], *, grace_s: float = 0.0, enabled: bool = True
    ) -> None:
        self.say = say
        self.grace_s = grace_s  # 0: no deadline, the step finishes however long it takes
        self.enabled = enabled
        self.phase = SETUP
        self.requested = False
        self.signum: int | None = None  # the first stop signal received (its exit code)
        self.deadline: float | None = None  # time.monotonic() by which the step must end
        self.expired = False  # the grace ran out
        # (when the step began, how long the previous one took): set by the trainer per step
        self.step_started: float | None = None
        self.last_step_s: float | None = None
        self.raised: BaseException | None = None  # what a handler here raised, if anything
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)

    @property
    def reason(self) -> str:
        return name(self.signum or signal.SIGINT)

    def __enter__(self) -> GracefulStop:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return self
        defaults = {signal.SIGINT: signal.default_int_handler}
        for signum in (*STOP_SIGNALS, signal.SIGALRM):
            if signal.getsignal(signum) is defaults.get(signum, signal.SIG_DFL):
                self._previous[signum] = signal.signal(
                    signum, self._expire if signum == signal.SIGALRM else self._handle
                )
        return self

    def __exit__(self, *exc: object) -> None:
        self._disarm()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _disarm(self) -> None:
        if signal.SIGALRM in self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def request(self, signum: int) -> None:
        """A stop asked for by `signum` here, or by another rank (torchrun: the trainer's
        agreement at the end of each step); no grace of its own."""
        if not self.requested:
            self.requested = True
            self.signum = signum

    def would_overrun(self, rest_s: float) -> bool:
        """Whether `rest_s` more seconds of work would end past the grace's deadline."""
        return self.deadline is not None and time.monotonic() + rest_s > self.deadline

    def meant(self, err: BaseException | None) -> BaseException | None:
        """What `err` stands for: the exception a handler here raised (an abandonment, a second
        Ctrl-C, a stop before training) when `err` is it or carries it as its context, because
        the code it interrupted turned it into another error (raised as `threading.Condition.wait`
        reacquires its lock, it surfaces as RuntimeError "release unlocked lock"); else `err`."""
        cause, seen = err, 0
        while cause is not None and seen < 100:  # a chain set by hand could loop
            if cause is self.raised:
                return cause
            cause, seen = cause.__context__, seen + 1
        return err

    def abandonment(self, err: BaseException | None) -> StepAbandoned | None:
        """The abandoned step `err` stands for (`meant`), if it stands for one."""
        meant = self.meant(err)
        return meant if isinstance(meant, StepAbandoned) else None

    def _raise(self, exc: BaseException) -> BaseException:
        self.raised = exc
        return exc

    # ------------------------------------------------------------------------- signal handlers

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and (self.requested or self.phase == SETUP):
            if self.requested:
                self.say(SECOND)
            self.__exit__()
            raise self._raise(KeyboardInterrupt())
        if self.phase == SETUP:  # no model yet, nothing to save: stop now
            self.__exit__()
            self.say(f"{name(signum)}: stopping before training began (nothing to save)")
            raise self._raise(Stopped(128 + signum))
        first = not self.requested
        self.request(signum)
        if signum == signal.SIGINT:
            self.say(FIRST)
            return
        if self.deadline is not None:  # a repeated SIGTERM/SIGUSR1: already stopping
            return
        if self.grace_s <= 0 or signal.SIGALRM not in self._previous:
            if first:
                self.say(f"{name(signum)}: finishing this step, then saving a checkpoint")
            return
        self.deadline = time.monotonic() + self.grace_s
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)
        self.say(
            f"{name(signum)}: finishing this step within {self.grace_s:g} s "
            "(trainer.stop_grace_s), then saving a checkpoint"
        )
        expected_end = (self.step_started or 0.0) + (self.last_step_s or 0.0)
        if self.phase == ROLLOUT and self.last_step_s and expected_end > self.deadline:
            raise self._raise(
                StepAbandoned(
                    ROLLOUT,
                    f"the previous step took {self.last_step_s:.0f} s: this one would not end "
                    f"within the {self.grace_s:g} s grace",
                )
            )

    def _expire(self, signum: int, frame: Any) -> None:
        """SIGALRM: the grace is over. A step still running is abandoned where it is."""
        self.expired = True
        if self.phase in (ROLLOUT, UPDATE):
            raise self._raise(StepAbandoned(self.phase, f"the {self.grace_s:g} s grace ran out"))
