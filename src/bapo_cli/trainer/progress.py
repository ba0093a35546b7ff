"""What a person watches while training runs: a rich progress bar, a status line at a readable
cadence, and the closing summary (a table, then where everything went and what to type next).

On a terminal the bar shows steps done, steps/s, elapsed time and the ETA, with the latest
reward, entropy and clip bounds; the status lines stay above it as a record. Without a live
display (CI, a pipe, a file) only the status lines are printed, at the same cadence. Lines a user
copies (paths, run ids, commands) are printed with soft wrapping: a console of any width (a pipe
is 80 columns) never cuts or breaks them.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from bapo_cli import redact

LINES_PER_RUN = 20
"""Status lines a run prints at most by step count (plus the first and the last step)."""
MAX_SILENCE_S = 30.0
"""A status line at least this often however slow the steps are (a loaded machine)."""


class _StepsPerSecond(ProgressColumn):
    """rich's speed estimate of the task (over its last 30 s) as steps/s."""

    def render(self, task) -> Text:  # noqa: ANN001 - rich's Task
        speed = task.finished_speed or task.speed
        return Text("– steps/s" if speed is None else f"{speed:.2f} steps/s", style="cyan")


def status_line(window: list[dict[str, float]]) -> str:
    """Reward, entropy and clip bounds (BAPO's adaptive [c_low, c_high]) averaged over `window`,
    the steps since the previous line: one step's reward is too noisy to show a trend."""

    def mean(key: str) -> float:
        values = [m[key] for m in window if key in m]
        return sum(values) / len(values) if values else 0.0

    return (
        f"reward {mean('reward/mean'):.3f}  entropy {mean('actor/entropy'):.3f}  "
        f"clip [{mean('actor/c_low'):.2f}, {mean('actor/c_high'):.2f}]"
    )


class TrainProgress:
    """The bar (terminal only) and the status lines (always): at the first step, every
    `total // LINES_PER_RUN` steps, after `MAX_SILENCE_S` without one, and at the last step.
    A line covering several steps (`steps 8-14/150`) shows their means."""

    def __init__(self, total: int, done: int, console: Console) -> None:
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            _StepsPerSecond(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
            disable=not console.is_terminal and not console.is_jupyter,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info="")
        self.console = console
        self.total, self.start_step = total, done
        self.every = max(1, total // LINES_PER_RUN)
        self.started = self.last_line = time.monotonic()
        self.window: list[dict[str, float]] = []

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, m: dict[str, float]) -> None:
        self.progress.update(self.task, completed=step, info=status_line([m]))
        self.window.append(m)
        now = time.monotonic()
        due = (
            step == self.start_step + 1
            or step % self.every == 0
            or step == self.total
            or now - self.last_line >= MAX_SILENCE_S
        )
        if due:
            self.last_line = now
            rate = (step - self.start_step) / max(now - self.started, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else 0.0
            first = step - len(self.window) + 1
            steps = f"step {step}" if first == step else f"steps {first}-{step}"
            info, self.window = status_line(self.window), []
            self.console.print(
                f"{steps}/{self.total}  {info}  {rate:.2f} steps/s  ETA {_clock(eta)}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )

    def note(self, line: str) -> None:
        """A line above the bar (e.g. Ctrl-C was seen)."""
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


def _clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    seconds = int(round(seconds))
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _mean(history: list[dict[str, float]], key: str, part: slice) -> float | None:
    values = [h[key] for h in history[part] if key in h]
    return sum(values) / len(values) if values else None


# time per stage (trainer.throughput): generation, scoring, update tokens/s, push seconds, MFU
MFU = "perf/update_mfu"
STAGES = (
    "perf/rollout_tokens_per_s",
    "perf/score_tokens_per_s",
    "perf/update_tokens_per_s",
    "perf/weight_sync_s",
    MFU,
)


# weights by file (rollout.servers): bytes written and versions written as deltas, per step
PUSHES = ("servers/push_bytes", "servers/push_delta")


def _number(value: float | None) -> str:
    """A window's mean; '-' where no step of that window logged the metric (seen: rank 1 of a
    resumed --nproc 2 run with servers, push metrics in its first tenth only)."""
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"  # bytes: 8.16e+07


def summary_table(history: list[dict[str, float]], title: str = "bapo train: summary") -> Table:
    """First and last tenth of the run side by side."""
    tenth = max(len(history) // 10, 1)
    table = Table(title=title, title_justify="left")
    for column in ("metric", f"first {tenth} steps", f"last {tenth} steps"):
        table.add_column(column)
    for key in (
        "reward/mean",
        "reward/acc",
        "actor/entropy",
        "response/length_mean",
        "actor/c_low",
        "actor/c_high",
        "actor/clipfrac_low",
        "actor/clipfrac_high",
        "bapo/rho",
        "staleness/mean",
        "perf/step_s",
        *STAGES,
        *PUSHES,
    ):
        first, last = _mean(history, key, slice(0, tenth)), _mean(history, key, slice(-tenth, None))
        if first is not None:
            table.add_row(key, _number(first), _number(last))
        elif key == MFU and history:  # no peak known for this chip (CPU): said, not guessed
            table.add_row(key, "n/a", "n/a")
    return table


def where_lines(
    run_dir: Path,
    uri: str,
    run_id: str | None,
    *,
    resume: str | None = None,
    mlflow: bool = True,
    others: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """Where the run went and what to type next: the run dir, the MLflow store and run, how to
    open it (`bapo ui`), the other trackers' lines (`others`: W&B, TensorBoard;
    bapo_cli.tracking.backends.where_lines), and for a stopped run the exact command that
    continues it. `mlflow`: whether MLflow was one of the trackers (`run_id` is then its run)."""
    lines = [f"run dir: {run_dir}"]
    if mlflow and run_id:
        lines.append(f"MLflow: {redact.text(uri)}  run {run_id}")
        lines.append(f"open the results: {ui_command(uri)}")
    elif not others:
        lines.append("MLflow: off (tracking=none)")
    lines.extend(others)
    if resume:
        lines.append(f"resume: {resume}")
    return lines


def ui_command(uri: str) -> str:
    """`bapo ui`, with `--uri` when the store is not the one it opens by default."""
    return "bapo ui" + ("" if _default_uri(uri) else f" --uri {redact.text(uri)}")


def _default_uri(uri: str) -> bool:
    """Whether `bapo ui` without --uri opens `uri`: the default store of conf/tracking/mlflow.yaml
    under the output root `bapo` picks here (./outputs or $BAPO_OUTPUT_ROOT). Not by composing
    the config: this runs inside a Hydra job, where Hydra cannot be initialised again."""
    from bapo_cli.config import hydra_runner

    root = hydra_runner.normalize_overrides([])[-1].partition("=")[2]
    return uri == f"sqlite:///{root}/mlflow.db"


def print_summary(
    console: Console,
    history: list[dict[str, float]],
    lines: list[str],
    title: str = "bapo train: summary",
) -> None:
    """The table, then `lines` (`where_lines`) unwrapped: copyable at any console width."""
    console.print(summary_table(history, title))
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
