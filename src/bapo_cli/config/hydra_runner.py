"""The one place that touches Hydra's private API (`hydra._internal.utils`).

`bapo train -m ...` must be a real Hydra multirun (launcher and sweeper plugins, sweep dirs,
`hydra.job.num`), not a loop of compose calls. Hydra exposes that only through `@hydra.main`, which
reads `sys.argv`; we need it behind a Typer command instead, so we call what `@hydra.main` calls:
`get_args_parser()` and `_run_hydra()`. These are private and may change; hydra-core is pinned to
1.3.x in pyproject.toml and tests/config/test_hydra_runner.py exercises this module directly.

Also here: the compose API for `bapo config` and pre-flight validation, and the normalisation of
overrides the CLI does before Hydra sees them. Where the configs live (`config_dir`) is
`bapo_cli.config.paths`, re-exported here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bapo_cli.config import schema
from bapo_cli.config.paths import config_dir as config_dir  # callers name hydra_runner's

OUTPUT_ROOT_ENV = "BAPO_OUTPUT_ROOT"
VERSION_BASE = "1.3"


def group_options(group: str) -> list[str]:
    """Option names of a config group: the YAML files in conf/<group>/ (schemas excluded)."""
    folder = config_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def config_groups() -> list[str]:
    return sorted(
        p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_")
    )


def _numeric_groups() -> set[str]:
    """Groups whose options are integers (staleness=4): Hydra wants them as strings."""
    return {
        g
        for g in config_groups()
        if group_options(g) and all(o.isdigit() for o in group_options(g))
    }


def quote(value: str) -> str:
    """`value` spelled as one override value that Hydra and OmegaConf read back unchanged: as is
    when it already is (`/data/run`), else quoted (`'/home/josé (copy) [1]'`). A path is never
    spliced raw into the override grammar, where `( [ ' " , = ; & #`, spaces and non-ASCII letters
    are syntax or not allowed at all.

    In a quoted value Hydra unescapes only `\\'` and the backslashes before a quote or the end;
    OmegaConf then reads `${` as an interpolation, `\\${` as a literal one (and doubled
    backslashes before it as one)."""
    if _reads_back(value):
        return value
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    text = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{text}'"


def _reads_back(value: str) -> bool:
    """Whether `key=value`, unquoted, is read as this very string (no escapes, no interpolation)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not value or "$" in value or "\\" in value:
        return False
    try:
        return OverridesParser.create().parse_override(f"k={value}").value() == value
    except Exception:
        return False


def override_value(line: str) -> Any:
    """The value of one override as Hydra reads it (quotes and escapes undone); None when the
    line does not parse (pre-flight reports that)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(line).value()
    except Exception:
        return None


def normalize_overrides(overrides: list[str]) -> list[str]:
    """Make the overrides users type work unchanged in Hydra, and pin the output root.

    - `staleness=4` / `staleness=0,4,8`: Hydra parses 4 as an int and refuses it as a group
      choice, so the integers of numeric groups are quoted (`staleness='4'`), also in a glob
      (`staleness=glob(*,exclude=8)`); a pattern such as `glob(1*)` is left as typed.
    - `paths.output_root` is made absolute (default `./outputs`, or $BAPO_OUTPUT_ROOT) in the
      launching process, so launchers that start jobs elsewhere (SLURM) write to the same place,
      and quoted for Hydra (`quote`): any working directory's name works.
    """
    numeric = _numeric_groups()
    out: list[str] = []
    has_root = False
    for raw in overrides:
        key, sep, value = raw.partition("=")
        bare = key.lstrip("+~")
        if sep and bare in numeric:
            value = re.sub(r"(?<![\w'\".*?])(\d+)(?![\w'\".*?])", r"'\1'", value)
        if sep and bare == "paths.output_root":
            has_root = True
            typed = override_value(raw)
            if isinstance(typed, str) and "${" not in typed:  # an interpolation stays as typed
                value = quote(str(Path(os.path.expanduser(typed)).resolve()))
        out.append(f"{key}{sep}{value}")
    if not has_root:
        root = Path(os.environ.get(OUTPUT_ROOT_ENV) or "outputs").expanduser().resolve()
        out.append(f"paths.output_root={quote(str(root))}")
    return out


def compose(config_name: str, overrides: list[str], *, with_hydra: bool = False) -> Any:
    """Compose `conf/<config_name>.yaml` with (normalised) overrides; the job config only, or
    with Hydra's own node (`hydra.run.dir`, `hydra.sweep.*`: where the run will write)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    schema.register()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=VERSION_BASE):
        return hydra_compose(
            config_name=config_name, overrides=overrides, return_hydra_config=with_hydra
        )


def sweeper_params(config_name: str, overrides: list[str]) -> list[str] | None:
    """The sweep a config itself declares (`hydra.sweeper.params`, e.g. an experiment preset), as
    overrides to put before the command line's, the way Hydra's basic sweeper reads them.

    None when the composed sweeper is not the basic one (Optuna samples its own params).
    `overrides` must hold no sweep syntax (the fixed part of the command line).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    schema.register()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=VERSION_BASE):
        cfg = hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
        return None
    params = sweeper.get("params") or {}
    return [f"{key}={value}" for key, value in params.items()]


def expand_sweep(overrides: list[str]) -> list[list[str]] | None:
    """The override list of every job a basic-sweeper multirun would launch.

    None when another sweeper is selected (e.g. Optuna's `interval(...)` cannot be enumerated):
    then only the base config is validated up front and each trial validates itself. A
    `group=glob(...)` is expanded the way the basic sweeper does it, against the options Hydra's
    config loader lists (schemas in the ConfigStore included); the CLI turns the globs typed on
    its command line into explicit choices first (`preflight.expand_globs`).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    if any(o.lstrip("+").startswith("hydra/sweeper=") for o in overrides):
        sweeper = next(o for o in overrides if o.lstrip("+").startswith("hydra/sweeper="))
        if not sweeper.endswith("=basic"):
            return None
    parsed = OverridesParser.create().parse_overrides(overrides)
    if any(o.is_sweep_override() and not o.is_discrete_sweep() for o in parsed):
        return None  # interval(...): the selected sweeper samples it
    if any(o.value_type == ValueType.GLOB_CHOICE_SWEEP for o in parsed):
        parser = OverridesParser.create(config_loader=_config_loader())
        parsed = parser.parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(job) for batch in batches for job in batch]


def _config_loader() -> Any:
    """The config loader a Hydra run over conf/ creates (it lists a group's options for glob)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    schema.register()
    return ConfigLoaderImpl(config_search_path=create_config_search_path(str(config_dir())))


def run(
    argv: list[str],
    *,
    config_name: str,
    task_function: Callable[[Any], Any],
) -> None:
    """Run `task_function` the way `@hydra.main` would, on Hydra's own argument parser.

    `argv` is Hydra's command line (`["-m", "algo.rho0=0.3,0.5"]`). `parse_intermixed_args`
    because Hydra 1.3.8's `parse_args` rejects flags after overrides (`a=1 -m b=2`).
    """
    from hydra._internal.utils import _run_hydra, get_args_parser
    from hydra.version import setbase

    schema.register()
    setbase(VERSION_BASE)
    parser = get_args_parser()
    args = parser.parse_intermixed_args(argv)
    _run_hydra(
        args=args,
        args_parser=parser,
        task_function=task_function,
        config_path=str(config_dir()),
        config_name=config_name,
    )
