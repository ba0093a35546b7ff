"""Policy-loss core: pure functions on tensors, importable without the CLI or any config.

- `bounds`: BAPO's adaptive clipping bounds (Algorithm 1), `adaptive_bounds`, `BoundAccumulator`.
- `losses`: `policy_loss(name, ...)` with `REGISTRY` = ppo, clip_higher, bapo.
- `advantages`: `REGISTRY` = grpo, drgrpo, rloo.
- `diagnostics`: the Entropy-Clip quadrant table and the predicted entropy change.

Only torch is imported, so a config layer can read the registry keys cheaply.
"""

from bapo_cli.algos.bounds import BapoBounds, BoundAccumulator, adaptive_bounds
from bapo_cli.algos.losses import policy_loss

__all__ = ["BapoBounds", "BoundAccumulator", "adaptive_bounds", "policy_loss"]
