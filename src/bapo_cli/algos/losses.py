"""Clipped policy-gradient losses: PPO, clip-higher (DAPO) and BAPO, as pure functions on tensors.

All three minimise the negated PPO surrogate, token by token,

    loss_t = -min(r_t A_t, clip(r_t, c_low, c_high) A_t),   r_t = exp(log pi_theta - log pi_old)

and differ only in where the bounds come from: `ppo` uses (1 - eps, 1 + eps), `clip_higher` uses
(1 - eps_low, 1 + eps_high) (DAPO: 0.2 / 0.28), `bapo` chooses them per update with Algorithm 1
(`bounds.adaptive_bounds`) or takes them already solved (`bounds=`, e.g. from a `BoundAccumulator`
over all micro-batches and ranks of the optimizer step). GRPO is not a loss: it is the `ppo` loss
with group-normalised advantages (`advantages.grpo`).

Activity is decided by explicit masks, never by torch.min/max tie-breaking, with the same strict
comparisons as the bound search (in the ratio's dtype): a positive token (A > 0) carries gradient
iff r < c_high, a negative token (A < 0) iff c_low < r (< dual_clip). Clipped tokens contribute
their clipped value to the loss and exactly zero gradient.

Dual clip (negative advantages, as verl): loss_t = min(max(-A r, -A clip(r)), -A * dual_clip);
default 3.0, None turns it off. With BAPO, negative tokens at r >= dual_clip carry no gradient
whatever c_low is, so they are left out of the search's mass.

Non-finite tokens: a token whose ratio, advantage or loss (r * A) is NaN or infinite is masked
out (zero loss, zero gradient) and counted in the `nonfinite_tokens` metric, so one bad token
does not poison the step. Shapes: [B, T] (advantages may be [B], one per sequence), or flat [N]
with agg="token-mean". Gradient-accumulation normalisers (`global_tokens`, `global_seqs`) make
the micro-batch losses sum to the exact mini-batch loss.

Returns ``(loss, metrics)``; every loss reports the same metrics, detached 0-dim tensors (no
host sync), averaged over the valid tokens unless said otherwise:

    clipfrac_low / clipfrac_high  A < 0 with r <= c_low / A > 0 with r >= c_high (dual-clipped
                                  negatives are in neither)
    ppo_kl                        mean of log pi_rollout - log pi_theta
    ratio_mean, ratio_max         of r_t
    pos_mass, neg_mass            r |A| of the active positive / negative tokens, per valid token
    active_tokens                 count of gradient-carrying tokens (0: the loss has no gradient)
    nonfinite_tokens              count of masked-out non-finite tokens
    c_low, c_high                 the bounds the loss clipped with, float64: CPU tensors for
                                  fixed bounds, device tensors where the loss computes them
                                  from the tokens (TOPR, DCPO, M2PO, KL-Cov), a `HostMetric`
                                  (VESPO: math.exp taken when the trainer reads it)
    rho                           positive share of the active mass, pos / (pos + neg) (1 if 0/0)
    rho_pos, rho_neg              the sums rho is the share of, in the bound search's units
                                  (sum of w r |A|, not per token): fixed bounds: pos_mass and
                                  neg_mass times the valid tokens; BAPO: the search's P and N
    rho_before, search_steps      BAPO: rho at the search's start point and the steps it walked
                                  (with `rho`, c_low and c_high: Python floats from the search);
                                  fixed bounds: rho_before = rho, search_steps = 0
    rho_pos_before, rho_neg_before  the sums rho_before is the share of (fixed: = rho_pos/neg)

A trainer averages rho over micro-batches and updates by these sums, sum(pos) / sum(pos + neg),
so a call without active mass (rho = 1 by convention) does not count as rho = 1.

Every loss has one signature, ``fn(log_prob, inputs, params, aggregation) -> (loss, metrics)``
(`contract`): `inputs` a `RatioInputs` (old_log_prob, advantages, mask, behav_log_prob,
weights), `params` its own frozen params dataclass, `aggregation` an `Aggregation`. Each loss
is registered with that dataclass (`LossEntry`): fields with defaults and help, a `check()` and
a `describe()`. The CLI builds the `algo` schema of each loss from it and reads the config into
it by field name, once; `policy_loss(name, log_prob, old_log_prob, advantages, mask, **options)`
calls a loss on plain tensors. A new loss is its module's function and dataclass, a YAML in
conf/algo/ and a test (docs/architecture.md).

Where the code is: this module is the losses' entry point (import `losses.REGISTRY`,
`losses.policy_loss` from here: importing it registers every loss). `contract` holds what passes
between the trainer and a loss, `core` the registry and the shared pieces; each method (or
family) has its own module named for it: `ppo` (ppo, clip_higher), `bapo`, `gspo`, `cispo`,
`sapo`, `dppo` (dppo_tv, dppo_kl), `m2po`, `cov` (clip_cov, kl_cov), `ce_gppo`, `vcpo`, `minpro`,
`prime` (prime_default), `topr`, `dcpo`, `vespo`, `luspo`. Adding a loss: docs/architecture.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from bapo_cli.algos.bapo import (
    BOUND_SCOPES,
    BapoParams,
    bapo_loss,
    inputs_search,
    search_inputs,
)
from bapo_cli.algos.bapo_path import WEIGHTINGS
from bapo_cli.algos.ce_gppo import CEGPPOParams, ce_gppo_loss
from bapo_cli.algos.cispo import CISPOParams, cispo_loss
from bapo_cli.algos.contract import (
    AGGREGATIONS,
    Aggregation,
    LossHooks,
    RatioInputs,
    aggregate,
)
from bapo_cli.algos.core import (
    REGISTRY,
    LossEntry,
    Tokens,
    clip_metrics,
    clipped_surrogate,
    policy_loss,
    prepare_tokens,
    surrogate_metrics,
    token_activity,
    tokens,
)
from bapo_cli.algos.cov import ClipCovParams, KLCovParams, clip_cov_loss, kl_cov_loss
from bapo_cli.algos.dppo import DPPOKLParams, DPPOTVParams, dppo_kl_loss, dppo_tv_loss
from bapo_cli.algos.gspo import GSPOParams, gspo_loss
from bapo_cli.algos.m2po import M2POParams, m2po_loss
from bapo_cli.algos.params import LossParams, check_eps
from bapo_cli.algos.ppo import ClipHigherParams, PPOParams, clip_higher_loss, ppo_loss
from bapo_cli.algos.sapo import SAPO_HALF_WIDTH, SAPOParams, sapo_loss


def _import_method_modules() -> None:
    """Import every module of `bapo_cli.algos`: a method module registers its losses when
    imported, so a new loss is its own module (plus a YAML and a test), with no line here."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"bapo_cli.algos.{info.name}")


_import_method_modules()

__all__ = [
    "AGGREGATIONS",
    "BOUND_SCOPES",
    "REGISTRY",
    "SAPO_HALF_WIDTH",
    "WEIGHTINGS",
    "Aggregation",
    "BapoParams",
    "CEGPPOParams",
    "CISPOParams",
    "ClipCovParams",
    "ClipHigherParams",
    "DPPOKLParams",
    "DPPOTVParams",
    "GSPOParams",
    "KLCovParams",
    "LossEntry",
    "LossHooks",
    "LossParams",
    "M2POParams",
    "PPOParams",
    "RatioInputs",
    "SAPOParams",
    "Tokens",
    "aggregate",
    "bapo_loss",
    "ce_gppo_loss",
    "check_eps",
    "cispo_loss",
    "clip_cov_loss",
    "clip_higher_loss",
    "clip_metrics",
    "clipped_surrogate",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "gspo_loss",
    "inputs_search",
    "kl_cov_loss",
    "m2po_loss",
    "policy_loss",
    "ppo_loss",
    "prepare_tokens",
    "sapo_loss",
    "search_inputs",
    "surrogate_metrics",
    "token_activity",
    "tokens",
]
