"""Hostile command lines: random keys from the real schema, values of the wrong type, garbage,
unicode, unbalanced brackets, unknown group choices. `preflight` either composes or raises
`PreflightError` with one line, nothing else; the real CLI exits 0 or 2 with no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bapo_cli.config import hydra_runner, schema
from bapo_cli.config.preflight import Preflight, PreflightError, preflight

FUZZED: Counter[str] = Counter()
KEYS = [key for key, *_ in schema.option_docs(schema.TrainConfig)]
GROUPS = {g: hydra_runner.group_options(g) for g in hydra_runner.config_groups()}
FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            "null",
            "None",
            "true",
            "False",
            "0",
            "-1",
            "1e309",
            "nan",
            "-inf",
            "0x10",
            "1_000",
            "[",
            "]",
            "[1,2",
            "{a:",
            "{a: 1}",
            "[[[]]]",
            "'",
            '"',
            "'unclosed",
            "${",
            "${oops}",
            "${oc.env:HOME}",
            "${trainer.lr}",
            "a,b,c",
            "1,2",
            "range(1,3)",
            "choice(a)",
            "=",
            "==",
            "\\",
            "\x00",
            "\x1b[2J",
            "\u202e",
            "\U0001f600",
            "\udcff",
            "..",
            "a b",
            " ",
            "glob(*)",
            "interval(0,1)",
            "tag(x,y)",
            "~",
            "+",
            "@",
            "#",
            "%",
            "1:2",
        ]
    ),  # fmt: skip
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=20),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=10),
)
KEY = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + ".x"),
    st.sampled_from(KEYS).map(lambda k: k.rsplit(".", 1)[0]),
    st.text(st.sampled_from("abcz._/-@+~[]"), min_size=1, max_size=12),
)
GROUP_CHOICE = st.sampled_from(sorted(GROUPS)).flatmap(
    lambda g: st.one_of(st.sampled_from(GROUPS[g]), VALUES).map(lambda v: f"{g}={v}")
)
OVERRIDE = st.one_of(
    st.tuples(KEY, VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.tuples(KEY, VALUES).map(lambda kv: f"+{kv[0]}={kv[1]}"),
    st.tuples(KEY, VALUES).map(lambda kv: f"++{kv[0]}={kv[1]}"),
    KEY.map(lambda k: f"~{k}"),
    GROUP_CHOICE,
    VALUES,  # no key at all
)
COMMAND_LINES = st.lists(OVERRIDE, min_size=1, max_size=4)


def check_preflight(overrides: list[str], multirun: bool = False) -> str:
    """'ok' or 'rejected'; anything else fails the test (that is the bug the fuzzing hunts)."""
    return "rejected" if checked_or_none(overrides, multirun) is None else "ok"


def checked_or_none(overrides: list[str], multirun: bool = False) -> Preflight | None:
    """The Preflight, or None after checking that the rejection is one readable line."""
    try:
        return preflight("train", overrides, multirun=multirun)
    except PreflightError as exc:
        line = str(exc)
        assert line.strip(), f"empty error for {overrides!r}"
        assert "\n" not in line and "\r" not in line, f"{overrides!r} -> {line!r}"
        assert "Traceback" not in line
        return None


@settings(FUZZ, max_examples=400)
@given(COMMAND_LINES)
def test_preflight_composes_or_says_one_line(overrides: list[str]) -> None:
    FUZZED[check_preflight(overrides)] += 1


@pytest.mark.parametrize(
    ("override", "single", "sweep"),
    [
        ("algo=glob(?)", "rejected", "rejected"),  # matches nothing
        ("staleness=glob(9*)", "rejected", "rejected"),
        ("model=glob(*)", "rejected", "ok"),  # a sweep: fine with -m only
        ("algo=glob(*,exclude=ppo)", "rejected", "ok"),
        ("algo.rho0=glob(*)", "rejected", "rejected"),  # not a config group
        ("glob(*)", "rejected", "rejected"),
    ],
)
def test_glob_group_choices_get_one_line(override: str, single: str, sweep: str) -> None:
    """Found by the fuzzing: `algo=glob(?)` escaped preflight as Hydra's 'ConfigLoader is not set'
    (a traceback from `bapo config`). With `-m` a glob over a group is a sweep of its options."""
    assert check_preflight([override]) == single
    assert check_preflight([override], multirun=True) == sweep


GLOB_PATTERN = st.one_of(
    st.sampled_from(
        [
            "*",
            "?",
            "*p*",
            "b*",
            "[b,g]*",
            "1*",
            "*,exclude=ppo",
            "*,exclude=[0,8]",
            "[0,4]",
            "include=*,exclude=[g*,h*]",
            "[]",
            "*,exclude=*",
            "exclude=x",
        ]
    ),
    st.text(st.sampled_from("*?[]!,=_abcgiopx01248'\" ()"), max_size=10),
)


@settings(FUZZ, max_examples=50)
@given(st.sampled_from(["algo", "staleness", "rollout"]), GLOB_PATTERN)
def test_glob_sweeps_compose_or_say_one_line(group: str, pattern: str) -> None:
    """`-m group=glob(<garbage>)`: one line, or a sweep whose every job is an option of the group
    (never a ConfigStore schema such as `algo=_bapo_schema`)."""
    override = f"{group}=glob({pattern})"
    checked = checked_or_none([override], multirun=True)
    FUZZED["glob " + ("rejected" if checked is None else "ok")] += 1
    if checked is not None:
        choices = [job[0].partition("=")[2].strip("'") for job in checked.jobs]
        assert choices and set(choices) <= set(GROUPS[group]), (override, choices)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print(f"\nfuzzed command lines: {dict(FUZZED)}")


CLI_CASES = [
    ["algo.rho0=[1,2"],
    ["trainer.max_steps=${oops}"],
    ["staleness=\u202e7", "algo=bapo"],
    ["model.max_model_len=1e309"],
    ["tracking.uri=\U0001f600", "rollout.n=-1"],
    ["++trainer.lr={a:", "data=arith"],
    ["~algo"],
    ["algo=glob(?)"],  # found by the fuzzing: a traceback from Hydra before the fix
    ["algo.rho0=glob(*)"],  # glob sweeps a config group's options only
    ["algo=bapo", "trainer.lr=1e-3"],  # a good one: exit 0
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CLI_CASES, ids=[" ".join(c)[:30] for c in CLI_CASES])
def test_cli_config_exits_0_or_2_without_a_traceback(overrides: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "bapo_cli", "config", *overrides],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        env=env,
    )
    assert done.returncode in (0, 2), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    if done.returncode == 2:
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    expected = check_preflight(overrides)  # the CLI agrees with preflight
    assert (done.returncode == 0) == (expected == "ok")
