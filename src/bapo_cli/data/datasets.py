"""Training prompt sets built from the `data` config group.

    data=arith      ArithTask(data.seed).prompts(data.num_prompts), graded by exact match
    data=pairs      PairTask(data.seed).prompts(data.num_prompts), graded by `pairs_reward`
    data=<preset>   rows of data.path (or data.hf_id), graded by bapo_cli.rewards.grade; plain
                    rows (a question through data.template) or chat messages (data.format)

`build_prompt_set(cfg)` returns a `PromptSet`: the problems in a fixed order (shuffled by
`data.seed`), the template that turns a question into prompt text, the reward function of the
kind, and an endless stream addressed by position -- `take(position, count)` is the same list
whether a run got there directly or resumed from a checkpoint, with a fresh shuffle (seeded by
data.seed and the epoch) at each pass over the set.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bapo_cli.data.formats import render_plain
from bapo_cli.data.pairs import PAIRS_TEMPLATE, PairTask, named_pair, pairs_reward
from bapo_cli.data.records import DataError, load_records
from bapo_cli.data.tasks import ARITH_TEMPLATE, ArithTask, Problem, arith_reward, clean_response
from bapo_cli.rewards import grade

RewardFn = Callable[[str, str], float]
T = TypeVar("T")


def math_reward(response: str, reference: str) -> float:
    """Math grading by `bapo_cli.rewards.grade` (math-verify, loaded by its grading worker on
    first use: importing `rewards` costs milliseconds)."""
    return float(grade(response, reference))


@dataclass(frozen=True)
class SyntheticKind:
    """A seeded synthetic task: training prompts, held-out split, template and grading."""

    make: Callable[[int], Any]
    """seed -> task with `prompts(n)` (training set) and `held_out(n)` (seed-independent)."""
    template: str
    reward: RewardFn
    answer_of: Callable[[str], str | None]
    """The answer a response gives (for maj@n in validation)."""


SYNTHETIC: dict[str, SyntheticKind] = {
    "arith": SyntheticKind(ArithTask, ARITH_TEMPLATE, arith_reward, clean_response),
    "pairs": SyntheticKind(PairTask, PAIRS_TEMPLATE, pairs_reward, named_pair),
}
"""The synthetic data kinds; `trainer.val_benchmarks` accepts the same names (held-out split)."""

REWARDS: dict[str, RewardFn] = {
    **{kind: spec.reward for kind, spec in SYNTHETIC.items()},
    "dataset": math_reward,
}
"""Reward function of each data kind (the keys are DataConfig.kind's values)."""


@dataclass
class PromptSet:
    """Problems in a fixed order, the template that renders them, and the reward of their kind."""

    items: list[Problem]
    template: str
    reward_fn: RewardFn
    seed: int = 0
    source: str = ""
    skipped: int = 0
    """Rows of the source that were unusable (dataset kind)."""

    def __len__(self) -> int:
        return len(self.items)

    def render(self, problem: Problem) -> str:
        """The prompt text of one problem: the template with {problem} filled in (a chat-message
        problem: its messages' contents, as without a chat template)."""
        if problem.messages is not None:
            return render_plain(problem.messages)
        return render(self.template, problem.question)

    def engine_text(
        self,
        problem: Problem,
        format: Callable[[str], str] | None = None,
        format_messages: Callable[[Any], str] | None = None,
    ) -> str:
        """What the engine encodes: `format` (the chat template of one user turn) over the
        rendered text, or for a chat-message problem `format_messages` over its messages."""
        if problem.messages is not None and format_messages is not None:
            return format_messages(problem.messages)
        text = self.render(problem)
        return format(text) if format is not None and problem.messages is None else text

    def texts(self) -> list[str]:
        return [self.render(p) for p in self.items]

    def take(self, position: int, count: int) -> list[Problem]:
        """`count` problems from `position` on in the endless stream: epoch after epoch over the
        set, each epoch in the order `epoch_order(epoch)`. Any position can be produced directly,
        so a resumed run continues exactly where it stopped."""
        n = len(self.items)
        out: list[Problem] = []
        order, order_epoch = [], -1
        for pos in range(position, position + count):
            epoch, index = divmod(pos, n)
            if epoch != order_epoch:
                order, order_epoch = self.epoch_order(epoch), epoch
            out.append(self.items[order[index]])
        return out

    def batch(self, step: int, size: int) -> list[Problem]:
        """The problems of batch number `step` (0-based): `take(step * size, size)`."""
        if size < 1:
            raise ValueError(f"batch size {size}: must be >= 1")
        return self.take(step * size, size)

    def batches(self, size: int, *, start: int = 0) -> Iterator[list[Problem]]:
        """Endless batches from batch number `start` on (resume passes the step reached)."""
        step = start
        while True:
            yield self.batch(step, size)
            step += 1

    def filter_long(
        self,
        tokenizer: Any,
        max_prompt_tokens: int,
        *,
        format: Callable[[str], str] | None = None,
        format_messages: Callable[[Any], str] | None = None,
    ) -> tuple[PromptSet, int]:
        """A copy without problems whose prompt exceeds `max_prompt_tokens`, and how many went.

        `format` / `format_messages` turn a problem into what the engine sees (`engine_text`;
        e.g. `functools.partial(models.format_prompt, tokenizer)`).
        """
        kept, dropped = filter_long(
            self.items,
            tokenizer,
            max_prompt_tokens,
            text=lambda p: self.engine_text(p, format, format_messages),
        )
        if not kept:
            raise DataError(
                f"{self.source or 'prompt set'}: all {len(self.items)} prompts are longer than "
                f"{max_prompt_tokens} tokens; raise model.max_model_len or lower rollout.max_tokens"
            )
        copy = PromptSet(kept, self.template, self.reward_fn, self.seed, self.source, self.skipped)
        return copy, dropped

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order


def render(template: str, question: str) -> str:
    """`template` with {problem} replaced (str.format: literal braces are written {{ }})."""
    try:
        return template.format(problem=question)
    except (KeyError, IndexError, ValueError) as err:
        raise DataError(
            f"data.template={template!r}: cannot be filled ({type(err).__name__}: {err}); "
            "use {problem} for the question and {{ }} for literal braces"
        ) from None


def filter_long(
    prompts: Sequence[T],
    tokenizer: Any,
    max_prompt_tokens: int,
    *,
    text: Callable[[T], str] | None = None,
) -> tuple[list[T], int]:
    """(prompts whose token count, special tokens included, is <= max_prompt_tokens, dropped).

    `prompts` are strings, or anything `text` maps to the string the engine will encode.
    """
    to_text = text or (lambda item: item)  # type: ignore[assignment,return-value]
    texts = [to_text(p) for p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []
    kept = [p for p, length in zip(prompts, lengths, strict=True) if length <= max_prompt_tokens]
    return kept, len(prompts) - len(kept)


def build_prompt_set(cfg: Any) -> PromptSet:
    """The prompt set of a `DataConfig`: synthetic prompts or a dataset's rows, shuffled by seed."""
    if cfg.kind not in REWARDS:
        raise DataError(f"data.kind={cfg.kind}: must be one of {', '.join(REWARDS)}")
    if cfg.kind in SYNTHETIC:
        items = SYNTHETIC[cfg.kind].make(cfg.seed).prompts(cfg.num_prompts)
        source, skipped = f"{cfg.kind} (seed {cfg.seed})", 0
    else:
        records = load_records(
            path=cfg.path,
            hf_id=cfg.hf_id,
            split=cfg.split,
            fields={"id": "id", "problem": cfg.prompt_field, "answer": cfg.answer_field},
            format=cfg.format,
        )
        items = [
            Problem(r["id"], r["problem"], r["answer"], record=original, messages=r.get("messages"))
            for r, original in zip(records.rows, records.originals, strict=True)
        ]
        source, skipped = records.source, records.skipped
    render(cfg.template, "x")  # a broken template fails here, not at the first batch
    random.Random(cfg.seed).shuffle(items)
    return PromptSet(items, cfg.template, REWARDS[cfg.kind], cfg.seed, source, skipped)
