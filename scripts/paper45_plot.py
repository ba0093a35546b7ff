"""The paper's comparison (issue 45) as a picture and as per-seed values. Descriptive only: the
verdicts are scripts/paper45.py's, fixed before the runs; this reads the same runs (the same
loader, the same design filter) so that a reader sees the seeds behind each verdict.

    python scripts/paper45_plot.py STORE_A STORE_B --out DIR [--seeds 0-7]

writes DIR/heldout_change.png (scripts/stress2_plot.py's drawing: one panel per arm, a dot per
run coloured by setting, a bar at each configuration's mean over both settings, the dashed line
GRPO's mean) and DIR/per_seed.md (per arm, one row per configuration: every run's held-out
change by setting and seed, and the mean over both settings). A store is what paper45.py takes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paper45  # noqa: E402  (the loader, the design's filter, its 13 configurations)
import replicate  # noqa: E402  (the seed-range parser)
import stress2_plot  # noqa: E402  (the held-out change drawing)

Runs = list[paper45.study_v3.Run]


def per_seed(settings: dict[str, Runs]) -> str:
    """Markdown: per arm, a row per configuration (the design's order) with the held-out change
    of each (setting, seed) and the mean of the values present; a missing run reads "–"."""
    seeds = sorted({r.seed for runs in settings.values() for r in runs})
    heads = [f"{name}{s}" for name in settings for s in seeds]
    parts = []
    for arm in paper45.ARMS:
        lines = [
            f"## study_v3_{arm}, lr {paper45.LR:g}: held-out change per run\n",
            "| configuration | " + " | ".join(heads) + " | mean |",
            "|" + " --- |" * (len(heads) + 2),
        ]
        for config in paper45.CONFIGURATIONS:
            found = {
                (name, r.seed): r.values.get(paper45.KEY)
                for name, runs in settings.items()
                for r in runs
                if r.arm == arm and r.algo == config
            }
            cells = [found.get((name, s)) for name in settings for s in seeds]
            mean = paper45.study_v3.mean([v for v in cells if v is not None])
            text = ["–" if v is None else f"{v:+.3f}" for v in cells]
            tail = "–" if mean is None else f"{mean:+.3f}"
            lines.append(f"| {config} | " + " | ".join(text) + f" | {tail} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store_a", help="setting A's runs: a tracking URI or CSV file(s)")
    parser.add_argument("store_b", help="setting B's runs: a tracking URI or CSV file(s)")
    parser.add_argument("--seeds", help="a seed range, e.g. 0-7 (default: every seed found)")
    parser.add_argument("--out", type=Path, required=True, help="write the PNG and table here")
    args = parser.parse_args(argv)
    try:
        seeds = replicate._seeds(args.seeds)
        settings = {
            name: paper45.pick(paper45.load_setting(store), seeds)
            for name, store in (("A", args.store_a), ("B", args.store_b))
        }
    except (paper45.report.ReportError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import matplotlib  # slow: only once the runs are read

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "heldout_change.png"
    stress2_plot.draw_changes(plt, plt.get_cmap("tab10").colors, settings, png)
    table = args.out / "per_seed.md"
    table.write_text(per_seed(settings), encoding="utf-8")
    for path in (png, table):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
