"""Policy-loss core: pure functions on tensors, importable without the CLI or any config.

- `bounds`: BAPO's adaptive clipping bounds (Algorithm 1), `adaptive_bounds`, `BoundAccumulator`
  (the entry point of `bapo_path`, `bapo_locator`, `bapo_algorithm1`, `bapo_recipe`).
- `losses`: `policy_loss(name, ...)` with `REGISTRY` (the entry point of `core` and the method
  modules `ppo`, `bapo`, `gspo`, `cispo`, `sapo`, `dppo`, `m2po`, `cov`, `ce_gppo`, `vcpo`,
  `minpro`, `prime`).
- `correction`: off-policy sequence masks (`rollout.seq_mask`).
- `ess`: the effective sample size of an update's importance weights (`actor/ess`).
- `proximal`: A-3PO's interpolated proximal log-probs (`trainer.old_logprob=loglinear`).
- `advantages`: `REGISTRY` = grpo, drgrpo, rloo.
- `diagnostics`: the Entropy-Clip quadrant table and the predicted entropy change.

Only torch is imported, so a config layer can read the registry keys cheaply.
"""

from bapo_cli.algos.bounds import BapoBounds, BoundAccumulator, adaptive_bounds
from bapo_cli.algos.losses import policy_loss

__all__ = ["BapoBounds", "BoundAccumulator", "adaptive_bounds", "policy_loss"]
