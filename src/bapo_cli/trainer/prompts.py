"""The training prompts of one rank: an endless, seeded, resumable stream, and their grading.

`PromptStream` is what the staleness regimes draw from (`draw(count)`) and what the collector
encodes and grades with (`encode`, `reward_many`); its position is checkpointed, so a resumed run
draws the same prompts it would have drawn.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from bapo_cli.config.schema import TrainConfig
from bapo_cli.models import loading as models
from bapo_cli.rewards import GradeReport, MathGrader, StepGrader
from bapo_cli.rewards.plugin import PythonReward
from bapo_cli.rewards.selfcheck import check_references, grading_advice
from bapo_cli.rollout.collect import SignalWatch

# Steps in a row without any learning signal before the one warning (`SignalWatch`): long enough
# that a hard batch or two do not trigger it, short enough to come before a demo's first minute.
SILENT_STEPS = 3


class PromptStream:
    """The training prompts as an endless, seeded, resumable stream (position = prompts drawn).

    Regimes draw different counts per step (partial rollouts top up their pool), so the stream is
    addressed by position, not by step; the order is the prompt set's seeded per-epoch shuffle.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer: Any,
        console: Console,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        from functools import partial

        from bapo_cli.data.datasets import SYNTHETIC, build_prompt_set

        self.tokenizer = tokenizer
        prompt_set = build_prompt_set(cfg.data)
        limit = max(cfg.model.max_model_len - cfg.rollout.max_tokens, 1)
        self._format = partial(models.format_prompt, tokenizer)
        self._format_messages = partial(models.format_messages, tokenizer)
        self.prompt_set, dropped = prompt_set.filter_long(
            tokenizer, limit, format=self._format, format_messages=self._format_messages
        )
        self.skipped_rows, self.dropped_long = prompt_set.skipped, dropped
        if dropped or prompt_set.skipped:
            console.print(
                f"[yellow]prompts: {prompt_set.skipped} unusable rows skipped, {dropped} longer "
                f"than {limit} tokens dropped; {len(self.prompt_set)} kept[/yellow]"
            )
        self.position = 0  # prompts this rank has drawn
        self.rank, self.world_size = rank, world_size
        # math grading (data.kind=dataset, and validation on math benchmarks) under reward.*;
        # worker processes start on first need, so an arith run never starts one
        self.math = MathGrader(timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
        # reward=python replaces the data kind's grading, whatever the kind (docs/rewards.md)
        self.plugin: PythonReward | None = None
        if cfg.reward.name == "python":
            self.plugin = PythonReward(
                cfg.reward.fn, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers
            )
            grade = self.plugin.grade_batch
        elif cfg.data.kind == "dataset":
            grade = self.math.grade_batch
        else:
            answer_of = SYNTHETIC[cfg.data.kind].answer_of
            grade = partial(_exact_batch, self.prompt_set.reward_fn, answer_of)
        self.grading = StepGrader(grade, cfg.reward.step_budget_s)
        self.console = console
        self.signal = SignalWatch(SILENT_STEPS, grading_advice(cfg))
        self._check_references(cfg)

    def _check_references(self, cfg: TrainConfig) -> None:
        """Grade a sample of the dataset's own answers through this run's grader before any
        step (`rewards.selfcheck`): refuse answers nothing could match, warn when the model
        will likely never write the form the grader reads."""
        from bapo_cli.data.records import DataError

        def grade(responses: list[str], references: list[str], problems: list[Any]) -> Any:
            if self.plugin is not None:
                records = [p.as_record() for p in problems]
                return self.plugin.grade_batch(responses, references, records, budget_s=30.0)
            return self.math.grade_batch(responses, references, budget_s=30.0)

        source = cfg.data.path or cfg.data.hf_id or cfg.data.name
        refusal, warning = check_references(self.prompt_set.items, grade, cfg, source)
        if refusal is not None:
            raise DataError(refusal)
        if warning is not None:
            self.console.print(f"[yellow]warning: {warning}[/yellow]", soft_wrap=True)

    def watch(self, batch: list[Any]) -> dict[str, float]:
        """Count the step toward the no-signal warning (printed once, `SignalWatch`); returns
        `reward/silent_steps`, the steps in a row so far without any learning signal."""
        warning = self.signal.observe(batch, self.grading.ungradeable_frac)
        if warning is not None:
            self.console.print(f"[yellow]warning: {warning}[/yellow]", soft_wrap=True)
        return {"reward/silent_steps": float(self.signal.silent_in_a_row)}

    def draw(self, count: int) -> list[Any]:
        """The next `count` prompts of this rank's share: global positions rank, rank + W, ...
        (ranks never share a prompt, whatever counts they draw)."""
        w = self.world_size
        out = self.prompt_set.take(self.position * w, count * w)[self.rank :: w]
        self.position += count
        return out

    def encode(self, problem: Any) -> list[int]:
        text = self.prompt_set.engine_text(problem, self._format, self._format_messages)
        return list(self.tokenizer(text)["input_ids"])

    def reward(self, text: str, problem: Any) -> float:
        return self.reward_many([text], [problem])[0]

    def reward_many(self, texts: list[str], problems: list[Any]) -> list[float]:
        """Rewards of finished samples, graded together within the step's grading budget."""
        answers = [p.answer for p in problems]
        if self.plugin is not None:
            return self.grading.grade(texts, answers, [p.as_record() for p in problems])
        return self.grading.grade(texts, answers)

    def take_grading(self) -> dict[str, float]:
        """The step's reward/timeouts, reward/over_budget, reward/errors,
        reward/ungradeable_frac and perf/grade_s; resets the budget."""
        return self.grading.take()

    def close(self) -> None:
        """Stop the grading worker processes (math-verify, reward=python)."""
        self.math.close()
        if self.plugin is not None:
            self.plugin.close()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _exact_batch(
    reward_fn: Any, answer_of: Any, texts: Any, answers: Any, *, budget_s: Any = None
) -> GradeReport:
    """A per-sample exact-match reward (data=arith, pairs) as a batch grader: instant, no budget
    needed; a response the task reads no answer from (`answer_of`: None or empty) is ungradeable."""
    return GradeReport(
        [reward_fn(t, a) > 0 for t, a in zip(texts, answers, strict=True)],
        ungradeable=sum(not answer_of(t) for t in texts),
    )
