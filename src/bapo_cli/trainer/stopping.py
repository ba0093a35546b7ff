"""How a training run stops. `StopProtocol` is the one context around `train()`: it turns stop
signals into a request (bapo_cli.trainer.interrupt), and on the way out closes the run with its
status (FINISHED; KILLED after a stop, an abandoned step or a second Ctrl-C; FAILED otherwise),
saves the last step first when the generator stopped serving (`checkpoint_first`), and prints
the summary with the command that resumes a stopped run. Beside it, the loop's side of a stop:
every rank agrees on the step to stop at, or to abandon (`agree`), and an abandoned step saves
the last completed one from the snapshot taken at its start (`step_snapshot`, `abandon`)."""

from __future__ import annotations

import copy
from typing import Any

from rich.console import Console

from bapo_cli.config.schema import TrainConfig
from bapo_cli.staleness.regimes import Regime
from bapo_cli.staleness.worker import WorkerError
from bapo_cli.tracking.backends import where_lines as tracking_where_lines
from bapo_cli.trainer import distributed
from bapo_cli.trainer.interrupt import IDLE, ROLLOUT, UPDATE, GracefulStop, StepAbandoned
from bapo_cli.trainer.progress import print_summary, where_lines
from bapo_cli.trainer.run import Run, TrainingError, TrainResult
from bapo_cli.trainer.save_resume import save

__all__ = ["StopProtocol", "abandon", "agree", "step_snapshot"]


def say_on(console: Console):
    """A line on the console (rank 0's), unwrapped and without markup."""
    return lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True)


class StopProtocol:
    """The stop protocol of one training run, as one context (module docstring). In order:
    entered, a stop signal before anything is built stops at once (`interrupt.Stopped`);
    `built(run)`: from here a stop ends the loop and still saves; `tracking(tracker)`: from here
    leaving closes the run with its status; `stopped`: set when the loop ended on a stop."""

    def __init__(self, cfg: TrainConfig, console: Console, resume_command: str | None) -> None:
        self.signals = GracefulStop(say_on(console), grace_s=cfg.trainer.stop_grace_s)
        self.cfg = cfg
        self.console = console
        self.resume_command = resume_command
        self.run: Run | None = None
        self.tracker: Any = None
        self.stopped = False

    def __enter__(self) -> StopProtocol:
        self.signals.__enter__()
        return self

    def speak_to(self, console: Console) -> None:
        """Say what it has to say on `console` (rank 0's; the others' are quiet)."""
        self.console = console
        self.signals.say = say_on(console)

    def built(self, run: Run) -> None:
        self.run = run
        self.signals.phase = IDLE  # a stop now closes the run KILLED and says how to resume

    def tracking(self, tracker: Any) -> Any:
        self.tracker = tracker
        return tracker

    def __exit__(self, kind: Any, err: BaseException | None, trace: Any) -> bool:
        meant = self.signals.meant(err)  # a signal's exception the interrupted code re-raised
        handled = False
        try:
            if self.run is not None and self.tracker is not None:  # started: needs closing
                handled = self._close(meant)
                if handled:
                    self._summary()
        finally:
            self.signals.__exit__()
        if not handled and meant is not err:  # leave as the signal meant (Ctrl-C: exit 130)
            raise meant from None
        return handled

    def _close(self, err: BaseException | None) -> bool:
        """Close the run with the status `err` gives it (None: the loop ended; a signal's own
        exception where the interrupted code re-raised it as another, `GracefulStop.meant`);
        whether `err` ends here (an abandoned step) rather than propagating."""
        run, signals = self.run, self.signals
        status, clean = "FAILED", False
        try:
            if err is None:
                status, clean = ("KILLED" if self.stopped else "FINISHED"), True
            elif isinstance(err, StepAbandoned):  # saved what could be (abandon), or nothing
                status, clean, self.stopped = "KILLED", err.phase == ROLLOUT, True
                if err.phase == UPDATE:
                    newest = f"step {run.saved_step}" if run.saved_step else "none"
                    signals.say(
                        f"{signals.reason}: abandoning step {run.state.step + 1} during its "
                        f"updates ({err.why}); nothing more saved (newest checkpoint: {newest})"
                    )
            elif isinstance(err, KeyboardInterrupt):  # a second Ctrl-C
                status = "KILLED"
            elif isinstance(err, WorkerError):
                self._serving_stopped(err)
            elif signals.requested:  # under torchrun: a rank that stopped ends the others'
                status = "KILLED"
        finally:
            signals.phase = IDLE
            close(run, self.tracker, status, clean=clean)
        return err is None or isinstance(err, StepAbandoned)

    def _serving_stopped(self, err: WorkerError) -> None:
        """The generator cannot go on: one process saves its last step first when the error
        asks for it (data-parallel ranks may meet the failure at different points, so no
        collective: the last periodic checkpoint stands); a one-line TrainingError."""
        run = self.run
        first = getattr(err, "checkpoint_first", False) and run.ctx.world_size == 1
        if first and run.state.step > 0:
            save(run, self.tracker)
            raise TrainingError(f"{err}; step {run.state.step} is saved: {run.last_ckpt}") from err
        raise TrainingError(str(err)) from err

    def _summary(self) -> None:
        run, run_id = self.run, self.tracker.run_id
        resume, title = None, "bapo train: summary"
        if self.stopped:
            resume = self.resume_command or (
                f"rerun the same command with trainer.resume=true hydra.run.dir={run.run_dir}"
            )
            title += f" (stopped by {self.signals.reason} at step {run.state.step})"
        settings = self.cfg.tracking
        lines = where_lines(
            run.run_dir,
            settings.uri,
            run_id,
            resume=resume,
            mlflow="mlflow" in settings.backends,
            others=tracking_where_lines(settings, run_id, run.run_dir),
        )
        print_summary(self.console, run.state.history, lines, title=title)

    def result(self) -> TrainResult:
        run = self.run
        return TrainResult(
            run.run_dir,
            self.tracker.run_id,
            run.state.history,
            run.last_ckpt,
            run.updates,
            run.batch,
            interrupted=self.stopped,
            exit_code=self.signals.exit_code if self.stopped else 0,
        )


def close(run: Run, tracker: Any, status: str, *, clean: bool) -> None:
    """The samples file to MLflow, the run closed with `status`, engine, graders and process
    group stopped (`clean`: every rank is past its last collective, so they leave together)."""
    run.regime.close()  # first: an async generation worker must not outlive a failure below
    samples_file = run.run_dir / "samples.jsonl"
    if samples_file.exists() and run.ctx.is_main:
        tracker.log_artifact(samples_file)
    tracker.close(status)
    run.engine.close()
    run.prompts.close()
    distributed.shutdown(run.ctx, clean=clean)


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
