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

A regime class owns everything about it: how many optimizer updates a rollout batch makes
(`updates_per_batch`, for the LR schedule and the data-parallel split), whether the first update
may score its own behaviour log-probs (`defer_first`), its line in the run plan (`describe`) and
its config rules (`check` on the staleness group, `check_run` across groups; the schema calls
both). Adding a regime is a class registered with `@regime("name")` here, nothing else.

`state_dict()` is plain data (samples as dicts, `sample_state`): checkpoints are loaded with
`torch.load(weights_only=True)`, which refuses class instances (bapo_cli.trainer.checkpoint).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from bapo_cli.algos.registry import Registry
from bapo_cli.config.errors import ConfigError
from bapo_cli.data.tasks import Problem
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.collect import Collector

if TYPE_CHECKING:
    from bapo_cli.config.schema import TrainConfig

REGIMES: Registry = Registry("staleness regime")


def regime(name: str) -> Callable[[type[Regime]], type[Regime]]:
    """Class decorator: register a regime under `name` (`staleness.regime=<name>`); the class
    knows its name for its error messages."""

    def decorate(cls: type[Regime]) -> type[Regime]:
        cls.name = name
        return REGIMES.register(name)(cls)

    return decorate


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
    """Shared shape: `next_batch()` → samples for this step; `split()` → one mini-batch per
    optimizer update (repeated `epochs` times by the trainer).

    The class-level rules (no instance needed: the config and the trainer ask them before a
    collector exists) default to one update per batch, scored by a separate pass, and k >= 1.
    """

    k: int
    epochs: int
    collector: Collector
    draw: Draw
    prompts_per_step: int

    name: ClassVar[str] = ""  # set by @regime(name)
    # the first mini-batch is trained right away by the weights that sampled it, so its behaviour
    # log-probs may come from that update's own forward instead of a scoring pass
    defer_first: ClassVar[bool] = False

    @classmethod
    def updates_per_batch(cls, k: int) -> int:
        """Optimizer updates per rollout batch and epoch: the mini-batches `split` makes."""
        return 1

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        """What `staleness=k` means under this regime, one line for the run plan."""
        raise NotImplementedError

    @classmethod
    def check(cls, k: int, epochs: int) -> None:
        """Rules on the staleness group alone; a ConfigError keyed within it (`regime`, `k`)."""
        if k == 0:
            raise ConfigError(
                "regime", cls.name, "needs staleness.k >= 1 (k=0 is on-policy: use reuse)"
            )

    @classmethod
    def check_run(cls, cfg: TrainConfig) -> None:
        """Rules across groups (trainer, rollout); a ConfigError with the full dotted key."""

    def next_batch(self) -> list[Sample]:
        raise NotImplementedError

    def split(self, samples: list[Sample]) -> list[list[Sample]]:
        """The step's samples as mini-batches, one optimizer update each (per epoch)."""
        return [samples]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@regime("reuse")
@dataclass
class Reuse(Regime):
    defer_first: ClassVar[bool] = True

    @classmethod
    def updates_per_batch(cls, k: int) -> int:
        return max(k, 1)

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        updates = cls.updates_per_batch(k) * epochs
        if updates == 1:
            return "on-policy: one optimizer update per rollout batch"
        return (
            f"reuse: {updates} optimizer updates per rollout batch "
            f"({cls.updates_per_batch(k)} mini-batches × {epochs} epochs); the first is on-policy"
        )

    @classmethod
    def check(cls, k: int, epochs: int) -> None:
        pass  # k=0 and k=1 are on-policy

    @classmethod
    def check_run(cls, cfg: TrainConfig) -> None:
        k, prompts = cfg.staleness.k, cfg.trainer.prompts_per_step
        if cls.updates_per_batch(k) > 1 and prompts % cls.updates_per_batch(k):
            raise ConfigError(
                "trainer.prompts_per_step",
                prompts,
                f"must split into staleness.k={k} mini-batches of whole prompt groups",
            )

    def next_batch(self) -> list[Sample]:
        return self.collector.collect(self.draw, self.prompts_per_step)

    def split(self, samples: list[Sample]) -> list[list[Sample]]:
        return split_groups(samples, self.updates_per_batch(self.k))


@regime("replay")
@dataclass
class Replay(Regime):
    buffer: deque = field(default_factory=deque)

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        return f"replay: train on rollouts generated {k} policy versions ago"

    def next_batch(self) -> list[Sample]:
        fresh = self.collector.collect(self.draw, self.prompts_per_step)
        self.buffer.append(fresh)
        old = self.buffer.popleft() if len(self.buffer) > self.k else []
        return fresh + old

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": _batches_state(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = _batches_from_state(state["buffer"])


@regime("partial")
@dataclass
class Partial(Regime):
    pool: list[Sample] = field(default_factory=list)

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        return f"partial rollout: a response may span up to {k + 1} policy versions"

    @classmethod
    def check_run(cls, cfg: TrainConfig) -> None:
        if cfg.algo.dynamic_sampling:
            raise ConfigError(
                "algo.dynamic_sampling",
                True,
                "refills whole rollout batches, which partial rollouts (groups finishing over "
                "several steps) do not make: use staleness.regime=reuse, replay or async",
            )
        if cfg.trainer.strategy == "fsdp2":
            raise ConfigError(
                "trainer.strategy",
                cfg.trainer.strategy,
                "fsdp2 needs the same number of micro-batches on every rank, which partial "
                "rollouts do not give: use trainer.strategy=ddp with staleness.regime=partial",
            )

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


@regime("async")
@dataclass
class Async(Regime):
    queue: deque = field(default_factory=deque)

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        return f"async: generation runs {k} policy versions ahead of training"

    def next_batch(self) -> list[Sample]:
        while len(self.queue) < self.k:  # pipeline fill: k batches from the first weights
            self.queue.append(self.collector.collect(self.draw, self.prompts_per_step))
        self.queue.append(self.collector.collect(self.draw, self.prompts_per_step))
        return self.queue.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"queue": _batches_state(self.queue)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queue = _batches_from_state(state["queue"])


def _finished_groups(pool: list[Sample]) -> set[int]:
    open_groups = {s.group for s in pool if not s.done}
    return {s.group for s in pool} - open_groups


def make_regime(
    name: str, *, k: int, epochs: int, collector: Collector, draw: Draw, prompts_per_step: int
) -> Regime:
    return REGIMES.get(name)(
        k=k, epochs=epochs, collector=collector, draw=draw, prompts_per_step=prompts_per_step
    )
