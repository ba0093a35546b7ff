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
- lag     (k): generation runs k versions ahead of training, simulated in one process: a queue of
               k batches (filled at version 0), each step generates one batch and trains on the
               oldest, which came from the weights of step t − k. Same staleness as async, none
               of its speed (generation and training still take turns); deterministic.
- partial (k): generation has a token budget per round of ceil(max_tokens / (k + 1)); unfinished
               responses wait in a pool and are continued by newer weights, so one response may
               span up to k + 1 versions; each step trains on the groups that finished.

replay, lag and partial make one update per step (× ppo_epochs).

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
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from bapo_cli.algos.registry import Registry
from bapo_cli.config.errors import ConfigError
from bapo_cli.data.tasks import Problem
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.collect import Collector
from bapo_cli.staleness.server_setup import ServerSettings
from bapo_cli.staleness.servers import ServerWorker
from bapo_cli.staleness.worker import GenerationWorker, WorkerError, WorkerSpec

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


@dataclass(frozen=True)
class RegimeSettings:
    """What a regime is built from (`make_regime`), made by the trainer's builder."""

    name: str  # staleness.regime
    k: int
    epochs: int  # staleness.ppo_epochs
    prompts_per_step: int  # this rank's share of the step's prompts
    # async: what generates, a WorkerSpec (its worker process) or ServerSettings (servers)
    generator: WorkerSpec | ServerSettings | None = None


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
    generator: WorkerSpec | ServerSettings | None = None  # async's (RegimeSettings)

    name: ClassVar[str] = ""  # set by @regime(name)
    # the first mini-batch is trained right away by the weights that sampled it, so its behaviour
    # log-probs may come from that update's own forward instead of a scoring pass
    defer_first: ClassVar[bool] = False
    # samples come from a generator of the regime's own (the async worker and its engine); the
    # trainer's engine then only serves validation, on the trainer's own weights (transformers)
    generates_elsewhere: ClassVar[bool] = False

    @classmethod
    def data_parallel(cls, cfg: TrainConfig) -> bool:
        """Whether it runs under torchrun data parallelism (`bapo train --nproc N`)."""
        return True

    @classmethod
    def updates_per_batch(cls, k: int) -> int:
        """Optimizer updates per rollout batch and epoch: the mini-batches `split` makes."""
        return 1

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        """What `staleness=k` means under this regime, one line for the run plan."""
        raise NotImplementedError

    @classmethod
    def lag_steps(cls, k: int) -> int:
        """Steps between the one whose weights sample a token and the one that trains it."""
        return k

    @classmethod
    def worst_staleness(cls, k: int, epochs: int) -> int:
        """The most versions an update can trail the weights that sampled a token it trains.
        Every step makes `updates_per_batch × epochs` updates, so a lag of L steps is L times
        that many versions, and the batch's last update comes that many minus one after its
        first: reuse and lag compound, (L + 1) × updates per step − 1."""
        return (cls.lag_steps(k) + 1) * cls.updates_per_batch(k) * epochs - 1

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

    @classmethod
    def split(cls, samples: list[Sample], k: int) -> list[list[Sample]]:
        """The step's samples as mini-batches, one optimizer update each (per epoch): whole
        prompt groups, `updates_per_batch(k)` of them. Pure: the trainer lays out batches before
        any regime exists."""
        parts = cls.updates_per_batch(k)
        return [samples] if parts == 1 else split_groups(samples, parts)

    def next_batch(self) -> list[Sample]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # A regime that generates outside the training loop (async) starts, feeds and stops its
    # generator through these three; the others generate inside `next_batch` and need none.

    def start(self, model: Any, version: int, run_dir: Any = None, group: Any = None) -> list[str]:
        """Before the first step (after any resume): `model` holds the weights of `version`;
        `group`: the trainer's DistContext (data-parallel ranks). Returns warnings for the
        trainer to show (generation servers that did not answer)."""
        return []

    def publish(self, model: Any, version: int) -> None:
        """After each step's updates: the trainer's weights are now `version`."""

    def close(self) -> None:
        """When training ends, normally or not."""

    def take_metrics(self) -> dict[str, float]:
        """The generator's own numbers since the last call (generation servers: `servers/*`)."""
        return {}

    def take_notes(self) -> list[str]:
        """The generator's console lines since the last call (servers down, back, joined,
        left)."""
        return []


@regime("reuse")
@dataclass
class Reuse(Regime):
    defer_first: ClassVar[bool] = True

    @classmethod
    def updates_per_batch(cls, k: int) -> int:
        return max(k, 1)

    @classmethod
    def lag_steps(cls, k: int) -> int:
        return 0  # sampled by the weights of the batch's first update

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

    @classmethod
    def split(cls, samples: list[Sample], k: int) -> list[list[Sample]]:
        return split_groups(samples, cls.updates_per_batch(k))

    def next_batch(self) -> list[Sample]:
        return self.collector.collect(self.draw, self.prompts_per_step)


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
                "several steps) do not make: use staleness.regime=reuse, replay or lag",
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


@regime("lag")
@dataclass
class Lag(Regime):
    queue: deque = field(default_factory=deque)

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        return (
            f"lag: trains on rollouts of the weights {k} steps back (simulated async, one process)"
        )

    def next_batch(self) -> list[Sample]:
        while len(self.queue) < self.k:  # pipeline fill: k batches from the first weights
            self.queue.append(self.collector.collect(self.draw, self.prompts_per_step))
        self.queue.append(self.collector.collect(self.draw, self.prompts_per_step))
        return self.queue.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"queue": _batches_state(self.queue)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queue = _batches_from_state(state["queue"])


def admission_capacity(
    *, k: int, version: int, batch: int, accepted: int, running: int, max_concurrent: int
) -> int:
    """AReaL's admission rule: how many more rollouts (prompt groups) may start now so that none
    is trained more than k versions after the version it started at.

    Batches of `batch` rollouts are trained in start order, one version per batch, so the rollout
    numbered r (0-based) is trained at version r // batch. Started at `version`, it is at most k
    versions stale iff r // batch <= version + k, i.e. r < (k + version + 1) * batch; the next
    number is r = accepted + running. `max_concurrent` caps what may be in flight at once."""
    return min(max_concurrent - running, (k + version + 1) * batch - (accepted + running))


@regime("async")
@dataclass
class AsyncRL(Regime):
    """Real asynchronous RL: a worker process (bapo_cli.staleness.worker) generates while this
    process trains, at most k versions ahead.

    Units: the worker generates one step's prompts (`prompts_per_step` groups) per unit, so the
    sampling seed and batch composition are fixed by the data order; which weights a unit is
    sampled with depends on timing (the newest published when the worker starts it), and is
    recorded per token. Admission (`admission_capacity`) is counted in groups with version = the
    steps trained (one update per step); the queue in front of the worker never holds more than
    k + 1 units, so max_concurrent = (k + 1) * prompts_per_step.

    Data-parallel (generation servers only, `bapo train --nproc N`): each rank runs this regime
    on its share of the prompt stream (`prompts_per_step` is the rank's share of the step's),
    with units of its own on the shared servers; the ranks train in lockstep, so `consumed` is
    the global version on every rank and the rule bounds every rank's tokens by the same k.
    Rank 0 pushes the weights; another rank admits only after it did (staleness.servers).

    Resume: `state_dict` keeps the units submitted but not yet trained (their prompts and group
    ids, not what the worker made of them); a resumed run submits those again first and then
    continues the prompt stream, so every prompt group is trained exactly once and none is
    skipped; the regenerated samples come from the resumed weights.
    """

    pending: deque = field(default_factory=deque)  # units submitted, not yet trained on, in order
    resubmit: list = field(default_factory=list)  # after a resume: units to generate again first
    consumed: int = 0  # units trained on = steps
    worker: Any = None
    _threads: int | None = None  # this process's torch threads before start (restored on close)

    generates_elsewhere: ClassVar[bool] = True

    @classmethod
    def data_parallel(cls, cfg: TrainConfig) -> bool:
        """On generation servers every rank generates its own units there (rank 0 pushes the
        weights, staleness.servers); the worker process is one per trainer: one process."""
        return bool(cfg.rollout.servers)

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        return (
            f"async: generation runs beside training (the generation row says where), at "
            f"most {k} policy versions ahead (AReaL's admission rule)"
        )

    @classmethod
    def check(cls, k: int, epochs: int) -> None:
        super().check(k, epochs)
        if epochs != 1:
            raise ConfigError(
                "ppo_epochs",
                epochs,
                "staleness.regime=async makes one update per batch: needs ppo_epochs=1",
            )

    @classmethod
    def check_run(cls, cfg: TrainConfig) -> None:
        servers = bool(cfg.rollout.servers)  # vLLM servers generate (staleness/servers.py)
        if cfg.rollout.name == "vllm" and cfg.staleness.interrupt and not servers:
            raise ConfigError(
                "staleness.interrupt",
                True,
                "pauses responses between tokens, which the vLLM engine cannot do (it generates "
                "each call to the end): use rollout=hf, or drop staleness.interrupt",
            )
        if cfg.algo.dynamic_sampling:
            raise ConfigError(
                "algo.dynamic_sampling",
                True,
                "refills a batch with new prompts once its rewards are known, which a worker "
                "that generates ahead does not do: use staleness.regime=reuse, replay or lag",
            )
        if cfg.trainer.strategy == "fsdp2" and not servers:
            raise ConfigError(
                "trainer.strategy",
                cfg.trainer.strategy,
                "staleness.regime=async without rollout.servers is one process beside its "
                "generation worker: use trainer.strategy=ddp, or vLLM servers "
                "(rollout.servers=[URL,...], docs/engines.md)",
            )
        if cfg.model.device == "cuda" and not servers:
            raise ConfigError(
                "model.device",
                cfg.model.device,
                "staleness.regime=async on CUDA generates on vLLM servers: needs "
                "rollout.servers=[URL,...] and staleness.weights=filesystem (bapo serve, "
                "docs/engines.md), or model.device=cpu",
            )

    def start(self, model: Any, version: int, run_dir: Any = None, group: Any = None) -> list[str]:
        if isinstance(self.generator, ServerSettings):  # this process keeps its threads
            self.worker = ServerWorker.for_run(
                self.generator, model, version, self.collector, run_dir, group=group
            )
            self._admit()
            return list(self.worker.notes)
        first = next(model.parameters())
        if first.device.type != "cpu":
            raise WorkerError(
                f"staleness.regime=async without rollout.servers runs on CPU only; the policy is "
                f"on {first.device} (model.device=cpu, or vLLM servers: docs/engines.md)"
            )
        self._threads = torch.get_num_threads()
        threads = max(1, self._threads // 2)  # the cores this run was given, half each
        torch.set_num_threads(threads)
        self.worker = GenerationWorker(replace(self.generator, threads=threads), model, version)
        self._admit()
        return []

    def _admit(self) -> None:
        """Submit whole units while the admission rule allows (first any to generate again)."""
        batch = self.prompts_per_step
        while (
            admission_capacity(
                k=self.k,
                version=self.consumed,
                batch=batch,
                accepted=self.consumed * batch,
                running=len(self.pending) * batch,
                max_concurrent=(self.k + 1) * batch,
            )
            >= batch
        ):
            unit = self.resubmit.pop(0) if self.resubmit else self.collector.start(self.draw(batch))
            self.worker.submit(unit)
            self.pending.append(unit)

    def next_batch(self) -> list[Sample]:
        self._admit()  # the weights of the last step are published: one more unit may start
        unit = self.worker.receive()
        submitted = self.pending.popleft()
        if [s.group for s in unit] != [s.group for s in submitted]:
            raise RuntimeError("async: the worker returned units out of order")
        self.collector.grade(unit)
        self.collector.note_mismatch(unit)  # an engine with its own log-probs (vLLM)
        self.collector.generated_tokens += sum(len(s.response_ids) for s in unit)
        self.consumed += 1
        return unit

    def publish(self, model: Any, version: int) -> None:
        self.worker.publish(model, version)

    def take_metrics(self) -> dict[str, float]:
        return getattr(self.worker, "take_metrics", dict)()

    def take_notes(self) -> list[str]:
        return getattr(self.worker, "take_notes", list)()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "in_flight": _batches_state([*self.pending, *self.resubmit]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = state["consumed"]
        self.resubmit = list(_batches_from_state(state["in_flight"]))


def _finished_groups(pool: list[Sample]) -> set[int]:
    open_groups = {s.group for s in pool if not s.done}
    return {s.group for s in pool} - open_groups


def make_regime(settings: RegimeSettings, collector: Collector, draw: Draw) -> Regime:
    """The regime `settings.name` names, drawing prompts with `draw`, generating with
    `collector`."""
    return REGIMES.get(settings.name)(
        k=settings.k,
        epochs=settings.epochs,
        collector=collector,
        draw=draw,
        prompts_per_step=settings.prompts_per_step,
        generator=settings.generator,
    )
