"""Typed schemas of every config group, with each option documented once and validated once.

Hydra composes `conf/train.yaml` / `conf/eval.yaml` onto these dataclasses (registered in Hydra's
ConfigStore by `register()`), so a wrong type fails at composition. Range rules and
cross-group rules live in each dataclass's `check()`, next to the fields they guard; `validate()`
walks a config and prefixes the dotted key, so every failure reads as one line such as
`algo.rho0=1.5: must be within [0, 1]`.

Each field's `help` is the only documentation of that option: `bapo config --docs` and the README
point here, and a test checks that no field is undocumented.

The `algo` group has one schema per registered loss, `_<loss>_schema`, generated from the loss
registry (`algo_schemas()`): `AlgoConfig`'s shared options plus the fields of the loss's params
dataclass (`bapo_cli.algos.losses`), whose defaults, help and `check()` live with the loss. A new
loss therefore needs no edit here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from bapo_cli.config import servers as server_rules
from bapo_cli.config.errors import ConfigError
from bapo_cli.models.adapters import MAX_ALPHA as MAX_LORA_ALPHA
from bapo_cli.models.adapters import MAX_RANK as MAX_LORA_RANK


def opt(default: Any = MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field carrying its one-line documentation (`help`)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


def _one_of(key: str, value: Any, allowed: list[str] | tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"must be one of {', '.join(allowed)}")


def _positive(key: str, value: float | int, *, allow_zero: bool = False) -> None:
    bad = value < 0 if allow_zero else value <= 0
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(key, value, "must be >= 0" if allow_zero else "must be > 0")


# --------------------------------------------------------------------------------------- model


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
        from bapo_cli.models.tiny import WARMUP_TASKS

        _one_of("task", self.task, tuple(WARMUP_TASKS))
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        _positive("intermediate_size", self.intermediate_size)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", self.num_kv_heads, "must divide num_heads")
        _positive("sft_steps", self.sft_steps)
        _positive("sft_lr", self.sft_lr)
        _positive("sft_batch_size", self.sft_batch_size)


DTYPES = ("auto", "float32", "bfloat16", "float16")
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
    dtype: str = opt("auto", "auto = bfloat16 on CUDA, float32 on CPU")
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
        _positive("max_model_len", self.max_model_len)
        if self.path == "tiny" and self.tiny is None:
            raise ConfigError("tiny", None, "model.path=tiny needs the tiny settings (model=tiny)")


# ---------------------------------------------------------------------------------------- algo


def _registry_keys(module: str) -> tuple[str, ...]:
    """Names registered in `bapo_cli.algos.<module>.REGISTRY` (the single list of valid names)."""
    import importlib

    return tuple(sorted(importlib.import_module(f"bapo_cli.algos.{module}").REGISTRY))


def _aggregations() -> tuple[str, ...]:
    from bapo_cli.algos import losses

    return tuple(losses.AGGREGATIONS)


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
        _one_of("loss", self.loss, _registry_keys("losses"))
        _one_of("advantage", self.advantage, _registry_keys("advantages"))
        _one_of("agg", self.agg, _aggregations())
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ConfigError("dual_clip", self.dual_clip, "must be > 1 (or null to disable)")


def algo_schemas() -> dict[str, type]:
    """`_<loss>_schema` -> the algo schema of every registered loss (generated, memoised)."""
    return {f"_{loss}_schema": cls for loss, cls in _schemas_by_loss().items()}


def _schemas_by_loss() -> dict[str, type]:
    from bapo_cli.algos import losses

    return {name: _algo_schema(losses.REGISTRY.get(name)) for name in losses.REGISTRY}


def _schema_type(hint: Any) -> Any:
    """The params' field type as OmegaConf takes it: a tuple (a range) becomes a list."""
    if typing.get_origin(hint) is tuple:
        return list[typing.get_args(hint)[0]]
    return hint


@functools.cache
def _algo_schema(entry: Any) -> type:
    """AlgoConfig's fields + the fields of `entry.params` (type, default, help), checked by
    AlgoConfig.check and the params' own check (its ParamError becomes a ConfigError)."""
    from bapo_cli.algos.params import ParamError

    hints = typing.get_type_hints(entry.params)
    own = [
        (
            f.name,
            _schema_type(hints[f.name]),
            opt(list(f.default) if isinstance(f.default, tuple) else f.default, f.metadata["help"]),
        )
        for f in dataclasses.fields(entry.params)
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
        except ParamError as err:
            raise ConfigError(err.key, err.value, err.message) from None

    name = entry.params.__name__.removesuffix("Params") + "AlgoConfig"
    cls = dataclasses.make_dataclass(
        name, own, bases=(AlgoConfig,), namespace={"check": check, "__doc__": entry.params.__doc__}
    )
    cls.__module__ = __name__  # pickled by name: `schema.<name>` resolves through __getattr__
    return cls


def __getattr__(name: str) -> type:
    """`schema.BapoAlgoConfig`, `schema.PPOAlgoConfig`, ...: the generated algo schemas."""
    if name.endswith("AlgoConfig"):
        for cls in algo_schemas().values():
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- staleness / data


def _regime(name: str) -> Any:
    """The regime class registered as `name` (`bapo_cli.staleness.regimes.REGIMES`): it holds the
    regime's config rules (`check`, `check_run`), so a new regime needs no edit here."""
    from bapo_cli.staleness.regimes import REGIMES

    return REGIMES.get(name)


def _regime_names() -> tuple[str, ...]:
    from bapo_cli.staleness.regimes import REGIMES

    return tuple(REGIMES.registered())


@dataclass
class StalenessConfig:
    """How far the behaviour policy lags the policy being updated (staleness=<k>)."""

    k: int = opt(
        0,
        "reuse: optimizer updates per rollout batch (0 and 1 = on-policy); replay/async: "
        "policy versions between generation and training; partial: versions a response may span",
    )
    regime: str = opt(
        "reuse",
        "a key of bapo_cli.staleness.regimes.REGIMES: reuse | replay | lag | partial | async",
    )
    ppo_epochs: int = opt(1, "passes over each rollout batch (reuse); multiplies the updates")
    interrupt: bool = opt(
        False,
        "async: newer weights pause the responses being generated, which continue with them "
        "(tokens stamped per version; AReaL's interruptible rollout)",
    )
    weights: str = opt(  # generation servers (config/servers.py)
        "shm",
        "async: how new weights reach the generator: shm (a worker process on this machine) | "
        "filesystem (safetensors under staleness.weights_dir, reloaded by every server of "
        "rollout.servers) | nccl (refused: not built, docs/engines.md)",
    )
    weights_dir: str | None = opt(
        None,
        "filesystem: the directory versions are written to (every server must read it: a "
        "shared filesystem across machines); null = <run dir>/weights",
    )

    def check(self) -> None:
        _positive("k", self.k, allow_zero=True)
        _one_of("regime", self.regime, _regime_names())
        _positive("ppo_epochs", self.ppo_epochs)
        _regime(self.regime).check(self.k, self.ppo_epochs)
        _one_of("weights", self.weights, server_rules.WEIGHT_TRANSPORTS)
        if self.interrupt and self.regime != "async":
            raise ConfigError(
                "interrupt",
                True,
                "pauses the responses a generation worker is sampling when new weights arrive; "
                "only staleness.regime=async has a worker (in one process, staleness.regime="
                "partial continues responses with newer weights)",
            )


DATA_KINDS = ("arith", "pairs", "dataset")
DATA_FORMATS = ("auto", "plain", "verl", "messages")  # bapo_cli.data.formats.FORMATS


@dataclass
class DataConfig:
    """Training prompts: the seeded synthetic task, or a prompt set by HF id or local file."""

    name: str = opt("arith", "preset name")
    kind: str = opt(
        "arith",
        "arith or pairs (synthetic, exactly checkable; pairs: wrong answers longer) or dataset",
    )
    hf_id: str | None = opt(None, "HF dataset id (kind=dataset)")
    path: str | None = opt(None, "local jsonl/json/parquet/csv; wins over hf_id (kind=dataset)")
    format: str = opt(
        "auto",
        "row format (kind=dataset): plain (prompt_field/answer_field + template), verl (parquet: "
        "prompt as chat messages, reward_model.ground_truth), messages (OpenAI-style 'messages' "
        "list); auto: from the first row. Chat rows get the tokenizer's chat template "
        "(docs/training.md)",
    )
    split: str = opt("train", "dataset split")
    prompt_field: str = opt("problem", "field holding the question")
    answer_field: str = opt("answer", "field holding the reference answer")
    template: str = opt(
        "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        "prompt template; {problem} is replaced by the question",
    )
    num_prompts: int = opt(4096, "synthetic prompts generated (kind=arith or pairs)")
    seed: int = opt(0, "seed of the synthetic task and of prompt shuffling")

    def check(self) -> None:
        _one_of("kind", self.kind, DATA_KINDS)
        _one_of("format", self.format, DATA_FORMATS)
        if self.kind == "dataset" and not (self.hf_id or self.path):
            raise ConfigError("path", None, "kind=dataset needs data.path or data.hf_id")
        if self.kind != "dataset":
            for key in ("path", "hf_id"):
                if getattr(self, key):
                    raise ConfigError(
                        key,
                        getattr(self, key),
                        f"read only by data.kind=dataset (kind={self.kind} makes its own "
                        "prompts); add data.kind=dataset",
                    )
        if "{problem}" not in self.template:
            raise ConfigError("template", self.template, "must contain {problem}")
        _positive("num_prompts", self.num_prompts)


@dataclass
class BenchmarkConfig:
    """An evaluation set: a public HF dataset by id, or a local jsonl/parquet file."""

    name: str = opt(MISSING, "benchmark name, used in metric keys eval/<name>/...")
    hf_id: str | None = opt(None, "HF dataset id for users with a network")
    hf_config: str | None = opt(None, "HF dataset config name, if the dataset has several")
    split: str = opt("test", "dataset split")
    path: str | None = opt(
        None,
        "local jsonl/parquet, or shipped:<name> (a file shipped with the package); wins over hf_id",
    )
    id_field: str = opt("id", "field holding the problem id")
    problem_field: str = opt("problem", "field holding the question")
    answer_field: str = opt("answer", "field holding the reference answer")

    def check(self) -> None:
        if not (self.hf_id or self.path):
            raise ConfigError("path", None, "a benchmark needs benchmark.path or benchmark.hf_id")


# -------------------------------------------------------------------------------------- reward

REWARD_GRADERS = ("math", "python")
REWARD_FN_FORMS = "module:function or path/to/file.py:function"


@dataclass
class RewardConfig:
    """How answers are graded (math-verify, or the user's function), and how long it may take."""

    name: str = opt(
        "math",
        "grader: math (last boxed answer vs the reference, math-verify in worker processes; "
        "data=arith/pairs keep their instant exact match) or python (reward.fn)",
    )
    fn: str | None = opt(
        None,
        f"reward=python: the function, {REWARD_FN_FORMS}, called as fn(response, reference, "
        "record) -> float or bool in worker processes (docs/rewards.md)",
    )
    timeout_s: float = opt(
        5.0,
        "hard limit per answer graded (math-verify, or one reward.fn call): past it the worker is "
        "killed and the answer scores 0 (counted in reward/timeouts, eval's grade_timeouts)",
    )
    workers: int = opt(
        4, "grading worker processes: a batch's slow answers are graded this many at once"
    )
    step_budget_s: float | None = opt(
        60.0,
        "training: seconds of grading per step; once spent, the step's answers still waiting for "
        "a worker score 0 (counted in reward/over_budget); null = no limit. Not used by eval",
    )

    def check(self) -> None:
        _one_of("name", self.name, REWARD_GRADERS)
        if self.name == "python":
            target, colon, function = (self.fn or "").rpartition(":")
            if not (colon and target and function):
                raise ConfigError("fn", self.fn, f"reward=python needs reward.fn={REWARD_FN_FORMS}")
        elif self.fn is not None:
            raise ConfigError("fn", self.fn, "only reward=python calls a function; drop reward.fn")
        _positive("timeout_s", self.timeout_s)
        if not 1 <= self.workers <= MAX_GRADER_WORKERS:
            raise ConfigError("workers", self.workers, f"must be within [1, {MAX_GRADER_WORKERS}]")
        if self.step_budget_s is not None:
            _positive("step_budget_s", self.step_budget_s)


MAX_GRADER_WORKERS = 64  # each is a Python process holding sympy (~150 MB)


# ------------------------------------------------------------------------------------- rollout

ENGINES = ("auto", "hf", "vllm")
TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask")
SEQ_MASKS = ("none", "geo", "opsm")  # = algos.correction.SEQ_MASKS (no torch import here)


@dataclass
class RolloutConfig:
    """Generation: engine and sampling parameters."""

    name: str = opt("auto", "engine: auto (vllm on CUDA when it imports, else hf), hf or vllm")
    n: int = opt(8, "samples per prompt (the GRPO group size)")
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    top_k: int = opt(-1, "top-k sampling; -1 = off")
    max_tokens: int = opt(16, "response token budget per sample")
    stop: list[str] = opt([], "stop strings")
    seed: int | None = opt(None, "sampling seed; null = trainer.seed")
    gpu_memory_utilization: float = opt(0.5, "vLLM: share of GPU memory for weights + KV cache")
    tensor_parallel_size: int = opt(1, "vLLM: GPUs per engine")
    enable_sleep_mode: bool = opt(False, "vLLM on CUDA: free the KV cache while training")
    servers: list[str] = opt(  # generation servers (config/servers.py)
        [],
        "staleness.regime=async: URLs of running vLLM generation servers (bapo serve) that "
        "generate instead of a worker process, e.g. [http://127.0.0.1:8001]; [] = none",
    )
    tis_cap: float | None = opt(
        None,
        "truncated importance sampling: weight each token by min(pi_trainer / pi_engine, cap), "
        "correcting the engine/trainer numerical mismatch (vllm; not staleness); null = off",
    )
    tis_level: str = opt(
        "token",
        "rollout.tis_cap per token, or per sequence (one weight: the product of its tokens' "
        "ratios)",
    )
    tis_mode: str = opt(
        "truncate",
        "truncate: weights above rollout.tis_cap become the cap (TIS); mask: tokens (or whole "
        "sequences, tis_level=sequence) above it get weight 0 (MIS)",
    )
    seq_mask: str = opt(
        "none",
        "off-policy sequence masking (algos/correction.py): geo = drop a sequence whose "
        "geometric-mean pi_trainer / pi_engine is outside [1/t, t] (verl's geometric mask); "
        "opsm = drop a negative-advantage sequence whose mean log(pi_old / pi_theta) > t "
        "(DeepSeek-V3.2); t = rollout.seq_mask_threshold",
    )
    seq_mask_threshold: float | None = opt(
        None,
        "rollout.seq_mask's t: geo > 1 (a bound on the geometric-mean ratio), opsm > 0 (nats "
        "per token; the paper gives none, TRL suggests 0.5 to start)",
    )

    def check(self) -> None:
        _one_of("name", self.name, ENGINES)
        if self.n < 1:
            raise ConfigError("n", self.n, "must be >= 1")
        _positive("temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", self.top_p, "must be within (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k", self.top_k, "must be -1 (off) or >= 1")
        _positive("max_tokens", self.max_tokens)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "gpu_memory_utilization", self.gpu_memory_utilization, "must be within (0, 1]"
            )
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ConfigError("tis_cap", self.tis_cap, "must be >= 1 (or null to disable)")
        _one_of("tis_level", self.tis_level, TIS_LEVELS)
        _one_of("tis_mode", self.tis_mode, TIS_MODES)
        _one_of("seq_mask", self.seq_mask, SEQ_MASKS)
        t = self.seq_mask_threshold
        if self.seq_mask != "none" and t is None:
            raise ConfigError("seq_mask_threshold", t, f"required with seq_mask={self.seq_mask}")
        if self.seq_mask == "geo" and not t > 1.0:
            raise ConfigError("seq_mask_threshold", t, "must be > 1 with seq_mask=geo")
        if self.seq_mask == "opsm" and not 0.0 < t < math.inf:
            raise ConfigError("seq_mask_threshold", t, "must be a finite number > 0 with opsm")


# ------------------------------------------------------------------------------ tracking/paths

TRACKING_BACKENDS = ("mlflow", "wandb", "tensorboard")  # bapo_cli.tracking.BACKENDS
WANDB_MODES = ("online", "offline")
# backends whose library comes with the `trackers` extra, and the module each needs
EXTRA_TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (`import wandb` takes a second)."""
    import importlib.util

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


# ------------------------------------------------------------------------------------- trainer


LR_SCHEDULES = ("constant", "cosine")
OLD_LOGPROBS = ("behaviour", "recompute")
STRATEGIES = ("ddp", "fsdp2")
PRECISIONS = (
    "mixed",
    "pure",
)  # bapo_cli.trainer.distributed.STRATEGIES (not imported: keeps torch out)


@dataclass
class TrainerConfig:
    """The RL loop: steps, optimiser, batch shape, checkpoints, validation."""

    max_steps: int = opt(300, "rollout batches to train on")
    lr: float = opt(1e-4, "AdamW learning rate (paper: 1e-6 to 2e-6 for 7B models)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float | None = opt(1.0, "max global grad norm; null = off")
    prompts_per_step: int = opt(32, "prompts per rollout batch (each sampled rollout.n times)")
    micro_batch_size: int = opt(
        64,
        "sequences per forward/backward (gradient accumulation), in arrival order; used when "
        "micro_batch_tokens is null",
    )
    micro_batch_tokens: int | None = opt(
        None,
        "padded tokens (prompt + response) per forward/backward instead of a sample count: each "
        "mini-batch's samples sorted by length and packed greedily under this budget (a sample "
        "longer than the budget gets a micro-batch of its own); null = micro_batch_size",
    )
    logprob_chunk: int = opt(
        256,
        "response tokens per chunk through the output layer when computing log-probs and "
        "entropy (memory ~2 x chunk x vocabulary x 4 bytes, whatever the response length)",
    )
    seed: int = opt(0, "seed of everything (0 is a seed)")
    save_every: int = opt(0, "checkpoint every N steps; 0 = only at the end")
    keep_last: int | None = opt(
        None, "keep only the newest N complete checkpoints (older ones deleted); null = keep all"
    )
    resume: bool = opt(False, "continue from the last checkpoint in the run dir")
    val_every: int = opt(0, "validate every N steps; 0 = never")
    val_benchmarks: list[str] = opt(
        [],
        "validation sets (val_every > 0): arith or pairs (held-out synthetic), a benchmark preset "
        "(aime24, aime25, math500, amc23, minerva_math, olympiadbench) or a local "
        ".jsonl/.json/.parquet",
    )
    val_n: int = opt(4, "samples per validation problem (logged as val/<set>/avg_at_<n>)")
    val_limit: int | None = opt(None, "first N problems of each validation set; null = all")
    log_every: int = opt(1, "log metrics every N steps")
    warmup_steps: int = opt(0, "optimizer updates of linear learning-rate warm-up")
    lr_schedule: str = opt("constant", "after warm-up: constant or cosine (to 10% at the end)")
    old_logprob: str = opt(
        "behaviour",
        "ratio denominator: behaviour (log-prob recorded when the token was sampled) or "
        "recompute (pi_old re-scored by the current weights when the batch is first used: the "
        "proximal policy of decoupled PPO; without algo.behav_weight_cap the behaviour policy's "
        "correction is dropped)",
    )
    log_samples: int = opt(
        4, "samples per step written to samples.jsonl (prompt, response, reward)"
    )
    max_skipped_steps: int = opt(
        5, "consecutive non-finite updates (skipped) before training stops with an error"
    )
    precision: str = opt(
        "mixed",
        "mixed: float32 weights and AdamW state, forwards in model.dtype (autocast; FSDP2's "
        "MixedPrecisionPolicy); pure: weights in model.dtype (half the memory, but bfloat16 "
        "weights round away updates below ~0.4% of a weight, e.g. lr 1e-6)",
    )
    dist_timeout_min: float = opt(
        60.0,
        "under torchrun: minutes a rank waits for the others in a collective before failing (rank "
        "0 validates and writes checkpoints alone; NCCL's own default is 10)",
    )
    strategy: str = opt(
        "ddp",
        "data parallelism under torchrun (bapo train --nproc N): ddp (whole model per rank) or "
        "fsdp2 (parameters, gradients and optimizer state sharded; float32 master weights)",
    )

    def check(self) -> None:
        _positive("max_steps", self.max_steps)
        _one_of("strategy", self.strategy, STRATEGIES)
        _one_of("precision", self.precision, PRECISIONS)
        _positive("dist_timeout_min", self.dist_timeout_min)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("old_logprob", self.old_logprob, OLD_LOGPROBS)
        _positive("log_samples", self.log_samples, allow_zero=True)
        _positive("max_skipped_steps", self.max_skipped_steps)
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)
        _positive("prompts_per_step", self.prompts_per_step)
        _positive("micro_batch_size", self.micro_batch_size)
        if self.micro_batch_tokens is not None:
            _positive("micro_batch_tokens", self.micro_batch_tokens)
        _positive("logprob_chunk", self.logprob_chunk)
        _positive("save_every", self.save_every, allow_zero=True)
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", self.keep_last, "must be >= 1 (or null to keep all)")
        _positive("val_every", self.val_every, allow_zero=True)
        _positive("log_every", self.log_every)
        _positive("val_n", self.val_n)
        if self.val_limit is not None:
            _positive("val_limit", self.val_limit)
        if self.val_every and not self.val_benchmarks:
            raise ConfigError("val_benchmarks", [], "val_every > 0 needs at least one benchmark")


@dataclass
class EvalConfig:
    """Scoring: samples per problem, which k to report, sampling defaults of the paper."""

    n: int = opt(16, "samples per problem (the paper's avg@16)")
    limit: int | None = opt(None, "score only the first N problems (smoke runs); null = all")
    temperature: float = opt(0.6, "sampling temperature")
    top_p: float = opt(0.95, "nucleus sampling mass")
    max_tokens: int = opt(
        32768, "response token budget (sized for reasoning models; capped by model.max_model_len)"
    )
    seed: int = opt(0, "sampling seed")
    template: str = opt(
        "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        "prompt template; {problem} is replaced by the question",
    )
    server: str | None = opt(  # generation servers (config/servers.py)
        None,
        "score the model a running vLLM server serves (bapo serve, or vllm serve with its "
        "flags) at this URL instead of loading its weights here; null = in this process",
    )

    def check(self) -> None:
        if self.n < 1:
            raise ConfigError("n", self.n, "must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("limit", self.limit, "must be >= 1 (or null for all problems)")
        _positive("temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", self.top_p, "must be within (0, 1]")
        _positive("max_tokens", self.max_tokens)
        if "{problem}" not in self.template:
            raise ConfigError("template", self.template, "must contain {problem}")


# ----------------------------------------------------------------------------------- top level

GROUP_ADVANTAGES = ("grpo", "drgrpo", "rloo")


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
        if self.algo.advantage in GROUP_ADVANTAGES and self.rollout.n < 2:
            raise ConfigError(
                "rollout.n",
                self.rollout.n,
                f"algo.advantage={self.algo.advantage} compares samples of one prompt: needs >= 2",
            )
        cap = self.algo.behav_weight_cap
        if cap is not None and self.trainer.old_logprob != "recompute":
            raise ConfigError(
                "algo.behav_weight_cap",
                cap,
                "needs trainer.old_logprob=recompute (the proximal policy it divides by)",
            )
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
        _regime(self.staleness.regime).check_run(self)  # the regime's rules across groups


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
        server_rules.check_eval(self)  # generation servers (config/servers.py)


# ---------------------------------------------------------------------------------- validation


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
    import yaml

    from bapo_cli.config.hydra_runner import config_dir

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
    import typing

    hint = typing.get_type_hints(owner)[f.name]
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate  # type: ignore[return-value]
    return None
