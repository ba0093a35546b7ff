"""From problems to graded samples: prompts × n, generation rounds, version stamps, rewards.

`Collector` is what the staleness regimes call. `start()` opens n samples per problem (one GRPO
group); `advance()` runs one generation round on the unfinished ones, each getting at most
`budget` new tokens (the whole `max_tokens` for ordinary rollouts; a slice of it for partial
rollouts), stamps every new token with the engine's policy version, records behaviour log-probs
through `score` when the engine reports none, and grades samples as they finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    encode: Callable[[Any], list[int]]  # problem -> prompt token ids
    reward: Callable[[str, Any], float]  # (response text, problem) -> reward
    score: Callable[[list[Sample]], None]  # records behaviour log-probs of unscored tokens
    next_group: int = 0
    generated_tokens: int = 0

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
        unscored = []
        for s, gen in zip(todo, generations, strict=True):
            s.response_ids.extend(gen.token_ids)
            s.versions.extend([version] * len(gen.token_ids))
            self.generated_tokens += len(gen.token_ids)
            if gen.logprobs is None:
                unscored.append(s)
            else:
                s.logprobs.extend(gen.logprobs)
            s.finish_reason = gen.finish_reason
            if s.finish_reason == FINISH_BUDGET and len(s.response_ids) >= cap:
                s.finish_reason = FINISH_LENGTH
        if unscored:
            self.score(unscored)
        for s in todo:
            if s.done:
                s.text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                s.reward = float(self.reward(s.text, s.problem))

    def complete(self, problems: Sequence[Any]) -> list[Sample]:
        """Ordinary rollouts: n full responses per problem in one round."""
        samples = self.start(problems)
        self.advance(samples)
        return samples
