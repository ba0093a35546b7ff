"""The per-run values a report shows: one column of runs.md per entry of `COLUMNS`, each a
function of the run's metric histories, and the run's net entropy push of the Entropy-Clip
quadrants (quadrants.md, and study v3's mechanism read-out).

"Final" values are means over the last 10% of logged steps (what `train_job` returns, and so
what an Optuna sweep maximizes); "best reward" is the highest per-step `reward/mean`; bounds,
rho, clip fractions and step time are means over all steps; "start rho" is the mean of
`actor/rho` (the mass-weighted positive share every loss reports) over the first 10% of steps.
"held-out start/final" are the first and last logged value of the run's validation metric
(`val/<set>/avg_at_<n>`, the first such key when there are several: `trainer.val_every`).
"ESS first quarter min" is the stress design's predictor E_q (docs/algorithms.md, issue 34): the
minimum of `actor/ess` over the logged steps 1 ... ceil(S/4), S the run's last logged step;
"final ESS" its mean over the last 10% of steps. Runs that never logged `actor/ess` (stores from
before it existed) get empty cells.
"""

from __future__ import annotations

import math

from bapo_cli.report.runs import VAL_KEY, RunData

QUADRANTS = ("high_pos", "low_pos", "high_neg", "low_neg")  # diagnostics.QUADRANT_KEYS' order
ENTROPY_EFFECT = {"high_pos": -1, "low_pos": +1, "high_neg": +1, "low_neg": -1}
"""Sign of an active token's first-order effect on entropy (algos.diagnostics.ENTROPY_EFFECT,
restated so the report does not import torch)."""


def mean(points: list[tuple[int, float]] | None) -> float | None:
    """Mean of a history's values (None for no points)."""
    return sum(v for _, v in points) / len(points) if points else None


def tail_mean(points: list[tuple[int, float]] | None, frac: float = 0.1) -> float | None:
    """Mean over the last `frac` of the points (at least one): a run's "final" value."""
    return mean(points[-max(int(len(points) * frac), 1) :]) if points else None


def head_mean(points: list[tuple[int, float]] | None, frac: float = 0.1) -> float | None:
    """Mean over the first `frac` of the points (at least one): a run's "start" value."""
    return mean(points[: max(int(len(points) * frac), 1)]) if points else None


def _change(start: float | None, final: float | None) -> float | None:
    return None if start is None or final is None else final - start


def _val(h: dict[str, list[tuple[int, float]]], which: int) -> float | None:
    """First (which=0) or last (-1) value of the run's first validation metric."""
    keys = sorted(k for k in h if VAL_KEY.match(k))
    return h[keys[0]][which][1] if keys and h[keys[0]] else None


def first_quarter_min(points: list[tuple[int, float]] | None) -> float | None:
    """Minimum over the points logged at steps 1 ... ceil(S/4), S the last logged step (for a
    run that finished, `trainer.max_steps`): the stress design's E_q. A step's value is what the
    run logged for it (under reuse 8 the mean of its 8 updates). NaN points are left out (the
    metric is guarded never to be NaN, and `min` over a NaN depends on the order); None when no
    point falls in the quarter."""
    if not points:
        return None
    quarter = math.ceil(points[-1][0] / 4)
    values = [v for s, v in points if 1 <= s <= quarter and not math.isnan(v)]
    return min(values) if values else None


COLUMNS = (  # (header, function of a run's histories)
    ("held-out start", lambda h: _val(h, 0)),
    ("held-out final", lambda h: _val(h, -1)),
    ("held-out change", lambda h: _change(_val(h, 0), _val(h, -1))),
    ("final reward", lambda h: tail_mean(h.get("reward/mean"))),
    ("best reward", lambda h: max((v for _, v in h.get("reward/mean", [])), default=None)),
    ("start entropy", lambda h: head_mean(h.get("actor/entropy"))),
    ("final entropy", lambda h: tail_mean(h.get("actor/entropy"))),
    ("mean c_low", lambda h: mean(h.get("actor/c_low"))),
    ("mean c_high", lambda h: mean(h.get("actor/c_high"))),
    ("start rho", lambda h: head_mean(h.get("actor/rho"))),
    ("mean rho before", lambda h: mean(h.get("bapo/rho_before"))),
    ("mean rho", lambda h: mean(h.get("bapo/rho"))),
    ("ESS first quarter min", lambda h: first_quarter_min(h.get("actor/ess"))),
    ("final ESS", lambda h: tail_mean(h.get("actor/ess"))),
    ("clipfrac low", lambda h: mean(h.get("actor/clipfrac_low"))),
    ("clipfrac high", lambda h: mean(h.get("actor/clipfrac_high"))),
    ("length start", lambda h: head_mean(h.get("response/length_mean"))),
    ("length final", lambda h: tail_mean(h.get("response/length_mean"))),
    ("budget hit final", lambda h: tail_mean(h.get("response/clip_frac"))),
    ("step s", lambda h: mean(h.get("perf/step_s"))),
)


def net_entropy_push(run: RunData) -> float | None:
    """A run's net first-order entropy push of the active loss mass: sum of ENTROPY_EFFECT x the
    quadrant's active share (mean over steps); > 0 raises entropy. None when not logged."""
    shares = [mean(run.histories.get(f"tokens/quadrant_{q}_active_mass")) for q in QUADRANTS]
    if any(v is None for v in shares):
        return None
    return sum(ENTROPY_EFFECT[q] * v for q, v in zip(QUADRANTS, shares, strict=True))
