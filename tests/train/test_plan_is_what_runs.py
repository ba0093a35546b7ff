"""The run plan `bapo train` prints is read from the same `SampleSource` the run is built from:
for each place samples come from (the trainer's transformers or colocated vLLM engine, the async
regime's worker process, generation servers) the plan's rows name what `setup` really built.
Nothing generates here: `setup` builds the engine and the regime, it starts no worker and asks
no server."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.launch.plan import train_rows
from bapo_cli.rollout.base import engine_class
from bapo_cli.staleness.server_setup import ServerSettings
from bapo_cli.staleness.source import sample_source
from bapo_cli.staleness.worker import WorkerSpec
from bapo_cli.trainer.run import Run
from bapo_cli.trainer.setup import setup, start
from tests.train.conftest import FAST

URLS = ("http://127.0.0.1:18001", "http://127.0.0.1:18002")


def _plan_and_run(tmp_path: Path, *overrides: str) -> tuple[dict[str, str], Run]:
    fast = [o for o in FAST if not o.startswith("rollout=")]
    cfg = preflight("train", [*fast, *overrides]).config
    source = sample_source(cfg)
    rows = dict(train_rows(cfg, tmp_path / "run", source))
    console = Console(file=io.StringIO())
    ctx, run_dir, console = start(cfg, tmp_path / "run", console)
    run = setup(cfg, source, ctx, run_dir, console)
    return rows, run


def _close(run: Run) -> None:
    run.regime.close()
    run.engine.close()
    run.prompts.close()


def test_the_trainers_transformers_engine(tmp_path: Path) -> None:
    rows, run = _plan_and_run(tmp_path, "rollout=auto", "staleness=2")
    try:
        assert type(run.engine) is engine_class("hf")
        assert run.regime.generator is None  # the trainer's own engine samples
        assert rows["rollout"].startswith("hf (auto: transformers on CPU")
        assert "generation" not in rows
    finally:
        _close(run)


def test_the_async_worker_process(tmp_path: Path) -> None:
    rows, run = _plan_and_run(tmp_path, "rollout=hf", "staleness=1", "staleness.regime=async")
    try:
        spec = run.regime.generator
        assert isinstance(spec, WorkerSpec) and spec.engine == "hf"
        assert rows["rollout"].startswith("hf in the generation worker process (selected)")
        assert rows["generation"].startswith("a worker process on this machine")
    finally:
        _close(run)


def test_generation_servers(tmp_path: Path) -> None:
    servers = "rollout.servers=[" + ",".join(URLS) + "]"
    rows, run = _plan_and_run(
        tmp_path, servers, "staleness=1", "staleness.regime=async", "staleness.weights=filesystem"
    )
    try:
        settings = run.regime.generator
        assert isinstance(settings, ServerSettings) and settings.urls == URLS
        # the trainer's own engine only validates; the servers sample
        assert type(run.engine) is engine_class("hf")
        assert rows["rollout"].startswith("vllm on generation servers")
        assert rows["generation"].startswith(f"2 vLLM servers ({', '.join(URLS)})")
        assert "worker process" not in " ".join(rows.values())
    finally:
        _close(run)


@pytest.mark.slow
@pytest.mark.vllm
def test_colocated_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    rows, run = _plan_and_run(tmp_path, "rollout=vllm", "staleness=2")
    try:
        assert type(run.engine) is engine_class("vllm")
        assert run.regime.generator is None
        assert rows["rollout"].startswith("vllm (selected)")
        assert "generation" not in rows
    finally:
        _close(run)
