"""The stress table's runs as pictures (issue 34): every run's held-out change, and the ESS
question's scatter. Descriptive only: the verdicts are scripts/stress2.py's, fixed before the runs;
this draws the same runs (the same loader, the same design filter) so a reader can see the seeds
behind each verdict.

    python scripts/stress2_plot.py STORE_A STORE_B --out DIR [--seeds 0-7] [--names A,B]

writes DIR/heldout_change.png (one panel per arm: a dot per run, coloured by setting, a bar at
each configuration's mean over both settings, configurations ordered by that mean; the dashed
line is GRPO's mean, the baseline of every comparison) and DIR/ess_collapse.png (a dot per run:
E_q, the minimum ESS over the first quarter of training, against the final held-out avg@8, with
the pre-registered thresholds E_q = 0.5 and held-out = 0.05 as lines and each quadrant's count).
A store is what stress2.py takes: a tracking URI or its per-run CSV exports, comma-joined.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ess_readout  # noqa: E402  (the thresholds and the E_q / final column names)
import replicate  # noqa: E402  (the seed-range parser)
import stress2  # noqa: E402  (the loader and the design's filter)

Runs = list[stress2.study_v3.Run]
MARKERS = ("o", "^")  # setting A, setting B


def arm_order(settings: dict[str, Runs], arm: str) -> list[tuple[str, float]]:
    """(configuration, mean held-out change over every run of both settings) for one arm, the
    largest mean first; a configuration with no finished value is left out."""
    values: dict[str, list[float]] = {}
    for runs in settings.values():
        for r in runs:
            v = r.values.get(stress2.KEY)
            if r.arm == arm and v is not None:
                values.setdefault(r.algo, []).append(v)
    means = [(c, sum(vs) / len(vs)) for c, vs in values.items()]
    return sorted(means, key=lambda cm: (-cm[1], cm[0]))


def quadrants(settings: dict[str, Runs]) -> dict[tuple[bool, bool], int]:
    """Runs counted by (falling ESS, collapse) over both settings: ess_readout's 2 x 2 table
    (E_q < 0.5, final held-out < 0.05) of the pooled runs; a run missing either is not counted."""
    pairs = [
        (r.values.get(ess_readout.EQ_KEY), r.values.get(ess_readout.FINAL_KEY))
        for runs in settings.values()
        for r in runs
    ]
    t = ess_readout.ess_table(pairs)
    return {
        (True, True): t.falling_collapse,
        (True, False): t.falling_kept,
        (False, True): t.steady_collapse,
        (False, False): t.steady_kept,
    }


def plot(settings: dict[str, Runs], out: Path) -> list[Path]:
    """Draw both PNGs into `out`; returns their paths. matplotlib is imported here (slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colors = plt.get_cmap("tab10").colors
    paths = [out / "heldout_change.png", out / "ess_collapse.png"]
    draw_changes(plt, colors, settings, paths[0])
    _draw_ess(plt, colors, settings, paths[1])
    return paths


def draw_changes(plt, colors, settings: dict[str, Runs], path: Path) -> None:
    """heldout_change.png: per arm, a dot per run by setting, each configuration's mean."""
    fig, axes = plt.subplots(1, len(stress2.ARMS), figsize=(12, 7.5), squeeze=False)
    for ax, arm in zip(axes[0], stress2.ARMS, strict=True):
        order = arm_order(settings, arm)
        row = {c: i for i, (c, _) in enumerate(order)}
        for k, (name, runs) in enumerate(settings.items()):
            pts = [
                (r.values[stress2.KEY], row[r.algo] + (k - 0.5) * 0.25)
                for r in runs
                if r.arm == arm and r.algo in row and r.values.get(stress2.KEY) is not None
            ]
            ax.scatter(
                [x for x, _ in pts],
                [y for _, y in pts],
                s=14,
                alpha=0.7,
                color=colors[k],
                marker=MARKERS[k % 2],
                label=f"setting {name}",
            )
        for i, (_, mean) in enumerate(order):
            ax.plot([mean, mean], [i - 0.35, i + 0.35], color="black", lw=1.6)
        base = dict(order).get(stress2.BASELINE)
        if base is not None:
            ax.axvline(base, color="grey", ls="--", lw=1, label="GRPO mean")
        ax.set_yticks(range(len(order)), [c for c, _ in order])
        ax.invert_yaxis()
        ax.set_xlabel("held-out change (final − step 0 avg@8)")
        ax.set_title(f"study_v3_{arm}, lr {stress2.LR:g}")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_ess(plt, colors, settings: dict[str, Runs], path: Path) -> None:
    """ess_collapse.png: E_q against the final held-out, the thresholds, the quadrant counts."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for a, arm in enumerate(stress2.ARMS):
        for k, (name, runs) in enumerate(settings.items()):
            pts = [
                (r.values.get(ess_readout.EQ_KEY), r.values.get(ess_readout.FINAL_KEY))
                for r in runs
                if r.arm == arm
            ]
            pts = [(e, f) for e, f in pts if e is not None and f is not None]
            ax.scatter(
                [e for e, _ in pts],
                [f for _, f in pts],
                s=12,
                alpha=0.6,
                color=colors[2 + a],
                marker=MARKERS[k % 2],
                label=f"{arm}, setting {name}",
            )
    ax.axvline(ess_readout.FALLING, color="grey", ls="--", lw=1)
    ax.axhline(ess_readout.COLLAPSE, color="grey", ls="--", lw=1)
    counts = quadrants(settings)
    for (falling, collapse), n in counts.items():
        x = 0.02 if falling else 0.98
        y = 0.02 if collapse else 0.98
        ax.text(
            x,
            y,
            f"{'falling' if falling else 'steady'}, {'collapse' if collapse else 'kept'}: {n}",
            transform=ax.transAxes,
            ha="left" if falling else "right",
            va="bottom" if collapse else "top",
            fontsize=8,
        )
    ax.set_xlabel("E_q: min ESS over the first quarter of training")
    ax.set_ylabel("final held-out avg@8")
    ax.set_title("falling ESS early vs held-out collapse (both settings)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stress2.add_setting_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="write the PNGs here")
    args = parser.parse_args(argv)
    try:
        seeds = replicate._seeds(args.seeds)
        settings = {
            name: stress2.pick(runs, stress2.LR, seeds)
            for name, runs in stress2.read_settings(args).items()
        }
    except (stress2.report.ReportError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in plot(settings, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
