"""PPO's clipped surrogate with fixed bounds: `ppo` (1 - eps, 1 + eps) and `clip_higher`
(DAPO's decoupled 1 - eps_low, 1 + eps_high). GRPO and Dr. GRPO are `ppo` with other advantages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, clipped_surrogate, tokens
from bapo_cli.algos.params import (
    ClipRangeParams,
    LossParams,
    ParamError,
    check_dual_clip,
    dual_clip_param,
    number,
    param,
)


@dataclass(frozen=True)
class PPOParams(LossParams):
    """Symmetric clipping [1 - eps, 1 + eps] (ppo, grpo)."""

    eps: float = param(0.2, "clip range: ratios outside [1 - eps, 1 + eps] are clipped")
    dual_clip: float | None = dual_clip_param()

    def check(self) -> None:
        if not 0.0 < number("eps", self.eps) < 1.0:
            raise ParamError("eps", self.eps, "must be within (0, 1)")
        check_dual_clip(self.dual_clip)

    def bounds(self) -> tuple[float, float]:
        return 1.0 - float(self.eps), 1.0 + float(self.eps)

    def describe(self) -> str:
        return f"[{1 - self.eps:g}, {1 + self.eps:g}]"


@REGISTRY.register("ppo", params=PPOParams)
def ppo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: PPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """PPO-clip with symmetric bounds (1 - eps, 1 + eps); with GRPO advantages this is GRPO."""
    tok = tokens(log_prob, inputs)
    return clipped_surrogate(tok, params.bounds(), params.dual_clip, aggregation)


@dataclass(frozen=True)
class ClipHigherParams(ClipRangeParams):
    """Decoupled clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher)."""

    eps_low: float = param(0.2, "lower clip range: c_low = 1 - eps_low")
    eps_high: float = param(0.28, "upper clip range: c_high = 1 + eps_high (DAPO default)")

    def describe(self) -> str:
        return f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}]"


@REGISTRY.register("clip_higher", params=ClipHigherParams)
def clip_higher_loss(
    log_prob: Tensor, inputs: RatioInputs, params: ClipHigherParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """Asymmetric bounds (1 - eps_low, 1 + eps_high), DAPO's clip-higher (0.2 / 0.28)."""
    tok = tokens(log_prob, inputs)
    return clipped_surrogate(tok, params.bounds(), params.dual_clip, aggregation)
