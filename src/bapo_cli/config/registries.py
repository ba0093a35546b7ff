"""The one plug-in point of config: the registries it validates against, loaded by module path.

A config group mirrors a code module, and the names a group accepts are that module's registry:
`algo.loss` the losses' `REGISTRY`, `algo.advantage` the advantage estimators', `staleness.regime`
the regime classes of `REGIMES` (which also carry the regime's own config rules, `check` and
`check_run`). The registry is the one list of valid names, so adding a loss or a regime needs no
edit in config.

These are loaded by name with importlib, when a config is checked, not imported, for two reasons:
`bapo_cli.staleness` sits above config in the layers (its regimes import `ConfigError` and
`TrainConfig`, so an import back would be a circle and an upward edge), and the algos package
imports torch, which importing a schema must not do (`bapo config --docs`, `--help`, and the
models, evaluation and launch code that only read a dataclass). It is one of the named exceptions
to the layers in docs/architecture.md; every module config loads this way is listed here, and
`load` refuses any other.
"""

from __future__ import annotations

import importlib
from typing import Any

LOSSES = "bapo_cli.algos.losses"  # REGISTRY (a LossEntry per loss), AGGREGATIONS
ADVANTAGES = "bapo_cli.algos.advantages"  # REGISTRY
PARAMS = "bapo_cli.algos.params"  # ParamError, which a loss's params check raises
REGIMES = "bapo_cli.staleness.regimes"  # REGIMES (regime classes: check, check_run)

PLUGINS = (LOSSES, ADVANTAGES, PARAMS, REGIMES)


def load(module: str, name: str) -> Any:
    """`module.name` (a registry or a table of it), importing `module` on first use."""
    if module not in PLUGINS:
        raise ValueError(f"{module} is not a config plug-in; valid: {', '.join(PLUGINS)}")
    return getattr(importlib.import_module(module), name)
