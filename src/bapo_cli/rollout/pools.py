"""`pool_for`: the one way a pool over generation servers is made, for training
(`staleness.servers`) and evaluation (`evaluation.served`) alike: the servers must serve the
run's model, so the pool is given that model's identity and context window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bapo_cli.models import loading as models
from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.identity import model_identity
from bapo_cli.rollout.servers import ServerPool

__all__ = ["pool_for"]


def pool_for(
    urls: Sequence[str],
    model: Any,
    *,
    stall_s: float,
    fingerprint: bool = False,
    kind: type[ServerPool] = ServerPool,
    **options: Any,
) -> ServerPool:
    """A `kind` pool over `urls` expecting `model` (a ModelConfig; its files are read, no
    weights loaded); `fingerprint`: also the fingerprint of its weights (`pool.base`), which a
    push names and an evaluation compares. `options` go to the pool as they are."""
    source = models.model_dir(model)
    expect = model_identity(source, trust_remote_code=bool(model.trust_remote_code))
    return kind(
        list(urls),
        expect=expect,
        max_model_len=int(model.max_model_len),
        stall_s=float(stall_s),
        base=weights_fs.model_fingerprint(source) if fingerprint else None,
        **options,
    )
