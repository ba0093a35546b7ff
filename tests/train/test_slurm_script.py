"""What `bapo train --slurm-script` writes, line by line, and the flags it refuses (issue 48). The
scripts are submitted for real in tests/slurm (the CPU form on a GPU-less node; the GPU form has
no node to run on here).

Before: `#SBATCH --gpus-per-node=N` was written unless model.device=cpu (sbatch refuses it on a
node without GPUs) and nothing asked for none; no `--requeue`, `--signal`, fixed run dir or resume
(a requeued job started a new run from step 0); torchrun's own `main` (a traceback at every
stop) with a fixed rendezvous port even on one node.
"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_bapo


def test_the_gpu_form_runs_one_torchrun_per_node_with_c10d_and_continues_one_run_dir(
    tmp_path: Path, _output_root: Path
) -> None:
    script = tmp_path / "job.sh"
    result = run_bapo(
        "train",
        "--nnodes",
        "4",
        "--nproc",
        "8",
        "--slurm-script",
        str(script),
        "--sbatch=--partition=gpu",
        "--sbatch",
        "--time=04:00:00",
        "model.device=cuda",  # --gpus-per-node defaults to --nproc
        "algo=bapo",
        "trainer.lr=1e-6",
        # 32 ranks x staleness 4's mini-batches: a step's prompts must split into 128 parts
        # (refused before the script is written otherwise)
        "trainer.prompts_per_step=128",
        "trainer.stop_grace_s=100",
        "tracking.run_name=a b",  # quoted for the shell
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    text = script.read_text()
    assert stat.S_IMODE(script.stat().st_mode) == 0o700  # may hold credentials: owner only
    (run_dir,) = (_output_root / "runs").glob("*/*")  # claimed now: every attempt trains there
    assert f"(run dir {run_dir}; 8 GPU(s) per node)" in " ".join(result.stdout.split())
    root = f"paths.output_root={_output_root}"
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={tmp_path}/bapo-train-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@160",  # the grace (100 s) + 60 s for the save
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        f"run_dir={run_dir}  # fixed when written: every attempt continues it",
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "  --nnodes=4 \\",
        "  --nproc-per-node=8 \\",
        "  --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$head:29500" \\',
        '  --rdzv-id="$SLURM_JOB_ID" \\',
        "  -m bapo_cli train model.device=cuda algo=bapo trainer.lr=1e-6 "
        "trainer.prompts_per_step=128 "
        f"trainer.stop_grace_s=100 'tracking.run_name=a b' {root} trainer.resume=true "
        f"hydra.run.dir={run_dir} &",
        "trap 'warned=1; kill -USR1 \"$srun_pid\" 2>/dev/null' USR1",
        # a TERM to srun would make it SIGKILL the ranks: the job's steps are signalled instead
        "trap 'scancel --signal=TERM \"$SLURM_JOB_ID\" 2>/dev/null' TERM",
        'if [ "$warned" = 1 ] && [ "$code" = 138 ]; then',
        '  scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in text.splitlines(), line
    # torchrun through bapo's wrapper: a stop it passes on ends without a traceback
    assert "srun --ntasks-per-node=1 " in text and " -m bapo_cli.launch.forward \\" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0  # valid shell


def test_gpus_only_when_asked_and_one_node_keeps_its_store_on_the_loopback(
    tmp_path: Path,
) -> None:
    script = tmp_path / "job.sh"
    cpu = run_bapo("train", "--slurm-script", str(script), "--nproc", "2", cwd=tmp_path)
    assert cpu.returncode == 0, cpu.stderr
    assert "no GPU (--gpus-per-node N asks for some)" in cpu.stdout  # model.device=auto
    text = script.read_text()
    assert "--gpus-per-node" not in text and "head=" not in text
    assert " -m bapo_cli.launch.loopback \\" in text
    assert "  --rdzv-backend=bapo-loopback \\" in text.splitlines()
    # one node: torchrun in the batch step, no srun (a SIGTERM to srun kills its step)
    assert "srun" not in text
    assert "trap 'kill -TERM \"$torchrun_pid\" 2>/dev/null' TERM" in text.splitlines()
    asked = run_bapo("train", "--slurm-script", str(script), "--gpus-per-node", "1", cwd=tmp_path)
    assert asked.returncode == 0 and "#SBATCH --gpus-per-node=1" in script.read_text()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--gpus-per-node", "0", "model.device=cuda"], "--gpus-per-node 0 with model.device=cuda"),
        (["--sbatch=-p"], "--sbatch -p: give one long sbatch option per --sbatch"),
        (["--sbatch=--nodes=2"], "--sbatch --nodes=2: the script sets --nodes from --nnodes"),
        (["--sbatch=--gpus-per-node=2"], "the script sets --gpus-per-node from --gpus-per-node"),
        (  # warned as it starts (80 s before a 2 min limit), every attempt would requeue again
            ["--sbatch=--time=2"],
            "--sbatch --time=2: the time-limit warning comes 80 s before the limit",
        ),
        (["--sbatch=--time=0:10:00", "--sbatch=--signal=B:USR1@300"], "give a --time over 600 s"),
    ],
)
def test_flags_that_cannot_work_are_one_line_and_claim_nothing(
    tmp_path: Path, _output_root: Path, args: list[str], says: str
) -> None:
    script = tmp_path / "job.sh"
    result = run_bapo("train", "--slurm-script", str(script), *args, cwd=tmp_path)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1
    assert not script.exists() and not (_output_root / "runs").exists()


def test_script_flags_without_a_script_are_one_line() -> None:
    result = run_bapo("train", "--sbatch=--partition=gpu")
    assert result.returncode == 2
    assert "error: --gpus-per-node and --sbatch go with --slurm-script FILE" in result.stderr


def test_a_named_run_dir_that_holds_a_run_needs_resume_to_be_written_into(
    tmp_path: Path,
) -> None:
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    script = tmp_path / "job.sh"
    refused = run_bapo("train", "--slurm-script", str(script), f"hydra.run.dir={used}")
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    assert not script.exists()
    resumed = run_bapo(
        "train", "--slurm-script", str(script), f"hydra.run.dir={used}", "trainer.resume=true"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"run_dir={used}  #" in script.read_text()
