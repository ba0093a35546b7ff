"""The statistics of a report: seed means and standard deviations per group (groups.md), and
`--baseline algo=grpo` (comparisons.md): every other group against the baseline group of its
cell (the group holding that facet whose other label keys -- all but the baseline's own key and
its sub-keys, `algo.*` -- have the same values), per outcome the mean difference over seeds and
an exact two-sided permutation p-value (all relabelings of the seeds into the two groups; a
seeded Monte-Carlo sample of 20,000 when there are more), which assumes nothing about the
distribution. With 5 seeds per side the smallest possible p is 2/252 ≈ 0.008. `holm` adjusts a
family of such p-values (study v3's primary question, scripts/study_v3.py).
"""

from __future__ import annotations

import itertools
import math
import random

from bapo_cli.report.columns import COLUMNS
from bapo_cli.report.labels import (
    canonical,
    check_facet,
    facet_key,
    facet_value,
    group_without,
    label_runs,
)
from bapo_cli.report.runs import ReportError, RunData


def group_rows(runs: list[RunData]) -> list[tuple[str, int, dict[str, tuple[float, float] | None]]]:
    """(group, seeds, {column: (mean, std) over the group's runs}) in first-seen order."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    out = []
    for name, members in groups.items():
        stats: dict[str, tuple[float, float] | None] = {}
        for header, _ in COLUMNS:
            values = [m.values[header] for m in members if m.values[header] is not None]
            if not values:
                stats[header] = None
                continue
            mean = sum(values) / len(values)
            var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
            stats[header] = (mean, math.sqrt(var))
        out.append((name, len(members), stats))
    return out


OUTCOMES = ("held-out change", "held-out final", "final reward", "final entropy")
"""What --baseline compares; "held-out change" (final - start) is study v3's primary outcome."""


def permutation_p(a: list[float], b: list[float], *, samples: int = 20_000) -> float:
    """Two-sided p-value of mean(a) - mean(b) under the null that the labels are exchangeable:
    the share of relabelings of a + b into groups of len(a) and len(b) whose |difference| is at
    least the observed one (exact when there are at most `samples` relabelings, else a seeded
    Monte-Carlo estimate that counts the observed split)."""
    if not a or not b:
        raise ValueError("permutation_p needs at least one value on each side")
    pooled, n = [*a, *b], len(a)
    total = sum(pooled)
    observed = abs(sum(a) / n - sum(b) / len(b))
    tol = 1e-12 * max(1.0, abs(observed))

    def extreme(idx: tuple[int, ...] | list[int]) -> bool:
        sa = sum(pooled[i] for i in idx)
        return abs(sa / n - (total - sa) / len(b)) >= observed - tol

    if math.comb(len(pooled), n) <= samples:
        splits = list(itertools.combinations(range(len(pooled)), n))
        return sum(extreme(s) for s in splits) / len(splits)
    rng = random.Random(0)
    hits = sum(extreme(rng.sample(range(len(pooled)), n)) for _ in range(samples))
    return (hits + 1) / (samples + 1)


def holm(pvalues: dict[str, float], alpha: float = 0.05) -> dict[str, bool]:
    """Holm-Bonferroni over a family of p-values: sort ascending; the i-th smallest (0-based) is
    rejected while p <= alpha / (m - i), stopping at the first that is not."""
    m = len(pvalues)
    rejected = dict.fromkeys(pvalues, False)
    for i, (name, p) in enumerate(sorted(pvalues.items(), key=lambda kv: kv[1])):
        if p > alpha / (m - i):
            break
        rejected[name] = True
    return rejected


def comparisons_table(
    runs: list[RunData], baseline: str, facet: str | None = None
) -> tuple[list[str], list[list[str]]]:
    """Each group against the baseline group of its cell: the group whose runs hold the facet
    `baseline` (`algo=grpo`) and agree with it on every other label key but the baseline's own
    (`algo` and `algo.*`). Seeds, mean difference and permutation p per outcome. With `facet`,
    its value is the first column (and a baseline on the facet's own key is refused)."""
    key, sep, wanted = baseline.partition("=")
    key = facet_key(key)
    if not sep or not key:
        raise ReportError(f"--baseline {baseline}: must be KEY=VALUE, e.g. algo=grpo")
    facet_keys = [facet_key(k) for k in facet.split(",")] if facet else []
    if key in facet_keys:
        raise ReportError(
            f"--baseline {baseline}: compares groups within one --facet {facet} value, so it "
            "must set another key (e.g. algo=grpo), or drop --facet"
        )
    keys = label_runs(runs)
    check_facet(runs, key, "--baseline")
    cell_keys = [k for k in keys if not _same_setting(k, key, runs)]
    by_group: dict[str, list[RunData]] = {}
    for run in runs:
        by_group.setdefault(run.group, []).append(run)

    def cell(members: list[RunData]) -> tuple[str | None, ...]:
        return tuple(members[0].facets.get(k) for k in cell_keys)

    base_of: dict[tuple[str | None, ...], list[RunData]] = {}
    for group, members in by_group.items():
        if all(m.facets.get(key) == canonical(wanted) for m in members):
            other = base_of.setdefault(cell(members), members)
            if other is not members:
                raise ReportError(
                    f"--baseline {baseline}: two groups have it in one cell ({other[0].group}; "
                    f"{group}); name a narrower baseline"
                )
    if not base_of:
        groups = ", ".join(by_group)
        raise ReportError(f"--baseline {baseline}: no group has it; groups: {groups}")
    header = [facet or "", "group", "vs", "seeds"]
    for outcome in OUTCOMES:
        header += [f"{outcome} diff", f"{outcome} p"]
    rows = []
    for group, members in by_group.items():
        base = base_of.get(cell(members))
        if base is None or base is members:
            continue
        value = facet_value(members[0], facet)
        row = [value, group_without(group, facet), group_without(base[0].group, facet)]
        row.append(f"{len(members)} vs {len(base)}")
        for outcome in OUTCOMES:
            a = [m.values[outcome] for m in members if m.values[outcome] is not None]
            b = [m.values[outcome] for m in base if m.values[outcome] is not None]
            if not a or not b:
                row += ["", ""]
                continue
            diff = sum(a) / len(a) - sum(b) / len(b)
            row += [f"{diff:+.3f}", f"{permutation_p(a, b):.3f}"]
        rows.append(row)
    if not rows and len(base_of) == len(by_group):
        raise ReportError(f"--baseline {baseline}: every group has it; nothing to compare")
    if not rows:
        raise ReportError(
            f"--baseline {baseline}: no other group agrees with a baseline group on "
            f"{', '.join(cell_keys)}; nothing to compare"
        )
    if facet is None:
        header, rows = header[1:], [r[1:] for r in rows]
    return header, rows


def _same_setting(key: str, baseline_key: str, runs: list[RunData]) -> bool:
    """Whether `key` is part of what the baseline sets, so cells ignore it: the key itself, and
    when it lies in a config group (`algo`, `algo.name`, `algo.loss`) the whole group, whose
    other keys (algo.rho0, algo.eps_high) come with the choice."""
    group = baseline_key.split(".")[0]
    if any(f"{group}.name" in r.params for r in runs):
        return key == group or key.startswith(group + ".")
    return key == baseline_key
