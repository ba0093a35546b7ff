"""Time per stage (`trainer.throughput`): tokens/s per stage from counted tokens and measured
seconds, FLOPs per token from the model, MFU where the chip's peak is known and n/a elsewhere."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from bapo_cli.trainer import throughput
from bapo_cli.trainer.progress import summary_table
from bapo_cli.trainer.throughput import (
    ScoreClock,
    StepTimes,
    flops_per_token,
    mfu,
    peak_flops,
    stage_metrics,
)


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),  # SXM
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),  # before the SXM entry it contains
        ("NVIDIA H100 PCIe", torch.float32, 51e12),
        ("NVIDIA H200", torch.float16, 989e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2e12),
        ("NVIDIA GeForce GTX 1080", torch.float32, None),  # not in the table: no guess
        ("NVIDIA L40", torch.bfloat16, None),  # not an L4, nor an L40S
        ("NVIDIA H100 80GB HBM3", torch.float64, None),
        (None, torch.float32, None),  # CPU
    ],
)
def test_the_peak_is_the_tables_for_the_chip_and_dtype(name, dtype, peak) -> None:
    assert peak_flops(name, dtype) == peak


class Tiny(torch.nn.Module):
    """Embedding 10x4 (40), a linear 4x4 with bias (20), an output layer 4x10 (40)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_flops_per_token_counts_the_matmul_parameters_by_hand() -> None:
    # untied: the embedding lookup costs nothing, N = 20 + 40 = 60; 6N = 360
    assert flops_per_token(Tiny(tied=False)) == 360.0
    # tied: the one matrix is the output layer's matmul, counted once, N = 40 + 20 = 60
    assert flops_per_token(Tiny(tied=True)) == 360.0
    frozen = Tiny(tied=False)
    frozen.head.weight.requires_grad_(False)  # no weight gradient for 40 of them (LoRA-like)
    assert flops_per_token(frozen) == 4 * 60 + 2 * 20
    assert flops_per_token(Tiny(tied=False), checkpointing=True) == 360.0 + 120.0


def test_mfu_on_a_hand_computed_case() -> None:
    # 4096 tokens in 0.5 s at 3e9 FLOPs each on an H100 SXM in bf16:
    # 1.2288e13 FLOPs / (0.5 s * 989e12 FLOP/s) = 0.024849...
    assert mfu(4096, 0.5, 3e9, 989e12) == pytest.approx(0.0248493, rel=1e-5)


def test_stage_metrics_divide_counted_tokens_by_the_stages_seconds() -> None:
    out = stage_metrics(
        StepTimes(
            rollout_s=10.0,
            train_s=5.0,
            sync_s=0.75,
            step_s=16.0,
            new_tokens=800,
            trained_tokens=2000,
            scored=(
                (2.0, 400),
                (1.0, 600),
            ),  # behaviour scoring in the rollout, proximal in updates
            per_token=6e6,
            peak=1e12,
        )
    )
    assert out == {
        "perf/rollout_tokens_per_s": 800 / 8.0,  # the rollout's 10 s less its 2 s of scoring
        "perf/update_tokens_per_s": 2000 / 4.0,  # the updates' 5 s less their 1 s of scoring
        "perf/weight_sync_s": 0.75,
        "perf/score_tokens_per_s": 1000 / 3.0,
        "perf/update_mfu": pytest.approx(2000 * 6e6 / (4.0 * 1e12)),  # 3e-3
    }
    cpu = stage_metrics(
        StepTimes(
            rollout_s=1.0,
            train_s=1.0,
            sync_s=0.0,
            step_s=2.0,
            new_tokens=10,
            trained_tokens=10,
            scored=((0.0, 0), (0.0, 0)),  # nothing scored by the trainer (servers' log-probs)
            per_token=1.0,
            peak=None,
        )
    )
    assert "perf/update_mfu" not in cpu and "perf/score_tokens_per_s" not in cpu


def test_the_score_clock_adds_each_timed_block_and_resets_when_read(monkeypatch) -> None:
    ticks = iter([1.0, 1.25, 3.0, 3.5])  # a fixed clock: two blocks of 0.25 s and 0.5 s
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(ticks))
    clock = ScoreClock()
    with clock.timing(7):
        pass
    with clock.timing(5, torch.device("cpu")):
        pass
    assert clock.take() == (0.75, 12)
    assert clock.take() == (0.0, 0)


def _rendered(history: list[dict[str, float]]) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(summary_table(history))
    return console.file.getvalue()


def test_the_summary_prints_each_stage_and_mfu_only_where_known() -> None:
    step = {
        "perf/rollout_tokens_per_s": 100.0,
        "perf/score_tokens_per_s": 300.0,
        "perf/update_tokens_per_s": 500.0,
        "perf/weight_sync_s": 0.5,
    }
    cpu = _rendered([step, step])
    for key, value in step.items():
        assert f"{key} {value:.4f} {value:.4f}" in " ".join(cpu.replace("│", " ").split())
    assert "perf/update_mfu n/a n/a" in " ".join(cpu.replace("│", " ").split())
    gpu = _rendered([{**step, "perf/update_mfu": 0.25}] * 2)
    assert "perf/update_mfu 0.2500 0.2500" in " ".join(gpu.replace("│", " ").split())


def test_a_metric_missing_from_one_window_prints_a_dash() -> None:
    """Rank 1 of a resumed data-parallel run with servers: its history from the checkpoint has
    the push metrics, its own steps do not (only rank 0 pushes). CI's vLLM pass, at 273ce70."""
    pushed = {"reward/mean": 0.5, "servers/push_bytes": 2.5e7}
    table = _rendered([pushed, {"reward/mean": 0.25}])
    assert "servers/push_bytes 2.5e+07 -" in " ".join(table.replace("│", " ").split())
