"""`-m group=glob(...)`: one job per matching option of a config group, validated up front, and
exactly the jobs (count and order) that Hydra's basic sweeper then launches."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from bapo_cli.config import hydra_runner
from bapo_cli.config.preflight import PreflightError, preflight, to_validated


def _sweep(*overrides: str):
    return preflight("train", list(overrides), multirun=True)


def _values(jobs: list[list[str]], key: str) -> list[str]:
    return [next(o.partition("=")[2] for o in job if o.startswith(key + "=")) for job in jobs]


def _configs(jobs: list[list[str]]) -> list:
    return [to_validated(hydra_runner.compose("train", job)) for job in jobs]


ALGOS = ["bapo", "bapo_recipe", "ce_gppo", "cispo", "clip_cov", "clip_higher", "dapo", "dcpo"]
ALGOS += ["dppo_kl", "dppo_tv", "drgrpo", "grpo", "gspo", "kl_cov", "luspo", "m2po", "minpro"]
ALGOS += ["ppo", "prime_default", "sapo", "topr", "vcpo", "vespo"]


def test_algo_glob_is_every_algo_in_hydras_order() -> None:
    checked = _sweep("algo=glob(*)")
    assert checked.num_jobs == 23
    assert "algo=" + ",".join(ALGOS) in checked.overrides  # what Hydra is handed
    assert _values(checked.jobs, "algo") == ALGOS
    configs = _configs(checked.jobs)
    assert [c.algo.name for c in configs] == ALGOS
    assert [c.algo.loss for c in configs] == [
        "bapo",
        "bapo",
        "ce_gppo",
        "cispo",
        "clip_cov",
        "clip_higher",
        "clip_higher",
        "dcpo",
        "dppo_kl",
        "dppo_tv",
        "ppo",
        "ppo",
        "gspo",
        "kl_cov",
        "luspo",
        "m2po",
        "minpro",
        "ppo",
        "prime_default",
        "sapo",
        "topr",
        "vcpo",
        "vespo",
    ]
    assert checked.config.algo.name == "bapo"  # the first job's validated config


@pytest.mark.parametrize(
    ("glob", "expected"),
    [
        (
            "glob(*,exclude=*po)",
            [
                "bapo_recipe",
                "clip_cov",
                "clip_higher",
                "dppo_kl",
                "dppo_tv",
                "kl_cov",
                "minpro",
                "prime_default",
                "topr",
            ],
        ),
        (
            "glob(*,exclude=[*_*,*s*])",
            ["bapo", "dapo", "dcpo", "drgrpo", "grpo", "m2po", "minpro", "ppo", "topr", "vcpo"],
        ),
        ("glob([bapo,grpo])", ["bapo", "grpo"]),
        ("glob(include=c*)", ["ce_gppo", "cispo", "clip_cov", "clip_higher"]),
        (
            "glob(*r*,exclude=bapo*)",
            ["clip_higher", "drgrpo", "grpo", "minpro", "prime_default", "topr"],
        ),
    ],
)
def test_algo_glob_include_and_exclude(glob: str, expected: list[str]) -> None:
    checked = _sweep(f"algo={glob}")
    assert checked.num_jobs == len(expected)
    assert _values(checked.jobs, "algo") == expected
    assert [c.algo.name for c in _configs(checked.jobs)] == expected


def test_staleness_glob_is_five_jobs_with_their_k() -> None:
    checked = _sweep("staleness=glob(*)")
    assert checked.num_jobs == 5
    assert "staleness='0','1','2','4','8'" in checked.overrides  # quoted: a string to Hydra
    assert [c.staleness.k for c in _configs(checked.jobs)] == [0, 1, 2, 4, 8]


@pytest.mark.parametrize(
    ("glob", "ks"),
    [
        ("glob(*,exclude=8)", [0, 1, 2, 4]),
        ("glob(*,exclude=[0,8])", [1, 2, 4]),
        ("glob(1*)", [1]),  # one match: a plain override, one job
        ("glob([2,4])", [2, 4]),
    ],
)
def test_staleness_glob_patterns_are_text_not_numbers(glob: str, ks: list[int]) -> None:
    checked = _sweep(f"staleness={glob}")
    assert checked.num_jobs == len(ks)
    assert [c.staleness.k for c in _configs(checked.jobs)] == ks


def test_globs_combine_with_other_sweeps_outer_first() -> None:
    checked = _sweep("algo=glob([bapo,grpo])", "staleness=0,8")
    jobs = [(c.algo.name, c.staleness.k) for c in _configs(checked.jobs)]
    assert jobs == [("bapo", 0), ("bapo", 8), ("grpo", 0), ("grpo", 8)]
    checked = _sweep("algo=glob(b*)", "algo.rho0=0.3,0.5")
    assert [(c.algo.name, c.algo.rho0) for c in _configs(checked.jobs)] == [
        ("bapo", 0.3),
        ("bapo", 0.5),
        ("bapo_recipe", 0.3),
        ("bapo_recipe", 0.5),
    ]


def test_a_glob_with_an_invalid_job_is_refused_naming_the_job() -> None:
    # rho0 exists only in bapo's schema (bapo, bapo_recipe): job 2 (ce_gppo) is the first it breaks
    with pytest.raises(PreflightError) as info:
        _sweep("algo=glob(*)", "algo.rho0=0.3")
    line = str(info.value)
    assert line.startswith("job 2 (algo=ce_gppo): algo.rho0: unknown key in algo; valid keys:")
    assert "\n" not in line
    with pytest.raises(PreflightError) as info:
        _sweep("algo=glob(*,exclude=bapo*)", "algo.rho0=0.3")
    assert str(info.value).startswith("job 0 (algo=ce_gppo): algo.rho0: unknown key")


def test_errors_that_name_their_swept_value_are_unchanged() -> None:
    with pytest.raises(PreflightError) as info:
        _sweep("algo=glob(bapo)", "algo.rho0=0.3,7")
    assert str(info.value) == "algo.rho0=7.0: must be within [0, 1]"


@pytest.mark.parametrize("override", ["algo.rho0=glob(*)", "trainer.lr=glob(*)", "foo=glob(*)"])
def test_glob_on_a_key_that_is_not_a_group_is_one_line(override: str) -> None:
    for multirun in (True, False):
        with pytest.raises(PreflightError) as info:
            preflight("train", [override], multirun=multirun)
        line = str(info.value)
        assert line.startswith(f"{override}: glob() sweeps the options of a config group (algo, ")
        assert line.endswith("sweep values as a,b,c or range(...)") and "\n" not in line


def test_glob_matching_nothing_lists_the_options() -> None:
    with pytest.raises(PreflightError) as info:
        _sweep("staleness=glob(3*)")
    assert str(info.value) == "staleness=glob(3*): matches no option; valid: 0, 1, 2, 4, 8"


def test_glob_without_multirun_asks_for_it() -> None:
    with pytest.raises(PreflightError) as info:
        preflight("train", ["algo=glob(*)"])
    assert str(info.value) == "Sweep parameters 'algo=glob(*)' requires --multirun"


def test_glob_under_optuna_becomes_a_categorical_choice() -> None:
    checked = _sweep("sweeper=optuna", "algo=glob(include=[bapo,clip_higher])")
    assert checked.num_jobs is None
    assert "algo=bapo,clip_higher" in checked.overrides


def test_hydras_own_glob_would_also_list_the_schemas() -> None:
    """Why the CLI hands Hydra an explicit list: Hydra expands a glob against its config loader,
    which lists the ConfigStore schemas of the group too."""
    jobs = hydra_runner.expand_sweep(["algo=glob(*)"])
    losses = ["bapo", "ce_gppo", "cispo", "clip_cov", "clip_higher", "dcpo", "dppo_kl", "dppo_tv"]
    losses += ["gspo", "kl_cov", "luspo", "m2po", "minpro", "ppo", "prime_default", "sapo", "topr"]
    losses += ["vcpo", "vespo"]
    assert [job[0] for job in jobs] == [f"algo=_{loss}_schema" for loss in losses] + [
        f"algo={name}" for name in ALGOS
    ]


def test_normalize_quotes_numbers_in_a_glob_but_not_patterns() -> None:
    out = hydra_runner.normalize_overrides(
        ["staleness=glob(*,exclude=[0,8])", "staleness=glob(1*)", "staleness=glob(*)"]
    )
    assert out[:3] == [
        "staleness=glob(*,exclude=['0','8'])",
        "staleness=glob(1*)",
        "staleness=glob(*)",
    ]


def test_hydra_launches_exactly_the_jobs_preflight_validated(tmp_path: Path) -> None:
    """The real multirun (Hydra's basic sweeper and launcher, in process) on what preflight
    returns: same count, same order, same choices."""
    checked = _sweep(
        "algo=glob([bapo,clip_higher,grpo])", "staleness=glob(*,exclude=[1,2])", "tracking=none"
    )
    seen: list = []

    def record(cfg: DictConfig) -> None:
        hydra = HydraConfig.get()
        seen.append((hydra.job.num, cfg.algo.name, cfg.staleness.k, list(hydra.overrides.task)))

    hydra_runner.run(["--multirun", *checked.overrides], config_name="train", task_function=record)
    assert checked.num_jobs == len(seen) == 9
    assert [s[0] for s in seen] == list(range(9))
    assert [(s[1], s[2]) for s in seen] == [
        (algo, k) for algo in ("bapo", "clip_higher", "grpo") for k in (0, 4, 8)
    ]
    assert [s[3] for s in seen] == checked.jobs
