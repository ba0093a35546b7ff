"""`data=pairs` end to end in config: presets compose, the prompt set and validation set use it."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.config.errors import ConfigError
from bapo_cli.config.preflight import preflight
from bapo_cli.config.schema import DATA_KINDS, DataConfig
from bapo_cli.data.datasets import REWARDS, SYNTHETIC, build_prompt_set
from bapo_cli.data.pairs import PairTask, pairs_reward
from bapo_cli.evaluation.evaluate import validation_sets


def test_bapo_config_data_pairs_composes_and_validates() -> None:
    result = CliRunner().invoke(app, ["config", "data=pairs"])
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(result.output)["data"]
    assert (data["kind"], data["template"], data["name"]) == ("pairs", "{problem}!", "pairs")


def test_experiment_preset_sets_model_and_budget() -> None:
    cfg = preflight("train", ["experiment=pairs"]).config
    assert (cfg.data.kind, cfg.model.tiny.task, cfg.rollout.max_tokens) == ("pairs", "pairs", 40)
    # "<bos>318596:?+?=12!" + the response budget, and validation's max_model_len // 2 cap
    assert cfg.model.max_model_len >= max(15 + 40, 2 * 40)


def test_data_kinds_match_the_reward_registry() -> None:
    assert set(DATA_KINDS) == set(REWARDS)
    assert REWARDS["pairs"] is pairs_reward and SYNTHETIC["pairs"].make is PairTask
    try:
        DataConfig(kind="pair").check()
    except ConfigError as err:
        assert str(err) == "kind=pair: must be one of arith, pairs, dataset"
    else:
        raise AssertionError("kind=pair was accepted")


def test_pairs_prompt_set() -> None:
    ps = build_prompt_set(DataConfig(kind="pairs", template="{problem}!", num_prompts=64))
    assert len(ps) == 64 and ps.reward_fn is pairs_reward
    assert ps.source == "pairs (seed 0)"
    assert {p.id for p in ps.items} == {p.id for p in PairTask(0).prompts(64)}
    p = ps.items[0]
    assert ps.render(p) == f"{p.question}!"
    a, b = p.answer.split(",")
    assert ps.reward_fn(f"{a}+{b}={int(a) + int(b)}!", p.answer) == 1.0


def test_pairs_validation_set() -> None:
    cfg = preflight(
        "train", ["experiment=pairs", "trainer.val_benchmarks=[pairs,arith]", "trainer.val_limit=5"]
    ).config
    (name, problems, kwargs), (arith_name, _, arith_kwargs) = validation_sets(cfg)
    assert (name, arith_name) == ("pairs", "arith")
    assert problems == PairTask(123).held_out(5)  # the held-out split, whatever the seed
    assert kwargs["template"] == "{problem}!" and arith_kwargs["template"] == "{problem}="
    a, b = problems[0].answer.split(",")
    right = f"{b}+{a}={int(a) + int(b)}!"
    assert kwargs["grader"]([right, right + ";"], [problems[0].answer] * 2).verdicts == [
        True,
        False,
    ]
    assert kwargs["answer_of"](right) == problems[0].answer
