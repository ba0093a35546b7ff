"""model.dtype=float64: the CPU replication testbed (docs/study-v3.md, "What is not pinned").

The point of the testbed is that nothing on the trainer's path rounds to float32: weights, the
chunked log-probs and their gradients, the recorded behaviour log-probs and the advantages. The
tests assert the dtypes and the one number that shows a float32 rounding at once: the first
update of a reuse batch is on-policy, so its ratio is exactly 1 only if the behaviour log-probs
were kept in float64 (stored as float32 they differ from the float64 forward by ~1e-8)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.preflight import preflight
from bapo_cli.config.schema import ModelConfig
from bapo_cli.models import loading as models
from bapo_cli.rollout.logprobs import chunked_logprobs, full_vocab_logprobs
from tests.train.conftest import run_train


def test_float64_resolves_and_loads_as_float64() -> None:
    cfg = preflight("train", ["model.dtype=float64"]).config.model
    assert models.resolve_dtype(cfg, torch.device("cpu")) == torch.float64
    model, _ = models.load_policy(cfg)
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_float64_on_cuda_is_refused_by_the_config_and_by_auto() -> None:
    with pytest.raises(ConfigError, match="float64 is a CPU testbed"):
        ModelConfig(dtype="float64", device="cuda").check()
    # model.device=auto that resolves to CUDA: refused before any weight loads
    with pytest.raises(models.ModelLoadError, match="model.dtype=float64 on cuda"):
        models.resolve_dtype(ModelConfig(dtype="float64"), torch.device("cuda"))


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["rollout=vllm"], "error: rollout.name=vllm: model.dtype=float64 needs rollout=hf"),
        (["model.device=cuda"], "error: model.dtype=float64: float64 is a CPU testbed"),
    ],
)
def test_what_cannot_run_float64_is_one_line_and_exit_2(tmp_path, overrides, line) -> None:
    cmd = [sys.executable, "-m", "bapo_cli", "train", "model.dtype=float64", *overrides]
    cmd.append(f"paths.output_root={tmp_path}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(line), lines
    assert not any(tmp_path.iterdir())  # nothing written: refused before the run dir


def test_chunked_logprobs_stay_float64_and_match_the_float64_oracle() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(53, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 53, (37,), generator=g)
    logp, ent = chunked_logprobs(hidden, weight, None, targets, chunk=5, entropy=True)
    assert logp.dtype == torch.float64 and ent.dtype == torch.float64
    grads = torch.autograd.grad(logp.sum(), (hidden, weight))
    assert all(x.dtype == torch.float64 for x in grads)
    ref, ref_ent = full_vocab_logprobs(hidden @ weight.t(), targets, entropy=True)
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    # float64 agreement (a float32 step anywhere would leave errors of ~1e-7)
    assert float((logp - ref).detach().abs().max()) < 1e-12
    assert float((ent - ref_ent).detach().abs().max()) < 1e-12
    for a, b in zip(grads, ref_grads, strict=True):
        assert float((a - b).abs().max()) < 1e-12


def test_a_float64_run_trains_in_float64_and_logs_finite_values(tmp_path) -> None:
    result = run_train(
        tmp_path, "model.dtype=float64", "algo=bapo", "staleness=4", "trainer.max_steps=2"
    )
    assert len(result.history) == 2
    for h in result.history:
        bad = [k for k, v in h.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, bad
    assert result.history[-1]["actor/entropy"] > 0
    assert any(u["ratio_max"] != 1.0 for u in result.updates[1:])  # off-policy mini-batches
    end, _ = models.load_checkpoint(result.checkpoint, dtype=torch.float64)
    start, _ = models.load_policy(preflight("train", ["model.dtype=float64"]).config.model)
    pairs = zip(start.parameters(), end.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_recorded_behaviour_logprobs_keep_float64(tmp_path) -> None:
    """replay scores the fresh batch right after sampling (nothing deferred) and its first update
    trains it with the weights that sampled it: the ratio is exactly 1 only if the recorded
    log-probs reach the loss in float64 (rounded to float32 they are off by ~1e-8)."""
    result = run_train(
        tmp_path,
        "model.dtype=float64",
        "algo=grpo",
        "staleness=2",
        "staleness.regime=replay",
        "trainer.max_steps=1",
    )
    first = result.updates[0]
    assert first["staleness_max"] == 0.0
    assert first["ratio_mean"] == 1.0 and first["ratio_max"] == 1.0 and first["ppo_kl"] == 0.0
