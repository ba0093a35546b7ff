"""One process of the two-node test (tests/train/test_multinode.py), started by torchrun:
`python -m torch.distributed.run --nnodes 2 ... -m tests.train.multinode_rank OUT [lora]`.

It joins the process group torchrun describes (`trainer.distributed.from_env`, gloo on CPU),
takes its rank's whole prompt groups of the shared global batch and makes one optimizer update;
the test compares the bounds and weights with one process on the global batch.
"""

from __future__ import annotations

import sys

import torch

from bapo_cli.config.schema import LoraConfig
from bapo_cli.models import lora
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import ResponseLogits, collate
from bapo_cli.trainer import distributed
from bapo_cli.trainer.distributed import DistContext
from bapo_cli.trainer.update import Learner, optimizer_update
from tests.train.test_distributed import SPEC, _chunks, _global_batch, _model


def update(samples: list[Sample], ctx: DistContext, micro_size: int, use_lora: bool):
    """(metrics, trained tensors) of one update of the test model (LoRA adapters on it, B = 0:
    the same function) on `samples`."""
    model = _model()
    if use_lora:
        model = lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    scorer = ctx.wrap(ResponseLogits(model))
    optimizer = torch.optim.SGD(lora.trainable(model), lr=0.5)
    micro = [collate(chunk, 0, torch.device("cpu")) for chunk in _chunks(samples, micro_size)]
    result = optimizer_update(Learner(scorer, optimizer, ctx=ctx), SPEC, micro, version=0)
    return result.metrics, [p.detach().clone() for p in lora.trainable(model)]


def main(out: str, use_lora: bool) -> None:
    ctx = distributed.from_env("ddp")
    mine = [s for s in _global_batch(_model()) if s.group % ctx.world_size == ctx.rank]
    metrics, params = update(mine, ctx, micro_size=6, use_lora=use_lora)
    torch.save({"metrics": metrics, "params": params, "world": ctx.world_size}, f"{out}.{ctx.rank}")
    distributed.shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "lora")
