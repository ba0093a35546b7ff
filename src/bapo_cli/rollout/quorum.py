"""How many of a run's generation servers must answer for it to start (`rollout.min_servers`),
and the lines that say which did not: the error when too few answer, the warning when the run
starts without some (they are taken in when they answer: `ServerPool.revive`).

The default (`rollout.min_servers=null`) depends on the start. A new run needs every server: its
list is unproven, and a server that does not answer is as likely a typo or a server never
started as one restarting, which a run at part speed would hide. A resumed run
(`trainer.resume=true`) needs one: its list was proven by its own start, and on a fleet some
server is nearly always restarting, so a crashed run must not wait for all of them. NCCL weights
(`staleness.weights=nccl`) need every server either way: its group has no place for a member
that joins later (`rollout.weights_transfer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

START_HINT = "`bapo serve --port PORT`"


@dataclass(frozen=True)
class Quorum:
    """`need` of `total` servers must answer at start; `given`: rollout.min_servers as set
    (None: the default, which `resume` and `every` chose)."""

    need: int
    total: int
    given: int | None = None
    resume: bool = False
    every: bool = False  # every server, whatever was given (NCCL weights)

    @classmethod
    def of(cls, given: int | None, total: int, *, resume: bool, every: bool = False) -> Quorum:
        if every:
            need = total
        elif given is not None:
            need = min(given, total)  # the config rule refuses more than listed
        else:
            need = 1 if resume else total
        return cls(need, total, given, resume, every)

    def setting(self) -> str:
        """What asked for `need`, in words."""
        if self.every:
            return "staleness.weights=nccl: all"
        if self.given is not None:
            return f"rollout.min_servers={self.given}"
        default = "1 for a resumed run" if self.resume else "all for a new run"
        return f"rollout.min_servers=null: {default}"

    def short(self, down: Sequence[tuple[str, str]]) -> str | None:
        """The one line refusing a start where the servers `down` ((url, why) each) leave fewer
        than `need` answering; None when enough answer."""
        answered = self.total - len(down)
        if answered >= self.need:
            return None
        fixes = [f"start {'them' if len(down) > 1 else 'one'} there with {START_HINT}"]
        fixes.append("fix rollout.servers")
        if self.need > 1 and not self.every:
            fixes.append("lower rollout.min_servers")
        return (
            f"cannot reach the generation server{_s(down)} {_named(down)}: {answered} of "
            f"{self.total} answer{'s' if answered == 1 else ''}, fewer than {self.need} "
            f"({self.setting()}); {', '.join(fixes[:-1])} or {fixes[-1]}"
        )

    def warning(self, down: Sequence[tuple[str, str]]) -> str | None:
        """The one warning line of a start without the servers `down`; None when none is."""
        if not down:
            return None
        verb = "do not answer" if len(down) > 1 else "does not answer"
        each = "each is" if len(down) > 1 else "it is"
        return (
            f"the generation server{_s(down)} {_named(down)} {verb}: starting on the "
            f"{self.total - len(down)} of {self.total} that do ({self.setting()}); {each} taken "
            "in once it answers (checked, then given the newest weights)"
        )

    def describe(self) -> str | None:
        """The run plan's words when a start may leave servers out; None when it needs all."""
        if self.need >= self.total:
            return None
        return f"starts once {self.need} of them answer{'s' if self.need == 1 else ''}"


def _s(down: Sequence[tuple[str, str]]) -> str:
    return "s" if len(down) > 1 else ""


def _named(down: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{url} ({why})" for url, why in down)
