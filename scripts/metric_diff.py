"""Every logged metric of two runs, step by step, compared to the last bit (issue 32, item 3).

Two runs of one cell under two kernel settings (or two machines) agree bit for bit when every
metric they log has the same float64 value at every step. The console summary shows four decimals
and a few metrics; this reads the MLflow store (the `metrics` table of its `mlflow.db`) directly,
so nothing is rounded or left out.

    python scripts/metric_diff.py STORE_A STORE_B [--skip perf/ --skip time/]

A STORE is a run's `mlflow.db` or the directory that holds it, with exactly one run (the newest
run is taken when there are more). Prints per step how many metrics differ and by how much
(relative), the metrics identical at every step, and per other metric its first differing step
with both values; exit 0 when all agree, 1 when some differ.
Timing metrics (`perf/`, names ending `_s`) differ on every run and are skipped unless asked.
"""

from __future__ import annotations

import argparse
import math
import sqlite3
import sys
from pathlib import Path

TIMING = ("perf/", "time/", "timing/")


def load(store: str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of the newest run in `store`."""
    path = Path(store)
    if path.is_dir():
        path = path / "mlflow.db"
    if not path.is_file():
        raise SystemExit(f"error: {store}: no mlflow.db there; give a run's store or its mlflow.db")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    run = con.execute("select run_uuid from runs order by start_time desc limit 1").fetchone()
    if run is None:
        raise SystemExit(f"error: {store}: the store holds no run")
    out: dict[str, dict[int, float]] = {}
    rows = con.execute(
        "select key, step, value from metrics where run_uuid = ? order by key, step, timestamp",
        run,
    )
    for key, step, value in rows:
        out.setdefault(key, {})[int(step)] = float(value)  # the last value logged at a step
    if not out:
        raise SystemExit(f"error: {store}: its run logged no metrics (still starting?)")
    return out


def timing(key: str) -> bool:
    return key.startswith(TIMING) or key.endswith("_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--timing", action="store_true", help="compare timing metrics too")
    args = ap.parse_args(argv)
    a, b = load(args.a), load(args.b)
    keys = sorted(k for k in set(a) | set(b) if args.timing or not timing(k))
    first: dict[str, tuple[int, float | None, float | None]] = {}
    per_step: dict[int, list[float]] = {}  # step -> relative differences of the metrics there
    for key in keys:
        sa, sb = a.get(key, {}), b.get(key, {})
        for step in sorted(set(sa) | set(sb)):
            va, vb = sa.get(step), sb.get(step)
            rel = relative(va, vb)
            per_step.setdefault(step, []).append(rel)
            if rel and key not in first:
                first[key] = (step, va, vb)
    values = sum(len(v) for v in per_step.values())
    if not first:
        print(f"identical: {len(keys)} metrics, {values} values, every step, to the last bit")
        return 0
    print("step  metrics differing  largest relative difference")
    for step, rels in sorted(per_step.items()):
        print(f"{step:>4}  {sum(r > 0 for r in rels):>4} of {len(rels):<4}      {max(rels):.3g}")
    same = [k for k in keys if k not in first]
    print(f"identical at every step ({len(same)} of {len(keys)}): {', '.join(same)}")
    print(f"first difference of each of the other {len(first)} metrics:")
    for key, (step, va, vb) in sorted(first.items(), key=lambda kv: (kv[1][0], kv[0])):
        print(f"  step {step:>3}  {key:<40} {va!r:>24} {vb!r:>24}")
    return 1


def relative(va: float | None, vb: float | None) -> float:
    """0 for the same bits (NaN equals NaN here), inf when one run lacks the value."""
    if va is None or vb is None:
        return 0.0 if va is vb else math.inf
    if va == vb or (va != va and vb != vb):
        return 0.0
    return abs(va - vb) / max(abs(va), abs(vb))


if __name__ == "__main__":
    sys.exit(main())
