"""The effective sample size of an update's importance weights, normalised to [0, 1].

Every update logs it (`actor/ess`), whatever the loss: how much of the batch the importance
weights from the behaviour policy to the current one still count. VCPO (arXiv 2602.17616) found
that a falling ESS precedes the collapse of training under staleness, and scales its step by it
(`algos.vcpo`). Formula and choices in docs/algorithms.md ("Effective sample size").

Per sequence, as VCPO's code (`staleness_utils.compute_is_info` / `compute_ess_info`): the weight
of sequence i is the product of its tokens' ratios, w_i = exp(sum_t log(pi_theta / pi_behav)),
and over the update's N sequences

    ESS / N = (sum_i w_i)^2 / (N sum_i w_i^2),   in [1/N, 1]; 1 iff all w_i are equal.

A sequence is the sample (the ratio that makes a sequence's reward an unbiased estimate is the
product); an ESS over token ratios would treat the tokens of one response as independent draws
and stay near 1 while the sequences' weights degenerate.

Computed in log space, shifted by the largest finite log-weight, so no finite weight overflows
(a 40-token response at log-ratio 20 per token is e^800). Guards, each a defined value, never NaN:

- a token whose log-ratio is NaN (NaN log-probs) is left out of its sequence's sum, as the
  losses leave non-finite tokens out;
- an infinite weight (a token the behaviour policy gave probability 0): ESS / N = 1/N, the
  smallest value, the limit as one weight outgrows all others (VCPO's code gives NaN there, and
  its step scale min(1, NaN) then takes the full step);
- every weight 0 (each sequence has a token the current policy gives probability 0): 0;
- no sequence with a valid token: 1 (nothing is off-policy in an empty update).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

__all__ = ["ess_from_sums", "ess_ratio", "sequence_log_weights", "weight_sums"]


def sequence_log_weights(log_prob: Tensor, behav_log_prob: Tensor, mask: Tensor) -> Tensor:
    """log w_i per sequence [B] (float64, detached): sum over the tokens in `mask` of
    log pi_theta - log pi_behav, NaN tokens left out. A row without a token gives NaN, which
    `weight_sums` does not count."""
    with torch.no_grad():
        log_ratio = log_prob.detach().double() - behav_log_prob.detach().double()
        keep = mask & ~torch.isnan(log_ratio)
        total = torch.where(keep, log_ratio, 0.0).sum(dim=-1)
        return torch.where(mask.any(dim=-1), total, math.nan)


def weight_sums(log_w: Tensor, shift: float) -> Tensor:
    """[sum w', sum w'^2, sequences, infinite weights] (float64) with
    w' = exp(log w - shift), over the sequences whose log weight is not NaN. `shift` is the
    largest finite log weight of all the ranks' sequences (-inf when there is none)."""
    with torch.no_grad():
        counted = log_w[~torch.isnan(log_w)]
        finite = counted[torch.isfinite(counted)]
        scaled = torch.exp(finite - shift) if math.isfinite(shift) else finite.new_zeros(0)
        return torch.stack(
            [
                scaled.sum(),
                scaled.square().sum(),
                counted.new_tensor(float(counted.numel())),
                (counted == math.inf).sum().double(),
            ]
        )


def ess_from_sums(s1: float, s2: float, n: float, n_inf: float) -> float:
    """ESS / N from `weight_sums` (summed over ranks), with the guards of the module docstring."""
    if n <= 0:
        return 1.0
    if n_inf > 0:
        return 1.0 / n
    if s2 <= 0:  # every weight exactly 0 (no finite weight is left after the shift)
        return 0.0
    return min(1.0, max(0.0, s1 * s1 / (n * s2)))


def ess_ratio(log_w: Tensor) -> float:
    """ESS / N of one set of sequence log weights [N] (NaN entries not counted)."""
    finite = log_w[torch.isfinite(log_w)]
    shift = float(finite.max()) if finite.numel() else -math.inf
    return ess_from_sums(*weight_sums(log_w, shift).tolist())
