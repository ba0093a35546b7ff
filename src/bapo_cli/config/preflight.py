"""Reject a bad command line before any heavy work: group choices, types, ranges, every sweep job.

`preflight()` is what the CLI runs first. For a multirun it composes and validates the config of
every job the basic sweeper would launch, so `bapo train -m algo.rho0=0.3,1.5` fails before job 0
starts, not halfway through a sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bapo_cli.config import hydra_runner, schema
from bapo_cli.config.errors import ConfigError, explain

PLUGIN_GROUPS = {"hydra/launcher": "sweep or slurm", "hydra/sweeper": "sweep"}


class PreflightError(Exception):
    """A rejected command line; `str()` is the one line shown to the user."""


@dataclass(frozen=True)
class Preflight:
    overrides: list[str]  # normalised, ready for Hydra
    config: Any  # validated dataclass of the first (or only) job
    num_jobs: int | None  # None when the sweeper samples (Optuna)


def to_validated(cfg: DictConfig) -> Any:
    """DictConfig -> schema dataclass, with every `check()` run. Raises ConfigError."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # interpolation or missing value: explain it in one line
        raise ConfigError("config", None, explain(exc)) from exc
    schema.validate(obj)
    return obj


def check_group_choices(overrides: list[str]) -> None:
    """`algo=foo` -> `algo=foo: unknown option; valid: bapo, clip_higher, grpo, ppo`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise PreflightError(f"cannot parse override: {explain(exc)}") from exc
    groups = set(hydra_runner.config_groups())
    for override in parsed:
        group = override.key_or_group
        if group not in groups or override.is_delete() or override.package:
            continue
        valid = hydra_runner.group_options(group)
        value = override.value()
        if isinstance(value, Glob):  # `algo=glob(*)`: Hydra expands it against the options
            values = value.filter(valid)
            if not values:
                raise PreflightError(
                    f"{override.input_line}: matches no option; valid: {', '.join(valid)}"
                )
        elif override.is_sweep_override():
            values = [getattr(v, "text", v) for v in override.sweep_iterator()]
        else:
            values = value if isinstance(value, list) else [value]
        for value in values:
            if value is None and group == "experiment":
                continue
            if str(value) not in valid:
                raise PreflightError(f"{group}={value}: unknown option; valid: {', '.join(valid)}")


def _compose_checked(config_name: str, overrides: list[str]) -> Any:
    try:
        cfg = hydra_runner.compose(config_name, overrides)
    except Exception as exc:
        line = explain(exc)
        for group, extra in PLUGIN_GROUPS.items():
            if line.startswith(group + "="):
                line += f" (install the plugin: pip install 'bapo-cli[{extra}]')"
        raise PreflightError(line) from exc
    try:
        return to_validated(cfg)
    except ConfigError as exc:
        raise PreflightError(exc.line()) from exc


def preflight(config_name: str, overrides: list[str], *, multirun: bool = False) -> Preflight:
    """Normalise, check and compose; raise PreflightError (one readable line) if anything is off."""
    overrides = hydra_runner.normalize_overrides(list(overrides))
    check_group_choices(overrides)
    if not multirun:
        return Preflight(overrides, _compose_checked(config_name, overrides), 1)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:  # a preset may declare the sweep itself (hydra.sweeper.params), or pick another sweeper
        declared = hydra_runner.sweeper_params(config_name, fixed)
    except Exception as exc:
        _compose_checked(config_name, fixed)  # the readable error, if composing is what failed
        raise PreflightError(f"cannot compose the sweeper: {explain(exc)}") from exc
    try:
        jobs = None if declared is None else hydra_runner.expand_sweep(declared + overrides)
    except Exception as exc:
        raise PreflightError(f"cannot expand the sweep: {explain(exc)}") from exc
    if jobs is None:  # a sampling sweeper: validate what is fixed; each trial checks itself
        return Preflight(overrides, _compose_checked(config_name, fixed), None)
    first = None
    for job in jobs:
        config = _compose_checked(config_name, job)
        first = first if first is not None else config
    return Preflight(overrides, first, len(jobs))
