"""Adding a loss is its function, its params dataclass and a YAML: nothing else changes.

A toy loss registered here, in a test module, gets its `_toy_schema` from the registry, composes
from a YAML, validates with its own rules, reads its params from the config, describes itself in the
run plan, and trains through the unchanged `optimizer_update` with the full metric set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bapo_cli.algos import losses
from bapo_cli.algos.params import LossParams, ParamError, dual_clip_param, param
from bapo_cli.config import hydra_runner, schema
from bapo_cli.config.errors import ConfigError
from bapo_cli.config.preflight import to_validated
from bapo_cli.launch import plan
from bapo_cli.rollout.scoring import ResponseLogits, collate
from bapo_cli.trainer.step_metrics import step_metrics
from bapo_cli.trainer.throughput import StepTimes
from bapo_cli.trainer.update import Learner, loss_spec, optimizer_update
from tests.algos.test_losses import LOSS_METRICS
from tests.train.test_distributed import _global_batch, _model


@dataclass(frozen=True)
class ToyParams(LossParams):
    """Toy: fixed bounds written as the bounds themselves."""

    c_low: float = param(0.7, "lower clip bound")
    c_high: float = param(1.5, "upper clip bound")
    dual_clip: float | None = dual_clip_param()  # the algo group's option, read by name

    def check(self) -> None:
        if not 0.0 < self.c_low <= 1.0:
            raise ParamError("c_low", self.c_low, "must be within (0, 1]")
        if self.c_high < 1.0:
            raise ParamError("c_high", self.c_high, "must be >= 1")

    def describe(self) -> str:
        return f"toy [{self.c_low:g}, {self.c_high:g}]"


def toy_loss(log_prob, inputs, params, aggregation):
    tok = losses.tokens(log_prob, inputs)
    return losses.clipped_surrogate(
        tok, (params.c_low, params.c_high), params.dual_clip, aggregation
    )


TOY_YAML = """# bapo train algo=toy
defaults:
  - _toy_schema
  - _self_
name: toy
loss: toy
advantage: grpo
c_high: 1.8
"""


@pytest.fixture
def toy(tmp_path: Path):
    """The toy loss registered (and removed afterwards), and a config dir holding algo/toy.yaml."""
    losses.REGISTRY.register("toy", params=ToyParams)(toy_loss)
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "toy.yaml").write_text(TOY_YAML)
    yield tmp_path
    losses.REGISTRY.remove("toy")
    assert "toy" not in losses.REGISTRY
    schema.register()  # drops `_toy_schema` from Hydra's ConfigStore again
    assert "_toy_schema" not in schema.algo_schemas()


def _compose(conf: Path, *overrides: str):
    extra = [f"hydra.searchpath=[file://{conf}]", "algo=toy", *overrides]
    return to_validated(hydra_runner.compose("train", hydra_runner.normalize_overrides(extra)))


def test_a_registered_loss_composes_validates_and_maps_to_its_arguments(toy) -> None:
    cfg = _compose(toy)
    assert type(cfg.algo).__name__ == "ToyAlgoConfig"
    assert isinstance(cfg.algo, schema.AlgoConfig)
    assert (cfg.algo.c_low, cfg.algo.c_high) == (0.7, 1.8)  # params default, YAML value
    spec = loss_spec(cfg.algo)
    assert spec.name == "toy" and not spec.searches_bounds
    assert spec.params == ToyParams(c_low=0.7, c_high=1.8, dual_clip=3.0)
    assert (spec.agg, spec.dual_clip) == ("token-mean", 3.0)
    assert plan.describe_clip(cfg.algo) == "toy [0.7, 1.8]"
    # its own rule, reported as a config error under algo.
    with pytest.raises(ConfigError) as info:
        _compose(toy, "algo.c_high=0.5")
    assert info.value.line() == "algo.c_high=0.5: must be >= 1"
    # its options are in the generated docs, with their help
    docs = {row[0]: row[3] for row in schema.option_docs(schema.TrainConfig)}
    assert docs["algo.c_low"] == "[loss=toy] lower clip bound"


def test_a_registered_loss_trains_through_the_unchanged_update(toy) -> None:
    cfg = _compose(toy, "algo.c_low=0.9", "algo.c_high=1.1")
    spec = loss_spec(cfg.algo)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    samples = _global_batch(model)
    micro = [
        collate(samples[i : i + 12], 0, torch.device("cpu")) for i in range(0, len(samples), 12)
    ]
    result = optimizer_update(Learner(ResponseLogits(model), optimizer), spec, micro, version=0)
    m = result.metrics
    assert set(m) >= LOSS_METRICS
    assert (m["c_low"], m["c_high"], m["search_steps"]) == (0.9, 1.1, 0.0)
    assert 0.0 < m["rho"] < 1.0 and m["rho_before"] == m["rho"]
    assert m["clipfrac_low"] + m["clipfrac_high"] > 0  # the ratios are stale: some clip
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    m["skipped"] = 0.0
    for s in samples:
        s.reward = float(s.advantage > 0)
    logged = step_metrics(
        samples,
        {},
        [m],
        optimizer,
        times=StepTimes(1.0, 1.0, 0.0, 2.0, 1, 1),
        searched=spec.searches_bounds,
    )
    assert (logged["actor/c_low"], logged["actor/c_high"]) == (0.9, 1.1)
    assert logged["actor/rho"] == m["rho"]
    assert not any(key.startswith("bapo/") for key in logged)


def test_a_loss_that_breaks_the_protocol_fails_at_registration() -> None:
    def keyword_params(log_prob, old_log_prob, advantages, mask, *, c_low=0.7, **_common):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"a loss takes \(log_prob, inputs, params, aggregation\)"):
        losses.REGISTRY.register("broken", params=ToyParams)(keyword_params)
    assert "broken" not in losses.REGISTRY
    with pytest.raises(TypeError, match="BoundSearch params"):
        losses.REGISTRY.register("broken", params=ToyParams, searches_bounds=True)(toy_loss)
    assert "broken" not in losses.REGISTRY


def test_the_toy_leaves_no_schema_behind(toy) -> None:
    schema.register()
    assert "_toy_schema" in schema.algo_schemas()
    losses.REGISTRY.remove("toy")
    schema.register()
    options = [job[0] for job in hydra_runner.expand_sweep(["algo=glob(_*)"])]
    assert options == [f"algo=_{loss}_schema" for loss in losses.REGISTRY.names()]
    assert "toy" not in losses.REGISTRY and len(options) == 19
    losses.REGISTRY.register("toy", params=ToyParams)(toy_loss)  # for the fixture's teardown


def test_a_mismatched_loss_and_preset_is_one_line() -> None:
    from bapo_cli.config.preflight import PreflightError, preflight

    with pytest.raises(PreflightError) as info:
        preflight("train", ["algo=grpo", "algo.loss=bapo"])
    assert str(info.value).startswith("algo.loss=bapo: this preset holds the options of loss ppo")
