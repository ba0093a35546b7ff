"""The plots of a report: one PNG per metric family of `PLOTS`, one line per group (seed mean of
the trailing-mean-smoothed runs, a min-max band where two or more seeds reached a step), and with
`--facet` one column of panels per value of the facet.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bapo_cli.report.labels import facet_value, group_without
from bapo_cli.report.runs import PLOTS, RunData


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _line(ax: Any, members: list[RunData], key: str, color: Any, label: str) -> int:
    """Seed mean of the trailing-mean-smoothed runs (over the runs that reached each step), and a
    min-max band where two or more did. Returns the smoothing window."""
    series = [m.histories[key] for m in members if key in m.histories]
    if not series:
        return 1
    window = max(max(len(s) for s in series) // 20, 1)
    by_step: dict[int, list[float]] = {}
    for points in series:
        smooth = _smooth([v for _, v in points], window)
        for (step, _), value in zip(points, smooth, strict=True):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    mean = [sum(by_step[t]) / len(by_step[t]) for t in steps]
    ax.plot(steps, mean, color=color, lw=1.4, label=label)
    if len(series) > 1:
        low = [min(by_step[t]) if len(by_step[t]) > 1 else math.nan for t in steps]
        high = [max(by_step[t]) if len(by_step[t]) > 1 else math.nan for t in steps]
        ax.fill_between(steps, low, high, color=color, alpha=0.12, lw=0)
    return window


def plot(runs: list[RunData], out_dir: Path, facet: str | None = None) -> list[Path]:
    """One PNG per metric family: one line per group (seed mean, min-max band, trailing mean);
    with `facet` (an override key, e.g. staleness), one column of panels per value of it.
    matplotlib is imported here, not at the top: it is slow to import, and its Agg backend is set
    for this process only when a report is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facets = list(dict.fromkeys(facet_value(r, facet) for r in runs))
    names = list(dict.fromkeys(group_without(r.group, facet) for r in runs))
    colors = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors
    color = {n: colors[i % len(colors)] for i, n in enumerate(names)}
    paths = []
    for name, keys in PLOTS.items():
        present = [k for k in keys if any(k in r.histories for r in runs)]
        if not present:
            continue
        shape = (len(present), len(facets)) if facet else (1, len(present))
        fig, axes = plt.subplots(
            *shape, figsize=(5.2 * shape[1], 3.6 * shape[0]), squeeze=False, sharey="row"
        )
        for k, key in enumerate(present):
            for f, value in enumerate(facets):
                ax = axes[k][f] if facet else axes[0][k]
                window = 1
                for group in names:
                    members = [
                        r
                        for r in runs
                        if group_without(r.group, facet) == group and facet_value(r, facet) == value
                    ]
                    window = max(window, _line(ax, members, key, color[group], group))
                where = f"{facet}={value}: " if facet else ""
                ax.set_title(f"{where}{key} (trailing mean, {window} steps)", fontsize=9)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
        handles: dict[str, Any] = {}  # one legend entry per group
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            fontsize=8,
        )
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=80, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
