"""Critic-free advantage estimators over groups of responses to the same prompt.

Each estimator takes scalar rewards [N] and the group of every response (`group_ids` [N], any
integer labels, or `group_size` G for N = prompts x G contiguous responses) and returns
``(advantages [N], stats)``. Broadcast the advantage over the response's tokens in the loss
(`losses.*` accept advantages of shape [B]).

- grpo:   A_i = (R_i - mean_g) / (std_g + eps)  (DeepSeekMath GRPO; BAPO's paper setting)
- drgrpo: A_i = R_i - mean_g                    (Dr. GRPO: no std normalisation)
- rloo:   A_i = R_i - mean of the *other* responses in the group  (REINFORCE leave-one-out)

std is the unbiased sample std (divides by G - 1), like `torch.std` in verl's and TRL's GRPO, so
the numbers match those trainers. A group whose rewards are all equal (including a group of one)
carries no signal: its advantages are exactly 0 and it is counted in
`stats["zero_variance_groups"]` (a rising count means the prompts are too easy or too hard).
Non-finite rewards raise a ValueError: a reward is a grader's output, NaN there is a bug.

stats (Python numbers): groups, zero_variance_groups, zero_variance_frac, singleton_groups.
"""

from __future__ import annotations

from typing import Any

import torch

from bapo_cli.algos.registry import Registry

__all__ = ["REGISTRY", "drgrpo", "grpo", "rloo"]

REGISTRY: Registry = Registry("advantage estimator")

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


def _per_group(count: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Group sizes [n_groups] from the per-response counts."""
    out = torch.zeros(n_groups, dtype=count.dtype, device=count.device)
    return out.scatter_(0, index, count)
