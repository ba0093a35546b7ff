"""The rollout-engine interface over a `ServerPool` (`ServerEngine`), so the Collector drives
generation servers as it drives an in-process engine, and the seeds its requests carry
(`request_seeds`). Split from `rollout.servers` (the pool itself) to keep each module to one
job: the pool talks to servers, this adapts it to the engine interface the rest of the project
uses (the async regime's server worker, `bapo eval eval.server=URL`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from bapo_cli.models import lora
from bapo_cli.rollout.base import Generation, Request, SamplingParams
from bapo_cli.rollout.servers import ServerPool


def request_seeds(
    count: int, params: SamplingParams, rng: random.Random | None = None
) -> list[int]:
    """One seed per request, as the colocated vLLM engine draws them: a base from torch's RNG
    (seeded by trainer.seed and checkpointed) mixed with rollout.seed; or from `rng` (the async
    worker's per-unit generator: seeds fixed by the data order, not by timing)."""
    if rng is None:
        base = int(torch.randint(0, 2**62, (1,)).item())
        rng = random.Random(f"{params.seed}:{base}")
    return [rng.getrandbits(63) for _ in range(count)]


class ServerEngine:
    """The rollout-engine interface (`rollout.base.RolloutEngine`) over a ServerPool, so the
    Collector drives servers as it drives an in-process engine: `generate` spreads requests
    (seeds drawn as the colocated vLLM engine draws them), every token stamped with the version
    its server reports; `sync_weights` publishes the trainer's weights through the filesystem
    (merged LoRA weights under the base's names), pausing responses in flight when
    `interrupt` (staleness.interrupt) and waiting for them otherwise."""

    name = "servers"

    def __init__(self, pool: ServerPool, eos_ids: Sequence[int], *, interrupt: bool) -> None:
        self.pool = pool
        self.eos_ids = list(eos_ids)
        self.interrupt = interrupt
        self.last_publish: dict[str, float] = {}
        # set by the async worker before each unit (its seeds then depend on the unit alone);
        # None: drawn from torch's RNG, as the colocated vLLM engine draws them
        self.seed_rng: random.Random | None = None

    @property
    def version(self) -> int:
        return self.pool.version

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: Any = None,
    ) -> list[Generation]:
        if interrupt is not None:
            raise ValueError(
                "generation servers take new weights mid-response through the weight push "
                "(staleness.interrupt pauses them), not through an interrupt callback"
            )
        seeds = request_seeds(len(requests), params, self.seed_rng)
        return list(self.pool.generate(requests, params, seeds, self.eos_ids))

    def sync_weights(self, model: torch.nn.Module, version: int) -> float:
        self.last_publish = self.pool.publish(
            lora.engine_weights(model), version, interrupt=self.interrupt
        )
        return self.last_publish["total_s"]

    def close(self) -> None:
        """The servers are not this process's (bapo serve started them): only its hold on them
        is given back (the pool's claims)."""
        self.pool.close()
