"""What a person watches while training runs: a rich progress bar and the closing summary table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bapo_cli.tracking import redact


class TrainProgress:
    """Step counter with reward, entropy and clip bounds of the latest step."""

    def __init__(self, total: int, done: int, console: Console) -> None:
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
            disable=not console.is_terminal and not console.is_jupyter,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info="")
        self.console = console

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, m: dict[str, float]) -> None:
        info = (
            f"reward {m.get('reward/mean', 0):.3f}  entropy {m.get('actor/entropy', 0):.3f}  "
            f"clip [{m.get('actor/c_low', 0):.2f}, {m.get('actor/c_high', 0):.2f}]"
        )
        self.progress.update(self.task, completed=step, info=info)
        if self.progress.disable:  # no live display (CI, pipes): one plain line per step
            self.console.print(
                f"step {step}/{self.progress.tasks[0].total}  {info}", highlight=False
            )


def _mean(history: list[dict[str, float]], key: str, part: slice) -> float | None:
    values = [h[key] for h in history[part] if key in h]
    return sum(values) / len(values) if values else None


def summary_table(
    history: list[dict[str, float]], run_dir: Path, uri: str, run_id: str | None
) -> Table:
    """First and last tenth of the run side by side, then where everything went."""
    tenth = max(len(history) // 10, 1)
    table = Table(title="bapo train: summary", title_justify="left")
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
    ):
        first, last = _mean(history, key, slice(0, tenth)), _mean(history, key, slice(-tenth, None))
        if first is not None:
            table.add_row(key, f"{first:.4f}", f"{last:.4f}")
    table.caption = f"run dir: {run_dir}\nMLflow: {redact.text(uri) or 'off'}" + (
        f"  run {run_id}" if run_id else ""
    )
    table.caption_justify = "left"
    return table
