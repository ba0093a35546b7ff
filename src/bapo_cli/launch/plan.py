"""Say, in plain words, what a validated config would run.

`bapo train` and `bapo eval` print this before they start (and, until the training and evaluation
engines land, instead of starting): the model, the loss and its clip bounds, what staleness means
for this regime, the batch shape, the engine `rollout=auto` resolves to, and where numbers go.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bapo_cli import redact
from bapo_cli.config.schema import EvalRunConfig, TrainConfig


def resolve_engine(name: str, device: str | None = None) -> tuple[str, str]:
    """(engine, why) for `rollout=<name>` on `model.device=<device>`: `auto` picks vLLM on CUDA
    when it imports, else transformers (see `rollout.base.choose_engine`)."""
    from bapo_cli.rollout.base import device_is_cuda, resolve_engine_name

    if name != "auto":
        return name, "selected"
    chosen = resolve_engine_name(name, device)
    if chosen == "vllm":
        return chosen, "auto: CUDA and vllm is available"
    if not device_is_cuda(device):
        return chosen, "auto: transformers on CPU, where it is faster than vllm"
    return chosen, "auto: vllm is not available"


def describe_clip(algo: object) -> str:
    """The clip bounds in words, from the loss's params (`describe()`), whatever the loss."""
    from bapo_cli.algos import losses

    return losses.REGISTRY.get(algo.loss).read_params(algo).describe()


def describe_staleness(k: int, regime: str, epochs: int) -> str:
    """What `staleness=k` means under `regime`, in the regime's own words (`describe()`)."""
    from bapo_cli.staleness.regimes import REGIMES

    return REGIMES.get(regime).describe(k, epochs)


def describe_worst_staleness(k: int, regime: str, epochs: int) -> str:
    """The worst staleness an update can see, in versions: the regime's lag in steps compounded
    with the updates each step makes (reuse's mini-batches × ppo_epochs)."""
    from bapo_cli.staleness.regimes import REGIMES

    cls = REGIMES.get(regime)
    lag, worst = cls.lag_steps(k), cls.worst_staleness(k, epochs)
    per_step = cls.updates_per_batch(k) * epochs
    return (
        f"{worst} version{'s' if worst != 1 else ''} (lag {lag} step{'s' if lag != 1 else ''} × "
        f"{per_step} update{'s' if per_step != 1 else ''} per step, + {per_step - 1} on the same "
        "batch)"
    )


def describe_generation(cfg: TrainConfig) -> str:
    """Where an async run's samples come from: its worker process, or generation servers."""
    servers = list(cfg.rollout.servers)
    if not servers:
        return "a worker process on this machine, weights through shared memory"
    if cfg.staleness.weights == "nccl":
        weights = f"weights by NCCL from the trainer's GPU (group at {cfg.staleness.nccl_master})"
    else:
        weights = f"weights by file under {cfg.staleness.weights_dir or '<run dir>/weights'}"
    pause = "; a push pauses responses mid-way (interrupt)" if cfg.staleness.interrupt else ""
    return (
        f"{len(servers)} vLLM server{'s' if len(servers) > 1 else ''} ({', '.join(servers)}), "
        f"{weights}{pause}"
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
    from bapo_cli.tracking.backends import where

    if not cfg.tracking.backends:
        return "off (tracking=none)"
    return "; ".join(f"{name}: {where(cfg.tracking, name)}" for name in cfg.tracking.backends)


def _lora(model: object) -> str:
    """`, LoRA r=8 alpha=32 on all-linear` when model.lora is on (only the adapters train)."""
    lora = getattr(model, "lora", None)
    if lora is None or not lora.rank:
        return ""
    return f", LoRA r={lora.rank} alpha={lora.alpha:g} on {','.join(lora.target_modules)}"


def train_rows(cfg: TrainConfig, run_dir: Path) -> list[tuple[str, str]]:
    engine, why = resolve_engine(cfg.rollout.name, cfg.model.device)
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
        ("rollout", f"{engine} ({why}); n={cfg.rollout.n} T={cfg.rollout.temperature:g}"),
        *([("generation", describe_generation(cfg))] if cfg.staleness.regime == "async" else []),
        ("batch", f"{cfg.trainer.prompts_per_step} prompts × {cfg.rollout.n} = {seqs} sequences"),
        ("steps", f"{cfg.trainer.max_steps} at lr {cfg.trainer.lr:g}, seed {cfg.trainer.seed}"),
        ("tracking", _tracking(cfg)),
        ("run dir", str(run_dir)),
    ]


def eval_rows(cfg: EvalRunConfig, run_dir: Path) -> list[tuple[str, str]]:
    engine, why = resolve_engine(cfg.rollout.name, cfg.model.device)
    source = cfg.benchmark.path or f"{cfg.benchmark.hf_id} [{cfg.benchmark.split}]"
    limit = "all problems" if cfg.eval.limit is None else f"first {cfg.eval.limit} problems"
    return [
        ("model", f"{cfg.model.name} ({cfg.model.path})"),
        ("benchmark", f"{cfg.benchmark.name}: {source}, {limit}"),
        ("sampling", f"n={cfg.eval.n} T={cfg.eval.temperature:g} top_p={cfg.eval.top_p:g}"),
        ("engine", f"{engine} ({why})"),
        ("tracking", _tracking(cfg)),
        ("run dir", str(run_dir)),
    ]


def show(title: str, rows: list[tuple[str, str]], console: Console | None = None) -> None:
    (console or Console()).print(_table(title, rows))
