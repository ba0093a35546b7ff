"""Where a run's numbers and files go: the `tracking` group (MLflow, W&B, TensorBoard) and
`paths` (the output root)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from omegaconf import MISSING

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, opt

TRACKING_BACKENDS = ("mlflow", "wandb", "tensorboard")  # bapo_cli.tracking.BACKENDS
WANDB_MODES = ("online", "offline")
# backends whose library comes with the `trackers` extra, and the module each needs
EXTRA_TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (`import wandb` takes a second)."""
    return importlib.util.find_spec(module) is not None


@dataclass
class WandbConfig:
    """W&B settings (used when tracking.backends has wandb); the API key comes from
    `wandb login` or $WANDB_API_KEY, never from the config."""

    project: str | None = opt(None, "W&B project; null = tracking.experiment")
    entity: str | None = opt(None, "W&B team or user; null = your default entity")
    mode: str | None = opt(
        None, "online, or offline (upload later: wandb sync); null = $WANDB_MODE, else online"
    )

    def check(self) -> None:
        if self.mode is not None:
            _one_of("mode", self.mode, WANDB_MODES)


@dataclass
class TensorboardConfig:
    """TensorBoard settings (used when tracking.backends has tensorboard)."""

    log_dir: str | None = opt(None, "directory of the event files; null = <run dir>/tensorboard")


@dataclass
class TrackingConfig:
    """Where numbers go: MLflow (local SQLite or a server URI), W&B, TensorBoard, or several."""

    backends: list[str] = opt(
        ["mlflow"], "mlflow, wandb, tensorboard, or several ([mlflow,wandb]); [] logs nothing"
    )
    uri: str = opt(MISSING, "MLflow tracking URI (sqlite:///..., file:..., http://host:port)")
    experiment: str = opt("bapo", "MLflow experiment name (and the default W&B project)")
    run_name: str | None = opt(None, "run name; null = derived from the overrides")
    wandb: WandbConfig = field(
        default_factory=WandbConfig, metadata={"help": "W&B project, entity and mode"}
    )
    tensorboard: TensorboardConfig = field(
        default_factory=TensorboardConfig, metadata={"help": "TensorBoard event files"}
    )

    def check(self) -> None:
        for name in self.backends:
            _one_of("backends", name, TRACKING_BACKENDS)
            if name in EXTRA_TRACKERS and not _installed(EXTRA_TRACKERS[name]):
                raise ConfigError(
                    "backends", name, "is not installed: pip install 'bapo-cli[trackers]'"
                )
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError("backends", list(self.backends), "names a backend twice")
        if not self.experiment:
            raise ConfigError("experiment", self.experiment, "must not be empty")
        if "mlflow" in self.backends and not self.uri:
            raise ConfigError("uri", self.uri, "must name the MLflow store when mlflow is on")


@dataclass
class PathsConfig:
    """Absolute roots, fixed by the launching process so jobs started elsewhere still agree."""

    output_root: str = opt(MISSING, "root of runs/, sweeps/ and the default MLflow store")
