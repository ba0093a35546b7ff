"""Study v3's gates and pre-registered answers, computed from the runs' MLflow store.

docs/study-v3.md fixes every rule before the runs: the gates G0-G4 on GRPO's runs, the primary
lr per stale arm, Holm over Q1's four comparisons, the stability frontier at a -0.03 margin. This
script applies exactly those rules to the per-run values `bapo report` computes (held-out
change, clip fractions, rho, entropy, lengths, the Entropy-Clip quadrant shares), read from the
store unrounded, so the numbers in the results section can be re-derived by anyone who re-runs
the grid:

    python scripts/study_v3.py gates sqlite:///outputs/mlflow.db
    python scripts/study_v3.py answers sqlite:///outputs/mlflow.db

p-values are the exact two-sided permutation p of `bapo report --baseline` (5 + 5 seeds: all 252
relabelings), on the same unrounded values; Holm is `bapo report`'s too (`bapo_cli.report.holm`).
The script calls only the report's public names (`load_runs`, `label_runs`, `net_entropy_push`,
`permutation_p`, `holm`, `ReportError`).
"""

# ruff: noqa: E501  (markdown table rows read better whole)
from __future__ import annotations

import sys
from dataclasses import dataclass

from bapo_cli import report
from bapo_cli.report import holm, permutation_p

LRS = (1e-4, 3e-4, 6e-4, 1e-3)
ARMS = ("reuse1", "reuse8", "lag8")
STALE = ("reuse8", "lag8")
ALGOS = ("grpo", "clip_higher", "bapo0.4", "bapo0.5")
MARGIN = -0.03  # the frontier's margin on the seed-mean held-out change
G1_DROP = -0.05  # GRPO "breaks": seed-mean held-out change at most this, and 4 of 5 seeds < 0
ALPHA = 0.05


@dataclass
class Run:
    arm: str
    lr: float
    algo: str  # grpo | clip_higher | bapo0.4 | bapo0.5
    seed: int
    values: dict[str, float | None]


def _algo(facets: dict[str, str]) -> str:
    algo = facets.get("algo", "grpo")
    return f"bapo{float(facets['algo.rho0']):g}" if algo == "bapo" else algo


def load(uri: str, experiment: str = "study_v3") -> list[Run]:
    """The study's runs from the MLflow store, with `bapo report`'s per-run columns (unrounded)
    and each run's net entropy push of the active mass (as quadrants.md computes it)."""
    data = report.load_runs(uri, experiment=experiment)
    report.label_runs(data)
    runs = []
    for d in data:
        values = {**d.values, "net entropy push": report.net_entropy_push(d)}
        require_facets(
            d,
            "not a study v3 sweep job (its runs are `bapo train -m experiment=study_v3_... "
            "trainer.lr=... trainer.seed=...`)",
        )
        runs.append(
            Run(
                arm=d.facets["experiment"].removeprefix("study_v3_"),
                lr=float(d.facets["trainer.lr"]),
                algo=_algo(d.facets),
                seed=int(d.facets["trainer.seed"]),
                values=values,
            )
        )
    return runs


SWEEP_FACETS = ("experiment", "trainer.lr", "trainer.seed")


def require_facets(run: report.RunData, what: str) -> None:
    """One line naming the run and what it lacks when it is not a sweep job (no experiment,
    lr or seed facet); `what` says which sweeps its runs come from."""
    missing = [k for k in SWEEP_FACETS if k not in run.facets]
    if missing:
        raise report.ReportError(f"run {run.run_id[:12]} has no {', '.join(missing)}: {what}")


def cell(runs: list[Run], arm: str, lr: float, algo: str, key: str) -> list[float]:
    """One cell's per-seed values of `key`, in seed order."""
    picked = sorted(
        (r for r in runs if (r.arm, r.lr, r.algo) == (arm, lr, algo)), key=lambda r: r.seed
    )
    return [r.values[key] for r in picked if r.values.get(key) is not None]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compare(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """(mean(a) - mean(b), exact two-sided permutation p); None if a side is empty."""
    if not a or not b:
        return None
    return mean(a) - mean(b), permutation_p(a, b)


def frontier(change_by_lr: dict[float, float | None], margin: float = MARGIN) -> str:
    """The largest grid lr at which, and at every smaller grid lr, the seed-mean held-out change
    is above `margin`: "< 1e-4" when the smallest fails, "≥ 1e-3" when all pass (censored)."""
    passed = None
    for lr in LRS:
        value = change_by_lr.get(lr)
        if value is None or not value > margin:
            break
        passed = lr
    if passed is None:
        return f"< {LRS[0]:g}"
    return f"≥ {LRS[-1]:g}" if passed == LRS[-1] else f"{passed:g}"


def frontier_index(text: str) -> int:
    """A frontier on the grid as an index: -1 below it, 0..3 at a grid lr (3 also when censored
    at the top)."""
    if text.startswith("<"):
        return -1
    return LRS.index(float(text.removeprefix("≥ ")))


def frontier_higher(mine: str, theirs: str) -> str:
    """Q3: "yes" at least one grid step higher, "no" the same or lower, "not determinable"
    when both are censored at the same end of the grid."""
    if mine == theirs and (mine.startswith("<") or mine.startswith("≥")):
        return "not determinable"
    return "yes" if frontier_index(mine) > frontier_index(theirs) else "no"


def g1(changes: list[float]) -> bool:
    """GRPO breaks: seed-mean held-out change <= -0.05 and at least 4 of its 5 seeds below 0."""
    return bool(changes) and mean(changes) <= G1_DROP and sum(c < 0 for c in changes) >= 4


def primary_lr(runs: list[Run], arm: str) -> float | None:
    """6e-4 if G1 holds there for GRPO on `arm`, else 1e-3 if it does there, else None."""
    for lr in (6e-4, 1e-3):
        if g1(cell(runs, arm, lr, "grpo", "held-out change")):
            return lr
    return None


def _f(value: float | None, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _cmp(result: tuple[float, float] | None) -> str:
    return "—" if result is None else f"{result[0]:+.3f}, p = {result[1]:.3f}"


def gates(runs: list[Run]) -> str:
    """G0-G4 on GRPO's runs, as markdown."""
    runs = [r for r in runs if r.algo == "grpo"]
    out = []
    starts = [r.values["held-out start"] for r in runs if r.values["held-out start"] is not None]
    g0 = mean(starts)
    out.append(
        f"**G0** step-0 held-out avg@8, mean over GRPO's {len(starts)} runs: {_f(g0)} "
        f"(≥ 0.15 needed): **{'passed' if g0 is not None and g0 >= 0.15 else 'failed'}**\n"
    )
    out.append("**G1** GRPO breaks (seed-mean held-out change ≤ −0.05 and ≥ 4 of 5 seeds < 0):\n")
    out.append("| arm | " + " | ".join(f"lr {lr:g}" for lr in LRS) + " |")
    out.append("|" + " --- |" * (len(LRS) + 1))
    for arm in ARMS:
        cells = []
        for lr in LRS:
            ch = cell(runs, arm, lr, "grpo", "held-out change")
            below = sum(c < 0 for c in ch)
            cells.append(
                f"{_f(mean(ch), sign=True)} ({below}/{len(ch)} < 0): {'holds' if g1(ch) else 'no'}"
            )
        out.append(f"| {arm} | " + " | ".join(cells) + " |")
    out.append("")
    for arm in STALE:
        lr = primary_lr(runs, arm)
        out.append(f"- primary stressed lr on {arm}: **{'none' if lr is None else f'{lr:g}'}**")
    out.append("")
    out.append(
        "**G2** GRPO stale arm − GRPO on-policy control (difference, exact permutation p):\n"
    )
    out.append("| arm | lr | held-out change | final entropy |")
    out.append("| --- | --- | --- | --- |")
    for arm in STALE:
        for lr in LRS:
            row = [
                _cmp(compare(cell(runs, arm, lr, "grpo", k), cell(runs, "reuse1", lr, "grpo", k)))
                for k in ("held-out change", "final entropy")
            ]
            out.append(f"| {arm} | {lr:g} | {row[0]} | {row[1]} |")
    out.append("")
    out.append(
        "**G3** GRPO's clip fraction low + high (mean over steps, seed mean) ≥ 1% "
        "at the primary lr:\n"
    )
    for arm in STALE:
        lr = primary_lr(runs, arm)
        if lr is None:
            out.append(f"- {arm}: no primary lr")
            continue
        low = cell(runs, arm, lr, "grpo", "clipfrac low")
        high = cell(runs, arm, lr, "grpo", "clipfrac high")
        total = mean([a + b for a, b in zip(low, high, strict=True)])
        out.append(
            f"- {arm} at {lr:g}: low {_f(mean(low))} + high {_f(mean(high))} = {_f(total)}: "
            f"**{'holds' if total is not None and total >= 0.01 else 'fails'}**"
        )
    out.append("")
    out.append(
        "**G4** GRPO's start rho (first 10% of steps) on the on-policy control, "
        "seed mean (≤ 0.4):\n"
    )
    for lr in LRS:
        rho = mean(cell(runs, "reuse1", lr, "grpo", "start rho"))
        out.append(
            f"- lr {lr:g}: {_f(rho)}: **{'holds' if rho is not None and rho <= 0.4 else 'fails'}**"
        )
    return "\n".join(out) + "\n"


def answers(runs: list[Run]) -> str:
    """Q1-Q6 by the design's rules, as markdown."""
    out = []
    primaries = {arm: primary_lr(runs, arm) for arm in STALE}
    starts = [r.values["held-out start"] for r in runs if r.algo == "grpo"]
    g0 = mean([s for s in starts if s is not None])
    key = "held-out change"

    out.append("### Q1 (primary): BAPO − GRPO, held-out change, at each stale arm's primary lr\n")
    q1 = {}
    for arm in STALE:
        lr = primaries[arm]
        for algo in ("bapo0.4", "bapo0.5"):
            if lr is None:
                continue
            q1[(arm, algo)] = compare(
                cell(runs, arm, lr, algo, key), cell(runs, arm, lr, "grpo", key)
            )
    tested = {k: v for k, v in q1.items() if v is not None}
    rejected = holm({f"{a}/{b}": v[1] for (a, b), v in tested.items()}, alpha=ALPHA)
    out.append(
        "| arm | primary lr | BAPO | difference | p | Holm (α = 0.05 over the family) | answer |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    q1_answer = {}
    for arm in STALE:
        for algo in ("bapo0.4", "bapo0.5"):
            lr = primaries[arm]
            name = f"ρ0 {algo.removeprefix('bapo')}"
            if g0 is None or g0 < 0.15 or lr is None:
                q1_answer[(arm, algo)] = "not determinable"
                out.append(
                    f"| {arm} | {'none' if lr is None else f'{lr:g}'} | {name} | | | | not determinable |"
                )
                continue
            diff, p = q1[(arm, algo)]
            sig = rejected[f"{arm}/{algo}"]
            ans = "yes" if sig and diff > 0 else "no"
            q1_answer[(arm, algo)] = ans
            out.append(
                f"| {arm} | {lr:g} | {name} | {diff:+.3f} | {p:.3f} | "
                f"{'rejected' if sig else 'not rejected'} | **{ans}** |"
            )
    out.append("")

    out.append(
        "### Q2 (secondary, unadjusted p): clip-higher − GRPO and BAPO − clip-higher at the primary lr\n"
    )
    out.append("| arm | lr | comparison | difference, p | reading |")
    out.append("| --- | --- | --- | --- | --- |")
    for arm in STALE:
        lr = primaries[arm]
        if lr is None:
            continue
        for mine, theirs in (
            ("clip_higher", "grpo"),
            ("bapo0.4", "clip_higher"),
            ("bapo0.5", "clip_higher"),
        ):
            result = compare(cell(runs, arm, lr, mine, key), cell(runs, arm, lr, theirs, key))
            reading = (
                "indicated" if result and result[1] < 0.05 and result[0] > 0 else "not indicated"
            )
            out.append(f"| {arm} | {lr:g} | {mine} − {theirs} | {_cmp(result)} | {reading} |")
    out.append("")

    out.append(
        "### Q3: stability frontier (largest grid lr with seed-mean held-out change > −0.03 there and below)\n"
    )
    out.append(
        "| arm | "
        + " | ".join(ALGOS)
        + " | BAPO ρ0 0.4 higher than GRPO? | ρ0 0.5? | clip-higher? |"
    )
    out.append("|" + " --- |" * (len(ALGOS) + 4))
    for arm in STALE:
        fr = {a: frontier({lr: mean(cell(runs, arm, lr, a, key)) for lr in LRS}) for a in ALGOS}
        verdicts = [
            frontier_higher(fr[a], fr["grpo"]) for a in ("bapo0.4", "bapo0.5", "clip_higher")
        ]
        out.append(
            f"| {arm} | " + " | ".join(fr[a] for a in ALGOS) + " | " + " | ".join(verdicts) + " |"
        )
    control = frontier({lr: mean(cell(runs, "reuse1", lr, "grpo", key)) for lr in LRS})
    out.append(f"\nOn-policy GRPO's frontier: {control}.\n")

    out.append(
        "### Q4: staleness and GRPO; does stale BAPO reach on-policy GRPO? (held-out change, difference, p)\n"
    )
    out.append(
        "| lr | arm | GRPO stale − GRPO on-policy | BAPO ρ0 0.4 stale − GRPO on-policy | BAPO ρ0 0.5 stale − GRPO on-policy |"
    )
    out.append("| --- | --- | --- | --- | --- |")
    for lr in LRS:
        base = cell(runs, "reuse1", lr, "grpo", key)
        for arm in STALE:
            row = [
                _cmp(compare(cell(runs, arm, lr, a, key), base))
                for a in ("grpo", "bapo0.4", "bapo0.5")
            ]
            out.append(f"| {lr:g} | {arm} | " + " | ".join(row) + " |")
    out.append("")

    out.append("### Q5: mechanism read-outs at the primary lr (seed means)\n")
    out.append(
        "| arm | lr | algo | rho before → after search | clip low | clip high | net entropy push | Q5 |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm in STALE:
        lr = primaries[arm]
        if lr is None:
            continue
        grpo_low = mean(cell(runs, arm, lr, "grpo", "clipfrac low"))
        for algo in ALGOS:
            before = mean(cell(runs, arm, lr, algo, "mean rho before"))
            after = mean(cell(runs, arm, lr, algo, "mean rho"))
            start = mean(cell(runs, arm, lr, algo, "start rho"))
            low = mean(cell(runs, arm, lr, algo, "clipfrac low"))
            high = mean(cell(runs, arm, lr, algo, "clipfrac high"))
            p = mean(cell(runs, arm, lr, algo, "net entropy push"))
            rho = f"{_f(before)} → {_f(after)}" if before is not None else f"(start {_f(start)})"
            verdict = ""
            if algo.startswith("bapo"):
                if q1_answer.get((arm, algo)) != "yes":
                    verdict = "not determinable (Q1 not yes)"
                else:
                    a = before is not None and after is not None and after - before >= 0.02
                    b = low is not None and grpo_low is not None and low > grpo_low
                    grpo_push = mean(cell(runs, arm, lr, "grpo", "net entropy push"))
                    c = p is not None and grpo_push is not None and p > grpo_push
                    verdict = f"{'yes' if a and b and c else 'no'} (a {a}, b {b}, c {c})"
            out.append(
                f"| {arm} | {lr:g} | {algo} | {rho} | {_f(low)} | {_f(high)} | "
                f"{'—' if p is None else f'{p:+.3f}'} | {verdict} |"
            )
    out.append("")

    out.append(
        "### Q6: the form of the breakdown, where GRPO breaks (G1), per algorithm (seed means)\n"
    )
    out.append(
        "| arm | lr | algo | held-out change | entropy start → final | length start → final | budget hit final |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for arm in ARMS:
        for lr in LRS:
            if not g1(cell(runs, arm, lr, "grpo", key)):
                continue
            for algo in ALGOS:
                ch = cell(runs, arm, lr, algo, key)
                if not ch:
                    continue
                e0, e1 = (
                    mean(cell(runs, arm, lr, algo, k)) for k in ("start entropy", "final entropy")
                )
                l0, l1 = (
                    mean(cell(runs, arm, lr, algo, k)) for k in ("length start", "length final")
                )
                hit = mean(cell(runs, arm, lr, algo, "budget hit final"))
                out.append(
                    f"| {arm} | {lr:g} | {algo} | {_f(mean(ch), sign=True)} | {_f(e0)} → {_f(e1)} | "
                    f"{_f(l0, 1)} → {_f(l1, 1)} | {_f(hit)} |"
                )
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("gates", "answers"):
        print("usage: python scripts/study_v3.py gates|answers TRACKING_URI", file=sys.stderr)
        return 2
    try:
        runs = load(argv[1])
    except report.ReportError as err:
        print(f"study_v3: {err}", file=sys.stderr)
        return 2
    print(gates(runs) if argv[0] == "gates" else answers(runs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
