"""The sbatch script `bapo train --slurm-script FILE` writes: one run that survives preemption,
requeue and its time limit.

One node: torchrun runs in the batch step itself (bapo_cli.launch.loopback, its store on
127.0.0.1 with no fixed port, so two jobs on one node do not collide). Several: one srun task per
node, each a torchrun starting the node's `--nproc` processes (the recipe of torchrun's and
prime-rl's documentation; submitit and torchrun are not combined: each would start the per-GPU
processes), c10d at the allocation's first node, `--rdzv-id=$SLURM_JOB_ID`. Either torchrun runs
through bapo's wrapper, which ends a stop signal it passed on with 128 + N instead of torchrun's
SignalException traceback. Why no srun on one node: srun turns a SIGTERM it receives into a
SIGKILL of its step ("srun: forcing job termination"), and SLURM signals srun too whenever it
signals the whole job; while the job is still alive (preemption with a GraceTime, `scancel
--signal=TERM --full`) that SIGKILL lands and the ranks die mid-step, unsaved (seen here). Across
nodes srun cannot be avoided: there a preemption must warn with SIGUSR1 (docs/distributed.md).

What makes every attempt of the job continue one run:
- the run dir is fixed when the script is written (claimed then, `hydra.run.dir=<abs path>`) and
  each attempt trains with `trainer.resume=true`: the first finds no checkpoint and starts, a
  requeued one resumes from the newest checkpoint, the same MLflow run and samples.jsonl;
- `--requeue` (preemption puts the job back in the queue) and `--open-mode=append` (the log of
  every attempt in one file);
- `--signal=B:USR1@LEAD`: SLURM signals the batch shell LEAD s before the time limit; its trap
  passes SIGUSR1 on to torchrun (across nodes through srun), torchrun to the ranks, the ranks
  finish or abandon the step within `trainer.stop_grace_s`, save and exit 138, and the script
  requeues the job;
- SIGTERM (preemption, `scontrol requeue`, `scancel`, the time limit itself) reaches every
  process of the job from SLURM; the script waits for torchrun (srun), so the save completes
  within KillWait, and SLURM (not the script) decides whether the job runs again. A SIGTERM to
  the batch shell alone is passed on: to torchrun, or across nodes to the job's steps
  (`scancel --signal=TERM`, which leaves srun's batch step alone).
The script's python is the one that wrote it, and it `cd`s to where it was written: the nodes
must see that environment and the run dir (a shared file system).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys

from bapo_cli.config.hydra_runner import quote
from bapo_cli.launch import forward
from bapo_cli.launch.multinode import (
    DEFAULT_PORT,
    LOOPBACK_MODULE,
    Topology,
    torchrun_args,
    train_program,
)

SAVE_LEAD_S = 60  # the warning's lead beyond the stop grace: the save, and SLURM's timer slack
UNBOUNDED_LEAD_S = 600  # trainer.stop_grace_s=0 (the step takes what it takes): 10 minutes
STOP_CODE_USR1 = 128 + 10  # what a run stopped by SIGUSR1 exits with (bapo_cli.trainer.interrupt)
_LONG_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=\S.*)?", re.ASCII)
FROM_FLAGS = {  # sbatch options the script derives from bapo's own flags
    "nodes": "--nnodes",
    "ntasks-per-node": "--nproc (one srun task per node)",
    "ntasks": "--nnodes (one srun task per node)",
    "gpus-per-node": "--gpus-per-node",
}
HEAD = 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'  # c10d's host
OVERRIDDEN = ("hydra.run.dir", "trainer.resume")  # the script sets both


class SlurmScriptError(ValueError):
    """A `--slurm-script` flag that cannot work; the message names it and what is allowed."""


def signal_lead_s(grace_s: float) -> int:
    """Seconds before the time limit at which SLURM signals the job: the step's grace plus
    time for the save (SLURM's timer may fire up to a minute early or late as well)."""
    if grace_s <= 0:
        return UNBOUNDED_LEAD_S
    return math.ceil(grace_s) + SAVE_LEAD_S


def time_limit_s(value: str) -> int | None:
    """sbatch's `--time` in seconds (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS), None
    for a form it does not parse (or UNLIMITED): sbatch then judges it."""
    days, _, clock = value.rpartition("-") if "-" in value else ("0", "", value)
    parts = clock.split(":")
    if not days.isdigit() or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    numbers = [int(p) for p in parts]
    if "-" in value:  # D-HH[:MM[:SS]]
        numbers += [0] * (3 - len(numbers))
        hours, minutes, seconds = numbers
    elif len(numbers) == 1:  # minutes
        hours, minutes, seconds = 0, numbers[0], 0
    elif len(numbers) == 2:  # MM:SS
        hours, minutes, seconds = 0, *numbers
    else:
        hours, minutes, seconds = numbers
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_warning_fits(lines: dict[str, str], grace_s: float) -> None:
    """A `--time` no longer than the warning's lead would warn every attempt as it starts, and
    each would requeue the job again, forever: one line instead."""
    time_line = lines.get("time")
    limit = time_limit_s(time_line.partition("=")[2]) if time_line else None
    signal_line = lines.get("signal", "")
    lead = re.search(r"@(\d+)$", signal_line)
    lead_s = int(lead.group(1)) if lead else signal_lead_s(grace_s)
    if limit is not None and limit <= 2 * lead_s:
        raise SlurmScriptError(
            f"--sbatch {time_line}: the time-limit warning comes {lead_s} s before the limit "
            f"(trainer.stop_grace_s + {SAVE_LEAD_S} s, or --sbatch=--signal=B:USR1@N), so each "
            f"attempt would be warned and requeued before it trained; give a --time over "
            f"{2 * lead_s} s"
        )


def check_sbatch(options: list[str], grace_s: float = 0.0) -> dict[str, str]:
    """`--sbatch` values → {name: line}; a one-line SlurmScriptError for one that is not a long
    option (`--name` or `--name=value`), that bapo's own flags decide, or a `--time` the
    time-limit warning would not leave room in."""
    lines: dict[str, str] = {}
    for option in options:
        shown = option if option.isprintable() else ascii(option)
        if not _LONG_OPTION.fullmatch(option) or not option.isprintable():
            raise SlurmScriptError(
                f"--sbatch {shown}: give one long sbatch option per --sbatch, as --name or "
                "--name=value (e.g. --sbatch=--partition=gpu --sbatch=--time=04:00:00)"
            )
        name = option[2:].partition("=")[0]
        if name in FROM_FLAGS:
            raise SlurmScriptError(
                f"--sbatch {shown}: the script sets --{name} from {FROM_FLAGS[name]}; use that"
            )
        lines[name] = option
    check_warning_fits(lines, grace_s)
    return lines


def script(
    topo: Topology,
    overrides: list[str],
    *,
    run_dir: str,
    grace_s: float,
    gpus_per_node: int = 0,
    sbatch: list[str] | None = None,
    job_name: str = "bapo-train",
    port: int = DEFAULT_PORT,
) -> str:
    """The sbatch script: `topo.nnodes` nodes × `topo.nproc` processes, `gpus_per_node` GPUs per
    node (0: no GPU line), `sbatch` extra long options (they replace the script's own of the same
    name: --signal, --output, --job-name, ...), training into `run_dir` on every attempt."""
    cwd = os.getcwd()
    own = {
        "job-name": f"--job-name={job_name}",
        "nodes": f"--nodes={topo.nnodes}",
        "ntasks-per-node": "--ntasks-per-node=1",
        "output": f"--output={os.path.join(cwd, job_name)}-%j.out",
        "open-mode": "--open-mode=append",
        "requeue": "--requeue",
        "signal": f"--signal=B:USR1@{signal_lead_s(grace_s)}",
    }
    if gpus_per_node > 0:
        own["gpus-per-node"] = f"--gpus-per-node={gpus_per_node}"
    own.update(check_sbatch(sbatch or [], grace_s))
    kept = [o for o in overrides if o.lstrip("+").partition("=")[0] not in OVERRIDDEN]
    program = [*train_program(kept), "trainer.resume=true", f"hydra.run.dir={quote(run_dir)}"]
    env = forward.agent_env(grace_s, env={})
    python = shlex.quote(sys.executable)
    if topo.nnodes == 1:
        # torchrun's store on the loopback, no port for two jobs on one node to collide on; no
        # srun (module docstring: srun turns a SIGTERM into a SIGKILL of its step)
        launcher = [f"{python} -m {LOOPBACK_MODULE}", *torchrun_args(Topology(topo.nproc, 1))]
        pid, on_term = "torchrun_pid", 'kill -TERM "$torchrun_pid" 2>/dev/null'
    else:
        launcher = [
            f"srun --ntasks-per-node=1 {python} -m bapo_cli.launch.forward",
            *_c10d_flags(topo, port),
        ]
        # the job's steps, not the batch step: srun, in it, would SIGKILL the ranks
        pid, on_term = "srun_pid", 'scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null'
    command = " ".join(shlex.quote(a) for a in program) + " &"
    return "\n".join(
        [
            "#!/bin/bash",
            f"# written by: bapo train --nnodes {topo.nnodes} --nproc {topo.nproc} "
            "--slurm-script ...; submit with sbatch",
            "# every attempt (requeue, preemption, the time-limit warning) continues the run in",
            "# run_dir below (docs/distributed.md#preemption-time-limits-and-requeue)",
            *(f"#SBATCH {line}" for line in own.values()),
            "set -uo pipefail  # no -e: `wait` returns a signal's status",
            f"cd {shlex.quote(cwd)}",
            f"run_dir={shlex.quote(run_dir)}  # fixed when written: every attempt continues it",
            *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            *([HEAD] if topo.nnodes > 1 else []),
            'echo "bapo: job $SLURM_JOB_ID, attempt $((${SLURM_RESTART_COUNT:-0} + 1)), '
            'run dir $run_dir"',
            f"{launcher[0]} \\",
            *(f"  {flag} \\" for flag in launcher[1:]),
            f"  {command}",
            f"{pid}=$!",
            "warned=0",
            "# the time-limit warning (--signal=B:USR1@N) reaches this shell only: pass it on",
            f"trap 'warned=1; kill -USR1 \"${pid}\" 2>/dev/null' USR1",
            "# SIGTERM to this shell alone (scancel --signal=TERM --batch) is passed on; SLURM's",
            "# own (requeue, preemption, scancel, the time limit) reaches every process anyway",
            f"trap '{on_term}' TERM",
            f'while kill -0 "${pid}" 2>/dev/null; do wait "${pid}"; done',
            f'wait "${pid}"; code=$?',
            f'if [ "$warned" = 1 ] && [ "$code" = {STOP_CODE_USR1} ]; then',
            '  echo "bapo: saved at the time-limit warning; requeueing job $SLURM_JOB_ID"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi",
            'exit "$code"',
            "",
        ]
    )


def _c10d_flags(topo: Topology, port: int) -> list[str]:
    return [
        f"--nnodes={topo.nnodes}",
        f"--nproc-per-node={topo.nproc}",
        "--rdzv-backend=c10d",
        f'--rdzv-endpoint="$head:{port}"',  # expanded by bash on the node
        '--rdzv-id="$SLURM_JOB_ID"',
    ]
