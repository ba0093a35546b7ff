"""Staleness regimes: which rollouts feed which optimizer update (bapo-spec "Staleness regimes").

Each regime produces, per training step, the samples to train on and how they split into
optimizer updates. The policy version advances by one per optimizer update; every token carries
the version that sampled it, so the staleness each update sees is measured, not assumed
(`staleness/mean`, `staleness/max`).

- reuse   (k): one fresh rollout batch per step split into max(k, 1) mini-batches of whole prompt
               groups, × ppo_epochs; k optimizer updates per batch, the first on-policy and the
               last k − 1 versions stale.
- replay  (k): each step trains on its fresh batch together with the batch generated k versions
               (steps) ago, kept in a buffer: tokens 0 and k versions old, half and half.
- async   (k): generation runs k versions ahead of training, simulated in one process: a queue of
               k batches (filled at version 0), each step generates one batch and trains on the
               oldest, which came from the weights of step t − k.
- partial (k): generation has a token budget per round of ceil(max_tokens / (k + 1)); unfinished
               responses wait in a pool and are continued by newer weights, so one response may
               span up to k + 1 versions; each step trains on the groups that finished.

replay, async and partial make one update per step (× ppo_epochs).

`state_dict()` is plain data (samples as dicts, `sample_state`): checkpoints are loaded with
`torch.load(weights_only=True)`, which refuses class instances (bapo_cli.trainer.checkpoint).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from bapo_cli.algos.registry import Registry
from bapo_cli.data.tasks import Problem
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.collect import Collector

REGIMES: Registry = Registry("staleness regime")

Draw = Callable[[int], list[Any]]  # count -> that many problems (prompts) from the data stream


def sample_state(sample: Sample) -> dict[str, Any]:
    """A Sample as plain data (its Problem as a dict), for a weights_only checkpoint."""
    state = {f.name: getattr(sample, f.name) for f in fields(Sample)}
    if isinstance(sample.problem, Problem):
        state["problem"] = asdict(sample.problem)
    return state


def sample_from_state(state: dict[str, Any]) -> Sample:
    problem = state["problem"]
    if isinstance(problem, dict):
        problem = Problem(**problem)
    return Sample(**{**state, "problem": problem})


def _batches_state(batches: Any) -> list[list[dict[str, Any]]]:
    return [[sample_state(s) for s in batch] for batch in batches]


def _batches_from_state(state: list[list[dict[str, Any]]]) -> deque:
    return deque([sample_from_state(s) for s in batch] for batch in state)


def split_groups(samples: list[Sample], parts: int) -> list[list[Sample]]:
    """Split into `parts` mini-batches of whole prompt groups, keeping order (sizes differ by at
    most one group)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    ordered = list(groups.values())
    parts = max(1, min(parts, len(ordered)))
    base, extra = divmod(len(ordered), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append([s for g in ordered[start : start + size] for s in g])
        start += size
    return out


@dataclass
class Regime:
    """Shared shape: `next_batch()` → samples for this step; `updates()` → one list per update."""

    k: int
    epochs: int
    collector: Collector
    draw: Draw
    prompts_per_step: int

    def next_batch(self) -> list[Sample]:
        raise NotImplementedError

    def split(self, samples: list[Sample]) -> list[list[Sample]]:
        """The step's samples as mini-batches, one optimizer update each (per epoch)."""
        return [samples]

    def updates(self, samples: list[Sample]) -> list[list[Sample]]:
        return self.split(samples) * self.epochs

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@REGIMES.register("reuse")
@dataclass
class Reuse(Regime):
    def next_batch(self) -> list[Sample]:
        return self.collector.complete(self.draw(self.prompts_per_step))

    def split(self, samples: list[Sample]) -> list[list[Sample]]:
        return split_groups(samples, max(self.k, 1))


@REGIMES.register("replay")
@dataclass
class Replay(Regime):
    buffer: deque = field(default_factory=deque)

    def next_batch(self) -> list[Sample]:
        fresh = self.collector.complete(self.draw(self.prompts_per_step))
        self.buffer.append(fresh)
        old = self.buffer.popleft() if len(self.buffer) > self.k else []
        return fresh + old

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": _batches_state(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = _batches_from_state(state["buffer"])


@REGIMES.register("async")
@dataclass
class Async(Regime):
    queue: deque = field(default_factory=deque)

    def next_batch(self) -> list[Sample]:
        while len(self.queue) < self.k:  # pipeline fill: k batches from the first weights
            self.queue.append(self.collector.complete(self.draw(self.prompts_per_step)))
        self.queue.append(self.collector.complete(self.draw(self.prompts_per_step)))
        return self.queue.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"queue": _batches_state(self.queue)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queue = _batches_from_state(state["queue"])


@REGIMES.register("partial")
@dataclass
class Partial(Regime):
    pool: list[Sample] = field(default_factory=list)

    @property
    def budget(self) -> int:
        return math.ceil(self.collector.params.max_tokens / (self.k + 1))

    def next_batch(self) -> list[Sample]:
        while True:
            groups_in_flight = len({s.group for s in self.pool})
            missing = self.prompts_per_step - groups_in_flight
            if missing > 0:
                self.pool += self.collector.start(self.draw(missing))
            self.collector.advance(self.pool, self.budget)
            finished = _finished_groups(self.pool)
            if finished:
                ready = [s for s in self.pool if s.group in finished]
                self.pool = [s for s in self.pool if s.group not in finished]
                return ready

    def state_dict(self) -> dict[str, Any]:
        return {"pool": [sample_state(s) for s in self.pool]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool = [sample_from_state(s) for s in state["pool"]]


def _finished_groups(pool: list[Sample]) -> set[int]:
    open_groups = {s.group for s in pool if not s.done}
    return {s.group for s in pool} - open_groups


def make_regime(
    name: str, *, k: int, epochs: int, collector: Collector, draw: Draw, prompts_per_step: int
) -> Regime:
    return REGIMES.get(name)(
        k=k, epochs=epochs, collector=collector, draw=draw, prompts_per_step=prompts_per_step
    )
