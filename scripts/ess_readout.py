"""The stress design's secondary question (docs/algorithms.md, issue 34): does a falling ESS in
the first quarter of training predict a held-out collapse?

The rule, fixed before the runs: per run, E_q = the minimum of `actor/ess` over the logged steps
1 ... ceil(S/4) (`bapo report`'s column "ESS first quarter min", bapo_cli.report.columns);
**falling** = E_q < 0.5; **collapse** = final held-out avg@8 < 0.05 (the column "held-out
final"). Per setting, over all its runs (both arms, every configuration), the 2 x 2 table of
falling x collapse and the one-sided Fisher exact test (more collapses among falling-ESS runs),
alpha 0.05 unadjusted; the answer is "yes" only if p < 0.05 under A and under B separately.
Reported beside it, descriptive: sensitivity, specificity, the AUROC of -E_q, and the same table
within each configuration that has both collapsed and non-collapsed runs.

Pure functions on plain numbers (no store, no torch), used by scripts/stress2.py; Fisher's test
is a plain hypergeometric sum in exact integers, so it needs no scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EQ_KEY = "ESS first quarter min"  # bapo report's column: E_q
FINAL_KEY = "held-out final"
FALLING = 0.5  # E_q below this: a falling ESS
COLLAPSE = 0.05  # final held-out avg@8 below this: a collapse
ALPHA = 0.05


def fisher_greater(a: int, b: int, c: int, d: int) -> float:
    """One-sided Fisher exact p of the 2 x 2 table [[a, b], [c, d]] (rows falling / not falling,
    columns collapse / no collapse): P(X >= a) for X hypergeometric with the table's margins,
    i.e. the chance, with the margins fixed, of at least as many collapses among the falling
    runs. scipy.stats.fisher_exact(..., alternative="greater") computes the same number."""
    if min(a, b, c, d) < 0:
        raise ValueError(f"a 2 x 2 table holds counts >= 0, not {[a, b, c, d]}")
    n, row, col = a + b + c + d, a + b, a + c
    hi = min(row, col)
    hits = sum(math.comb(col, k) * math.comb(n - col, row - k) for k in range(a, hi + 1))
    return hits / math.comb(n, row)


def auroc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """Area under the ROC curve of `scores` for `positive`: the chance that a random positive
    scores above a random negative, a tie counting 1/2 (the Mann-Whitney U over n1 n0, from
    mid-ranks). None when either class is empty."""
    if len(scores) != len(positive):
        raise ValueError("auroc needs one label per score")
    n1 = sum(1 for p in positive if p)
    n0 = len(positive) - n1
    if n1 == 0 or n0 == 0:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # mid-rank of a tied run of values
        i = j + 1
    u = sum(r for r, p in zip(ranks, positive, strict=True) if p) - n1 * (n1 + 1) / 2
    return u / (n1 * n0)


@dataclass
class EssTable:
    """The 2 x 2 table of one set of runs and what is read from it."""

    falling_collapse: int  # a
    falling_kept: int  # b
    steady_collapse: int  # c
    steady_kept: int  # d
    left_out: int  # runs without E_q or without a held-out final
    p: float  # one-sided Fisher
    sensitivity: float | None  # falling among the collapsed: a / (a + c)
    specificity: float | None  # not falling among the rest: d / (b + d)
    auroc: float | None  # of -E_q for collapse

    @property
    def runs(self) -> int:
        return self.falling_collapse + self.falling_kept + self.steady_collapse + self.steady_kept


def ess_table(pairs: Sequence[tuple[float | None, float | None]]) -> EssTable:
    """The table of runs given as (E_q, held-out final); a run missing either is left out."""
    kept = [(e, f) for e, f in pairs if e is not None and f is not None]
    left_out = len(pairs) - len(kept)
    falling = [e < FALLING for e, _ in kept]
    collapse = [f < COLLAPSE for _, f in kept]
    cells = {(x, y): 0 for x in (True, False) for y in (True, False)}
    for x, y in zip(falling, collapse, strict=True):
        cells[(x, y)] += 1
    a, b = cells[(True, True)], cells[(True, False)]
    c, d = cells[(False, True)], cells[(False, False)]
    return EssTable(
        falling_collapse=a,
        falling_kept=b,
        steady_collapse=c,
        steady_kept=d,
        left_out=left_out,
        p=fisher_greater(a, b, c, d),
        sensitivity=a / (a + c) if a + c else None,
        specificity=d / (b + d) if b + d else None,
        auroc=auroc([-e for e, _ in kept], collapse),
    )


def answer(tables: dict[str, EssTable], settings: Sequence[str]) -> str:
    """ "yes" only if Fisher's p < 0.05 under every one of the design's settings (A and B), each
    on its own; "no" otherwise, "not determinable" while a setting has no runs."""
    if any(s not in tables or tables[s].runs == 0 for s in settings):
        return "not determinable"
    return "yes" if all(tables[s].p < ALPHA for s in settings) else "no"


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def fmt_p(p: float) -> str:
    """A p-value to four decimals, or in scientific notation below 1e-4 (not "0.0000")."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def table_markdown(tables: dict[str, EssTable]) -> str:
    """One row per setting: the four cells, Fisher's p and the descriptive read-outs."""
    rows = [
        "| setting | runs | falling & collapse | falling & not | steady & collapse | "
        "steady & not | Fisher p (one-sided) | sensitivity | specificity | AUROC of −E_q | "
        "left out |",
        "|" + " --- |" * 11,
    ]
    for name, t in tables.items():
        rows.append(
            f"| {name} | {t.runs} | {t.falling_collapse} | {t.falling_kept} | "
            f"{t.steady_collapse} | {t.steady_kept} | {fmt_p(t.p)} | {_f(t.sensitivity)} | "
            f"{_f(t.specificity)} | {_f(t.auroc)} | {t.left_out} |"
        )
    return "\n".join(rows) + "\n"
