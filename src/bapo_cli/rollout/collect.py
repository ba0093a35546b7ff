"""From problems to graded samples: prompts × n, generation rounds, version stamps, rewards.

`Collector` is what the staleness regimes call. `start()` opens n samples per problem (one GRPO
group); `advance()` runs one generation round on the unfinished ones, each getting at most
`budget` new tokens (the whole `max_tokens` for ordinary rollouts; a slice of it for partial
rollouts), stamps every new token with the engine's policy version, records behaviour log-probs
with the trainer's forward (`score`), and grades samples as they finish (all of a round's in one
`reward_many` call when given: the math grader compares their slow answers in parallel).

`collect(draw, count)` is what the regimes that train on whole batches call: `count` prompt groups
drawn and completed. With DAPO's dynamic sampling (`DynamicSampling`, algo.dynamic_sampling) it
drops the groups that carry no gradient and refills the batch with new prompts.

Engines that report their own log-probs (vLLM) are scored by the trainer too, right after
sampling and with the same weights: the trainer's log-probs become the behaviour log-probs the
loss uses (so an on-policy ratio is exactly 1), the engine's are kept per token
(`Sample.engine_logprobs`) for the truncated importance-sampling correction (`rollout.tis_cap`),
and their difference is the train/rollout mismatch `take_mismatch()` reports each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bapo_cli.rollout.base import (
    FINISH_BUDGET,
    FINISH_LENGTH,
    Request,
    RolloutEngine,
    Sample,
    SamplingParams,
)


def informative(group: Sequence[Sample]) -> bool:
    """A group whose rewards are not all equal: its group-relative advantages are not all 0."""
    return len({s.reward for s in group}) > 1


def by_group(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples split into their prompt groups, in order of first appearance."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return list(groups.values())


@dataclass
class SignalWatch:
    """Notices a run that is learning nothing: `patience` steps in a row whose prompt groups all
    have equal rewards (every group-relative advantage 0, so no update moves the policy).

    Such a run looks healthy (steps complete, metrics are logged) and silently trains nothing:
    own data graded by `reward=math`, which reads only a response's last ``\\boxed{}``, scores
    every answer of a model that never writes one 0. `observe` returns one warning, the first
    time the streak reaches `patience` (never again in the run, so a long run is not flooded),
    naming the likely cause (`ungradeable_frac`: no response had an answer the grader reads;
    else every group all right or all wrong) and the fix the caller knows (`advice`).
    """

    patience: int
    advice: str  # what to change: the config's grader, template or data, in words
    silent_in_a_row: int = 0
    warned: bool = False

    def observe(self, batch: Sequence[Sample], ungradeable_frac: float) -> str | None:
        """Count one step; the warning line when this step completes the first silent streak."""
        groups = by_group(batch)
        if any(informative(g) for g in groups) or not groups:
            self.silent_in_a_row = 0
            return None
        self.silent_in_a_row += 1
        if self.warned or self.silent_in_a_row < self.patience:
            return None
        self.warned = True
        rewards = sorted({s.reward for s in batch})
        if ungradeable_frac >= 0.5:
            cause = f"{ungradeable_frac:.0%} of the responses had no answer the grader can read"
            fix = self.advice
        elif rewards[-1] <= 0:
            cause = f"every response scored {_listed(rewards)}"
            fix = f"the prompts may be too hard for this model, or {self.advice}"
        else:
            cause = f"every prompt group's responses scored alike (rewards {_listed(rewards)})"
            fix = (
                "the prompts are too easy or too hard for this model, or the reward does not "
                "depend on the answer: other data, or a reward that tells answers apart"
            )
        return (
            f"no learning signal for {self.silent_in_a_row} steps in a row: {cause}, so every "
            f"advantage is 0 and no update changes the policy. Fix: {fix}"
        )


def _listed(values: Sequence[float], shown: int = 4) -> str:
    text = ", ".join(f"{v:g}" for v in values[:shown])
    return text + (", ..." if len(values) > shown else "")


@dataclass
class DynamicSampling:
    """DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2): keep only prompt groups whose rewards
    are not all equal, and sample new prompts until the batch has `count` of them again.

    A group whose samples all score the same has zero advantage under every group baseline, so it
    adds tokens but no gradient, and a batch full of them shrinks the effective batch size. Each
    refill round draws exactly the missing number of prompts; after `max_rounds` rounds a batch
    still short is topped up with the earliest dropped groups (they train with zero advantage),
    so every step has the same number of groups and updates. The rewards compared are the task's
    (before any overlong shaping), as verl's `filter_groups.metric=acc`.

    Counters since the last `take()`: dropped groups, refill rounds, topped-up groups.
    """

    max_rounds: int
    dropped: int = 0
    rounds: int = 0
    topped_up: int = 0

    def fill(
        self, samples: list[Sample], more: Callable[[int], list[Sample]], count: int
    ) -> list[Sample]:
        """The informative groups of `samples`, refilled from `more(k)` (k new prompt groups,
        completed) up to `count` groups within `max_rounds` rounds, then topped up."""
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        fresh, rounds = samples, 0
        while True:
            for group in by_group(fresh):
                (kept if informative(group) else dropped).append(group)
            missing = count - len(kept)
            if missing <= 0 or rounds == self.max_rounds:
                break
            rounds += 1
            fresh = more(missing)
        topped = dropped[: max(missing, 0)]
        self.dropped += len(dropped) - len(topped)
        self.rounds += rounds
        self.topped_up += len(topped)
        return [s for group in kept[:count] + topped for s in group]

    def take(self) -> dict[str, float]:
        """`dynamic/{dropped_groups,resample_rounds,topped_up_groups}` since the last call."""
        out = {
            "dynamic/dropped_groups": float(self.dropped),
            "dynamic/resample_rounds": float(self.rounds),
            "dynamic/topped_up_groups": float(self.topped_up),
        }
        self.dropped = self.rounds = self.topped_up = 0
        return out


@dataclass
class Collector:
    engine: RolloutEngine
    tokenizer: Any
    params: SamplingParams
    n: int  # samples per prompt
    encode: Callable[[Any], list[int]] | None  # problem -> prompt token ids (None: no `start`)
    # (response text, problem) -> reward; None (and no reward_many): `advance` leaves samples
    # ungraded, for `grade` elsewhere (async: the trainer grades what its worker generated)
    reward: Callable[[str, Any], float] | None
    score: Callable[[list[Sample]], None]  # records behaviour log-probs of unscored tokens
    # (texts, problems) -> rewards: grades the samples a round finished in one call, so the
    # grader can compare slow answers in parallel and under one budget; None: `reward` each
    reward_many: Callable[[list[str], list[Any]], list[float]] | None = None
    dynamic: DynamicSampling | None = None  # algo.dynamic_sampling: see `collect`
    next_group: int = 0
    group_step: int = 1  # data-parallel: W, so that rank r's group ids r, r + W, ... are unique
    generated_tokens: int = 0
    # |trainer - engine| log-prob over the engine-scored tokens since the last take_mismatch():
    # [sum, max, count]
    _mismatch: list[float] = field(default_factory=lambda: [0.0, 0.0, 0])

    def start(self, problems: Sequence[Any]) -> list[Sample]:
        """n fresh samples per problem, grouped; nothing generated yet."""
        samples = []
        for problem in problems:
            prompt = self.encode(problem)
            samples += [
                Sample(prompt_ids=list(prompt), group=self.next_group, problem=problem)
                for _ in range(self.n)
            ]
            self.next_group += self.group_step
        return samples

    def advance(
        self,
        samples: Sequence[Sample],
        budget: int | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> None:
        """One generation round for every unfinished sample (at most `budget` new tokens; cut
        short for all once `interrupt()` says yes: the async worker's `staleness.interrupt`)."""
        todo = [s for s in samples if not s.done]
        if not todo:
            return
        cap = self.params.max_tokens
        requests = [
            Request(
                prompt_ids=tuple(s.prompt_ids),
                prefix_ids=tuple(s.response_ids),
                max_tokens=min(budget or cap, cap - len(s.response_ids)),
            )
            for s in todo
        ]
        if interrupt is None:  # engines written before `interrupt` existed still work
            generations = self.engine.generate(requests, self.params)
        else:
            generations = self.engine.generate(requests, self.params, interrupt=interrupt)
        version = self.engine.version
        starts = [len(s.response_ids) for s in todo]
        for s, gen in zip(todo, generations, strict=True):
            s.response_ids.extend(gen.token_ids)
            s.versions.extend(gen.versions or [version] * len(gen.token_ids))
            self.generated_tokens += len(gen.token_ids)
            if gen.logprobs is not None:
                s.engine_logprobs.extend(gen.logprobs)
            s.finish_reason = gen.finish_reason
            if s.finish_reason == FINISH_BUDGET and len(s.response_ids) >= cap:
                s.finish_reason = FINISH_LENGTH
        self.score(list(todo))  # the trainer's log-probs of the new tokens, same weights
        for s, start, gen in zip(todo, starts, generations, strict=True):
            trainer = s.logprobs[start : start + len(gen.token_ids)]  # empty if scoring deferred
            if gen.logprobs is not None and trainer:
                self._add_mismatch(trainer, gen.logprobs)
        if self.reward is not None or self.reward_many is not None:
            self.grade([s for s in todo if s.done])

    def grade(self, finished: Sequence[Sample]) -> None:
        """Text and reward of finished samples (all in one `reward_many` call when given)."""
        for s in finished:
            s.text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        if not finished:
            return
        if self.reward_many is not None:
            rewards = self.reward_many([s.text for s in finished], [s.problem for s in finished])
        else:
            rewards = [self.reward(s.text, s.problem) for s in finished]
        for s, reward in zip(finished, rewards, strict=True):
            s.reward = float(reward)

    def note_mismatch(self, samples: Sequence[Sample]) -> None:
        """Count the train/rollout mismatch of samples generated elsewhere (the async worker's
        engine): every token that has both a trainer and an engine log-prob."""
        for s in samples:
            if s.engine_logprobs:
                self._add_mismatch(s.logprobs, s.engine_logprobs)

    def _add_mismatch(self, trainer: Sequence[float], engine: Sequence[float]) -> None:
        diffs = [abs(a - b) for a, b in zip(trainer, engine, strict=False)]
        total, peak, count = self._mismatch
        self._mismatch = [total + sum(diffs), max([peak, *diffs]), count + len(diffs)]

    def take_mismatch(self) -> dict[str, float]:
        """`rollout/logprob_abs_diff_{mean,max}` over the engine-scored tokens since the last call
        (empty when the engine reports no log-probs), then start counting afresh."""
        (total, peak, count), self._mismatch = self._mismatch, [0.0, 0.0, 0]
        if not count:
            return {}
        return {
            "rollout/logprob_abs_diff_mean": total / count,
            "rollout/logprob_abs_diff_max": peak,
        }

    def complete(self, problems: Sequence[Any]) -> list[Sample]:
        """Ordinary rollouts: n full responses per problem in one round."""
        samples = self.start(problems)
        self.advance(samples)
        return samples

    def collect(self, draw: Callable[[int], list[Any]], count: int) -> list[Sample]:
        """`count` prompt groups from `draw`, completed: one step's batch. With `dynamic`, groups
        whose rewards are all equal are replaced by new prompts (`DynamicSampling.fill`)."""
        samples = self.complete(draw(count))
        if self.dynamic is None:
            return samples
        return self.dynamic.fill(samples, lambda k: self.complete(draw(k)), count)

    def take_dynamic(self) -> dict[str, float]:
        """The dynamic-sampling counters of the step (empty without dynamic sampling)."""
        return {} if self.dynamic is None else self.dynamic.take()
