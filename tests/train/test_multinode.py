"""Multi-node launch (bapo_cli.launch.multinode): two torchrun agents on loopback are two nodes.

The update test starts two agents (`--nnodes 2`, gloo, rendezvous on 127.0.0.1) with the same
command builder `bapo train --nnodes` uses, one process each, and compares their update with one
process on the global batch, like tests/train/test_distributed.py does for one node.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from bapo_cli.launch import multinode
from bapo_cli.launch.multinode import LaunchError, Topology
from bapo_cli.trainer.distributed import DistContext
from tests.conftest import REPO, run_bapo

ENV = {"OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(program: list[str], node_ranks: tuple, cwd: Path, **run) -> list:
    """Start one torchrun agent per node rank (None: c10d assigns it), wait for both."""
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        subprocess.Popen(
            multinode.torchrun_command(Topology(1, 2, rank, endpoint), program),
            cwd=cwd,
            env={**os.environ, **ENV, "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in node_ranks
    ]
    outputs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=run.get("timeout", 300))
            outputs.append((agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("node_ranks", "mode"),
    [((None, None), "full"), ((1, 0), "lora")],
    ids=["c10d-full", "static-node-rank-lora"],
)
def test_two_torchrun_agents_make_the_update_of_one_process_on_the_global_batch(
    tmp_path: Path, node_ranks, mode
) -> None:
    from tests.train.multinode_rank import update
    from tests.train.test_distributed import _global_batch, _model

    out = str(tmp_path / "rank")
    program = ["-m", "tests.train.multinode_rank", out, mode]
    for code, _, err in _two_nodes(program, node_ranks, REPO):
        assert code == 0, err[-3000:]
    single_metrics, single_params = update(
        _global_batch(_model()), DistContext(), 64, use_lora=mode == "lora"
    )
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]  # one world across the two agents
    for r in ranks:
        for key in ("c_low", "c_high", "search_steps"):  # the same global bounds
            assert r["metrics"][key] == single_metrics[key], key
        for key in ("rho", "rho_before"):  # float32 sums in another order (test_distributed)
            assert r["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-5), key
        assert len(r["params"]) == len(single_params)
        for a, b in zip(r["params"], single_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same update
    assert single_metrics["search_steps"] > 0  # the search really walked
    moved = [p.abs().max().item() for p in single_params if p.shape[0] > 4]  # LoRA: B (n × r)
    assert max(moved) > 0
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # the nodes stay in lockstep


@pytest.mark.slow
def test_bapo_train_lora_on_two_nodes_writes_one_run(tmp_path: Path, _output_root: Path) -> None:
    """`bapo train --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT`, once per node (c10d rendezvous),
    with LoRA (DDP over the adapters): one run dir (global rank 0's), a checkpoint holding both
    ranks' state and the adapter, optimizer state for the adapters alone."""
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        subprocess.Popen(
            [
                *multinode.torchrun_command(Topology(1, 1), [])[:1],
                "-m",
                "bapo_cli",
                "train",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                endpoint,
                "experiment=smoke",
                "tracking=none",
                "model.lora.rank=4",
            ],
            env={**os.environ, **ENV, "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    try:
        for agent in agents:
            results.append(agent.communicate(timeout=600))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, (_, err) in zip(agents, results, strict=True):
        assert agent.returncode == 0, err[-3000:]
    runs = list((_output_root / "runs").glob("*/*"))
    assert len(runs) == 1  # one run dir: rank 0's, whichever node it was
    state = torch.load(
        runs[0] / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True
    )
    assert len(state["ranks"]) == 2
    assert state["ranks"][0]["prompts"] == state["ranks"][1]["prompts"]  # same global stream
    assert sum("bapo train: summary" in out for out, _ in results) == 1  # rank 0 alone reports
    from safetensors.torch import load_file

    adapter = load_file(runs[0] / "checkpoints" / "step_000002" / "adapter_model.safetensors")
    assert len(state["optimizer"]["param_groups"][0]["params"]) == len(adapter)


def test_torchrun_flags_for_one_node_c10d_and_static() -> None:
    assert multinode.torchrun_args(Topology(2)) == [  # the store on 127.0.0.1 only
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=bapo-loopback",
        "--rdzv-endpoint=127.0.0.1:0",
    ]
    assert multinode.torchrun_command(Topology(2), [])[1:3] == ["-m", "bapo_cli.launch.loopback"]
    assert multinode.torchrun_args(Topology(8, 4, None, "node01:29500")) == [
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node01:29500",
    ]
    assert multinode.torchrun_args(Topology(8, 4, 3, "node01:29500")) == [
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=static",
        "--node-rank=3",
        "--master-addr=node01",
        "--master-port=29500",
    ]


@pytest.mark.parametrize(
    ("topo", "script", "says"),
    [
        (Topology(1, 2), False, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (Topology(1, 2, None, "node01"), False, "--rdzv-endpoint node01: no HOST:PORT"),
        (Topology(1, 2, 2, "h:1"), False, "--node-rank 2: must be within 0 .. 1"),
        (Topology(1, 1, 0, None), False, "--node-rank / --rdzv-endpoint need --nnodes > 1"),
        (Topology(1, 0), False, "--nnodes 0: must be >= 1"),
        (Topology(1, 2, None, "h:1"), True, "--slurm-script with --node-rank / --rdzv-endpoint"),
    ],
)
def test_flags_that_cannot_work_are_one_line(topo, script, says) -> None:
    with pytest.raises(LaunchError) as err:
        topo.check(script=script)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_bad_launch_flags_fail_before_any_process_starts(_output_root: Path) -> None:
    result = run_bapo("train", "--nnodes", "2", "experiment=smoke")
    assert result.returncode == 2
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in result.stderr
    assert not (_output_root / "runs").exists()
