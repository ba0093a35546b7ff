"""The generated config reference: every option of a top-level config as (dotted key, type,
default, help), read from the dataclasses (`bapo config --docs`, and the test that no field is
undocumented).

The `algo` group lists `AlgoConfig`'s shared options once, then each loss's own options tagged
with the presets (conf/algo/*.yaml) that use that loss.
"""

from __future__ import annotations

import dataclasses
import typing

import yaml
from omegaconf import MISSING

from bapo_cli.config.paths import config_dir
from bapo_cli.config.schema.algo import AlgoConfig, _schemas_by_loss
from bapo_cli.config.schema.top import TrainConfig


def _type_name(f: dataclasses.Field) -> str:
    if isinstance(f.type, str) or typing.get_origin(f.type) is not None:
        text = str(f.type)  # "float | None", list[float]
    else:
        text = getattr(f.type, "__name__", str(f.type))
    return text.replace("Config", "")


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return str(f.default_factory())  # type: ignore[misc]
    return "" if f.default is MISSING else str(f.default)


def _presets_of(loss: str) -> str:
    """The algo presets (conf/algo/*.yaml) that use `loss`, e.g. `ppo, grpo`; else the loss."""
    presets = [
        path.stem
        for path in sorted((config_dir() / "algo").glob("*.yaml"))
        if (yaml.safe_load(path.read_text()) or {}).get("loss") == loss
    ]
    return ", ".join(presets) if presets else f"loss={loss}"


def option_docs(top: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Every option as (dotted key, type, default, help): the generated config reference."""
    rows: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(top):
        key = f"{prefix}{f.name}"
        nested = _nested_schema(top, f)
        if f.name == "algo" and top is TrainConfig:
            rows += option_docs(AlgoConfig, "algo.")
            own = {g.name for g in dataclasses.fields(AlgoConfig)}
            for loss, cls in _schemas_by_loss().items():
                presets = _presets_of(loss)
                for row in option_docs(cls, "algo."):
                    if row[0].removeprefix("algo.") not in own:
                        rows.append((row[0], row[1], row[2], f"[{presets}] {row[3]}"))
        elif nested is not None:
            rows += option_docs(nested, key + ".")
        else:
            rows.append((key, _type_name(f), _default_text(f), f.metadata.get("help", "")))
    return rows


def _nested_schema(owner: type, f: dataclasses.Field) -> type | None:
    hint = typing.get_type_hints(owner)[f.name]
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate  # type: ignore[return-value]
    return None
