"""Every config group option composes and validates; presets hold the paper's numbers."""

from __future__ import annotations

import re

import pytest

from bapo_cli.config import hydra_runner, schema
from bapo_cli.config.preflight import preflight

TRAIN_GROUPS = [
    "model",
    "algo",
    "staleness",
    "data",
    "rollout",
    "reward",
    "tracking",
    "trainer",
    "experiment",
    "launcher",
    "sweeper",
]
EVAL_GROUPS = ["model", "benchmark", "rollout", "reward", "tracking", "eval"]


def _options(groups: list[str]) -> list[tuple[str, str]]:
    return [(g, o) for g in groups for o in hydra_runner.group_options(g)]


def test_every_group_has_options() -> None:
    assert set(hydra_runner.config_groups()) == set(TRAIN_GROUPS) | set(EVAL_GROUPS)
    for group in hydra_runner.config_groups():
        assert hydra_runner.group_options(group), group


@pytest.mark.parametrize(("group", "option"), _options(TRAIN_GROUPS))
def test_train_group_option_composes(group: str, option: str) -> None:
    checked = preflight("train", [f"{group}={option}"])
    assert isinstance(checked.config, schema.TrainConfig)
    if group == "algo":
        assert checked.config.algo.name == option
    if group == "staleness":
        assert checked.config.staleness.k == int(option)


@pytest.mark.parametrize(("group", "option"), _options(EVAL_GROUPS))
def test_eval_group_option_composes(group: str, option: str) -> None:
    checked = preflight("eval", [f"{group}={option}"])
    assert isinstance(checked.config, schema.EvalRunConfig)
    if group == "benchmark":
        assert checked.config.benchmark.name == option


def test_bapo_preset_has_paper_defaults() -> None:
    algo = preflight("train", ["algo=bapo", "staleness=4"]).config.algo
    assert isinstance(algo, schema.BapoAlgoConfig)
    assert (algo.rho0, algo.low_range, algo.high_range) == (0.4, [0.6, 0.9], [1.2, 3.0])
    assert (algo.low_step, algo.high_step, algo.weighting) == (0.02, 0.05, "none")
    assert algo.bound_scope == "minibatch"


def test_algo_presets_map_to_losses_and_advantages() -> None:
    got = {}
    for name in hydra_runner.group_options("algo"):
        algo = preflight("train", [f"algo={name}"]).config.algo
        got[name] = (algo.loss, algo.advantage)
    assert got == {
        "ppo": ("ppo", "rloo"),
        "grpo": ("ppo", "grpo"),
        "clip_higher": ("clip_higher", "grpo"),
        "bapo": ("bapo", "grpo"),
        "bapo_recipe": ("bapo", "grpo"),
        "drgrpo": ("ppo", "drgrpo"),
        "dapo": ("clip_higher", "grpo"),
        "gspo": ("gspo", "grpo"),
        "cispo": ("cispo", "grpo"),
        "sapo": ("sapo", "grpo"),
        "dppo_tv": ("dppo_tv", "grpo"),
        "dppo_kl": ("dppo_kl", "grpo"),
        "m2po": ("m2po", "grpo"),
        "clip_cov": ("clip_cov", "grpo"),
        "kl_cov": ("kl_cov", "grpo"),
        "ce_gppo": ("ce_gppo", "grpo"),
        "vcpo": ("vcpo", "grpo"),
        "minpro": ("minpro", "grpo"),
        "prime_default": ("prime_default", "grpo"),
        "topr": ("topr", "signed"),
        "dcpo": ("dcpo", "dcpo"),
        "vespo": ("vespo", "grpo"),
        "luspo": ("luspo", "grpo"),
    }
    clip_higher = preflight("train", ["algo=clip_higher"]).config.algo
    assert (clip_higher.eps_low, clip_higher.eps_high) == (0.2, 0.28)


def test_output_root_is_absolute_and_tracking_lives_under_it(_output_root) -> None:
    cfg = preflight("train", []).config
    assert cfg.paths.output_root == str(_output_root)
    assert cfg.tracking.uri == f"sqlite:///{_output_root}/mlflow.db"


def test_relative_output_root_override_is_made_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = preflight("train", ["paths.output_root=elsewhere"]).config
    assert cfg.paths.output_root == str(tmp_path / "elsewhere")


def test_every_schema_field_is_documented() -> None:
    rows = schema.option_docs(schema.TrainConfig) + schema.option_docs(schema.EvalRunConfig)
    undocumented = [key for key, _, _, help_text in rows if not help_text.strip()]
    assert undocumented == []
    keys = {row[0] for row in rows}
    # the contract names of design.md
    for key in [
        "algo.rho0",
        "algo.low_range",
        "algo.high_range",
        "algo.low_step",
        "algo.high_step",
        "staleness.regime",
        "model.path",
        "rollout.n",
        "rollout.temperature",
        "rollout.max_tokens",
        "trainer.max_steps",
        "trainer.lr",
        "trainer.seed",
        "trainer.save_every",
        "trainer.resume",
        "tracking.uri",
        "eval.n",
        "eval.limit",
        "benchmark.path",
    ]:
        assert key in keys, key


def test_every_yaml_starts_with_the_command_that_uses_it() -> None:
    for path in sorted(hydra_runner.config_dir().rglob("*.yaml")):
        head = [line for line in path.read_text().splitlines()[:2] if line.startswith("#")]
        assert any(re.match(r"# bapo (train|eval)\b", line) for line in head), path
