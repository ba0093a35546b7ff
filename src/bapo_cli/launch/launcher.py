"""How `bapo train` and `bapo eval` start once their command line is parsed (cli.py is only the
Typer glue around this): the overrides checked (every sweep job included), the generation
servers asked, the run dir claimed, then one process through Hydra, a grouped sweep, torchrun's
ranks (`--nproc`, `--nnodes`) or an sbatch script (`--slurm-script`). A refusal is `Refused`,
one line, raised before anything is written; the CLI prints it and exits 2."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from bapo_cli import redact
from bapo_cli.config import hydra_runner
from bapo_cli.config.hydra_runner import quote
from bapo_cli.config.preflight import Preflight, PreflightError, preflight
from bapo_cli.launch import forward, multinode, rundir, slurm, sweep

__all__ = ["Refused", "TrainLayout", "check", "claim_output_dir", "launch", "train"]


class Refused(Exception):
    """The command cannot run as given; the message is one line saying why and what to do."""


def check(config_name: str, overrides: list[str] | None, multirun: bool = False) -> Preflight:
    """The command line checked before anything runs (`config.preflight`); HYDRA_FULL_ERROR=1
    shows Hydra's own error instead of the one line."""
    try:
        return preflight(config_name, list(overrides or []), multirun=multirun)
    except PreflightError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise Refused(str(exc)) from None


def launch(
    config_name: str,
    overrides: list[str] | None,
    multirun: bool,
    task: Any,
    allow_existing: bool = False,
) -> None:
    """Check, ask the servers, claim the run (sweep) dir, then Hydra calls `task` per job (a
    train sweep tracked in MLflow: grouped under one parent run, `launch.sweep`). Under
    torchrun only rank 0 claims a run dir: the others run in a scratch dir of their own."""
    redact.mask_log_records()  # Hydra logs every job's overrides as typed
    checked = check(config_name, overrides, multirun)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        check_servers(config_name, checked.config)  # generation servers: before the run dir
    checked.overrides.extend(_rank_overrides(rank, checked.overrides))
    claim_output_dir(checked, multirun, allow_existing)
    if multirun:
        jobs = "a sampled number of" if checked.num_jobs is None else str(checked.num_jobs)
        Console().print(f"[bold]bapo {config_name}[/bold]: {jobs} jobs, every config validated")
    if not (multirun and config_name == "train" and "mlflow" in checked.config.tracking.backends):
        hydra_runner.run(
            (["--multirun"] if multirun else []) + checked.overrides,
            config_name=config_name,
            task_function=task,
        )
        return
    sweep.run_grouped(checked, list(overrides or []), config_name, task)


def _rank_overrides(rank: int, overrides: list[str]) -> list[str]:
    """A torchrun rank > 0 writes nothing in rank 0's run dir: a scratch run dir of its own,
    and no `.hydra/` in a run dir the command line names (another rank's record there could make
    rank 0's check take this very run for an earlier one)."""
    if rank == 0:
        return []
    if any(o.startswith("hydra.run.dir=") for o in overrides):
        return ["hydra.output_subdir=null"]
    scratch = Path(tempfile.gettempdir()) / f"bapo-rank{rank}-{os.getpid()}"
    return [f"hydra.run.dir={quote(str(scratch))}", "hydra.output_subdir=null"]


def check_servers(config_name: str, cfg: Any) -> None:
    """Generation servers (rollout.servers, eval.server) answer and serve the run's model, and
    the weights directory can be written: else `Refused`, nothing written (no run dir yet).
    Imported only when servers are named: the check needs torch."""
    if config_name == "train" and cfg.rollout.servers:
        from bapo_cli.staleness.server_setup import preflight as look
    elif config_name == "eval" and cfg.eval.server is not None:
        from bapo_cli.evaluation.served import preflight as look
    else:
        return
    from bapo_cli.models.errors import ModelLoadError
    from bapo_cli.rollout.servers import ServerError
    from bapo_cli.rollout.weights_fs import WeightsDirError

    try:
        look(cfg)
    except (ServerError, WeightsDirError, ModelLoadError) as exc:
        raise Refused(str(exc)) from None


def claim_output_dir(
    checked: Preflight, multirun: bool, allow_existing: bool = False
) -> Path | None:
    """A run (sweep) dir of its own (`rundir.settle`): a fresh `<time>[-N]`, or the real path
    of one the command line names (hydra.run.dir=... to resume), refused when it holds a run; a
    torchrun rank > 0 leaves it to rank 0 (None)."""
    if int(os.environ.get("RANK", "0")) > 0:
        return None
    try:
        return rundir.settle(checked, multirun, allow_existing)
    except rundir.RunDirError as err:
        raise Refused(str(err)) from None


@dataclass(frozen=True)
class TrainLayout:
    """`bapo train`'s process flags: --nproc, --nnodes, --node-rank, --rdzv-endpoint, and
    --slurm-script with --gpus-per-node and --sbatch."""

    nproc: int = 0  # 0: this process (1 per node with nnodes > 1)
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    slurm_script: Path | None = None
    gpus_per_node: int | None = None
    sbatch: tuple[str, ...] = ()

    @property
    def torchrun(self) -> bool:
        """Whether the run goes through torchrun (or a script that runs it)."""
        many = self.nnodes != 1 or self.node_rank is not None or self.rdzv_endpoint is not None
        return self.nproc >= 1 or many or self.slurm_script is not None

    def given(self) -> list[str]:
        """The flags given that only a launch from here can use."""
        flags = {
            "--nproc": self.nproc >= 1,
            "--nnodes": self.nnodes != 1,
            "--node-rank": self.node_rank is not None,
            "--rdzv-endpoint": self.rdzv_endpoint is not None,
            "--slurm-script": self.slurm_script is not None,
        }
        return [flag for flag, on in flags.items() if on]


def train(overrides: list[str] | None, multirun: bool, layout: TrainLayout, task: Any) -> int:
    """`bapo train`: one process (or a sweep) through Hydra, torchrun's ranks, or an sbatch
    script; the exit code (torchrun's, or 0)."""
    if layout.nproc < 0:
        raise Refused(f"--nproc {layout.nproc}: must be >= 0 (0 = no torchrun)")
    if layout.given() and "WORLD_SIZE" in os.environ:  # they would be ignored
        raise Refused(multinode.launched_already(layout.given()))
    if layout.slurm_script is None and (layout.gpus_per_node is not None or layout.sbatch):
        raise Refused("--gpus-per-node and --sbatch go with --slurm-script FILE")
    if not layout.torchrun:
        launch("train", overrides, multirun, task)
        return 0
    if multirun:
        raise Refused("--nproc and -m together: run the sweep's jobs one torchrun at a time")
    topo = multinode.Topology(
        max(layout.nproc, 1), layout.nnodes, layout.node_rank, layout.rdzv_endpoint
    )
    try:
        topo.check(script=layout.slurm_script is not None)
    except multinode.LaunchError as err:
        raise Refused(str(err)) from None
    checked = check("train", overrides)  # bad input fails here, before N processes start
    _check_parallel(checked.config, topo.nproc * topo.nnodes)
    if layout.slurm_script is not None:
        write_slurm_script(layout, topo, checked)
        return 0
    program = multinode.train_program(list(overrides or []))
    env = forward.agent_env(checked.config.trainer.stop_grace_s)
    return forward.run(forward.agent_command(multinode.torchrun_command(topo, program)), env)


def _check_parallel(cfg: Any, world_size: int) -> None:
    """The data-parallel rule (`staleness.source.parallel_refusal`), before torchrun starts;
    imported here since staleness loads torch, which every other refusal does without."""
    from bapo_cli.staleness.source import parallel_refusal

    refusal = parallel_refusal(cfg, world_size)
    if refusal is not None:
        raise Refused(refusal)


def write_slurm_script(layout: TrainLayout, topo: multinode.Topology, checked: Preflight) -> None:
    """The sbatch script (`launch.slurm`), its run dir claimed now: each attempt of the job
    trains there with trainer.resume=true."""
    cfg, path, gpus = checked.config, layout.slurm_script, layout.gpus_per_node
    device = cfg.model.device
    gpus = (topo.nproc if device == "cuda" else 0) if gpus is None else gpus
    if device == "cuda" and gpus == 0:
        raise Refused("--gpus-per-node 0 with model.device=cuda: the job would have no GPU")
    try:
        slurm.check_sbatch(list(layout.sbatch), cfg.trainer.stop_grace_s)
    except slurm.SlurmScriptError as err:
        raise Refused(str(err)) from None
    run_dir = claim_output_dir(checked, False)
    text = slurm.script(
        topo,
        checked.overrides,  # normalised: the output root pinned, as every attempt must see it
        run_dir=os.path.abspath(run_dir),
        grace_s=cfg.trainer.stop_grace_s,
        gpus_per_node=gpus,
        sbatch=list(layout.sbatch),
    )
    path.write_text(text)
    path.chmod(0o700)  # its overrides may hold credentials (tracking.uri)
    asked = f"{gpus} GPU(s) per node" if gpus else "no GPU (--gpus-per-node N asks for some)"
    Console().print(
        f"wrote {path}: sbatch {path}  (run dir {run_dir}; {asked})",
        markup=False,
        emoji=False,
        highlight=False,
        soft_wrap=True,
    )
