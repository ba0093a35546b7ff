"""Where a training run's samples come from, decided once (`sample_source`, from the validated
config and this machine) and handed down: the run plan prints it, the builder makes the engine
and the regime's generator from it, so what is shown is what runs. Beside it, the one rule of
whether a run may train on several data-parallel ranks (`parallel_refusal`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo_cli.rollout.base import EngineChoice, choose
from bapo_cli.staleness.regimes import REGIMES
from bapo_cli.staleness.server_setup import ServerSettings

__all__ = ["TRAINER", "WORKER", "SERVERS", "SampleSource", "parallel_refusal", "sample_source"]

TRAINER, WORKER, SERVERS = "trainer", "worker", "servers"


@dataclass(frozen=True)
class SampleSource:
    """Who samples the tokens a run trains on: the trainer's own engine, the async regime's
    worker process, or generation servers (`servers`, vLLM)."""

    place: str  # TRAINER | WORKER | SERVERS
    engine: EngineChoice  # the engine that samples (vllm on servers)
    servers: ServerSettings | None = None

    @property
    def trainer_engine(self) -> str:
        """The engine built in the trainer's process: the one that samples, or, when samples
        come from elsewhere, transformers for validation on the trainer's own weights."""
        return self.engine.name if self.place == TRAINER else "hf"

    def rollout(self) -> str:
        """The run plan's rollout line, sampling settings aside."""
        if self.servers is not None:
            return f"{self.engine.name} on generation servers (rollout.servers)"
        where = " in the generation worker process" if self.place == WORKER else ""
        return f"{self.engine.name}{where} ({self.engine.why})"

    def generation(self) -> str:
        """The run plan's generation line (samples that come from elsewhere)."""
        if self.servers is not None:
            return self.servers.describe()
        return "a worker process on this machine, weights through shared memory"


def sample_source(cfg: Any) -> SampleSource:
    """`rollout=auto` resolved for `model.device` (`rollout.base.choose`), placed where the
    regime generates: its worker process, or the servers of `rollout.servers`."""
    servers = ServerSettings.of(cfg)
    if servers is not None:  # async only (config/servers.py)
        return SampleSource(SERVERS, EngineChoice("vllm", "rollout.servers"), servers)
    engine = choose(cfg.rollout.name, cfg.model.device)
    elsewhere = REGIMES.get(cfg.staleness.regime).generates_elsewhere
    return SampleSource(WORKER if elsewhere else TRAINER, engine)


def parallel_refusal(cfg: Any, world_size: int) -> str | None:
    """Why `world_size` data-parallel ranks (torchrun, `bapo train --nproc`) cannot train this
    run, or None: the regime must allow it, and each step's prompts must split into equal
    shares of whole prompt groups for every rank and mini-batch."""
    regime = REGIMES.get(cfg.staleness.regime)
    if not regime.data_parallel(cfg):
        return (
            f"--nproc with staleness.regime={regime.name}: that regime trains in one process "
            "(its generation worker is the second); drop --nproc, or generate on vLLM servers "
            "(rollout.servers=[URL,...] staleness.weights=filesystem)"
        )
    parts = world_size * regime.updates_per_batch(cfg.staleness.k)
    prompts = cfg.trainer.prompts_per_step
    if prompts % parts:
        return (
            f"trainer.prompts_per_step={prompts} must split into {world_size} ranks × "
            f"mini-batches of whole prompt groups (a multiple of {parts})"
        )
    return None
