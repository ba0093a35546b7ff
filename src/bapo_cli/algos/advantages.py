"""Critic-free advantage estimators over groups of responses to the same prompt.

Each estimator takes scalar rewards [N] and the group of every response (`group_ids` [N], any
integer labels, or `group_size` G for N = prompts x G contiguous responses) and returns
``(advantages [N], stats)``. Broadcast the advantage over the response's tokens in the loss
(`losses.*` accept advantages of shape [B]).

- grpo:   A_i = (R_i - mean_g) / (std_g + eps)  (DeepSeekMath GRPO; BAPO's paper setting)
- drgrpo: A_i = R_i - mean_g                    (Dr. GRPO: no std normalisation)
- rloo:   A_i = R_i - mean of the *other* responses in the group  (REINFORCE leave-one-out)
- dcpo:   DCPO's smooth advantage standardisation: the step's standardisation mixed with one
          over every reward the prompt got at earlier steps (`dcpo`; `cumulative`)
- signed: A_i = 2 R_i - 1, no group statistics (TOPR's right +1 / wrong -1 rewards)

std is the unbiased sample std (divides by G - 1), like `torch.std` in verl's and TRL's GRPO, so
the numbers match those trainers. A group whose rewards are all equal (including a group of one)
carries no signal: its advantages are exactly 0 (dcpo: unless the prompt's earlier rewards
differ) and it is counted in `stats["zero_variance_groups"]` (a rising count means the prompts
are too easy or too hard). Non-finite rewards raise a ValueError: a reward is a grader's output,
NaN there is a bug.

Each is registered as an `AdvantageEntry`, called as the function: `groups` (it compares the
responses of a prompt, so needs rollout.n >= 2) and `cumulative` (it reads each prompt's reward
statistics from earlier steps, `prior=`, which the trainer keeps: `dcpo_history` gives the
updated ones).

stats (Python numbers): groups, zero_variance_groups, zero_variance_frac, singleton_groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.registry import Registry

__all__ = ["REGISTRY", "AdvantageEntry", "dcpo", "dcpo_history", "drgrpo", "grpo", "rloo", "signed"]


@dataclass(frozen=True)
class AdvantageEntry:
    """A registered estimator, called as its function. `groups`: it compares the responses of
    one prompt (needs rollout.n >= 2); `history`, for a `cumulative` estimator: it takes
    `prior=` (per response, its prompt's (steps seen, mean, std) of the rewards of earlier steps,
    [N, 3] float64, zeros for a prompt never seen), which the trainer keeps and updates with
    `history(rewards, group_ids, prior=prior)` after the step."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    groups: bool = True
    # cumulative: (rewards, group_ids, prior=) -> [N, 3] the prompts' statistics after this step
    history: Callable[..., torch.Tensor] | None = None

    @property
    def cumulative(self) -> bool:
        return self.history is not None

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.fn(*args, **kwargs)


REGISTRY: Registry[AdvantageEntry] = Registry("advantage estimator", entry=AdvantageEntry)

Tensor = torch.Tensor


def _groups(
    rewards: Tensor, group_ids: Tensor | None, group_size: int | None
) -> tuple[Tensor, int]:
    """Validate inputs; return (group index in [0, n_groups) per response [N], n_groups)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or infinite values")
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids and group_size")
    n = rewards.numel()
    if group_size is not None:
        if int(group_size) < 1 or n % int(group_size) != 0:
            raise ValueError(f"group_size must be >= 1 and divide N = {n}, got {group_size!r}")
        g = int(group_size)
        index = torch.arange(n, device=rewards.device) // g
        return index, n // g
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)}, expected {tuple(rewards.shape)}"
        )
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max().item()) + 1 if n else 0
    return index, n_groups


def _group_moments(
    rewards: Tensor, index: Tensor, n_groups: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-response (group count, group sum, group mean, zero-variance flag), in float64."""
    x = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(
        0, index, torch.ones_like(x)
    )
    total = torch.zeros_like(count).index_add_(0, index, x)
    hi = torch.full_like(count, -torch.inf).scatter_reduce_(0, index, x, reduce="amax")
    lo = torch.full_like(count, torch.inf).scatter_reduce_(0, index, x, reduce="amin")
    flat = hi == lo  # all rewards equal (a group of one included): exact, no tolerance
    return count[index], total[index], (total / count)[index], flat


def _stats(flat: Tensor, count_per_group: Tensor) -> dict[str, Any]:
    groups = flat.numel()
    zero = int(flat.sum().item())
    return {
        "groups": groups,
        "zero_variance_groups": zero,
        "zero_variance_frac": zero / groups if groups else 0.0,
        "singleton_groups": int((count_per_group == 1).sum().item()),
    }


def _finish(adv: Tensor, flat: Tensor, index: Tensor, rewards: Tensor) -> Tensor:
    return torch.where(flat[index], 0.0, adv).to(rewards.dtype)


@REGISTRY.register("grpo")
def grpo(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """A_i = (R_i - mean_g) / (std_g + eps); std unbiased by default (as verl and TRL)."""
    if not float(eps) >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    index, n_groups = _groups(rewards, group_ids, group_size)
    count, _, mean, flat = _group_moments(rewards, index, n_groups)
    x = rewards.double()
    sq = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(
        0, index, (x - mean) ** 2
    )[index]
    dof = (count - 1.0) if unbiased else count
    std = (sq / dof.clamp(min=1.0)).sqrt()
    adv = (x - mean) / (std + float(eps))
    return _finish(adv, flat, index, rewards), _stats(flat, _per_group(count, index, n_groups))


@REGISTRY.register("drgrpo")
def drgrpo(
    rewards: Tensor, group_ids: Tensor | None = None, *, group_size: int | None = None
) -> tuple[Tensor, dict[str, Any]]:
    """A_i = R_i - mean_g (Dr. GRPO: no division by the std, which biases toward easy/hard
    prompts). Pair with agg="seq-mean-token-sum-norm" for the full Dr. GRPO objective."""
    index, n_groups = _groups(rewards, group_ids, group_size)
    count, _, mean, flat = _group_moments(rewards, index, n_groups)
    adv = rewards.double() - mean
    return _finish(adv, flat, index, rewards), _stats(flat, _per_group(count, index, n_groups))


@REGISTRY.register("rloo")
def rloo(
    rewards: Tensor, group_ids: Tensor | None = None, *, group_size: int | None = None
) -> tuple[Tensor, dict[str, Any]]:
    """A_i = R_i - (sum_g - R_i) / (n_g - 1): the baseline leaves the response itself out."""
    index, n_groups = _groups(rewards, group_ids, group_size)
    count, total, _, flat = _group_moments(rewards, index, n_groups)
    x = rewards.double()
    adv = x - (total - x) / (count - 1.0).clamp(min=1.0)
    return _finish(adv, flat, index, rewards), _stats(flat, _per_group(count, index, n_groups))


@REGISTRY.register("signed", groups=False)
def signed(
    rewards: Tensor, group_ids: Tensor | None = None, *, group_size: int | None = None
) -> tuple[Tensor, dict[str, Any]]:
    """A_i = 2 R_i - 1: a reward in [0, 1] on [-1, 1], a right answer +1 and a wrong one -1
    (TOPR's rewards; REINFORCE with the constant baseline 1/2, times 2). No group statistic: an
    all-right or all-wrong group still trains (its zero_variance count is only reported)."""
    index, n_groups = _groups(rewards, group_ids, group_size)
    count, _, _, flat = _group_moments(rewards, index, n_groups)
    adv = (2.0 * rewards.double() - 1.0).to(rewards.dtype)
    return adv, _stats(flat, _per_group(count, index, n_groups))


def _group_prior(prior: Tensor | None, index: Tensor, n_groups: int, n: int) -> Tensor:
    """[n_groups, 3] (steps seen, mean, std) of each group's prompt from the per-response prior
    [N, 3] (None: every prompt unseen); its rows must agree within a group."""
    out = torch.zeros(n_groups, 3, dtype=torch.float64, device=index.device)
    if prior is None:
        return out
    prior = prior.to(torch.float64)
    if prior.shape != (n, 3):
        raise ValueError(f"prior must be [N, 3] = [{n}, 3], got shape {tuple(prior.shape)}")
    times, std = prior[:, 0], prior[:, 2]
    if not bool(torch.isfinite(prior).all()) or bool((times < 0).any() | (std < 0).any()):
        raise ValueError("prior must be finite, with steps seen >= 0 and std >= 0")
    out[index] = prior
    if not bool((out[index] == prior).all()):
        raise ValueError("prior differs between responses of one group (one prompt, one row)")
    return out


def _smooth_moments(
    rewards: Tensor, index: Tensor, n_groups: int, prior: Tensor | None
) -> tuple[Tensor, ...]:
    """Per group [n_groups]: (steps seen before, this step's mean and std, the cumulative mean
    and std), as DCPO's `get_mean_std`: each step counts once, its mean and (unbiased) std
    merged with the earlier steps' by the parallel-variance rule, K = steps including this one,
        mean_K = ((K - 1) mean_{K-1} + m) / K
        var_K  = ((K - 1) var_{K-1} + s^2 + (K - 1) / K (m - mean_{K-1})^2) / K.
    A group whose rewards are all equal (a group of one included) has s = 0 exactly."""
    x = rewards.double()
    count, _, mean, flat = _group_moments(rewards, index, n_groups)  # flat is per group
    sq = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(
        0, index, (x - mean) ** 2
    )
    per = torch.zeros(n_groups, dtype=torch.float64, device=x.device)
    n_g, m_g = per.scatter(0, index, count), per.scatter(0, index, mean)
    s_g = torch.where(flat, 0.0, (sq / (n_g - 1.0).clamp(min=1.0)).sqrt())
    g = _group_prior(prior, index, n_groups, x.numel())
    before, old_mean, old_std = g[:, 0], g[:, 1], g[:, 2]
    k = before + 1.0
    tot_mean = torch.where(before > 0, (old_mean * before + m_g) / k, m_g)
    tot_var = (before * old_std**2 + s_g**2 + before / k * (m_g - old_mean) ** 2) / k
    tot_std = torch.where(before > 0, tot_var.sqrt(), s_g)
    return before, m_g, s_g, tot_mean, tot_std


def dcpo_history(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    group_size: int | None = None,
    prior: Tensor | None = None,
) -> Tensor:
    """Per response [N, 3] float64: its prompt's (steps seen, mean, std) after this step, to keep
    for the prompt's next step (`dcpo`'s `prior`)."""
    index, n_groups = _groups(rewards, group_ids, group_size)
    before, _, _, tot_mean, tot_std = _smooth_moments(rewards, index, n_groups, prior)
    return torch.stack([before + 1.0, tot_mean, tot_std], dim=-1)[index]


@REGISTRY.register("dcpo", history=dcpo_history)
def dcpo(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    group_size: int | None = None,
    prior: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """DCPO's smooth advantage standardisation (arXiv 2509.02333; lime-RL/DCPO@01787b0,
    `verl/trainer/ppo/core_algos.py` `compute_dcpo_outcome_advantage` and `get_mean_std`).

    With i = steps the prompt has been seen, this one included, A_new = (R - m) / s this step's
    standardisation and A_tot = (R - mean_i) / std_i the cumulative one (`_smooth_moments`;
    each 0 where its std is 0):
        SA_new = (i - 1)/i A_new + 1/i A_tot,   SA_tot = 1/i A_new + (i - 1)/i A_tot
        A = SA_new if |SA_new| < |SA_tot| else SA_tot
    On a prompt's first step A = A_new (GRPO without eps); a later step whose rewards are all
    equal still trains with A_tot / i when the prompt's earlier rewards differed. `prior`: per
    response its prompt's (steps seen, mean, std) before this step ([N, 3]; None = all unseen).
    The reference raises on a group of one; here its std is 0 (no spread)."""
    index, n_groups = _groups(rewards, group_ids, group_size)
    count, _, _, flat = _group_moments(rewards, index, n_groups)
    before, m_g, s_g, tot_mean, tot_std = _smooth_moments(rewards, index, n_groups, prior)
    x = rewards.double()
    m, s, mt, st = m_g[index], s_g[index], tot_mean[index], tot_std[index]
    a_new = torch.where(s > 0, (x - m) / torch.where(s > 0, s, 1.0), 0.0)
    a_tot = torch.where(st > 0, (x - mt) / torch.where(st > 0, st, 1.0), 0.0)
    i = (before + 1.0)[index]
    sa_new = a_tot / i + (1.0 - 1.0 / i) * a_new
    sa_tot = a_new / i + (1.0 - 1.0 / i) * a_tot
    adv = torch.where(sa_new.abs() < sa_tot.abs(), sa_new, sa_tot)
    return adv.to(rewards.dtype), _stats(flat, _per_group(count, index, n_groups))


def _per_group(count: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Group sizes [n_groups] from the per-response counts."""
    out = torch.zeros(n_groups, dtype=count.dtype, device=count.device)
    return out.scatter_(0, index, count)
