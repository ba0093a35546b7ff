"""bapo-cli's vLLM plugin (`vllm.general_plugins` entry point in pyproject.toml): registers the
gloo weight-transfer engine (`rollout.weights_gloo`) with vLLM's two factories, the servers' and
the trainer's, by module path, so nothing heavy is imported until an engine is built.

vLLM calls this in each of its processes (API server, engine core, workers), possibly more than
once; the trainer calls it before it opens a group (`rollout.weights_transfer`). vLLM's registries
refuse a name given twice, so a second call changes nothing. Installed bapo-cli only: the entry
point is package metadata (`pip install -e .` writes it).
"""

from __future__ import annotations

import contextlib

GLOO = "bapo_gloo"  # the backend's name in vLLM (`--weight-transfer-config`)
ENGINES = "bapo_cli.rollout.weights_gloo"


def register() -> None:
    """Both halves of the gloo engine, once per process."""
    # vLLM, only in a process that has it: the plugin runs inside vLLM, the trainer calls it
    # for the gloo transport alone (the trainer's environment may have no vLLM)
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(GLOO, ENGINES, "GlooWeightTransferEngine")
    with contextlib.suppress(ValueError):
        WeightTransferTrainerFactory.register_engine(
            GLOO, ENGINES, "GlooTrainerWeightTransferEngine"
        )
