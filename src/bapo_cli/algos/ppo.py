"""PPO's clipped surrogate with fixed bounds: `ppo` (1 - eps, 1 + eps) and `clip_higher`
(DAPO's decoupled 1 - eps_low, 1 + eps_high). GRPO and Dr. GRPO are `ppo` with other advantages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo_cli.algos.core import (
    REGISTRY,
    Tensor,
    _check_agg,
    _check_dual_clip,
    check_eps,
    clipped_surrogate,
    prepare_tokens,
)
from bapo_cli.algos.params import ParamError, number, param


@dataclass(frozen=True)
class PPOParams:
    """Symmetric clipping [1 - eps, 1 + eps] (ppo, grpo)."""

    eps: float = param(0.2, "clip range: ratios outside [1 - eps, 1 + eps] are clipped")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if not 0.0 < number("eps", self.eps) < 1.0:
            raise ParamError("eps", self.eps, "must be within (0, 1)")

    def describe(self) -> str:
        return f"[{1 - self.eps:g}, {1 + self.eps:g}]"


@REGISTRY.register("ppo", params=PPOParams)
def ppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps: float = PPOParams.eps,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """PPO-clip with symmetric bounds (1 - eps, 1 + eps); with GRPO advantages this is GRPO."""
    PPOParams(eps=eps)
    return clip_higher_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        eps_low=eps,
        eps_high=eps,
        dual_clip=dual_clip,
        agg=agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )


@dataclass(frozen=True)
class ClipHigherParams:
    """Decoupled clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher)."""

    eps_low: float = param(0.2, "lower clip range: c_low = 1 - eps_low")
    eps_high: float = param(0.28, "upper clip range: c_high = 1 + eps_high (DAPO default)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        check_eps(self.eps_low, self.eps_high)

    def describe(self) -> str:
        return f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}]"


@REGISTRY.register("clip_higher", params=ClipHigherParams)
def clip_higher_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = ClipHigherParams.eps_low,
    eps_high: float = ClipHigherParams.eps_high,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """Asymmetric bounds (1 - eps_low, 1 + eps_high), DAPO's clip-higher (0.2 / 0.28)."""
    ClipHigherParams(eps_low=eps_low, eps_high=eps_high)
    c_low, c_high = 1.0 - float(eps_low), 1.0 + float(eps_high)
    dual_clip = _check_dual_clip(dual_clip, c_low)
    _check_agg(agg, log_prob.dim())
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    return clipped_surrogate(
        tok,
        c_low,
        c_high,
        dual_clip=dual_clip,
        agg=agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )
