"""Hydra task functions: one composed DictConfig in, one validated run out.

Hydra calls these once per job (a single run or each job of a multirun, in whatever process the
launcher chose). They validate again, since a sampling sweeper (Optuna) picks values the CLI's
pre-flight could not see, then hand the typed config and the job's absolute run dir on.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console

from bapo_cli import redact
from bapo_cli.config.errors import USAGE_EXIT_CODE, ConfigError
from bapo_cli.config.preflight import to_validated
from bapo_cli.launch.runlog import LoggedConsole, log, quiet_libraries

SWEPT_ENV = "BAPO_SWEPT_KEYS"
"""Set by a grouped sweep (bapo_cli.launch.sweep) for every job: the override keys whose values
differ between its jobs, space-separated; a job's run is named by its values of them."""


def _validated(cfg: DictConfig):
    import dataclasses

    redact.mask_log_records()  # also in a launcher's worker process (joblib, SLURM)
    quiet_libraries()  # MLflow's and torch's known-noisy lines: to the job's log file only
    _keep_private()
    try:
        config = to_validated(cfg)
    except ConfigError as err:
        print(f"error: {redact.text(err.line())}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    redact.remember_tree(dataclasses.asdict(config))  # a worker process never ran preflight
    return config


def _keep_private() -> None:
    """This job's dir and Hydra's records of its config and overrides (secrets as typed) are
    its owner's only: 0700 and 0600 (bapo_cli.launch.rundir)."""
    from hydra.types import RunMode

    from bapo_cli.launch import rundir

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    record = hydra_cfg.output_subdir  # `.hydra`; `.hydra-eval[-N]` beside another run's
    files = list((run_dir / record).glob("*.yaml")) if record else []
    if hydra_cfg.mode == RunMode.MULTIRUN:
        files.append(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    rundir.make_private([run_dir, *files])


def _share_cores() -> None:
    """Parallel jobs of a sweep (joblib's n_jobs) split the cores instead of each using all,
    which oversubscribes them (docs/sweeps.md). An explicit OMP_NUM_THREADS wins."""
    import os

    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return
    launcher = HydraConfig.get().launcher
    n_jobs = launcher.get("n_jobs") if hasattr(launcher, "get") else None
    if isinstance(n_jobs, int) and n_jobs > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n_jobs))


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def _job_tags() -> dict[str, str]:
    """For a multirun job: its overrides, sweep dir, job number and the sweep's parent run."""
    import os

    from hydra.types import RunMode

    from bapo_cli import tracking

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return {}
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("paths.output_root=")]
    return tracking.job_tags(
        overrides,
        str(Path(hydra_cfg.sweep.dir).resolve()),
        hydra_cfg.job.num,
        os.environ.get(tracking.PARENT_RUN_ENV),
    )


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors whose message is the whole story (bad path, bad data, bad checkpoint)."""
    from bapo_cli.data.records import DataError
    from bapo_cli.models.loading import ModelLoadError
    from bapo_cli.trainer.checkpoint import CheckpointError

    return (ModelLoadError, DataError, CheckpointError)


def _job_overrides() -> list[str]:
    """This job's overrides as the user would type them: the CLI's pinned output root left out,
    and the integers it quoted for Hydra (`staleness='4'`) unquoted again."""
    task = HydraConfig.get().overrides.task
    return [
        re.sub(r"^([^=]+)='(\d+)'$", r"\1=\2", o)
        for o in task
        if not o.startswith("paths.output_root=")
    ]


def _swept() -> list[str]:
    """A grouped sweep job's own values of what its sweep varies: `rho0=0.3` for algo.rho0."""
    keys = os.environ.get(SWEPT_ENV, "").split()
    out = []
    for override in _job_overrides():
        key, _, value = override.partition("=")
        if key.lstrip("+~") in keys:
            out.append(f"{key.lstrip('+~').split('.')[-1].split('/')[-1]}={value}")
    return out


def _resume_command(run_dir: Path) -> str:
    """The command that continues this run from its last checkpoint: the job's overrides (a
    sweep job's included), trainer.resume=true and the run dir; the output root only when it is
    not the one `bapo` picks here anyway. Under torchrun on one node, `--nproc` with the ranks'
    count (a checkpoint resumes with as many ranks as wrote it)."""
    from bapo_cli.config import hydra_runner

    root = next(
        (
            o.partition("=")[2]
            for o in HydraConfig.get().overrides.task
            if o.startswith("paths.output_root=")
        ),
        None,
    )
    default_root = hydra_runner.normalize_overrides([])[-1].partition("=")[2]
    words = ["bapo", "train"]
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if "RANK" in os.environ and local and local == os.environ.get("WORLD_SIZE"):
        words += ["--nproc", local]
    words += [o for o in _job_overrides() if not o.startswith("trainer.resume=")]
    if root is not None and root != default_root:
        words.append(f"paths.output_root={root}")
    words += ["trainer.resume=true", f"hydra.run.dir={hydra_runner.quote(str(run_dir))}"]
    return " ".join(shlex.quote(w) for w in redact.overrides(words))  # secrets masked


def _error(line: str, code: int) -> None:
    """One error line on stderr (and in the run's log file), masked, then exit."""
    line = redact.text(line)  # a path or URL it quotes may hold credentials
    print(line, file=sys.stderr)
    log.error(line)
    sys.exit(code)


def train_job(cfg: DictConfig) -> float:
    """Train; returns the final mean reward (the objective an Optuna sweep maximizes).

    A run stopped by Ctrl-C, SIGTERM or SIGUSR1 (saved, summarised, resume command shown)
    raises `Stopped` (a KeyboardInterrupt) here, so a sweep stops too and the CLI exits 128 + the
    signal (130, 143, 138)."""
    from bapo_cli.launch import plan  # torch and the trainer: loaded once a job runs
    from bapo_cli.staleness.source import sample_source
    from bapo_cli.trainer.interrupt import Stopped
    from bapo_cli.trainer.train import TrainingError, train

    config = _validated(cfg)
    run_dir = _run_dir()
    _share_cores()
    if config.data.kind == "dataset" and config.data.hf_id and not config.data.path:
        from bapo_cli.models import hub

        hub.go_offline_if_unreachable()  # no network: the HF cache or one error line, no retries
    console = LoggedConsole()
    source = sample_source(config)  # who samples, decided once: the plan shows what runs
    plan.show("bapo train", plan.train_rows(config, run_dir, source), console)
    try:
        result = train(
            config,
            run_dir,
            console,
            tags=_job_tags(),
            swept=_swept(),
            resume_command=_resume_command(run_dir),
            source=source,
        )
    except _user_errors() as err:
        _error(f"error: {err}", USAGE_EXIT_CODE)
    except TrainingError as err:
        _error(f"error: {err}", 1)
    if result.interrupted:
        raise Stopped(result.exit_code)
    tail = result.history[-max(len(result.history) // 10, 1) :]
    return sum(h["reward/mean"] for h in tail) / len(tail)


def eval_job(cfg: DictConfig) -> float:
    """Score; returns avg@n (the objective a sweep over eval settings would maximize)."""
    from bapo_cli.evaluation.evaluate import EvalTrackingError, eval_engine, evaluate
    from bapo_cli.launch import plan
    from bapo_cli.rollout.servers import ServerError  # eval.server: the server failed

    config = _validated(cfg)
    run_dir = _run_dir()
    console = Console()
    engine = eval_engine(config)  # decided once: the plan shows what runs
    plan.show("bapo eval", plan.eval_rows(config, run_dir, engine), console)
    try:
        results = evaluate(config, run_dir, console, engine)
    except _user_errors() as err:
        _error(f"error: {err}", USAGE_EXIT_CODE)
    except (EvalTrackingError, ServerError) as err:
        _error(f"error: {err}", 1)
    return float(results[config.benchmark.name][f"avg@{config.eval.n}"])
