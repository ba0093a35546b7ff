"""`bapo eval`: sample n responses per problem, grade them, report avg@n, pass@k and maj@n.

    benchmark rows → prompts (template, chat template) → engine (n samples each)
        → grade (math-verify, time-limited) → summarize → results.json, samples.jsonl, MLflow

The metrics are pure functions in `eval_metrics`, the grading is `rewards.MathGrader.grade_batch`
(`reward.timeout_s` per answer, `reward.workers` in parallel), or with reward=python the user's
function (a response is correct when it scores > 0); this module only moves data between them.
Each entry also says what grading cost: `grade_timeouts` (answers scored 0 because math-verify
ran out of time) and `grade_s` (seconds spent grading). `evaluate_benchmark` is also what the
trainer calls for validation (`trainer.val_every`), on its own engine and weights.

Paper protocol (bapo-spec): AIME 2024 / 2025 averaged over 16 samples (avg@16), temperature 0.6,
top_p 0.95. Prompts longer than the model's context (model.max_model_len minus the response
budget) keep their last tokens and are counted in `prompts_truncated`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bapo_cli.config.preflight import preflight
from bapo_cli.config.schema import BenchmarkConfig
from bapo_cli.data import shipped
from bapo_cli.data.datasets import SYNTHETIC
from bapo_cli.data.records import DataError, load_records
from bapo_cli.data.tasks import Problem
from bapo_cli.evaluation import metrics as eval_metrics
from bapo_cli.evaluation import served
from bapo_cli.models import hub
from bapo_cli.models import loading as models
from bapo_cli.rewards import GradeReport, MathGrader, extract_answer, grade_batch
from bapo_cli.rewards.plugin import PythonReward
from bapo_cli.rollout.base import EngineChoice, Request, SamplingParams, choose, make_engine
from bapo_cli.tracking import flatten, make_tracker, start_failure


class EvalTrackingError(RuntimeError):
    """The scores were written to the run dir but the tracking store could not take them."""


EVAL_TEMPLATE = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)

# bapo-spec "Headline results" (paper Table 1, AIME avg@16, percent)
PAPER_REFERENCE = {
    "aime24": {
        "BP-Math-7B SFT / GRPO / BAPO": "66.9 / 69.2 / 70.8",
        "BP-Math-32B SFT / GRPO / BAPO": "84.4 / 84.6 / 87.1",
        "SkyWork-OR1-7B": "70.2",
        "R1-Distill-Qwen-7B": "54.2",
    },
    "aime25": {
        "BP-Math-7B SFT / GRPO / BAPO": "59.0 / 59.2 / 62.5",
        "BP-Math-32B SFT / GRPO / BAPO": "78.1 / 78.8 / 80.0",
        "SkyWork-OR1-7B": "54.6",
        "R1-Distill-Qwen-7B": "38.4",
    },
}


@dataclass
class BenchmarkResult:
    name: str
    metrics: dict[str, float | int]
    samples: list[dict[str, Any]]
    prompts_truncated: int


def load_problems(bench: Any, limit: int | None = None) -> tuple[list[Problem], int]:
    """(problems, rows skipped) of a BenchmarkConfig, the first `limit` if given.

    By hub id with the hub out of reach (models.hub), only the HF cache is tried and the error
    says how to pass a local file, at once instead of after a minute of retries."""
    by_hub = not (bench.path is not None and str(bench.path)) and bench.hf_id
    offline = hub.go_offline_if_unreachable() if by_hub else None
    try:
        records = load_records(
            path=bench.path,
            hf_id=bench.hf_id,
            split=bench.split,
            config_name=bench.hf_config,
            fields={
                "id": bench.id_field,
                "problem": bench.problem_field,
                "answer": bench.answer_field,
            },
        )
    except DataError:
        if offline is None:
            raise
        ships = (
            f" (or the copy that ships: benchmark.path=shipped:{bench.name})"
            if bench.name in shipped.names()
            else ""
        )
        raise DataError(
            f"benchmark {bench.name}: HF dataset {bench.hf_id} is not in the HF cache and the HF "
            f"hub cannot be used ({offline}); pass a local file: benchmark.path=/path/to/"
            f"{bench.name}.jsonl{ships}"
        ) from None
    pairs = list(zip(records.rows, records.originals, strict=True))[:limit]
    problems = [Problem(str(r["id"]), r["problem"], r["answer"], record=o) for r, o in pairs]
    return problems, records.skipped


def evaluate_benchmark(
    name: str,
    problems: list[Problem],
    engine: Any,
    tokenizer: Any,
    *,
    template: str,
    n: int,
    params: SamplingParams,
    max_model_len: int,
    grader: Callable[[list[str], list[str]], GradeReport] = grade_batch,
    answer_of: Callable[[str], str | None] = extract_answer,
) -> BenchmarkResult:
    """n samples per problem from `engine`, graded; the results.json entry and the sample rows.

    `grader`/`answer_of` default to math grading (last boxed answer, math-verify); the synthetic
    task passes its exact-match reward instead."""
    if n < 1:
        raise ValueError(f"eval.n={n}: must be >= 1")
    budget = min(params.max_tokens, max(max_model_len // 2, 1))
    prompt_limit = max(max_model_len - budget, 1)
    truncated = 0
    requests = []
    for problem in problems:
        text = models.format_prompt(tokenizer, template.format(problem=problem.question))
        ids = list(tokenizer(text)["input_ids"])
        if len(ids) > prompt_limit:
            ids, truncated = ids[-prompt_limit:], truncated + 1
        requests += [Request(tuple(ids), (), min(budget, max_model_len - len(ids)))] * n
    sampling = SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=budget,
        stop=params.stop,
        seed=params.seed,
    )
    generations = engine.generate(requests, sampling)
    texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
    references = [p.answer for p in problems for _ in range(n)]
    t0 = time.perf_counter()
    report = grader(texts, references)
    grade_s = time.perf_counter() - t0
    verdicts = report.verdicts
    answers = [answer_of(t) for t in texts]
    correct = [verdicts[i * n : (i + 1) * n] for i in range(len(problems))]
    extracted = [answers[i * n : (i + 1) * n] for i in range(len(problems))]
    metrics = eval_metrics.summarize(correct, extracted, n)
    metrics["grade_timeouts"] = report.timeouts
    if report.scores is not None:  # reward=python: correct = score > 0; its mean and failures
        metrics["reward_mean"] = sum(report.scores) / max(len(report.scores), 1)
        metrics["grade_errors"] = report.errors
    metrics["grade_s"] = round(grade_s, 3)
    samples = [
        {
            "problem_id": problems[i // n].id,
            "sample": i % n,
            "response": texts[i],
            "extracted": answers[i],
            "reference": references[i],
            "correct": bool(verdicts[i]),
            **({"reward": report.scores[i]} if report.scores is not None else {}),
        }
        for i in range(len(texts))
    ]
    return BenchmarkResult(name, metrics, samples, truncated)


def eval_engine(cfg: Any) -> EngineChoice:
    """What samples `bapo eval`'s responses, decided once: the vLLM server of eval.server, or
    `rollout=<name>` for model.device (`rollout.base.choose`)."""
    if cfg.eval.server is not None:
        return EngineChoice("vllm", f"the server {cfg.eval.server}, eval.server")
    return choose(cfg.rollout.name, cfg.model.device)


def evaluate(
    cfg: Any, run_dir: Path, console: Console | None = None, engine: EngineChoice | None = None
) -> dict[str, Any]:
    """`bapo eval` for one benchmark config: results.json + samples.jsonl + MLflow + table;
    `engine`: what samples, as the run plan showed it (decided here if None)."""
    import transformers

    choice = engine or eval_engine(cfg)
    console = console or Console()
    transformers.utils.logging.disable_progress_bar()
    run_dir.mkdir(parents=True, exist_ok=True)
    problems, skipped = load_problems(cfg.benchmark, cfg.eval.limit)
    if not problems:
        raise DataError(f"benchmark {cfg.benchmark.name}: no problems to score")
    if cfg.eval.server is not None:  # a running vLLM server generates (evaluation/served.py)
        engine, tokenizer = served.served_engine(cfg, run_dir)
    else:
        model, tokenizer = models.load_policy(cfg.model)
        model.eval()
        engine = make_engine(choice.name, model=model, tokenizer=tokenizer, cfg=cfg)
    console.print(
        f"scoring {cfg.model.path} on {cfg.benchmark.name}: {len(problems)} problems × "
        f"{cfg.eval.n} samples with {choice}",
        markup=False,  # a path, not markup
        emoji=False,
    )
    try:
        result = score(cfg, problems, engine, tokenizer)
    finally:
        engine.close()  # a server's evaluation releases it
    results = write_results(run_dir, cfg.benchmark.name, result)
    try:  # the results are on disk already: a store that is down loses none of them
        tracker = make_tracker(
            cfg.tracking,
            run_name=cfg.tracking.run_name or f"eval-{cfg.benchmark.name}-{cfg.model.name}",
            tags={"kind": "eval", "benchmark": cfg.benchmark.name, "model": cfg.model.path},
            run_dir=run_dir,
        )
    except Exception as err:
        hint = f"the results are kept in {run_dir}"
        raise EvalTrackingError(start_failure(cfg.tracking, err, hint)) from None
    tracker.log_params(flatten(cfg))
    tracker.log_metrics(metric_keys("eval", cfg.benchmark.name, result.metrics), step=0)
    tracker.log_artifact(run_dir / "results.json")
    tracker.log_artifact(run_dir / "samples.jsonl")
    tracker.close()
    console.print(results_table(cfg.benchmark.name, result, skipped))
    console.print(f"results: {run_dir / 'results.json'}", markup=False, emoji=False)
    return results


def score(cfg: Any, problems: list[Problem], engine: Any, tokenizer: Any) -> BenchmarkResult:
    """`bapo eval`'s scoring of `problems` on `engine`: eval.* sampling, the generators seeded
    with eval.seed first (so the same weights give the same samples wherever this is called:
    `bapo eval`, `bapo eval --watch`), graded by `_eval_grader`."""
    import transformers

    params = SamplingParams(
        temperature=cfg.eval.temperature,
        top_p=cfg.eval.top_p,
        max_tokens=cfg.eval.max_tokens,
        seed=cfg.eval.seed,
    )
    transformers.set_seed(cfg.eval.seed)  # python, numpy, torch (and CUDA) generators
    grader, grade = _eval_grader(cfg, problems)
    try:
        return evaluate_benchmark(
            cfg.benchmark.name,
            problems,
            engine,
            tokenizer,
            template=cfg.eval.template,
            n=cfg.eval.n,
            params=params,
            max_model_len=cfg.model.max_model_len,
            grader=grade,
        )
    finally:
        grader.close()


def write_results(out: Path, name: str, result: BenchmarkResult) -> dict[str, Any]:
    """results.json ({name: metrics}) and samples.jsonl in `out`; the results."""
    out.mkdir(parents=True, exist_ok=True)
    results = {name: result.metrics}
    with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
        for row in result.samples:
            f.write(json.dumps(row) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")  # last: complete
    return results


def _eval_grader(cfg: Any, problems: list[Problem]) -> tuple[Any, Callable[..., GradeReport]]:
    """(grader to close, grading function) of `bapo eval`: math-verify, or with reward=python
    the user's function, each response with its problem's row as the record."""
    if cfg.reward.name != "python":
        grader = MathGrader(timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
        return grader, grader.grade_batch
    plugin = PythonReward(cfg.reward.fn, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
    records = [p.as_record() for p in problems for _ in range(cfg.eval.n)]

    def grade(texts: list[str], references: list[str]) -> GradeReport:
        return plugin.grade_batch(texts, references, records)

    return plugin, grade


def metric_keys(prefix: str, name: str, metrics: dict[str, float | int]) -> dict[str, float]:
    """`{"avg@16": x}` → `{"eval/aime24/avg_at_16": x}`: MLflow refuses '@' in metric names, so
    the keys spell it `_at_` (results.json keeps the '@' form)."""
    return {f"{prefix}/{name}/{k.replace('@', '_at_')}": float(v) for k, v in metrics.items()}


def results_table(name: str, result: BenchmarkResult, skipped: int = 0) -> Table:
    table = Table(title=f"bapo eval: {name}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.metrics.items():
        if key.endswith("_s"):
            table.add_row(key.removesuffix("_s") + " (s)", f"{value:.1f}")
            continue
        if key == "reward_mean":  # reward=python: the function's own scale, not a fraction
            table.add_row(key, f"{value:.3f}")
            continue
        shown = f"{100 * value:.1f}" if isinstance(value, float) else str(value)
        table.add_row(key + (" (%)" if isinstance(value, float) else ""), shown)
    notes = []
    if result.prompts_truncated:
        notes.append(f"{result.prompts_truncated} prompts truncated to the context")
    if skipped:
        notes.append(f"{skipped} unusable rows skipped")
    for model, value in PAPER_REFERENCE.get(name, {}).items():
        notes.append(f"paper avg@16, {model}: {value}")
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


# --------------------------------------------------------------------- validation in training

VAL_SAMPLING = SamplingParams(temperature=0.6, top_p=0.95)  # the paper's evaluation sampling
SYNTHETIC_VAL_PROBLEMS = 200


def _reward_grader(reward: Callable[[str, str], float]) -> Callable[..., GradeReport]:
    """A synthetic task's reward as a grader (exact and instant: no timeouts to count)."""

    def grader(texts: list[str], references: list[str]) -> GradeReport:
        return GradeReport([reward(t, r) > 0 for t, r in zip(texts, references, strict=True)])

    return grader


def validation_sets(
    cfg: Any, grader: Callable[[list[str], list[str]], GradeReport] | None = None
) -> list[tuple[str, list[Problem], dict[str, Any]]]:
    """(name, problems, evaluate_benchmark kwargs) per `trainer.val_benchmarks` entry.

    An entry is `arith` or `pairs` (that synthetic task's held-out split, graded by its reward;
    prompts in data.template when training on that task, else in the task's own template), a
    benchmark preset name (aime24, aime25, math500, amc23, minerva_math, olympiadbench: its file
    shipped with the package, or its HF id where the preset's path is cleared) or a local
    .jsonl/.json/.parquet file with fields id, problem, answer (named by its file stem), graded by
    `grader` (default: the shared math grader)."""
    math = {"template": EVAL_TEMPLATE, **({"grader": grader} if grader is not None else {})}

    out = []
    limit = cfg.trainer.val_limit
    for entry in cfg.trainer.val_benchmarks:
        if entry in SYNTHETIC:
            task = SYNTHETIC[entry]
            problems = task.make(cfg.data.seed).held_out(limit or SYNTHETIC_VAL_PROBLEMS)
            kwargs = {
                "template": cfg.data.template if cfg.data.kind == entry else task.template,
                "grader": _reward_grader(task.reward),
                "answer_of": task.answer_of,
            }
            out.append((entry, problems, kwargs))
            continue
        if Path(entry).suffix in (".jsonl", ".json", ".parquet"):
            bench = BenchmarkConfig(name=Path(entry).stem, path=entry)
        else:
            bench = preflight("eval", [f"benchmark={entry}"]).config.benchmark
        problems, _ = load_problems(bench, limit)
        out.append((bench.name, problems, dict(math)))
    return out


def validate(
    sets: list[tuple[str, list[Problem], dict[str, Any]]],
    engine: Any,
    tokenizer: Any,
    *,
    n: int,
    max_tokens: int,
    max_model_len: int,
) -> dict[str, float]:
    """`val/<name>/avg_at_<n>` (and the other metrics) for every validation set."""
    metrics: dict[str, float] = {}
    params = SamplingParams(VAL_SAMPLING.temperature, VAL_SAMPLING.top_p, max_tokens=max_tokens)
    for name, problems, kwargs in sets:
        result = evaluate_benchmark(
            name,
            problems,
            engine,
            tokenizer,
            n=n,
            params=params,
            max_model_len=max_model_len,
            **kwargs,
        )
        metrics.update(metric_keys("val", name, result.metrics))
    return metrics
