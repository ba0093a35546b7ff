"""The `model` group: the policy (HF id, local directory or the tiny model), its tiny-model
settings and its LoRA adapters.

Two tables the checks need belong to higher layers' code (models sits above config), so their
values live here and `bapo_cli.models` takes them from this module, not the other way round:
the LoRA bounds (`bapo_cli.models.adapters` checks adapter files against the same numbers, and
says why they are these) and the names of the tiny model's warm-up tasks
(`bapo_cli.models.tiny.WARMUP_TASKS` is keyed by them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt

MAX_LORA_RANK = 4096  # why these bounds: bapo_cli.models.adapters
MAX_LORA_ALPHA = 4.0 * MAX_LORA_RANK
WARMUP_TASK_NAMES = ("arith", "pairs")  # the keys of bapo_cli.models.tiny.WARMUP_TASKS


@dataclass
class TinyModelConfig:
    """Shape and warm-up of the locally built tiny Qwen2 model (no download needed)."""

    hidden_size: int = opt(128, "width of the residual stream")
    num_layers: int = opt(2, "transformer blocks")
    num_heads: int = opt(2, "attention heads")
    num_kv_heads: int = opt(1, "key/value heads (grouped-query attention)")
    head_dim: int = opt(64, "per-head width; 64 because vLLM's CPU attention rejects 16")
    intermediate_size: int = opt(256, "MLP width")
    sft_steps: int = opt(
        480, "warm-up SFT steps, exactly (a step count, not an accuracy target: reproducible)"
    )
    sft_lr: float = opt(2e-3, "learning rate of the warm-up SFT")
    sft_batch_size: int = opt(256, "sequences per warm-up SFT step")
    seed: int = opt(0, "seed of initialisation and warm-up data")
    task: str = opt(
        "arith",
        "warm-up task: arith (answers) or pairs (random-order search traces, model=tiny_pairs)",
    )

    def check(self) -> None:
        _one_of("task", self.task, WARMUP_TASK_NAMES)
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        _positive("intermediate_size", self.intermediate_size)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", self.num_kv_heads, "must divide num_heads")
        _positive("sft_steps", self.sft_steps)
        _positive("sft_lr", self.sft_lr)
        _positive("sft_batch_size", self.sft_batch_size)


# float64: the CPU replication testbed (docs/study-v3.md, "What is not pinned"): the transformers
# engine only (vLLM has no float64), and not on CUDA (ModelConfig.check says why)
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
FLOAT64_ON_CUDA = (
    "float64 is a CPU testbed for kernel rounding (docs/study-v3.md): on CUDA the engine auto "
    "picks (vLLM) has no float64, consumer GPUs run it at 1/64 of float32, and it does not make "
    "CUDA's kernels deterministic; use model.device=cpu, or float32/bfloat16"
)
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT) instead of full fine-tuning; dropout is always 0 (RL scores the
    policy that sampled). See bapo_cli.models.lora."""

    rank: int = opt(0, "adapter rank; 0 = off (full fine-tuning)")
    alpha: float = opt(32.0, "scale: the update is (alpha / rank) B A")
    target_modules: list[str] = opt(
        ["all-linear"], "layers given adapters: module names (q_proj, ...) or [all-linear]"
    )

    def check(self) -> None:
        # the bounds an adapter file must keep too (why these: bapo_cli.models.adapters)
        if not 0 <= self.rank <= MAX_LORA_RANK:
            raise ConfigError("rank", self.rank, f"must be within [0, {MAX_LORA_RANK}] (0 = off)")
        if not (math.isfinite(self.alpha) and 0 < self.alpha <= MAX_LORA_ALPHA):
            raise ConfigError("alpha", self.alpha, f"must be within (0, {MAX_LORA_ALPHA:g}]")
        if not self.target_modules or any(not str(t) for t in self.target_modules):
            raise ConfigError(
                "target_modules", self.target_modules, "must name modules, or be [all-linear]"
            )


@dataclass
class ModelConfig:
    """The policy: a HF id or local directory, or the locally built tiny model."""

    name: str = opt("tiny", "preset name, for display and run tags")
    path: str = opt("tiny", "HF model id, local checkpoint dir, or 'tiny' (built locally)")
    dtype: str = opt(
        "auto",
        "auto = bfloat16 on CUDA, float32 on CPU; float64 = the CPU replication testbed "
        "(rollout=hf only)",
    )
    device: str = opt("auto", "auto = cuda when available, else cpu")
    gradient_checkpointing: bool = opt(False, "recompute activations to save memory")
    trust_remote_code: bool = opt(False, "allow custom modelling code from the hub")
    max_model_len: int = opt(256, "prompt + response tokens the engines must hold")
    tiny: TinyModelConfig | None = opt(None, "settings of the tiny model (only for path=tiny)")
    lora: LoraConfig = field(
        default_factory=LoraConfig,
        metadata={"help": "LoRA adapters: model.lora.rank=8 trains adapters only"},
    )

    def check(self) -> None:
        if not self.path:
            raise ConfigError("path", self.path, "must name a HF id, a directory or 'tiny'")
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        if self.dtype == "float64" and self.device == "cuda":
            raise ConfigError("dtype", self.dtype, FLOAT64_ON_CUDA)
        _positive("max_model_len", self.max_model_len)
        if self.path == "tiny" and self.tiny is None:
            raise ConfigError("tiny", None, "model.path=tiny needs the tiny settings (model=tiny)")
