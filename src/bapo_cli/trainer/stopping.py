"""The loop's side of a stop (Ctrl-C, SIGTERM, SIGUSR1; the signals themselves are
bapo_cli.trainer.interrupt): every rank agrees on the step to stop at, or to abandon, and an
abandoned step saves the last completed one from the snapshot taken at its start."""

from __future__ import annotations

import copy
from typing import Any

from bapo_cli.staleness.regimes import Regime
from bapo_cli.trainer.interrupt import ROLLOUT, GracefulStop, StepAbandoned
from bapo_cli.trainer.run import Run
from bapo_cli.trainer.save_resume import save

__all__ = ["abandon", "agree", "step_snapshot"]


def agree(run: Run, stop: GracefulStop, abandon: bool = False) -> tuple[bool, bool]:
    """(a stop was asked for on some rank, some rank abandons its step): one all-reduce under
    torchrun, so that every rank stops (or abandons) at the same step and they write one
    checkpoint together, whichever ranks the signal reached. A rank that got none takes the
    signal of the one that did (its exit code)."""
    mine = [float(stop.signum or 0) if stop.requested else 0.0, float(abandon)]
    signum, anyone = run.ctx.max(mine) if run.ctx.enabled else mine
    if signum and not stop.requested:
        stop.request(int(signum))
        stop.say(f"{stop.reason} on another rank: stopping after this step")
    return bool(signum), bool(anyone)


def step_snapshot(run: Run) -> dict[str, Any] | None:
    """This rank's state at the start of a step (data position, RNG, next group), to save the
    last completed step if this one is abandoned before its updates. None for a regime that
    keeps buffers of samples (replay, lag, partial, async): copying them every step would cost
    more than the stop they serve; such a step, abandoned, saves nothing."""
    if type(run.regime).state_dict is not Regime.state_dict:
        return None
    return copy.deepcopy(run.rank_state())


def abandon(
    run: Run,
    tracker: Any,
    stop: GracefulStop,
    snapshot: dict[str, Any] | None,
    abandoned: StepAbandoned | None,
) -> None:
    """Give up the step before its updates (every rank at once): the weights, optimizer and
    counters are still the last completed step's, and `snapshot` holds the rest of its state,
    so that step is saved unless it already is. Raises StepAbandoned to leave the loop."""
    why = abandoned.why if abandoned is not None else "another rank abandoned it"
    done = run.state.step
    if done == 0 or run.saved_step == done or snapshot is None:
        kept = "nothing to save yet" if done == 0 else f"step {done} is saved already"
        if done and run.saved_step != done:
            newest = f"step {run.saved_step}" if run.saved_step else "none"
            kept = f"this regime's buffers are not kept per step (newest checkpoint: {newest})"
        stop.say(f"{stop.reason}: abandoning step {done + 1} ({why}); {kept}")
        raise StepAbandoned(ROLLOUT, why)
    stop.say(f"{stop.reason}: abandoning step {done + 1} ({why}); saving step {done}")
    if done % run.cfg.trainer.log_every:  # its metrics were not logged yet
        tracker.log_metrics(run.state.history[-1], step=done)
    save(run, tracker, ranks=snapshot, say=stop.say)
    raise StepAbandoned(ROLLOUT, why)
