"""The stress table again (issue 34): 40 pooled verdicts and the ESS answer, from two settings.

docs/algorithms.md ("The stress table again, both stale arms and two kernel settings") fixes the
rules before the runs. 21 configurations: the 19 presets, plus GRPO with
`trainer.old_logprob=loglinear` (A-3PO) and `=recompute` (decoupled PPO), both with
`algo.behav_weight_cap=5`; two arms, `experiment=study_v3_reuse8` and `study_v3_lag8`, at lr 6e-4;
seeds 0-7 under each of two kernel settings A and B. Per arm, every configuration against
`algo=grpo` (default old log-probs): 40 comparisons of the held-out change (final - step-0
held-out avg@8, `bapo report`'s column, bapo_cli.report.columns).

- per setting: the difference of seed means and the exact two-sided permutation p (8 + 8);
- pooled, the primary verdict: the mean over settings of the within-setting difference, p from
  the stratified permutation test with labels permuted within each setting
  (`replicate.stratified_permutation_p`, Monte-Carlo with 200,000 draws), Holm over the 40 at
  family-wise alpha 0.05 (a comparison with no runs counts in the 40 with p = 1: the family is
  the design's, not whatever has been run);
- the answer: **real** when the pooled p passes Holm and the difference has the same sign under
  A and B; **not replicated** when it passes with opposite signs; else **indicated** when the
  pooled p < 0.05 unadjusted; else **no**.

The secondary question (does a falling ESS in the first quarter predict a collapse?) is read
out by scripts/ess_readout.py from the same runs: per setting the 2 x 2 table, one-sided Fisher,
the answer "yes" only if p < 0.05 under A and under B, and the within-configuration tables.

    python scripts/stress2.py STORE_A STORE_B [--out DIR] [--seeds 0-7]
    python scripts/stress2.py --export STORE OUT.csv

A store is a tracking URI (experiment `algos_stress2`, `--experiment` for another) or per-run CSV
written by `--export` (replicate.py's format with this read-out's columns; stages of one setting
join with commas: `a1.csv,a2.csv`), so the verdicts can be re-drawn from committed files.
"""

# ruff: noqa: E501  (markdown table rows read better whole)
from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ess_readout  # noqa: E402  (the ESS question's statistics)
import replicate  # noqa: E402  (the stratified permutation test, the per-run CSV format)

study_v3 = replicate.study_v3  # the loader's Run, cells, permutation p and Holm: one copy
report = study_v3.report

EXPERIMENT = "algos_stress2"
LR = 6e-4
ARMS = ("reuse8", "lag8")  # experiment=study_v3_<arm>
PRESETS = (  # `algo=glob(*)`: the 19 presets as shipped when the design was committed
    *("bapo", "bapo_recipe", "ce_gppo", "cispo", "clip_cov", "clip_higher", "dapo", "dppo_kl"),
    *("dppo_tv", "drgrpo", "grpo", "gspo", "kl_cov", "m2po", "ppo", "sapo"),
    *("vcpo", "minpro", "prime_default"),
)
DECOUPLED = ("grpo+loglinear", "grpo+recompute")  # trainer.old_logprob on GRPO, cap 5
BEHAV_CAP = "5"  # algo.behav_weight_cap of the two, as AReaL's M2PO example
CONFIGURATIONS = (*PRESETS, *DECOUPLED)  # 21
BASELINE = "grpo"
COMPARISONS = tuple((arm, c) for arm in ARMS for c in CONFIGURATIONS if c != BASELINE)  # 40
KEY = "held-out change"
CSV_KEYS = (
    *("held-out start", "held-out final", "held-out change", "final reward", "final entropy"),
    *(ess_readout.EQ_KEY, "final ESS"),
)
SAMPLES = 200_000
ALPHA = 0.05
ANSWERS = ("real", "not replicated", "indicated", "no")


def configuration(facets: dict[str, str]) -> str:
    """A run's configuration: its `algo` preset, with `+<old_logprob>` when the run did not keep
    the default behaviour log-probs (`grpo+loglinear`, `grpo+recompute`)."""
    algo = facets.get("algo", "grpo")
    old = facets.get("trainer.old_logprob", "behaviour")
    return algo if old == "behaviour" else f"{algo}+{old}"


def load(
    uri: str,
    experiment: str = EXPERIMENT,
    name: Callable[[dict[str, str]], str] | None = None,
    capped: Callable[[str], bool] = DECOUPLED.__contains__,
) -> list[study_v3.Run]:
    """One setting's runs from its MLflow store, with `bapo report`'s per-run columns
    (unrounded), each named by `name` (default `configuration`). Refused in one line: a run
    that is not a sweep job of the design (no `experiment`, `trainer.lr` or `trainer.seed`), a
    run whose configuration is `capped` without `algo.behav_weight_cap=5`, and two runs of one
    cell that differ in anything but the seed."""
    name = name or configuration
    data = report.load_runs(uri, experiment=experiment)
    report.label_runs(data)
    runs, cells = [], {}
    for d in data:
        study_v3.require_facets(
            d,
            "not a job of the design's sweeps (`bapo train -m ... "
            "experiment=study_v3_reuse8,study_v3_lag8 trainer.lr=6e-4 trainer.seed=...`)",
        )
        config = name(d.facets)
        if capped(config) and d.facets.get("algo.behav_weight_cap") != BEHAV_CAP:
            raise report.ReportError(
                f"run {d.run_id[:12]} ({config}) has algo.behav_weight_cap="
                f"{d.facets.get('algo.behav_weight_cap')}; the design's decoupled GRPO runs set 5"
            )
        run = study_v3.Run(
            arm=d.facets["experiment"].removeprefix("study_v3_"),
            lr=float(d.facets["trainer.lr"]),
            algo=config,
            seed=int(d.facets["trainer.seed"]),
            values=dict(d.values),
        )
        setting = {k: v for k, v in d.facets.items() if k != report.SEED_KEY}
        first_id, first = cells.setdefault((run.arm, run.lr, config), (d.run_id, setting))
        if first != setting:
            keys = sorted(k for k in {*first, *setting} if first.get(k) != setting.get(k))
            raise report.ReportError(
                f"runs {first_id[:12]} and {d.run_id[:12]} ({run.arm}, {config}) differ in "
                f"{', '.join(keys[:4])}: one cell's runs may differ only in trainer.seed"
            )
        runs.append(run)
    return runs


def load_setting(source: str, experiment: str = EXPERIMENT) -> list[study_v3.Run]:
    """CSV files (comma-joined stages) or a store; the same run twice is refused."""
    return replicate.load_setting(source, lambda uri: load(uri, experiment), CSV_KEYS)


def pick(
    runs: list[study_v3.Run],
    lr: float,
    seeds: set[int] | None,
    configurations: tuple[str, ...] = CONFIGURATIONS,
) -> list[study_v3.Run]:
    """The design's runs: both arms at `lr` (and the chosen seeds); a configuration outside the
    design's `configurations` is refused (ValueError), since it would not belong to its Holm
    family (scripts/paper45.py passes its own 13)."""
    picked = [
        r for r in runs if r.arm in ARMS and r.lr == lr and (seeds is None or r.seed in seeds)
    ]
    stray = sorted({r.algo for r in picked} - set(configurations))
    if stray:
        raise ValueError(
            f"configuration(s) {', '.join(stray)} are not among the design's "
            f"{len(configurations)} ({', '.join(configurations)})"
        )
    return picked


def holm_over_family(pvalues: dict[tuple[str, str], float]) -> dict[tuple[str, str], bool]:
    """Holm over the design's 40 comparisons: one not computed counts with p = 1 (it can never
    be rejected, and it keeps m = 40)."""
    family = {f"{arm}/{c}": pvalues.get((arm, c), 1.0) for arm, c in COMPARISONS}
    rejected = study_v3.holm(family, alpha=ALPHA)
    return {(arm, c): rejected[f"{arm}/{c}"] for arm, c in COMPARISONS}


def answer(diffs: list[float], pooled_p: float, holm_pass: bool) -> str:
    """The design's rule: real = Holm pass and one sign under every setting; not replicated =
    Holm pass with signs that differ (or a zero); indicated = pooled p < 0.05; else no."""
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    if holm_pass:
        return "real" if same_sign else "not replicated"
    return "indicated" if pooled_p < ALPHA else "no"


def verdicts(
    settings: dict[str, list[study_v3.Run]],
    lr: float = LR,
    seeds: set[int] | None = None,
    samples: int = SAMPLES,
) -> dict[tuple[str, str], dict[str, object]]:
    """Per comparison (arm, configuration): each setting's (difference, p, seeds a, seeds b) or
    None, and "pooled": (difference, p, Holm-rejected, answer) or None when a setting lacks
    either side."""
    picked = {name: pick(runs, lr, seeds) for name, runs in settings.items()}
    out: dict[tuple[str, str], dict[str, object]] = {c: {} for c in COMPARISONS}
    pooled: dict[tuple[str, str], tuple[float, float]] = {}
    for arm, config in COMPARISONS:
        strata = []
        for name, runs in picked.items():
            a = study_v3.cell(runs, arm, lr, config, KEY)
            b = study_v3.cell(runs, arm, lr, BASELINE, KEY)
            result = study_v3.compare(a, b)
            out[(arm, config)][name] = None if result is None else (*result, len(a), len(b))
            strata.append((a, b))
        if all(a and b for a, b in strata):
            pooled[(arm, config)] = replicate.stratified_permutation_p(strata, samples=samples)
    rejected = holm_over_family({k: p for k, (_, p) in pooled.items()})
    for key, (diff, p) in pooled.items():
        diffs = [out[key][name][0] for name in picked]
        out[key]["pooled"] = (diff, p, rejected[key], answer(diffs, p, rejected[key]))
    return out


def _cell(result: object) -> str:
    if result is None:
        return "missing"
    diff, p, na, nb = result
    return f"{diff:+.3f}, p = {p:.4f} ({na} v {nb})"


def table(results: dict[tuple[str, str], dict[str, object]], names: list[str]) -> str:
    rows = [
        "| arm | configuration | "
        + " | ".join(names)
        + " | pooled difference, p | Holm (α 0.05 over 40) | answer |",
        "|" + " --- |" * (len(names) + 5),
    ]
    for arm, config in COMPARISONS:
        r = results[(arm, config)]
        pooled = r.get("pooled")
        tail = (
            f"{pooled[0]:+.3f}, p = {pooled[1]:.5f} | {'passes' if pooled[2] else 'fails'} | "
            f"**{pooled[3]}**"
            if pooled
            else "missing | | **not determinable**"
        )
        rows.append(
            f"| {arm} | {config} | " + " | ".join(_cell(r.get(n)) for n in names) + f" | {tail} |"
        )
    return "\n".join(rows) + "\n"


def ess_tables(
    settings: dict[str, list[study_v3.Run]], lr: float = LR, seeds: set[int] | None = None
) -> tuple[dict[str, ess_readout.EssTable], list[tuple[str, str, ess_readout.EssTable]]]:
    """Per setting the table over all its runs (both arms, every configuration), and the
    within-configuration tables (both arms of one configuration in one setting) of every
    configuration that has both collapsed and non-collapsed runs there."""
    whole, within = {}, []
    for name, runs in settings.items():
        picked = pick(runs, lr, seeds)
        pairs = [
            (r.values.get(ess_readout.EQ_KEY), r.values.get(ess_readout.FINAL_KEY)) for r in picked
        ]
        whole[name] = ess_readout.ess_table(pairs)
        for config in CONFIGURATIONS:
            t = ess_readout.ess_table(
                [
                    (r.values.get(ess_readout.EQ_KEY), r.values.get(ess_readout.FINAL_KEY))
                    for r in picked
                    if r.algo == config
                ]
            )
            collapsed = t.falling_collapse + t.steady_collapse
            if 0 < collapsed < t.runs:
                within.append((name, config, t))
    return whole, within


def ess_markdown(
    whole: dict[str, ess_readout.EssTable],
    within: list[tuple[str, str, ess_readout.EssTable]],
    names: list[str],
) -> str:
    out = [
        "Falling ESS = E_q < 0.5 (E_q = min of `actor/ess` over steps 1 … ⌈S/4⌉); "
        "collapse = final held-out avg@8 < 0.05.\n",
        ess_readout.table_markdown(whole),
        f"**Answer: {ess_readout.answer(whole, names)}** (yes only if the one-sided Fisher p "
        "< 0.05 under each setting separately)\n",
        "Within configurations that have both collapsed and non-collapsed runs (descriptive):\n",
    ]
    if within:
        out.append(
            "| setting | configuration | runs | falling & collapse | falling & not | "
            "steady & collapse | steady & not | Fisher p | AUROC of −E_q |\n" + "|" + " --- |" * 9
        )
        for name, config, t in within:
            auc = "—" if t.auroc is None else f"{t.auroc:.3f}"
            out.append(
                f"| {name} | {config} | {t.runs} | {t.falling_collapse} | {t.falling_kept} | "
                f"{t.steady_collapse} | {t.steady_kept} | {ess_readout.fmt_p(t.p)} | {auc} |"
            )
    else:
        out.append("(none)")
    return "\n".join(out) + "\n"


def write_csvs(
    out: Path, results: dict[tuple[str, str], dict[str, object]], settings: dict[str, list]
) -> None:
    """comparisons.csv (one row per comparison, unrounded) and ess_runs.csv (one row per run:
    E_q, held-out final, falling, collapse)."""
    names = list(settings)
    with (out / "comparisons.csv").open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        head = ["arm", "configuration"]
        for n in names:
            head += [f"{n} diff", f"{n} p", f"{n} seeds"]
        w.writerow([*head, "pooled diff", "pooled p", "holm", "answer"])
        for arm, config in COMPARISONS:
            r = results[(arm, config)]
            row = [arm, config]
            for n in names:
                s = r.get(n)
                row += ["", "", ""] if s is None else [s[0], s[1], f"{s[2]} v {s[3]}"]
            pooled = r.get("pooled")
            w.writerow([*row, *(pooled if pooled else ("", "", "", "not determinable"))])
    with (out / "ess_runs.csv").open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(
            [
                "setting",
                "arm",
                "configuration",
                "seed",
                "E_q",
                "held-out final",
                "falling",
                "collapse",
            ]
        )
        for n, runs in settings.items():
            for r in sorted(runs, key=lambda r: (r.arm, r.algo, r.seed)):
                e, final = r.values.get(ess_readout.EQ_KEY), r.values.get(ess_readout.FINAL_KEY)
                w.writerow(
                    [
                        n,
                        r.arm,
                        r.algo,
                        r.seed,
                        e,
                        final,
                        "" if e is None else e < ess_readout.FALLING,
                        "" if final is None else final < ess_readout.COLLAPSE,
                    ]
                )


def add_setting_args(parser: argparse.ArgumentParser) -> None:
    """The two settings' stores, their names, the experiment and the seeds: the arguments every
    reader of the design's runs takes (this read-out, scripts/stress2_plot.py)."""
    parser.add_argument("store_a", help="setting A's runs: a tracking URI or CSV file(s)")
    parser.add_argument("store_b", help="setting B's runs: a tracking URI or CSV file(s)")
    parser.add_argument("--experiment", default=EXPERIMENT, help=f"(default {EXPERIMENT})")
    parser.add_argument("--seeds", help="a seed range, e.g. 0-7 (default: every seed found)")
    parser.add_argument("--names", default="A,B", help="names of the two settings")


def read_settings(args: argparse.Namespace) -> dict[str, list[study_v3.Run]]:
    """{name: runs} of the two settings `add_setting_args` named; ValueError (one line) for
    names that are not two different ones, and load_setting's errors."""
    names = args.names.split(",")
    if len(names) != 2 or len(set(names)) != 2:
        raise ValueError("--names takes two different names; e.g. A,B")
    return {
        names[0]: load_setting(args.store_a, args.experiment),
        names[1]: load_setting(args.store_b, args.experiment),
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--export"]:
        if len(argv) not in (3, 5) or (len(argv) == 5 and argv[3] != "--experiment"):
            print("error: --export takes STORE OUT.csv [--experiment NAME]", file=sys.stderr)
            return 2
        try:
            runs = load(argv[1], argv[4] if len(argv) == 5 else EXPERIMENT)
        except report.ReportError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        replicate.export_csv(runs, Path(argv[2]), CSV_KEYS)
        print(f"wrote {argv[2]} ({len(runs)} runs)")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setting_args(parser)
    parser.add_argument("--out", type=Path, help="also write stress2.md and the CSVs here")
    parser.add_argument("--lr", type=float, default=LR, help="the design's lr (6e-4)")
    parser.add_argument("--samples", type=int, default=SAMPLES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        settings = read_settings(args)
        names = list(settings)
        seeds = replicate._seeds(args.seeds)
        results = verdicts(settings, args.lr, seeds, args.samples)
        whole, within = ess_tables(settings, args.lr, seeds)
    except (report.ReportError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = (
        "## Held-out change vs GRPO: per setting and pooled (40 comparisons)\n\n"
        + table(results, names)
        + "\n## Does a falling ESS in the first quarter predict a collapse?\n\n"
        + ess_markdown(whole, within, names)
    )
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stress2.md").write_text(text, encoding="utf-8")
        picked = {n: pick(runs, args.lr, seeds) for n, runs in settings.items()}
        write_csvs(args.out, results, picked)
        print(f"wrote {args.out}/stress2.md, comparisons.csv, ess_runs.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
