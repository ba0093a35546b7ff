"""The per-step metric dict `train()` logs: reward, response and rollout shares, actor/* (the
mean over the step's optimizer updates), the bound search under bapo/*, staleness/*,
tokens/quadrant_* and the step's perf/* timings and throughputs."""

from __future__ import annotations

from typing import Any

from bapo_cli.algos.bounds import rho_from_sums
from bapo_cli.trainer.throughput import StepTimes, stage_metrics
from bapo_cli.trainer.update import RHO_SUMS

__all__ = ["step_metrics"]

# per-update metric -> its logged name, the mean over the step's updates that report it
MEANS = {
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "ppo_kl": "actor/ppo_kl",
    "clipfrac_low": "actor/clipfrac_low",
    "clipfrac_high": "actor/clipfrac_high",
    "ratio_mean": "actor/ratio_mean",
    "pos_mass": "actor/pos_mass",
    "neg_mass": "actor/neg_mass",
    "ref_kl": "actor/ref_kl",
    "nonfinite_tokens": "actor/nonfinite_tokens",
    "c_low": "actor/c_low",
    "c_high": "actor/c_high",
    "zero_mass": "actor/zero_mass_frac",
    "staleness_mean": "staleness/mean",
    "trajectory_mean": "staleness/trajectory_mean",  # a response's oldest token
    "ess": "actor/ess",  # algos/ess.py: ESS / N of the sequences' weights, behaviour -> current
    "lr_scale": "actor/lr_scale",  # a loss's ESS step scale (VCPO)
}
SEARCH_MEANS = {"search_steps": "bapo/search_steps", "search_moved": "bapo/search_moved_frac"}
# per-update metric -> its logged name, the max over the step's updates (0 without updates)
MAXIMA = {
    "staleness_max": "staleness/max",
    "trajectory_max": "staleness/trajectory_max",
    "ratio_max": "actor/ratio_max",
}


def step_metrics(
    batch, adv_stats, updates, optimizer, *, searched: bool, times: StepTimes
) -> dict[str, float]:
    """The step's logged numbers. Every loss reports its bounds and the positive share of the
    active mass (`actor/c_low`, `actor/c_high`, `actor/rho`); a loss that searches its bounds
    (`searched`, BAPO) also logs the search under `bapo/`. `times`: the step's seconds and
    token counts, for `perf/` and the time per stage (`trainer.throughput`).

    rho and rho_before are weighted by mass over the step's updates, sum(pos) / sum(pos + neg):
    an update without active mass (rho = 1 by convention) adds nothing, and
    `actor/zero_mass_frac` says how many there were."""
    out = {**_samples(batch, adv_stats), **_perf(times)}
    out["actor/lr"] = optimizer.param_groups[0]["lr"]
    out["actor/updates"] = float(len(updates))
    out["actor/skipped_steps"] = sum(u["skipped"] for u in updates)
    out["actor/no_grad_updates"] = sum(u.get("no_grad", 0.0) for u in updates)
    names = {**MEANS, **(SEARCH_MEANS if searched else {})}
    for key, name in names.items():
        values = [u[key] for u in updates if key in u]
        if values:
            out[name] = sum(values) / len(values)
    if updates:
        pos, neg, pos_before, neg_before = (sum(u.get(k, 0.0) for u in updates) for k in RHO_SUMS)
        out["actor/rho"] = rho_from_sums(pos, neg)
        if searched:
            out["bapo/rho_before"] = rho_from_sums(pos_before, neg_before)
    if searched:
        for key in ("c_low", "c_high", "rho", "zero_mass_frac"):
            if f"actor/{key}" in out:
                out[f"bapo/{key}"] = out[f"actor/{key}"]
    for key, name in MAXIMA.items():
        out[name] = max((u.get(key, 0.0) for u in updates), default=0.0)
    for key in updates[0] if updates else []:
        if key.startswith("quadrant_"):
            out[f"tokens/{key}"] = sum(u[key] for u in updates) / len(updates)
    return out


def _samples(batch: list[Any], adv_stats: dict[str, Any]) -> dict[str, float]:
    """The step's reward, response length and rollout shares."""
    rewards = [s.reward for s in batch]
    lengths = [len(s.response_ids) for s in batch]
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/acc": sum(r > 0 for r in rewards) / len(rewards),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/clip_frac": sum(s.finish_reason == "length" for s in batch) / len(batch),
        # responses whose tokens came from more than one policy version: continued by newer
        # weights (staleness.regime=partial, or async with staleness.interrupt)
        "rollout/multi_version_frac": sum(len(set(s.versions)) > 1 for s in batch) / len(batch),
        "adv/zero_variance_frac": float(adv_stats.get("zero_variance_frac", 0.0)),
    }


def _perf(t: StepTimes) -> dict[str, float]:
    return {
        "perf/step_s": t.step_s,
        "perf/rollout_s": t.rollout_s,
        "perf/train_tokens_per_s": t.trained_tokens / max(t.train_s, 1e-9),
        **stage_metrics(t),
    }
