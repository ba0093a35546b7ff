"""Reading runs back for `bapo runs`: newest first, one row each, without creating a store
that was never written; and the table that shows them, whole at any console width. Also the
unfinished run an earlier attempt left in a run dir (`unfinished_run`), which a restart with
`trainer.resume=true` continues."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from bapo_cli.tracking.store import client as store_client
from bapo_cli.tracking.store import experiment_name, store_exists
from bapo_cli.tracking.sweep import RUN_DIR_TAG


@dataclass(frozen=True)
class RunRow:
    run_id: str
    experiment: str
    name: str
    status: str
    start: str
    metrics: dict[str, float]


def list_runs(uri: str, experiment: str | None = None, limit: int = 50) -> list[RunRow]:
    """Newest runs first, across experiments unless one is named."""
    from datetime import datetime

    if not store_exists(uri):
        return []
    client = store_client(uri)  # fail-fast HTTP: a server that is down fails in seconds
    experiments = client.search_experiments()
    if experiment is not None:
        experiments = [e for e in experiments if e.name == experiment_name(experiment)]
    names = {e.experiment_id: e.name for e in experiments}
    if not names:
        return []
    runs = client.search_runs(
        list(names), order_by=["attributes.start_time DESC"], max_results=limit
    )
    return [
        RunRow(
            run_id=r.info.run_id,
            experiment=names[r.info.experiment_id],
            name=r.info.run_name or "",
            status=r.info.status,
            start=datetime.fromtimestamp(r.info.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S"),
            metrics=dict(r.data.metrics),
        )
        for r in runs
    ]


def unfinished_run(uri: str, experiment: str, run_dir: str) -> str | None:
    """The id of the newest run of `experiment` tagged with `run_dir` (RUN_DIR_TAG) that did not
    finish, else None: what an attempt that left no checkpoint (a SLURM job requeued early)
    started there. None as well for a run dir whose name holds a quote (no filter can name it)."""
    if not store_exists(uri) or "'" in run_dir or "\\" in run_dir:
        return None
    client = store_client(uri)
    found = client.get_experiment_by_name(experiment_name(experiment))
    if found is None:
        return None
    runs = client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`{RUN_DIR_TAG}` = '{run_dir}' and attributes.status != 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def runs_table(rows: list[RunRow], where: str, columns: Sequence[str]) -> Table:
    """One row per run: the full run id (what `bapo report RUN_ID` and MLflow take), experiment,
    name, status, start and the last value of each metric in `columns`."""
    table = Table(title=f"runs in {where}", title_justify="left")
    for column in ("run id", "experiment", "name", "status", "start"):
        table.add_column(column, no_wrap=True)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        values = [row.metrics.get(key) for key in columns]
        shown = ["" if v is None else f"{v:.3f}" for v in values]
        table.add_row(row.run_id, row.experiment, row.name, row.status, row.start, *shown)
    return table


def print_whole(table: Table, console: Console) -> None:
    """Print `table` at its natural width when the console is narrower. rich fits a table to the
    console by cutting cells (a pipe counts as 80 columns: run ids came out as 4 characters);
    ids and names must stay copyable, so the lines are made as long as the table needs and a
    narrow terminal wraps them instead."""
    natural = Console(width=10_000).measure(table).maximum
    if natural > console.width:
        console = Console(width=natural, file=console.file)
    console.print(table)
