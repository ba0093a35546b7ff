"""The `rollout` group: the generation engine, sampling, and the corrections of the
engine/trainer mismatch (truncated importance sampling, sequence masks)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt

ENGINES = ("auto", "hf", "vllm")
TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask", "mask_two_sided")
# = algos.correction.SEQ_MASKS (no torch import here)
SEQ_MASKS = ("none", "geo", "opsm", "icepop", "kpop")


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
    min_servers: int | None = opt(
        None,
        "rollout.servers: how many must answer (and serve the run's model) for the run to start; "
        "the others are warned of, then taken in when they answer; null = all for a new run, 1 "
        "for a resume (trainer.resume=true), docs/engines.md",
    )
    servers_file: str | None = opt(
        None,
        "rollout.servers: a file of server URLs, one a line, read again before each unit: a URL "
        "added joins the run (checked, given the newest weights, then sent requests), a URL "
        "taken out leaves it (after the unit in flight); the run starts on rollout.servers; "
        "null = the servers are fixed, docs/engines.md",
    )
    server_stall_s: float = opt(
        30.0,
        "rollout.servers, eval.server: a server holding requests that does not answer GET "
        "/health within this many seconds (asked every 10 s) is stalled: marked down, its "
        "requests re-sent to the others; 0 = never asked (a request waits its whole 600 s)",
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
        "sequences, tis_level=sequence) above it get weight 0 (MIS); mask_two_sided: also those "
        "below 1 / tis_cap (verl's rollout_rs rejection, which is two-sided)",
    )
    seq_mask: str = opt(
        "none",
        "off-policy sequence and token masking (algos/correction.py): geo = drop a sequence "
        "whose geometric-mean pi_trainer / pi_engine is outside [1/t, t] (verl's geometric "
        "mask); opsm = drop a negative-advantage sequence whose mean log(pi_old / pi_theta) > t "
        "(DeepSeek-V3.2); icepop = drop a token whose pi_trainer / pi_engine is outside "
        "[rollout.seq_mask_low, t] (IcePop: [0.5, 5]); kpop = drop a token whose Bernoulli KL "
        "between pi_prox and pi_behav, the larger of both directions, exceeds t (AReaL's KPop: "
        "2.0; needs trainer.old_logprob=recompute); t = rollout.seq_mask_threshold; dropped "
        "tokens keep their place in the loss's normaliser (weight 0)",
    )
    seq_mask_threshold: float | None = opt(
        None,
        "rollout.seq_mask's t: geo > 1 (a bound on the geometric-mean ratio), opsm > 0 (nats "
        "per token; the paper gives none, TRL suggests 0.5 to start), icepop > 1 (the ratio's "
        "upper bound; IcePop: 5), kpop > 0 (nats; AReaL's KPop: 2.0)",
    )
    seq_mask_low: float | None = opt(
        None,
        "rollout.seq_mask=icepop: the ratio's lower bound, within (0, 1) (IcePop: 0.5); null = "
        "1 / rollout.seq_mask_threshold",
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
        _positive("server_stall_s", self.server_stall_s, allow_zero=True)
        if self.min_servers is not None and self.min_servers < 1:
            raise ConfigError("min_servers", self.min_servers, "must be >= 1 (or null)")
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ConfigError("tis_cap", self.tis_cap, "must be >= 1 (or null to disable)")
        _one_of("tis_level", self.tis_level, TIS_LEVELS)
        _one_of("tis_mode", self.tis_mode, TIS_MODES)
        _one_of("seq_mask", self.seq_mask, SEQ_MASKS)
        t = self.seq_mask_threshold
        if self.seq_mask == "none" and t is not None:  # a threshold that would mask nothing
            raise ConfigError(
                "seq_mask_threshold",
                t,
                "set while rollout.seq_mask=none, so nothing is masked; choose rollout.seq_mask="
                "geo, opsm, icepop or kpop, or drop the threshold (null)",
            )
        if self.seq_mask != "none" and t is None:
            raise ConfigError("seq_mask_threshold", t, f"required with seq_mask={self.seq_mask}")
        if self.seq_mask == "geo" and not t > 1.0:
            raise ConfigError("seq_mask_threshold", t, "must be > 1 with seq_mask=geo")
        if self.seq_mask in ("opsm", "kpop") and not 0.0 < t < math.inf:
            raise ConfigError(
                "seq_mask_threshold", t, f"must be a finite number > 0 with {self.seq_mask}"
            )
        if self.seq_mask == "icepop" and not 1.0 < t < math.inf:
            raise ConfigError("seq_mask_threshold", t, "must be a finite number > 1 with icepop")
        low = self.seq_mask_low
        if low is not None and self.seq_mask != "icepop":
            raise ConfigError(
                "seq_mask_low",
                low,
                "is icepop's lower bound: set rollout.seq_mask=icepop, or drop it (null)",
            )
        if low is not None and not 0.0 < low < 1.0:
            raise ConfigError("seq_mask_low", low, "must be within (0, 1)")
