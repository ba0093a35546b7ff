"""Say, in plain words, what a validated config will run.

`bapo train` and `bapo eval` print this before they start: the model, the loss and its clip
bounds, what staleness means for this regime, the batch shape, who samples, and where numbers
go. Who samples is not worked out here: the rows read the same resolved object the run is built
from (`staleness.source.SampleSource` for training, `rollout.base.EngineChoice` for evaluation),
so the plan cannot disagree with what runs.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bapo_cli import redact
from bapo_cli.algos import losses
from bapo_cli.config.schema import EvalRunConfig, TrainConfig
from bapo_cli.evaluation.evaluate import eval_engine
from bapo_cli.rollout.base import EngineChoice
from bapo_cli.staleness.regimes import REGIMES
from bapo_cli.staleness.source import SERVERS, WORKER, SampleSource, sample_source
from bapo_cli.tracking.backends import where


def describe_clip(algo: object) -> str:
    """The clip bounds in words, from the loss's params (`describe()`), whatever the loss."""
    return losses.REGISTRY.get(algo.loss).read_params(algo).describe()


def describe_staleness(k: int, regime: str, epochs: int) -> str:
    """What `staleness=k` means under `regime`, in the regime's own words (`describe()`)."""
    return REGIMES.get(regime).describe(k, epochs)


def describe_worst_staleness(k: int, regime: str, epochs: int) -> str:
    """The worst staleness an update can see, in versions: the regime's lag in steps compounded
    with the updates each step makes (reuse's mini-batches × ppo_epochs)."""
    cls = REGIMES.get(regime)
    lag, worst = cls.lag_steps(k), cls.worst_staleness(k, epochs)
    per_step = cls.updates_per_batch(k) * epochs
    return (
        f"{worst} version{'s' if worst != 1 else ''} (lag {lag} step{'s' if lag != 1 else ''} × "
        f"{per_step} update{'s' if per_step != 1 else ''} per step, + {per_step - 1} on the same "
        "batch)"
    )


def describe_data(data: object) -> str:
    """The prompt source: a synthetic preset by name; a dataset by the file or hub id it reads
    (`data.path` wins over `data.hf_id`), never by the preset name it may have been composed
    over (`data.kind=dataset data.path=mine.jsonl` on the default `data=arith`)."""
    if data.kind != "dataset":
        return f"{data.name} ({data.kind})"
    source = data.path if data.path else f"{data.hf_id} [{data.split}]"
    return f"{source} (dataset)"


def _table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    for key, value in rows:
        # every value masked, not only tracking's: free-form fields (model.name,
        # tracking.experiment, a data path) may hold a credentialed URL; a Text, so that user
        # text is shown as it is, never read as markup (`[/]`) or emoji codes (`:-1:`)
        table.add_row(key, Text(redact.text(value)))
    return table


def _tracking(cfg: TrainConfig | EvalRunConfig) -> str:
    if not cfg.tracking.backends:
        return "off (tracking=none)"
    return "; ".join(f"{name}: {where(cfg.tracking, name)}" for name in cfg.tracking.backends)


def _lora(model: object) -> str:
    """`, LoRA r=8 alpha=32 on all-linear` when model.lora is on (only the adapters train)."""
    lora = getattr(model, "lora", None)
    if lora is None or not lora.rank:
        return ""
    return f", LoRA r={lora.rank} alpha={lora.alpha:g} on {','.join(lora.target_modules)}"


def train_rows(
    cfg: TrainConfig, run_dir: Path, source: SampleSource | None = None
) -> list[tuple[str, str]]:
    """The plan of `bapo train`; `source`: who samples, as the run will be given it."""
    source = source or sample_source(cfg)
    sampling = f"n={cfg.rollout.n} T={cfg.rollout.temperature:g}"
    seqs = cfg.trainer.prompts_per_step * cfg.rollout.n
    return [
        ("model", f"{cfg.model.name} ({cfg.model.path}){_lora(cfg.model)}"),
        ("algo", f"{cfg.algo.name}: loss={cfg.algo.loss} advantage={cfg.algo.advantage}"),
        ("clip", describe_clip(cfg.algo)),
        ("dual clip", "off" if cfg.algo.dual_clip is None else f"{cfg.algo.dual_clip:g}"),
        (
            "staleness",
            describe_staleness(cfg.staleness.k, cfg.staleness.regime, cfg.staleness.ppo_epochs),
        ),
        (
            "worst staleness",
            describe_worst_staleness(
                cfg.staleness.k, cfg.staleness.regime, cfg.staleness.ppo_epochs
            ),
        ),
        ("data", describe_data(cfg.data)),
        ("rollout", f"{source.rollout()}; {sampling}"),
        *([("generation", source.generation())] if source.place in (WORKER, SERVERS) else []),
        ("batch", f"{cfg.trainer.prompts_per_step} prompts × {cfg.rollout.n} = {seqs} sequences"),
        ("steps", f"{cfg.trainer.max_steps} at lr {cfg.trainer.lr:g}, seed {cfg.trainer.seed}"),
        ("tracking", _tracking(cfg)),
        ("run dir", str(run_dir)),
    ]


def eval_rows(
    cfg: EvalRunConfig, run_dir: Path, engine: EngineChoice | None = None
) -> list[tuple[str, str]]:
    """The plan of `bapo eval`; `engine`: what samples, as the evaluation will be given it."""
    engine = engine or eval_engine(cfg)
    source = cfg.benchmark.path or f"{cfg.benchmark.hf_id} [{cfg.benchmark.split}]"
    limit = "all problems" if cfg.eval.limit is None else f"first {cfg.eval.limit} problems"
    return [
        ("model", f"{cfg.model.name} ({cfg.model.path})"),
        ("benchmark", f"{cfg.benchmark.name}: {source}, {limit}"),
        ("sampling", f"n={cfg.eval.n} T={cfg.eval.temperature:g} top_p={cfg.eval.top_p:g}"),
        ("engine", str(engine)),
        ("tracking", _tracking(cfg)),
        ("run dir", str(run_dir)),
    ]


def show(title: str, rows: list[tuple[str, str]], console: Console | None = None) -> None:
    (console or Console()).print(_table(title, rows))
