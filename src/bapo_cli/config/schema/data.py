"""The `data` group: training prompts, from the seeded synthetic tasks or a prompt set (HF id or
local file)."""

from __future__ import annotations

from dataclasses import dataclass

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt

DATA_KINDS = ("arith", "pairs", "dataset")
DATA_FORMATS = ("auto", "plain", "verl", "messages")  # bapo_cli.data.formats.FORMATS


@dataclass
class DataConfig:
    """Training prompts: the seeded synthetic task, or a prompt set by HF id or local file."""

    name: str = opt("arith", "preset name")
    kind: str = opt(
        "arith",
        "arith or pairs (synthetic, exactly checkable; pairs: wrong answers longer) or dataset",
    )
    hf_id: str | None = opt(None, "HF dataset id (kind=dataset)")
    path: str | None = opt(None, "local jsonl/json/parquet/csv; wins over hf_id (kind=dataset)")
    format: str = opt(
        "auto",
        "row format (kind=dataset): plain (prompt_field/answer_field + template), verl (parquet: "
        "prompt as chat messages, reward_model.ground_truth), messages (OpenAI-style 'messages' "
        "list); auto: from the first row. Chat rows get the tokenizer's chat template "
        "(docs/training.md)",
    )
    split: str = opt("train", "dataset split")
    prompt_field: str = opt("problem", "field holding the question")
    answer_field: str = opt("answer", "field holding the reference answer")
    template: str = opt(
        "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        "prompt template; {problem} is replaced by the question",
    )
    num_prompts: int = opt(4096, "synthetic prompts generated (kind=arith or pairs)")
    seed: int = opt(0, "seed of the synthetic task and of prompt shuffling")

    def check(self) -> None:
        _one_of("kind", self.kind, DATA_KINDS)
        _one_of("format", self.format, DATA_FORMATS)
        if self.kind == "dataset" and not (self.hf_id or self.path):
            raise ConfigError("path", None, "kind=dataset needs data.path or data.hf_id")
        if self.kind != "dataset":
            for key in ("path", "hf_id"):
                if getattr(self, key):
                    raise ConfigError(
                        key,
                        getattr(self, key),
                        f"read only by data.kind=dataset (kind={self.kind} makes its own "
                        "prompts); add data.kind=dataset",
                    )
        if "{problem}" not in self.template:
            raise ConfigError("template", self.template, "must contain {problem}")
        _positive("num_prompts", self.num_prompts)
