"""Typed schemas of every config group, with each option documented once and validated once.

Hydra composes `conf/train.yaml` / `conf/eval.yaml` onto these dataclasses (registered in Hydra's
ConfigStore by `register()`), so a wrong type fails at composition. Range rules and
cross-group rules live in each dataclass's `check()`, next to the fields they guard; `validate()`
walks a config and prefixes the dotted key, so every failure reads as one line such as
`algo.rho0=1.5: must be within [0, 1]`.

Each field's `help` is the only documentation of that option: `bapo config --docs` and the README
point here, and a test checks that no field is undocumented.

One module per config group, as the groups mirror the code (conf/<group>/, bapo_cli/<module>):

    fields      `opt` (a field with its help) and the shared rules `_one_of`, `_positive`
    model       model, model.tiny, model.lora (and the LoRA bounds, the warm-up task names)
    algo        AlgoConfig and the generated `_<loss>_schema` of every registered loss
    staleness   staleness (its rules are the regime classes', loaded by name)
    data        data
    rollout     rollout
    reward      reward
    trainer     trainer
    tracking    tracking, tracking.wandb, tracking.tensorboard, paths
    benchmark   benchmark and eval (bapo eval)
    top         TrainConfig and EvalRunConfig, assembled from the groups; cross-group rules
    docs        option_docs: the generated config reference

This package re-exports every public name, so `from bapo_cli.config.schema import X` is the one
import callers need. The `algo` group has one schema per registered loss, `_<loss>_schema`,
generated from the loss registry (`algo_schemas()`): `AlgoConfig`'s shared options plus the fields
of the loss's params dataclass (`bapo_cli.algos.losses`), whose defaults, help and `check()` live
with the loss. A new loss therefore needs no edit here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bapo_cli.config.errors import ConfigError

# every public name of the group modules, re-exported: callers import them from here
from bapo_cli.config.schema.algo import AlgoConfig as AlgoConfig
from bapo_cli.config.schema.algo import algo_schemas
from bapo_cli.config.schema.benchmark import BenchmarkConfig as BenchmarkConfig
from bapo_cli.config.schema.benchmark import EvalConfig as EvalConfig
from bapo_cli.config.schema.data import DATA_FORMATS as DATA_FORMATS
from bapo_cli.config.schema.data import DATA_KINDS as DATA_KINDS
from bapo_cli.config.schema.data import DataConfig as DataConfig
from bapo_cli.config.schema.docs import option_docs as option_docs
from bapo_cli.config.schema.fields import opt as opt
from bapo_cli.config.schema.model import DEVICES as DEVICES
from bapo_cli.config.schema.model import DTYPES as DTYPES
from bapo_cli.config.schema.model import MAX_LORA_ALPHA as MAX_LORA_ALPHA
from bapo_cli.config.schema.model import MAX_LORA_RANK as MAX_LORA_RANK
from bapo_cli.config.schema.model import WARMUP_TASK_NAMES as WARMUP_TASK_NAMES
from bapo_cli.config.schema.model import LoraConfig as LoraConfig
from bapo_cli.config.schema.model import ModelConfig as ModelConfig
from bapo_cli.config.schema.model import TinyModelConfig as TinyModelConfig
from bapo_cli.config.schema.reward import MAX_GRADER_WORKERS as MAX_GRADER_WORKERS
from bapo_cli.config.schema.reward import REWARD_FN_FORMS as REWARD_FN_FORMS
from bapo_cli.config.schema.reward import REWARD_GRADERS as REWARD_GRADERS
from bapo_cli.config.schema.reward import RewardConfig as RewardConfig
from bapo_cli.config.schema.rollout import ENGINES as ENGINES
from bapo_cli.config.schema.rollout import SEQ_MASKS as SEQ_MASKS
from bapo_cli.config.schema.rollout import TIS_LEVELS as TIS_LEVELS
from bapo_cli.config.schema.rollout import TIS_MODES as TIS_MODES
from bapo_cli.config.schema.rollout import RolloutConfig as RolloutConfig
from bapo_cli.config.schema.staleness import StalenessConfig as StalenessConfig
from bapo_cli.config.schema.top import EvalRunConfig, TrainConfig
from bapo_cli.config.schema.tracking import EXTRA_TRACKERS as EXTRA_TRACKERS
from bapo_cli.config.schema.tracking import TRACKING_BACKENDS as TRACKING_BACKENDS
from bapo_cli.config.schema.tracking import WANDB_MODES as WANDB_MODES
from bapo_cli.config.schema.tracking import PathsConfig as PathsConfig
from bapo_cli.config.schema.tracking import TensorboardConfig as TensorboardConfig
from bapo_cli.config.schema.tracking import TrackingConfig as TrackingConfig
from bapo_cli.config.schema.tracking import WandbConfig as WandbConfig
from bapo_cli.config.schema.trainer import LR_SCHEDULES as LR_SCHEDULES
from bapo_cli.config.schema.trainer import OLD_LOGPROBS as OLD_LOGPROBS
from bapo_cli.config.schema.trainer import PRECISIONS as PRECISIONS
from bapo_cli.config.schema.trainer import STRATEGIES as STRATEGIES
from bapo_cli.config.schema.trainer import TrainerConfig as TrainerConfig


def __getattr__(name: str) -> type:
    """`schema.BapoAlgoConfig`, `schema.PPOAlgoConfig`, ...: the generated algo schemas."""
    if name.endswith("AlgoConfig"):
        for cls in algo_schemas().values():
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent): exactly one algo schema per
    registered loss (a schema whose loss was removed from the registry is dropped)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="_train_schema", node=TrainConfig)
    cs.store(name="_eval_schema", node=EvalRunConfig)
    schemas = algo_schemas()
    stored = cs.repo.get("algo", {})
    for key in [k for k in stored if k.endswith("_schema.yaml")]:
        if key.removesuffix(".yaml") not in schemas:
            del stored[key]
    for name, node in schemas.items():
        cs.store(group="algo", name=name, node=node)


def validate(config: Any, prefix: str = "") -> None:
    """Run every `check()` in the tree, children first; errors carry the full dotted key."""
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        validate(getattr(config, f.name), f"{prefix}{f.name}.")
    check = getattr(config, "check", None)
    if check is not None:
        try:
            check()
        except ConfigError as err:
            raise err.under(prefix.rstrip(".")) from None
