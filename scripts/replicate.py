"""Study v3's Q1 under two machines or kernel settings: both verdicts and the pooled one.

docs/study-v3.md ("Replication across machines and kernel settings") fixes the rules before the
runs: per setting, Q1's four comparisons (BAPO − GRPO held-out change at lr 6e-4) with the exact
permutation p and Holm over the four; pooled, the mean over settings of the within-setting
difference, with labels permuted *within* each setting (a stratified permutation test), Holm over
the four; a "yes" is a pooled yes whose difference is positive under both settings.

    python scripts/replicate.py STORE_A STORE_B [--lr 6e-4] [--seeds 0-7]
    python scripts/replicate.py --export STORE OUT.csv

Each of A and B is one setting's runs of the grid: an MLflow store (tracking URI or directory;
experiment `study_v3`, as the presets set it) or a per-run CSV written by `--export` (the committed
docs/study-v3/replication/*.csv: one row per run, `arm,lr,algo,seed` and the outcome columns), so
a verdict can be re-drawn from the repository without the stores. Several CSVs of one setting
(stages) join with commas: `a1.csv,a2.csv`. Only the Q1 cells at `--lr` are read.
"""

# ruff: noqa: E501  (markdown table rows read better whole)
from __future__ import annotations

import argparse
import csv
import itertools
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import study_v3  # noqa: E402  (the study's loader, cells, permutation p and Holm: one copy)

COMPARISONS = tuple((arm, algo) for arm in study_v3.STALE for algo in ("bapo0.4", "bapo0.5"))
KEY = "held-out change"
CSV_KEYS = ("held-out start", "held-out final", "held-out change", "final entropy")
CSV_HEAD = ("arm", "lr", "algo", "seed", *CSV_KEYS)


def export_csv(runs: list[study_v3.Run], out: Path, keys: tuple[str, ...] = CSV_KEYS) -> None:
    """One row per run (sorted by arm, lr, algo, seed): the columns the verdicts read (`keys`;
    scripts/stress2.py adds its own)."""
    rows = sorted(runs, key=lambda r: (r.arm, r.lr, r.algo, r.seed))
    with out.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(("arm", "lr", "algo", "seed", *keys))
        for r in rows:
            writer.writerow([r.arm, r.lr, r.algo, r.seed, *(r.values.get(k) for k in keys)])


def _number(text: str, what: str, path: Path) -> float | None:
    if text in ("", "None"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{path}: {what} {text!r} is not a number") from None


def load_csv(path: Path, keys: tuple[str, ...] = CSV_KEYS) -> list[study_v3.Run]:
    """The runs of an `export_csv` file (the `keys` columns it has; `held-out change` is
    required); a missing column or a non-number is one ValueError."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [
            c for c in ("arm", "lr", "algo", "seed", KEY) if c not in (reader.fieldnames or [])
        ]
        if missing:
            raise ValueError(
                f"{path}: no column {', '.join(missing)} "
                f"(columns: arm, lr, algo, seed, {', '.join(keys)})"
            )
        runs = []
        for row in reader:
            values = {k: _number(row[k], k, path) for k in keys if k in row}
            runs.append(
                study_v3.Run(
                    arm=row["arm"],
                    lr=_number(row["lr"], "lr", path),
                    algo=row["algo"],
                    seed=int(_number(row["seed"], "seed", path)),
                    values=values,
                )
            )
    return runs


def load_setting(
    source: str,
    load: Callable[[str], list[study_v3.Run]] = study_v3.load,
    keys: tuple[str, ...] = CSV_KEYS,
) -> list[study_v3.Run]:
    """One setting's runs: CSV files (comma-joined, their `keys` columns) or an MLflow store
    (read by `load`). The same run (arm, lr, algo, seed) twice is refused: stages must not
    overlap."""
    if source.endswith(".csv") or ".csv," in source:
        runs = [r for part in source.split(",") for r in load_csv(Path(part), keys)]
    else:
        runs = load(source)
    seen: set[tuple] = set()
    for r in runs:
        key = (r.arm, r.lr, r.algo, r.seed)
        if key in seen:
            raise ValueError(f"{source}: the run {key} appears twice (overlapping stages?)")
        seen.add(key)
    return runs


def stratified_permutation_p(
    strata: list[tuple[list[float], list[float]]], *, samples: int = 200_000
) -> tuple[float, float]:
    """(statistic, two-sided p) of the mean over strata of mean(a) − mean(b), under the null that
    labels are exchangeable within each stratum (never across: a setting shifts both groups).

    Exact over the product of every stratum's relabelings when there are at most `samples` of
    them, else a seeded Monte-Carlo estimate that counts the observed split."""
    if not strata or any(not a or not b for a, b in strata):
        raise ValueError("every stratum needs at least one value on each side")

    def stat_of(stratum: tuple[list[float], list[float]], idx: tuple[int, ...]) -> float:
        a, b = stratum
        pooled = [*a, *b]
        sa = sum(pooled[i] for i in idx)
        return sa / len(a) - (sum(pooled) - sa) / len(b)

    observed_idx = [tuple(range(len(a))) for a, _ in strata]
    observed = sum(stat_of(s, i) for s, i in zip(strata, observed_idx, strict=True)) / len(strata)
    tol = 1e-12 * max(1.0, abs(observed))
    # each stratum's possible contributions, one per relabeling
    choices = [
        [stat_of(s, idx) for idx in itertools.combinations(range(len(s[0]) + len(s[1])), len(s[0]))]
        for s in strata
    ]
    total = math.prod(len(c) for c in choices)
    if total <= samples:
        hits = sum(
            abs(sum(combo) / len(strata)) >= abs(observed) - tol
            for combo in itertools.product(*choices)
        )
        return observed, hits / total
    rng = random.Random(0)
    if len({len(c) for c in choices}) == 1:  # one draw size: the same draws, in bulk
        draws = choice_draws(rng, len(choices[0]), samples * len(strata))
        total = np.zeros(samples)
        for s, values in enumerate(choices):  # summed stratum by stratum, as `sum` below adds
            total = total + np.asarray(values)[draws[s :: len(strata)]]
        hits = int(np.count_nonzero(np.abs(total / len(strata)) >= abs(observed) - tol))
    else:
        hits = sum(
            abs(sum(rng.choice(c) for c in choices) / len(strata)) >= abs(observed) - tol
            for _ in range(samples)
        )
    return observed, (hits + 1) / (samples + 1)


def choice_draws(rng: random.Random, n: int, count: int) -> np.ndarray:
    """The indices `count` calls of `rng.choice(seq)` with len(seq) == `n` pick, in order, and
    `rng` left unchanged: CPython takes the top n.bit_length() bits of one 32-bit Mersenne
    Twister word per try and tries again while they are >= n, so the words come in bulk from a
    NumPy generator set to `rng`'s state (a Python loop of millions of draws took seconds)."""
    if not 0 < n < 2**32:
        raise ValueError(f"n must be in [1, 2**32): {n}")
    state = rng.getstate()[1]
    mt = np.random.RandomState()
    mt.set_state(("MT19937", np.array(state[:624], dtype=np.uint32), state[624]))
    shift = 32 - n.bit_length()
    found: list[np.ndarray] = []
    left = count
    while left > 0:
        words = mt.randint(0, 2**32, size=left + left // 2 + 64, dtype=np.uint64) >> shift
        kept = words[words < n][:left]
        found.append(kept)
        left -= kept.size
    return np.concatenate(found) if found else np.empty(0, dtype=np.uint64)


def verdicts(
    settings: dict[str, list[study_v3.Run]], lr: float, seeds: set[int] | None = None
) -> dict[tuple[str, str], dict[str, object]]:
    """Per Q1 comparison: each setting's (difference, p, Holm-rejected) and the pooled
    (difference, p, Holm-rejected, answer), by the design's rules."""
    picked = {
        name: [r for r in runs if seeds is None or r.seed in seeds]
        for name, runs in settings.items()
    }
    out: dict[tuple[str, str], dict[str, object]] = {c: {} for c in COMPARISONS}
    for name, runs in picked.items():
        tested = {}
        for arm, algo in COMPARISONS:
            result = study_v3.compare(
                study_v3.cell(runs, arm, lr, algo, KEY), study_v3.cell(runs, arm, lr, "grpo", KEY)
            )
            out[(arm, algo)][name] = result
            if result is not None:
                tested[f"{arm}/{algo}"] = result[1]
        rejected = study_v3.holm(tested)
        for arm, algo in COMPARISONS:
            if out[(arm, algo)][name] is not None:
                diff, p = out[(arm, algo)][name]
                out[(arm, algo)][name] = (diff, p, rejected[f"{arm}/{algo}"])
    pooled = {}
    for arm, algo in COMPARISONS:
        strata = [
            (
                study_v3.cell(runs, arm, lr, algo, KEY),
                study_v3.cell(runs, arm, lr, "grpo", KEY),
            )
            for runs in picked.values()
        ]
        if all(a and b for a, b in strata):
            pooled[(arm, algo)] = stratified_permutation_p(strata)
    rejected = study_v3.holm({f"{a}/{b}": v[1] for (a, b), v in pooled.items()})
    for (arm, algo), (diff, p) in pooled.items():
        signs = [out[(arm, algo)][name] for name in picked]
        same_sign = all(s is not None and (s[0] > 0) == (diff > 0) for s in signs)
        sig = rejected[f"{arm}/{algo}"]
        if not sig:
            answer = "no"
        elif not same_sign:
            answer = "not replicated"
        elif diff > 0:
            answer = "yes"
        else:
            answer = "replicated harm"
        out[(arm, algo)]["pooled"] = (diff, p, sig, answer)
    return out


def _cell(result: object) -> str:
    if result is None:
        return "missing"
    diff, p, sig = result[:3]
    return f"{diff:+.3f}, p = {p:.3f}{' (Holm rejects)' if sig else ''}"


def table(results: dict[tuple[str, str], dict[str, object]], names: list[str]) -> str:
    head = "| arm | BAPO | " + " | ".join(names) + " | pooled | answer |"
    rows = [head, "|" + " --- |" * (len(names) + 4)]
    for arm, algo in COMPARISONS:
        r = results[(arm, algo)]
        pooled = r.get("pooled")
        rows.append(
            f"| {arm} | ρ0 {algo.removeprefix('bapo')} | "
            + " | ".join(_cell(r.get(n)) for n in names)
            + f" | {_cell(pooled)} | **{pooled[3] if pooled else 'not determinable'}** |"
        )
    return "\n".join(rows) + "\n"


def _seeds(text: str | None) -> set[int] | None:
    if text is None:
        return None
    lo, _, hi = text.partition("-")
    return set(range(int(lo), int(hi or lo) + 1))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv[:1] == ["--export"]:
        if len(argv) != 3:
            print("replicate: --export takes STORE OUT.csv", file=sys.stderr)
            return 2
        try:
            export_csv(study_v3.load(argv[1]), Path(argv[2]))
        except study_v3.report.ReportError as err:
            print(f"replicate: {err}", file=sys.stderr)
            return 2
        print(f"wrote {argv[2]}")
        return 0
    parser.add_argument("store_a", help="setting A's runs: a tracking URI or CSV file(s)")
    parser.add_argument("store_b", help="setting B's runs: a tracking URI or CSV file(s)")
    parser.add_argument("--lr", type=float, default=6e-4, help="the primary lr (6e-4)")
    parser.add_argument("--seeds", help="a seed range, e.g. 0-4 (default: every seed found)")
    parser.add_argument("--names", default="A,B", help="column names of the two stores")
    args = parser.parse_args(argv)
    names = args.names.split(",")
    if len(names) != 2:
        print("replicate: --names takes two names, e.g. A,B", file=sys.stderr)
        return 2
    try:
        settings = {names[0]: load_setting(args.store_a), names[1]: load_setting(args.store_b)}
    except (study_v3.report.ReportError, ValueError, OSError) as err:
        print(f"replicate: {err}", file=sys.stderr)
        return 2
    print(table(verdicts(settings, args.lr, _seeds(args.seeds)), names), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
