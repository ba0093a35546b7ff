"""The tables of a report, as header + rows of strings, and how they are written (markdown and
CSV): runs.md (one row per run, the `COLUMNS`), groups.md (seed mean ± standard deviation per
group, when a group holds several seeds) and quadrants.md (the Entropy-Clip quadrant shares of the
update's loss mass per group, when the runs logged them). comparisons.md is made by `stats`,
failures.md by `failures`.
"""

from __future__ import annotations

import csv
from pathlib import Path

from bapo_cli.report.columns import COLUMNS, QUADRANTS, mean, net_entropy_push
from bapo_cli.report.runs import QUADRANT_KEY, RunData
from bapo_cli.report.stats import group_rows


def fmt(value: float | None) -> str:
    """A value as every table prints it: three decimals, an empty cell for None."""
    return "" if value is None else f"{value:.3f}"


def _fmt_pm(value: tuple[float, float] | None) -> str:
    return "" if value is None else f"{value[0]:.3f} ± {value[1]:.3f}"


def runs_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "run id", "status", "steps", *(h for h, _ in COLUMNS)]
    rows = [
        [r.label, r.run_id[:12], r.status, str(len(r.histories.get("reward/mean", [])))]
        + [fmt(r.values[h]) for h, _ in COLUMNS]
        for r in runs
    ]
    return header, rows


def groups_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    header = ["group", "seeds", *(h for h, _ in COLUMNS)]
    rows = [
        [name, str(n)] + [_fmt_pm(stats[h]) for h, _ in COLUMNS]
        for name, n, stats in group_rows(runs)
    ]
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def quadrant_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]] | None:
    """The Entropy-Clip quadrant table per group (None when no run logged it): the share of the
    update's loss mass r|A| that active and clipped tokens carry in each quadrant (probability
    above / below the batch mean, advantage sign), mean over steps then over seeds; and the net
    first-order entropy push of the active mass (sum of ENTROPY_EFFECT x share: > 0 raises
    entropy, < 0 lowers it; clipped tokens push nothing)."""
    if not any(QUADRANT_KEY.match(k) for r in runs for k in r.histories):
        return None
    header = ["group", "seeds"]
    header += [f"{q} {state}" for q in QUADRANTS for state in ("active", "clipped")]
    header.append("net entropy push")
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    rows = []
    for group, members in groups.items():
        cells: list[str] = []
        for q in QUADRANTS:
            for state in ("active", "clipped"):
                per_run = [
                    mean(m.histories.get(f"tokens/quadrant_{q}_{state}_mass")) for m in members
                ]
                values = [v for v in per_run if v is not None]
                cells.append(fmt(sum(values) / len(values) if values else None))
        push = [p for p in map(net_entropy_push, members) if p is not None]
        cells.append(f"{sum(push) / len(push):+.3f}" if push else "")
        rows.append([group, str(len(members)), *cells])
    return header, rows
