"""reward=python: the user's function in real worker processes, its failures counted, its spec
checked before any model loads."""

from __future__ import annotations

import logging
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.rewards import StepGrader
from bapo_cli.rewards import plugin as plugin_module
from bapo_cli.rewards.plugin import PythonReward, RewardPluginError, check_spec, score

runner = CliRunner()

REWARDS = textwrap.dedent(
    """
    import sys
    import time

    def exact(response, reference, record):
        return response.strip() == reference

    def partial(response, reference, record):
        return 0.25 if record.get("kind") == "half" else 0.75

    def flaky(response, reference, record):
        if response == "boom":
            raise ValueError("cannot reach https://user:hunter2@grader.example/score")
        if response == "text":
            return "yes"
        if response == "nan":
            return float("nan")
        if response == "exit":
            sys.exit(3)
        if response == "slow":
            time.sleep(60)
        return 1.0

    def two_args(response, reference):
        return 1.0

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_scores_come_back_as_the_function_returns_them(reward_file: Path) -> None:
    with PythonReward(f"{reward_file}:exact", timeout_s=5, workers=2) as plugin:
        report = plugin.grade_batch([" 12", "13", "7"], ["12", "12", "7"], [{}, {}, {}])
    assert report.scores == [1.0, 0.0, 1.0]
    assert report.verdicts == [True, False, True]
    assert (report.errors, report.timeouts, report.over_budget) == (0, 0, 0)
    with PythonReward(f"{reward_file}:partial", timeout_s=5) as plugin:
        report = plugin.grade_batch(["a", "b"], ["x", "y"], [{"kind": "half"}, {"kind": "other"}])
    assert report.scores == [0.25, 0.75]


def test_failures_score_zero_and_are_counted_and_logged_once_masked(
    reward_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    responses = ["boom", "ok", "text", "boom", "nan", "exit", "ok"]
    with (
        caplog.at_level(logging.WARNING, logger="bapo_cli.rewards.plugin"),
        PythonReward(f"{reward_file}:flaky", timeout_s=5, workers=1) as plugin,
    ):
        report = plugin.grade_batch(responses, ["r"] * 7, [{}] * 7)
        step = StepGrader(plugin.grade_batch, budget_s=None)
        assert step.grade(["boom", "ok"], ["r", "r"], [{}, {}]) == [0.0, 1.0]
        metrics = step.take()
    assert report.scores == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert (report.errors, report.timeouts, report.over_budget) == (5, 0, 0)
    assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 0.0
    failures = [r.getMessage() for r in caplog.records if "reward/errors" in r.getMessage()]
    assert len(failures) == 1, failures  # the first error only
    assert "ValueError: cannot reach https://user:***@grader.example/score" in failures[0]
    assert "hunter2" not in caplog.text


def test_a_call_past_the_limit_scores_zero_and_counts_as_a_timeout(reward_file: Path) -> None:
    with PythonReward(f"{reward_file}:flaky", timeout_s=1.0, workers=1) as plugin:
        plugin.pool[0].start()
        report = plugin.grade_batch(["slow", "ok"], ["r", "r"], [{}, {}])
        assert report.scores == [0.0, 1.0]  # the worker was restarted for the next call
        assert (report.timeouts, report.errors) == (1, 0)
        assert plugin.pool[0].starts == 2
        cut = plugin.grade_batch(["slow"], ["r"], [{}], budget_s=0.0)
    assert (cut.over_budget, cut.timeouts, cut.scores) == (1, 0, [0.0])


def test_score_accepts_floats_and_bools_only() -> None:
    assert (score(True), score(False), score(2), score(0.5)) == (1.0, 0.0, 2.0, 0.5)
    for bad in (None, "1", float("inf"), [1.0]):
        with pytest.raises(ValueError, match="must return a finite float or a bool"):
            score(bad)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        ("my_rewards_nowhere:score", "no module named 'my_rewards_nowhere' on the path"),
        ("{file}:missing", "has no attribute 'missing'"),
        ("{file}:NOT_A_FUNCTION", "NOT_A_FUNCTION is not callable (int)"),
        ("{file}:two_args", "cannot be called with 3 arguments"),
        ("{dir}/absent.py:score", "absent.py: no such file"),
        ("json", "must be module:function or path/to/file.py:function"),
    ],
)
def test_check_spec_names_what_is_wrong_in_one_line(
    reward_file: Path, fn: str, expected: str
) -> None:
    spec = fn.format(file=reward_file, dir=reward_file.parent)
    with pytest.raises(RewardPluginError) as err:
        check_spec(spec)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_a_module_path_is_imported_from_the_working_directory(
    reward_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(reward_file.parent)
    check_spec("my_rewards:exact")
    with PythonReward("my_rewards:exact", timeout_s=5) as plugin:  # the workers find it too
        assert plugin.grade_batch(["4"], ["4"], [{}]).scores == [1.0]


def test_preflight_refuses_a_bad_reward_fn_before_anything_loads(reward_file: Path) -> None:
    cases = {
        (
            "reward=python",
            "reward.fn=null",
        ): "reward.fn: reward=python needs reward.fn=module:function or path/to/file.py:function",
        ("reward=python", f"reward.fn={reward_file}:two_args"): f"reward.fn={reward_file}:two_args:"
        " two_args(response, reference) cannot be called with 3 arguments",
        ("reward.fn=x:y",): "reward.fn=x:y: only reward=python calls a function",
        ("reward=python", "reward.fn=nowhere_at_all:f"): "reward.fn=nowhere_at_all:f: no module",
    }
    for overrides, expected in cases.items():
        with pytest.raises(PreflightError) as err:
            preflight("train", list(overrides))
        assert str(err.value).startswith(expected), str(err.value)
    cfg = preflight("train", ["reward=python", f"reward.fn={reward_file}:exact"]).config
    assert (cfg.reward.name, cfg.reward.fn) == ("python", f"{reward_file}:exact")
    assert preflight("eval", ["reward=python", f"reward.fn={reward_file}:exact"]).config
    default = preflight("train", ["reward=python"]).config.reward.fn
    assert default == "bapo_cli.rewards.examples:boxed_exact"


def test_the_default_function_matches_boxed_answers_by_string() -> None:
    with PythonReward("bapo_cli.rewards.examples:boxed_exact", timeout_s=5) as plugin:
        report = plugin.grade_batch([r"\boxed{033}", r"\boxed{\frac12}", "33"], ["33"] * 3)
    assert report.scores == [1.0, 0.0, 0.0]


# ------------------------------------------------------- hostile modules and values (issue 22)

HOSTILE = {
    "hangs_at_import.py": "import time\ntime.sleep(3600)\ndef f(a, b, c):\n    return 1.0\n",
    "exits_at_import.py": "import sys\nsys.exit(0)\ndef f(a, b, c):\n    return 1.0\n",
    "dies_at_import.py": (
        "import os, sys\n"
        "print('cannot reach https://bob:hunter2@grader.example/x', file=sys.stderr)\n"
        "os._exit(7)\n"
        "def f(a, b, c):\n    return 1.0\n"
    ),
    "huge.py": (
        "def huge(a, b, c):\n    return 1e308\n"
        "def inf(a, b, c):\n    return float('-inf')\n"
        "def hog(a, b, c):\n    block = bytearray(1 << 30)\n    return float(len(block) > 0)\n"
    ),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    for name, text in HOSTILE.items():
        (root / name).write_text(text)
    return root


def test_a_module_that_hangs_at_import_is_refused_within_the_limit(hostile: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RewardPluginError) as err:
        check_spec(f"{hostile}/hangs_at_import.py:f", timeout_s=2)
    assert time.monotonic() - t0 < 15
    assert str(err.value) == (
        "importing it did not finish within 2 s (a hang at import?); the preflight import "
        "limit is 2 s"
    )


def test_preflight_times_the_import_out(hostile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin_module, "IMPORT_TIMEOUT_S", 2.0)
    spec = f"{hostile}/hangs_at_import.py:f"
    with pytest.raises(PreflightError, match=r"did not finish within 2 s"):
        preflight("train", ["reward=python", f"reward.fn={spec}"])


def test_sys_exit_or_a_crash_at_import_is_one_error_line_and_exit_2(hostile: Path) -> None:
    """`sys.exit(0)` at import used to end `bapo config`/`train` with exit 0 and no output."""
    exits = runner.invoke(
        app, ["config", "reward=python", f"reward.fn={hostile}/exits_at_import.py:f"]
    )
    assert exits.exit_code == 2, exits.output
    assert "error: reward.fn=" in exits.output
    assert "exits_at_import.py fails on import (SystemExit: 0)" in " ".join(exits.output.split())
    dies = runner.invoke(
        app, ["config", "reward=python", f"reward.fn={hostile}/dies_at_import.py:f"]
    )
    assert dies.exit_code == 2, dies.output
    shown = " ".join(dies.output.split())
    assert "ended with exit code 7 before it could be checked" in shown
    assert "https://bob:***@grader.example/x" in shown and "hunter2" not in shown


def test_out_of_range_and_non_finite_rewards_are_errors_with_a_warning(
    hostile: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """1e308 is finite, but two of them make the step's reward/mean inf: refused, counted."""
    with (
        caplog.at_level(logging.WARNING, logger="bapo_cli.rewards.plugin"),
        PythonReward(f"{hostile}/huge.py:huge", timeout_s=5) as plugin,
    ):
        report = plugin.grade_batch(["a", "b"], ["r", "r"], [{}, {}])
    assert report.scores == [0.0, 0.0] and report.errors == 2
    assert "returned 1e+308; must return a finite float or a bool, within [-1e+06, 1e+06]" in (
        caplog.text
    )
    with PythonReward(f"{hostile}/huge.py:inf", timeout_s=5) as plugin:
        assert plugin.grade_batch(["a"], ["r"], [{}]).errors == 1
    assert score(plugin_module.MAX_ABS_REWARD) == 1e6
    with pytest.raises(ValueError, match=r"within \[-1e\+06, 1e\+06\]"):
        score(-1e6 - 1)


def test_workers_have_a_memory_cap(hostile: Path) -> None:
    """A function that allocates 1 GiB under a 512 MiB cap fails with MemoryError (an error,
    scored 0) instead of taking the machine's memory; the default cap is the math workers'."""
    with PythonReward(f"{hostile}/huge.py:hog", timeout_s=10, memory_limit_mb=512) as plugin:
        report = plugin.grade_batch(["a"], ["r"], [{}])
    assert (report.scores, report.errors) == ([0.0], 1)
    assert plugin_module.MEMORY_LIMIT_MB == 4096
    assert "--memory-mb" in PythonReward("x.py:f").pool[0].args
