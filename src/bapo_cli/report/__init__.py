"""`bapo report`: compare tracked runs in a table and in plots, offline, from the MLflow store.

    bapo report --sweep outputs/sweeps/2026-01-01/12-00-00     # the jobs of one `bapo train -m`
    bapo report --experiment staleness_study                   # every run of an experiment
    bapo report 4ae6d249... 9939f111...                        # these runs

Each run is labelled by its config facets, and runs whose labels differ only in `trainer.seed`
form a group: the report then adds a table of seed means ± standard deviations, and the plots
draw one line per group (seed mean, band from min to max).

Written into the report dir (default `<sweep dir>/report`, else `<output root>/reports/<time>`):
`runs.md` / `runs.csv` (one row per run), `groups.md` / `groups.csv` (with seeds), and one PNG
per metric family. The dir is also logged to the sweep's parent run (artifact path `report`).

One module per thing the report makes, in the order they build on each other:

- runs.py: the runs and the metric histories, read from the MLflow store (`load_runs`)
- columns.py: the per-run values (`COLUMNS`: final = last 10% of steps, start = first 10%, ...)
- labels.py: facets, labels and groups (`label_runs`)
- stats.py: seed statistics, permutation p-values and Holm (`--baseline`: comparisons.md)
- tables.py: runs.md, groups.md, quadrants.md, as markdown and CSV
- plots.py: the PNGs
- failures.py: failures.md (`--failures`), the one part that samples checkpoints again
- this module: `write_report`, which writes them all; the names callers use are re-exported
  (what the single report.py offered, and `holm`); the helpers the modules share (`mean`,
  `fmt`, `facet_key`, ...) are imported from their module
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bapo_cli.report.columns import (
    COLUMNS,
    ENTROPY_EFFECT,
    QUADRANTS,
    net_entropy_push,
)
from bapo_cli.report.labels import (
    IGNORED,
    SEED_KEY,
    canonical,
    check_facet,
    facet_value,
    facets,
    label_keys,
    label_runs,
)
from bapo_cli.report.plots import plot
from bapo_cli.report.runs import (
    METRICS,
    PLOTS,
    QUADRANT_KEY,
    VAL_KEY,
    ReportError,
    RunData,
    load_runs,
    saved_backends,
    sweep_store,
)
from bapo_cli.report.stats import (
    OUTCOMES,
    comparisons_table,
    group_rows,
    holm,
    permutation_p,
)
from bapo_cli.report.tables import (
    groups_table,
    markdown,
    quadrant_table,
    runs_table,
    write_csv,
)
from bapo_cli.tracking import store

__all__ = [
    "COLUMNS",
    "ENTROPY_EFFECT",
    "IGNORED",
    "METRICS",
    "OUTCOMES",
    "PLOTS",
    "QUADRANTS",
    "QUADRANT_KEY",
    "SEED_KEY",
    "VAL_KEY",
    "Report",
    "ReportError",
    "RunData",
    "canonical",
    "check_facet",
    "comparisons_table",
    "facet_value",
    "facets",
    "group_rows",
    "groups_table",
    "holm",
    "label_keys",
    "label_runs",
    "load_runs",
    "markdown",
    "net_entropy_push",
    "permutation_p",
    "plot",
    "quadrant_table",
    "runs_table",
    "saved_backends",
    "sweep_store",
    "write_report",
]


@dataclass
class Report:
    out_dir: Path
    files: list[Path]
    runs: list[RunData]
    parent_id: str | None  # the run the report was logged to


def write_report(
    runs: list[RunData],
    out_dir: Path,
    uri: str | None = None,
    facet: str | None = None,
    baseline: str | None = None,
    failures: bool = False,
) -> Report:
    """Tables and plots into out_dir; logged to the runs' common parent run when there is one."""
    label_runs(runs)
    if facet is not None:
        check_facet(runs, facet)
    comparison = comparisons_table(runs, baseline, facet) if baseline else None
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    header, rows = runs_table(runs)
    for suffix, writer in ((".md", None), (".csv", write_csv)):
        path = out_dir / f"runs{suffix}"
        if writer is None:
            path.write_text(markdown(header, rows), encoding="utf-8")
        else:
            writer(path, header, rows)
        files.append(path)
    if any(r.group != r.label for r in runs):  # several seeds per group
        header, rows = groups_table(runs)
        (out_dir / "groups.md").write_text(markdown(header, rows), encoding="utf-8")
        write_csv(out_dir / "groups.csv", header, rows)
        files += [out_dir / "groups.md", out_dir / "groups.csv"]
    if comparison is not None:
        (out_dir / "comparisons.md").write_text(markdown(*comparison), encoding="utf-8")
        write_csv(out_dir / "comparisons.csv", *comparison)
        files += [out_dir / "comparisons.md", out_dir / "comparisons.csv"]
    quadrants = quadrant_table(runs)
    if quadrants is not None:
        (out_dir / "quadrants.md").write_text(markdown(*quadrants), encoding="utf-8")
        write_csv(out_dir / "quadrants.csv", *quadrants)
        files += [out_dir / "quadrants.md", out_dir / "quadrants.csv"]
    if failures:
        # only here: sampling checkpoints loads torch and the evaluation stack (report.failures)
        from bapo_cli.report.failures import failure_table

        table = failure_table(runs, out_dir / "failures_cache.json")
        if table is not None:
            (out_dir / "failures.md").write_text(markdown(*table), encoding="utf-8")
            write_csv(out_dir / "failures.csv", *table)
            files += [out_dir / "failures.md", out_dir / "failures.csv"]
    files += plot(runs, out_dir, facet)
    parents = {r.parent_id for r in runs}
    parent = parents.pop() if len(parents) == 1 else None
    if parent and uri:
        store.client(uri).log_artifacts(parent, str(out_dir), "report")
    return Report(out_dir, files, runs, parent)
