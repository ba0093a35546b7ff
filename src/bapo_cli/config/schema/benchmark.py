"""What `bapo eval` scores and how: the `benchmark` group (an evaluation set) and the `eval`
group (samples per problem, sampling)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _positive, opt


@dataclass
class BenchmarkConfig:
    """An evaluation set: a public HF dataset by id, or a local jsonl/parquet file."""

    name: str = opt(MISSING, "benchmark name, used in metric keys eval/<name>/...")
    hf_id: str | None = opt(None, "HF dataset id for users with a network")
    hf_config: str | None = opt(None, "HF dataset config name, if the dataset has several")
    split: str = opt("test", "dataset split")
    path: str | None = opt(
        None,
        "local jsonl/parquet, or shipped:<name> (a file shipped with the package); wins over hf_id",
    )
    id_field: str = opt("id", "field holding the problem id")
    problem_field: str = opt("problem", "field holding the question")
    answer_field: str = opt("answer", "field holding the reference answer")

    def check(self) -> None:
        if not (self.hf_id or self.path):
            raise ConfigError("path", None, "a benchmark needs benchmark.path or benchmark.hf_id")


@dataclass
class EvalConfig:
    """Scoring: samples per problem, which k to report, sampling defaults of the paper."""

    n: int = opt(16, "samples per problem (the paper's avg@16)")
    limit: int | None = opt(None, "score only the first N problems (smoke runs); null = all")
    temperature: float = opt(0.6, "sampling temperature")
    top_p: float = opt(0.95, "nucleus sampling mass")
    max_tokens: int = opt(
        32768, "response token budget (sized for reasoning models; capped by model.max_model_len)"
    )
    seed: int = opt(0, "sampling seed")
    template: str = opt(
        "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        "prompt template; {problem} is replaced by the question",
    )
    server: str | None = opt(  # generation servers (config/servers.py)
        None,
        "score the model a running vLLM server serves (bapo serve, or vllm serve with its "
        "flags) at this URL instead of loading its weights here; null = in this process",
    )

    def check(self) -> None:
        if self.n < 1:
            raise ConfigError("n", self.n, "must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("limit", self.limit, "must be >= 1 (or null for all problems)")
        _positive("temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", self.top_p, "must be within (0, 1]")
        _positive("max_tokens", self.max_tokens)
        if "{problem}" not in self.template:
            raise ConfigError("template", self.template, "must contain {problem}")
