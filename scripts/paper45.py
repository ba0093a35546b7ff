"""The paper's comparison on the testbed (issue 45): three pre-registered families, read out.

docs/paper-comparison.md fixes every rule before the runs. 13 configurations on both stale arms
(`experiment=study_v3_reuse8`, `study_v3_lag8`) at lr 6e-4, seeds 0-7 under kernel settings A
and B; the outcome is the held-out change (final - step-0 held-out avg@8, `bapo report`'s
column). Three families, each with its own Holm at family-wise alpha 0.05:

- Q1, the paper's claim "BAPO ahead of GRPO, DAPO, TOPR and DCPO": BAPO at rho0 0.4 and 0.5,
  each minus each of the four, per arm (16 comparisons);
- Q2, 2026's staleness corrections against GRPO: VESPO - GRPO, LUSPO - GRPO, and GRPO with the
  KPop token mask minus its matched control (GRPO with the same recomputed proximal policy and
  behaviour-weight cap, no mask), per arm (6);
- Q3, the paper's ablation "raising c_high helps, loosening c_low hurts": fixed clip bounds
  [0.8, 1.28], [0.8, 2.0] and [0.6, 1.2], each minus GRPO's [0.8, 1.2], per arm (6).

Per comparison: each setting's difference of seed means and exact permutation p; pooled, the
mean over settings of the within-setting difference with the stratified permutation p
(`replicate.stratified_permutation_p`, 200,000 draws); **real** = the pooled p passes the
family's Holm and the difference has one sign under A and under B, **not replicated** = passes
with signs that differ, **indicated** = pooled p < 0.05 unadjusted, else **no**
(`stress2.answer`). A comparison without runs on both sides in both settings counts in its
family with p = 1 and reads "not determinable".

    python scripts/paper45.py STORE_A STORE_B [--out DIR] [--seeds 0-7]
    python scripts/paper45.py --export STORE OUT.csv
    python scripts/paper45.py --gate STORE    # the reuse gate: re-made stress-table runs

The reuse gate: the stress table's runs of GRPO, DAPO, BAPO (rho0 0.4), clip-higher and GRPO with
the recomputed proximal policy (commit 657327d, another machine) stand for this design's runs of
those configurations only if one run of each, re-made here at the design's commit (reuse8, seed
0, setting A, the stress table's own command), equals its committed row in every printed column.

A store is a tracking URI (experiment `paper45`) or per-run CSVs written by `--export` (commas
join stages of one setting).
"""

# ruff: noqa: E501  (markdown table rows read better whole)
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]

import replicate  # noqa: E402  (the stratified permutation test, the per-run CSV format)
import stress2  # noqa: E402  (the answer rule, the per-run columns)

study_v3 = replicate.study_v3
report = study_v3.report

EXPERIMENT = "paper45"
LR = stress2.LR  # 6e-4
ARMS = stress2.ARMS  # the same two stale arms
CONFIGURATIONS = (
    *("grpo", "dapo", "topr", "dcpo", "bapo0.4", "bapo0.5"),  # Q1
    *("vespo", "luspo", "grpo+recompute", "grpo+recompute+kpop"),  # Q2
    *("clip[0.80,1.28]", "clip[0.80,2.00]", "clip[0.60,1.20]"),  # Q3
)
FAMILIES: dict[str, tuple[tuple[str, str, str], ...]] = {
    # (arm, configuration, its baseline)
    "Q1": tuple(
        (arm, bapo, rival)
        for arm in ARMS
        for bapo in ("bapo0.4", "bapo0.5")
        for rival in ("grpo", "dapo", "topr", "dcpo")
    ),
    "Q2": tuple(
        (arm, config, base)
        for arm in ARMS
        for config, base in (
            ("vespo", "grpo"),
            ("luspo", "grpo"),
            ("grpo+recompute+kpop", "grpo+recompute"),
        )
    ),
    "Q3": tuple(
        (arm, clip, "grpo")
        for arm in ARMS
        for clip in ("clip[0.80,1.28]", "clip[0.80,2.00]", "clip[0.60,1.20]")
    ),
}
KEY = stress2.KEY  # held-out change
CSV_KEYS = stress2.CSV_KEYS
ALPHA = 0.05
SAMPLES = 200_000


def configuration(facets: dict[str, str]) -> str:
    """A run's configuration from its sweep facets: `bapo<rho0>` (the preset's 0.4 when not
    overridden), `clip[lo,hi]` for clip-higher (its 0.2 / 0.28 unless overridden), `grpo+recompute`
    (+`kpop`) for GRPO with `trainer.old_logprob=recompute` (and `rollout.seq_mask=kpop`)."""
    algo = facets.get("algo", "grpo")
    if algo == "bapo":
        return f"bapo{float(facets.get('algo.rho0', 0.4)):g}"
    if algo == "clip_higher":
        low = 1 - float(facets.get("algo.eps_low", 0.2))
        high = 1 + float(facets.get("algo.eps_high", 0.28))
        return f"clip[{low:.2f},{high:.2f}]"
    name = algo
    if facets.get("trainer.old_logprob", "behaviour") != "behaviour":
        name += f"+{facets['trainer.old_logprob']}"
    if facets.get("rollout.seq_mask", "none") != "none":
        name += f"+{facets['rollout.seq_mask']}"
    return name


def load(uri: str, experiment: str = EXPERIMENT) -> list[study_v3.Run]:
    """One setting's runs from its store, named by `configuration` (`stress2.load`'s checks:
    sweep jobs only, the recompute runs at `algo.behav_weight_cap=5`, one cell's runs differ
    only in the seed)."""
    return stress2.load(uri, experiment, configuration, lambda c: "+recompute" in c)


def load_setting(source: str, experiment: str = EXPERIMENT) -> list[study_v3.Run]:
    """CSV files (comma-joined stages) or a store; the same run twice is refused."""
    return replicate.load_setting(source, lambda uri: load(uri, experiment), CSV_KEYS)


def pick(runs: list[study_v3.Run], seeds: set[int] | None) -> list[study_v3.Run]:
    """The design's runs (both arms at lr 6e-4, the chosen seeds); a configuration outside the
    design's 13 is refused (ValueError): it belongs to no family."""
    return stress2.pick(runs, LR, seeds, CONFIGURATIONS)


def verdicts(
    settings: dict[str, list[study_v3.Run]],
    seeds: set[int] | None = None,
    samples: int = SAMPLES,
) -> dict[str, dict[tuple[str, str, str], dict[str, object]]]:
    """Per family, per comparison (arm, configuration, baseline): each setting's (difference, p,
    seeds a, seeds b) or None, and "pooled": (difference, p, Holm-rejected, answer), absent when
    a setting lacks either side."""
    picked = {name: pick(runs, seeds) for name, runs in settings.items()}
    out: dict[str, dict[tuple[str, str, str], dict[str, object]]] = {}
    for family, comparisons in FAMILIES.items():
        rows: dict[tuple[str, str, str], dict[str, object]] = {c: {} for c in comparisons}
        pooled: dict[tuple[str, str, str], tuple[float, float]] = {}
        for arm, config, base in comparisons:
            strata = []
            for name, runs in picked.items():
                a = study_v3.cell(runs, arm, LR, config, KEY)
                b = study_v3.cell(runs, arm, LR, base, KEY)
                result = study_v3.compare(a, b)
                rows[(arm, config, base)][name] = (
                    None if result is None else (*result, len(a), len(b))
                )
                strata.append((a, b))
            if all(a and b for a, b in strata):
                pooled[(arm, config, base)] = replicate.stratified_permutation_p(
                    strata, samples=samples
                )
        # Holm over the whole family: a comparison not computed counts with p = 1
        family_p = {"/".join(c): pooled[c][1] if c in pooled else 1.0 for c in comparisons}
        rejected = study_v3.holm(family_p, alpha=ALPHA)
        for key, (diff, p) in pooled.items():
            diffs = [rows[key][name][0] for name in picked]
            passed = rejected["/".join(key)]
            rows[key]["pooled"] = (diff, p, passed, stress2.answer(diffs, p, passed))
        out[family] = rows
    return out


def claims(results: dict[str, dict[tuple[str, str, str], dict[str, object]]]) -> list[str]:
    """The design's sentences, per arm: Q1 holds at a rho0 when all four of its comparisons are
    real and positive; Q3(a) when a c_high comparison is real and positive and none is real and
    negative; Q3(b) when [0.6, 1.2] - GRPO is real and negative."""

    def answer(family: str, arm: str, config: str, base: str) -> tuple[str, float] | None:
        pooled = results[family][(arm, config, base)].get("pooled")
        return None if pooled is None else (pooled[3], pooled[0])

    def real(found: tuple[str, float] | None, sign: int) -> bool:
        return found is not None and found[0] == "real" and found[1] * sign > 0

    lines = []
    for arm in ARMS:
        for bapo in ("bapo0.4", "bapo0.5"):
            found = [answer("Q1", arm, bapo, r) for r in ("grpo", "dapo", "topr", "dcpo")]
            verdict = (
                "not determinable"
                if any(f is None for f in found)
                else ("holds" if all(real(f, +1) for f in found) else "does not hold")
            )
            lines.append(f"Q1 {arm}: {bapo} ahead of GRPO, DAPO, TOPR and DCPO: {verdict}")
        high = [answer("Q3", arm, c, "grpo") for c in ("clip[0.80,1.28]", "clip[0.80,2.00]")]
        if any(f is None for f in high):
            verdict = "not determinable"
        else:
            helps = any(real(f, +1) for f in high) and not any(real(f, -1) for f in high)
            verdict = "holds" if helps else "does not hold"
        lines.append(f"Q3a {arm}: raising c_high helps: {verdict}")
        low = answer("Q3", arm, "clip[0.60,1.20]", "grpo")
        verdict = (
            "not determinable" if low is None else ("holds" if real(low, -1) else "does not hold")
        )
        lines.append(f"Q3b {arm}: loosening c_low hurts: {verdict}")
    return lines


# the stress table's configurations this design may reuse, by their names there
REUSABLE = {
    "grpo": "grpo",
    "dapo": "dapo",
    "bapo": "bapo0.4",
    "clip_higher": "clip[0.80,1.28]",
    "grpo+recompute": "grpo+recompute",
}
STRESS2_ROW = REPO / "docs" / "algos-pairs" / "stress2" / "setting-A-seed0.csv"


def gate(remade: list[study_v3.Run], committed: Path = STRESS2_ROW) -> dict[str, bool]:
    """Per reusable configuration (stress-table name): True when its re-made reuse8 seed-0 run
    equals the committed row in every column, compared as printed (the CSV's text). A
    configuration with no re-made run is False."""
    rows = {(r.arm, r.algo, r.seed): r for r in replicate.load_csv(committed, CSV_KEYS)}
    out = {}
    for name in REUSABLE:
        mine = [r for r in remade if (r.arm, r.algo, r.seed) == ("reuse8", name, 0)]
        theirs = rows.get(("reuse8", name, 0))
        out[name] = (
            len(mine) == 1
            and theirs is not None
            and all(str(mine[0].values.get(k)) == str(theirs.values.get(k)) for k in CSV_KEYS)
        )
    return out


def _cell(result: object) -> str:
    if result is None:
        return "missing"
    diff, p, na, nb = result
    return f"{diff:+.3f}, p = {p:.4f} ({na} v {nb})"


def table(rows: dict[tuple[str, str, str], dict[str, object]], names: list[str]) -> str:
    out = [
        "| arm | configuration | baseline | "
        + " | ".join(names)
        + f" | pooled difference, p | Holm (α 0.05 over {len(rows)}) | answer |",
        "|" + " --- |" * (len(names) + 6),
    ]
    for (arm, config, base), r in rows.items():
        pooled = r.get("pooled")
        tail = (
            f"{pooled[0]:+.3f}, p = {pooled[1]:.5f} | {'passes' if pooled[2] else 'fails'} | "
            f"**{pooled[3]}**"
            if pooled
            else "missing | | **not determinable**"
        )
        cells = " | ".join(_cell(r.get(n)) for n in names)
        out.append(f"| {arm} | {config} | {base} | {cells} | {tail} |")
    return "\n".join(out) + "\n"


def markdown(results: dict, names: list[str]) -> str:
    titles = {
        "Q1": "Q1: BAPO against the paper's four (held-out change, BAPO − rival)",
        "Q2": "Q2: 2026's staleness corrections against GRPO",
        "Q3": "Q3: the paper's clip ablation (fixed bounds − GRPO's [0.8, 1.2])",
    }
    parts = [f"## {titles[f]}\n\n" + table(results[f], names) for f in FAMILIES]
    parts.append("## The design's sentences\n\n" + "".join(f"- {c}\n" for c in claims(results)))
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--gate"] and len(argv) == 2:
        try:
            passed = gate(stress2.load(argv[1]))
        except report.ReportError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for name, ok in passed.items():
            print(f"{name}: {'equal: reused' if ok else 'differs or missing: re-made'}")
        return 0
    if argv[:1] == ["--export"]:
        if len(argv) != 3:
            print("error: --export takes STORE OUT.csv", file=sys.stderr)
            return 2
        try:
            runs = load(argv[1])
        except report.ReportError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        replicate.export_csv(runs, Path(argv[2]), CSV_KEYS)
        print(f"wrote {argv[2]} ({len(runs)} runs)")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store_a", help="setting A's runs: a tracking URI or CSV file(s)")
    parser.add_argument("store_b", help="setting B's runs: a tracking URI or CSV file(s)")
    parser.add_argument("--seeds", help="a seed range, e.g. 0-7 (default: every seed found)")
    parser.add_argument("--out", type=Path, help="also write paper45.md here")
    parser.add_argument("--samples", type=int, default=SAMPLES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        settings = {"A": load_setting(args.store_a), "B": load_setting(args.store_b)}
        results = verdicts(settings, replicate._seeds(args.seeds), args.samples)
    except (report.ReportError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = markdown(results, list(settings))
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paper45.md").write_text(text, encoding="utf-8")
        print(f"wrote {args.out}/paper45.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
