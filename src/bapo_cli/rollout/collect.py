"""From problems to graded samples: prompts × n, generation rounds, version stamps, rewards.

`Collector` is what the staleness regimes call. `start()` opens n samples per problem (one GRPO
group); `advance()` runs one generation round on the unfinished ones, each getting at most
`budget` new tokens (the whole `max_tokens` for ordinary rollouts; a slice of it for partial
rollouts), stamps every new token with the engine's policy version, records behaviour log-probs
with the trainer's forward (`score`), and grades samples as they finish (all of a round's in one
`reward_many` call when given: the math grader compares their slow answers in parallel).

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
    next_group: int = 0
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
            self.next_group += 1
        return samples

    def advance(self, samples: Sequence[Sample], budget: int | None = None) -> None:
        """One generation round for every unfinished sample (at most `budget` new tokens)."""
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
        generations = self.engine.generate(requests, self.params)
        version = self.engine.version
        starts = [len(s.response_ids) for s in todo]
        for s, gen in zip(todo, generations, strict=True):
            s.response_ids.extend(gen.token_ids)
            s.versions.extend([version] * len(gen.token_ids))
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
                diffs = [abs(a - b) for a, b in zip(trainer, gen.logprobs, strict=False)]
                total, peak, count = self._mismatch
                self._mismatch = [total + sum(diffs), max([peak, *diffs]), count + len(diffs)]
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
