"""The two top-level configs, assembled from the groups: `TrainConfig` (`bapo train`,
conf/train.yaml) and `EvalRunConfig` (`bapo eval`, conf/eval.yaml), with the rules that span
groups (`TrainConfig.check`, and the regime's own `check_run`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from bapo_cli.config import registries
from bapo_cli.config import servers as server_rules
from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.benchmark import BenchmarkConfig, EvalConfig
from bapo_cli.config.schema.data import DataConfig
from bapo_cli.config.schema.fields import opt
from bapo_cli.config.schema.model import ModelConfig
from bapo_cli.config.schema.reward import RewardConfig
from bapo_cli.config.schema.rollout import RolloutConfig
from bapo_cli.config.schema.staleness import StalenessConfig, regime_class
from bapo_cli.config.schema.tracking import PathsConfig, TrackingConfig
from bapo_cli.config.schema.trainer import TrainerConfig


@dataclass
class TrainConfig:
    """Everything `bapo train` needs; composed from conf/train.yaml."""

    model: ModelConfig = opt(MISSING, "the policy")
    algo: Any = opt(
        MISSING,
        "policy loss and advantages (algo=ppo|grpo|clip_higher|bapo|bapo_recipe|drgrpo|dapo|"
        "gspo|cispo|sapo)",
    )
    staleness: StalenessConfig = opt(MISSING, "off-policy regime (staleness=0|1|2|4|8)")
    data: DataConfig = opt(MISSING, "training prompts")
    rollout: RolloutConfig = opt(MISSING, "generation engine and sampling")
    reward: RewardConfig = opt(MISSING, "answer grading: time limit, workers, step budget")
    tracking: TrackingConfig = opt(MISSING, "MLflow, W&B and/or TensorBoard tracking")
    trainer: TrainerConfig = opt(MISSING, "the RL loop")
    paths: PathsConfig = opt(MISSING, "output locations")

    def check(self) -> None:
        if self.rollout.max_tokens >= self.model.max_model_len:
            raise ConfigError(
                "rollout.max_tokens",
                self.rollout.max_tokens,
                f"must be < model.max_model_len={self.model.max_model_len} (prompt + response "
                "share the context: leave room for the prompt)",
            )
        estimators = registries.load(registries.ADVANTAGES, "REGISTRY")
        if estimators.get(self.algo.advantage).groups and self.rollout.n < 2:
            raise ConfigError(
                "rollout.n",
                self.rollout.n,
                f"algo.advantage={self.algo.advantage} compares samples of one prompt: needs >= 2",
            )
        cap = self.algo.behav_weight_cap
        if self.rollout.seq_mask == "kpop" and self.trainer.old_logprob != "recompute":
            raise ConfigError(
                "rollout.seq_mask",
                "kpop",
                "compares the proximal policy with the behaviour one (AReaL's rejection "
                "sampling): needs trainer.old_logprob=recompute, which measures it before the "
                "update",
            )
        if cap is not None and self.trainer.old_logprob == "behaviour":
            raise ConfigError(
                "algo.behav_weight_cap",
                cap,
                "needs trainer.old_logprob=recompute or loglinear (the proximal policy it "
                "divides by)",
            )
        _check_offpolicy_losses(self)
        check_float64(self.model.dtype, self.rollout.name, bool(self.rollout.servers))
        truncated = self.rollout.top_p < 1.0 or self.rollout.top_k > 0
        for key, value in (
            ("rollout.tis_cap", self.rollout.tis_cap),
            ("algo.behav_weight_cap", cap),
        ):
            if truncated and value is not None:
                raise ConfigError(
                    key,
                    value,
                    "is an importance weight over the trainer's log-probs, which are on the full "
                    "distribution while rollout.top_p < 1 / top_k > 0 truncate sampling (biased): "
                    "use top_p=1 and top_k=-1, or null",
                )
        server_rules.check_train(self)  # generation servers (config/servers.py)
        regime_class(self.staleness.regime).check_run(self)  # the regime's rules across groups


def check_float64(dtype: str, engine: str, served: bool) -> None:
    """model.dtype=float64 (the CPU testbed) generates with the transformers engine only: vLLM
    (rollout=vllm, or generation servers, which are vLLM) has no float64 weights or kernels."""
    if dtype != "float64":
        return
    if engine == "vllm":
        raise ConfigError(
            "rollout.name", engine, "model.dtype=float64 needs rollout=hf (vLLM has no float64)"
        )
    if served:
        raise ConfigError(
            "model.dtype",
            dtype,
            "generation servers are vLLM, which has no float64: drop the servers, or use float32",
        )


def _check_offpolicy_losses(cfg: TrainConfig) -> None:
    """Cross-group rules of two losses' trainer settings (issue 34): prime_default's ratio is
    against the engine's log-probs, so no proximal policy replaces them; VCPO's baseline
    re-centres per-sequence advantages, which per-token corrections have already weighted."""
    if getattr(cfg.algo, "ratio_against", None) == "inference" and (
        cfg.trainer.old_logprob != "behaviour"
    ):
        raise ConfigError(
            "trainer.old_logprob",
            cfg.trainer.old_logprob,
            "algo.ratio_against=inference takes the ratio against the engine's log-probs: use "
            "trainer.old_logprob=behaviour, or algo.ratio_against=old",
        )
    per_token = [
        key
        for key, on in (
            ("rollout.tis_cap", cfg.rollout.tis_cap is not None),
            ("rollout.seq_mask", cfg.rollout.seq_mask != "none"),
            ("algo.behav_weight_cap", cfg.algo.behav_weight_cap is not None),
        )
        if on
    ]
    if getattr(cfg.algo, "baseline", None) == "opob" and per_token:
        raise ConfigError(
            "algo.baseline",
            "opob",
            f"re-centres per-sequence advantages; {', '.join(per_token)} makes them per token: "
            "turn that off, or use algo.baseline=none",
        )
    if getattr(cfg.algo, "baseline", None) == "opob" and cfg.trainer.strategy == "fsdp2":
        raise ConfigError(
            "algo.baseline",
            "opob",
            "takes one gradient per sequence of whole (unsharded) weights: use "
            "trainer.strategy=ddp, or algo.baseline=none",
        )


@dataclass
class EvalRunConfig:
    """Everything `bapo eval` needs; composed from conf/eval.yaml."""

    model: ModelConfig = opt(MISSING, "the model to score")
    benchmark: BenchmarkConfig = opt(
        MISSING, "benchmark=aime24|aime25|math500|amc23|minerva_math|olympiadbench"
    )
    rollout: RolloutConfig = opt(MISSING, "generation engine (sampling comes from eval.*)")
    reward: RewardConfig = opt(MISSING, "answer grading: time limit per answer, workers")
    tracking: TrackingConfig = opt(MISSING, "MLflow, W&B and/or TensorBoard tracking")
    eval: EvalConfig = opt(MISSING, "samples per problem and sampling")
    paths: PathsConfig = opt(MISSING, "output locations")

    def check(self) -> None:
        check_float64(self.model.dtype, self.rollout.name, self.eval.server is not None)
        server_rules.check_eval(self)  # generation servers (config/servers.py)
