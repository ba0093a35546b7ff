"""The `algo` group: `AlgoConfig`'s options shared by every loss, and one generated schema per
registered loss (`_<loss>_schema`).

A loss's own options are the fields of its params dataclass (`bapo_cli.algos.losses`), whose
defaults, help and `check()` live with the loss; `algo_schemas()` adds them to `AlgoConfig`, so a
new loss needs no edit here. The loss and advantage registries are read through the plug-in point
`bapo_cli.config.registries` (the algos package imports torch; checking a config loads it, merely
importing the schema does not).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from bapo_cli.config import registries
from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt


def _registry_keys(module: str) -> tuple[str, ...]:
    """Names registered in `<module>.REGISTRY` (the single list of valid names)."""
    return tuple(sorted(registries.load(module, "REGISTRY")))


def _aggregations() -> tuple[str, ...]:
    return tuple(registries.load(registries.LOSSES, "AGGREGATIONS"))


@dataclass
class AlgoConfig:
    """Options every algorithm has: which loss, which advantage estimator, how tokens aggregate."""

    name: str = opt(MISSING, "preset name (algo=<name>)")
    loss: str = opt(MISSING, "policy loss, a key of bapo_cli.algos.losses.REGISTRY")
    advantage: str = opt(MISSING, "advantage estimator, a key of bapo_cli.algos.advantages")
    dual_clip: float | None = opt(
        3.0, "dual-clip constant for negative advantages (verl's default); null turns it off"
    )
    agg: str = opt("token-mean", "token aggregation of the per-token loss")
    kl_coef: float = opt(
        0.0,
        "weight of a k3 KL penalty to the initial policy (0 = no reference model, as the paper)",
    )
    dynamic_sampling: bool = opt(
        False,
        "DAPO's dynamic sampling: drop prompt groups whose rewards are all equal (no gradient) "
        "and refill the batch with new prompts (counted in dynamic/*)",
    )
    resample_rounds: int = opt(
        10,
        "dynamic_sampling: extra generation rounds per step at most; a batch still short after "
        "them is topped up with dropped groups (dynamic/topped_up_groups)",
    )
    overlong_buffer: float = opt(
        0.0,
        "DAPO's overlong reward shaping: the last overlong_buffer x rollout.max_tokens tokens of "
        "the budget (L_cache) cost up to overlong_penalty, linearly (DAPO: 4096/20480 = 0.2); "
        "0 = off",
    )
    overlong_penalty: float = opt(
        1.0, "overlong_buffer > 0: reward subtracted from a response that fills the budget"
    )
    behav_weight_cap: float | None = opt(
        None,
        "decoupled PPO (needs trainer.old_logprob=recompute): the loss clips around the "
        "recomputed proximal policy and weights each token by pi_prox / pi_behav; tokens whose "
        "weight exceeds the cap are dropped (AReaL); null = no behaviour weight",
    )

    def check(self) -> None:
        _positive("kl_coef", self.kl_coef, allow_zero=True)
        _positive("resample_rounds", self.resample_rounds)
        if not 0.0 <= self.overlong_buffer < 1.0:
            raise ConfigError("overlong_buffer", self.overlong_buffer, "must be within [0, 1)")
        _positive("overlong_penalty", self.overlong_penalty, allow_zero=True)
        if self.behav_weight_cap is not None and not self.behav_weight_cap >= 1.0:
            raise ConfigError(
                "behav_weight_cap", self.behav_weight_cap, "must be >= 1 (or null to disable)"
            )
        _one_of("loss", self.loss, _registry_keys(registries.LOSSES))
        _one_of("advantage", self.advantage, _registry_keys(registries.ADVANTAGES))
        _one_of("agg", self.agg, _aggregations())
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ConfigError("dual_clip", self.dual_clip, "must be > 1 (or null to disable)")


def algo_schemas() -> dict[str, type]:
    """`_<loss>_schema` -> the algo schema of every registered loss (generated, memoised)."""
    return {f"_{loss}_schema": cls for loss, cls in _schemas_by_loss().items()}


def _schemas_by_loss() -> dict[str, type]:
    losses = registries.load(registries.LOSSES, "REGISTRY")
    return {name: _algo_schema(losses.get(name)) for name in losses}


def _schema_type(hint: Any) -> Any:
    """The params' field type as OmegaConf takes it: a tuple (a range) becomes a list."""
    if typing.get_origin(hint) is tuple:
        return list[typing.get_args(hint)[0]]
    return hint


@functools.cache
def _algo_schema(entry: Any) -> type:
    """AlgoConfig's fields + the fields of `entry.params` (type, default, help), checked by
    AlgoConfig.check and the params' own check (its ParamError becomes a ConfigError). A field
    marked `shared` is AlgoConfig's own option (dual_clip); one marked `runtime` is no option."""
    param_error = registries.load(registries.PARAMS, "ParamError")
    hints = typing.get_type_hints(entry.params)
    own = [
        (
            f.name,
            _schema_type(hints[f.name]),
            opt(list(f.default) if isinstance(f.default, tuple) else f.default, f.metadata["help"]),
        )
        for f in dataclasses.fields(entry.params)
        if not (f.metadata.get("shared") or f.metadata.get("runtime"))
    ]

    def check(self: Any) -> None:
        AlgoConfig.check(self)
        if self.loss != entry.name:
            raise ConfigError(
                "loss",
                self.loss,
                f"this preset holds the options of loss {entry.name}; choose "
                f"an algo preset of loss {self.loss} instead (algo=...)",
            )
        try:
            entry.read_params(self)
        except param_error as err:
            raise ConfigError(err.key, err.value, err.message) from None

    name = entry.params.__name__.removesuffix("Params") + "AlgoConfig"
    cls = dataclasses.make_dataclass(
        name, own, bases=(AlgoConfig,), namespace={"check": check, "__doc__": entry.params.__doc__}
    )
    # pickled by name: `bapo_cli.config.schema.<name>` resolves through the package's __getattr__
    cls.__module__ = __name__.rpartition(".")[0]
    return cls
