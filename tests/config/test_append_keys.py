"""`+key=v` into a schema group is refused like the plain `key=v` typo (Hydra's `+` lifts the
struct flag, so without preflight's own check the typo composed and was silently ignored)."""

from __future__ import annotations

import pytest

from bapo_cli.config.preflight import PreflightError, preflight
from tests.conftest import run_bapo


def _error(overrides: list[str], config: str = "train") -> str:
    with pytest.raises(PreflightError) as info:
        preflight(config, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("typo", "key"),
    [
        ("trainer.max_stepz=2", "trainer.max_stepz"),
        ("algo.rho=0.3", "algo.rho"),  # the algo node is typed by its preset's schema
        ("model.tiny.hidden=8", "model.tiny.hidden"),  # nested schema node
        ("nosuchkey=1", "nosuchkey"),  # the top level is TrainConfig
        ("trainer.extra={a:1}", "trainer.extra"),  # a whole dict appended
    ],
)
@pytest.mark.parametrize("prefix", ["+", "++"])
def test_append_into_a_schema_node_gets_the_plain_typo_line(prefix, typo, key) -> None:
    plain = typo if not typo.startswith("trainer.extra") else "trainer.extra=1"
    expected = _error([plain])
    line = _error([prefix + typo])
    assert line == expected
    assert line.startswith(f"{key}: unknown key"), line
    assert "valid keys: " in line


def test_eval_config_refuses_appended_typo_too() -> None:
    assert _error(["+eval.nn=3"], "eval") == _error(["eval.nn=3"], "eval")
    assert _error(["+eval.nn=3"], "eval").startswith("eval.nn: unknown key in eval; valid keys")


def test_appends_outside_the_schema_and_forced_sets_keep_working() -> None:
    checked = preflight("train", ["++trainer.max_steps=3", "+hydra.job.env_set.OMP_NUM_THREADS=1"])
    assert checked.config.trainer.max_steps == 3
    assert "+hydra.job.env_set.OMP_NUM_THREADS=1" in checked.overrides


def test_cli_refuses_appended_typo_in_one_line_with_exit_2() -> None:
    # before the fix this trained (the typo ignored): keep that short
    quick = ("experiment=smoke", "rollout=hf", "trainer.max_steps=1")
    result = run_bapo("train", *quick, "+trainer.max_stepz=2", timeout=180)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: trainer.max_stepz: unknown key in trainer; valid keys:")
    assert "max_steps" in lines[0] and "Traceback" not in result.stderr
