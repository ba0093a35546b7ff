"""The `staleness` group: how far the behaviour policy lags the policy being updated.

The valid regimes and their rules are the regime classes of `bapo_cli.staleness.regimes.REGIMES`
(`check` on this group, `check_run` across groups, called by `TrainConfig.check`). staleness sits
above config (its regimes import `ConfigError` and `TrainConfig`), so the registry is loaded by name
through the plug-in point `bapo_cli.config.registries`, not imported: a new regime is its class
and needs no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo_cli.config import registries
from bapo_cli.config import servers as server_rules
from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt


def regime_class(name: str) -> Any:
    """The regime class registered as `name` (`bapo_cli.staleness.regimes.REGIMES`): it holds the
    regime's config rules (`check`, `check_run`), so a new regime needs no edit here."""
    return registries.load(registries.REGIMES, "REGIMES").get(name)


def regime_names() -> tuple[str, ...]:
    return tuple(registries.load(registries.REGIMES, "REGIMES").registered())


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
        "rollout.servers) | nccl (vLLM's NCCL weight transfer, GPU to GPU; CUDA only; built, "
        "not run: docs/engines.md) | gloo (the same protocol over a gloo group: any device, "
        "servers started with bapo serve --weights gloo)",
    )
    nccl_master: str = opt(
        "127.0.0.1:29555",
        "nccl, gloo: HOST:PORT of the weight group's rendezvous, opened by the trainer (its "
        "address as every server reaches it; not torchrun's port)",
    )
    weights_timeout_s: float = opt(
        60.0,
        "gloo: how long the weight group waits for a member (its rendezvous, each broadcast; "
        "the servers' side too) before the push fails: a server that stopped mid-push costs "
        "at most this, then it is marked down and the group re-formed over the others; "
        "longer than one tensor's broadcast to every server (docs/engines.md)",
    )
    weights_dir: str | None = opt(
        None,
        "filesystem: where versions are written, each run under its own run-<id> subdirectory "
        "(every server must read it: a shared filesystem across machines); null = "
        "<run dir>/weights",
    )
    weights_delta: bool = opt(
        False,
        "filesystem: write each version as what changed since the one before, in the servers' "
        "dtype, where that is fewer bytes than every tensor (a full version at the start, every "
        "staleness.weights_full_every and after a server comes back); for versions that cross a "
        "slow link (a shared filesystem between machines), not a local disk: docs/engines.md",
    )
    weights_full_every: int = opt(
        10, "filesystem with weights_delta: every how many versions one is written full"
    )
    probe_tolerance: float | None = opt(
        None,
        "servers: the largest |server - trainer| log-prob (nats) of the probe text after a weight "
        "push before the run stops (the server does not hold its weights); null = auto: 0.01 "
        "when the trainer and every server compute in float32, 1.0 when either uses bf16/fp16 "
        "(their kernels round differently; docs/engines.md)",
    )

    def check(self) -> None:
        _positive("k", self.k, allow_zero=True)
        _one_of("regime", self.regime, regime_names())
        _positive("ppo_epochs", self.ppo_epochs)
        regime_class(self.regime).check(self.k, self.ppo_epochs)
        _one_of("weights", self.weights, server_rules.WEIGHT_TRANSPORTS)
        if self.probe_tolerance is not None:
            _positive("probe_tolerance", self.probe_tolerance)
        _positive("weights_full_every", self.weights_full_every)
        _positive("weights_timeout_s", self.weights_timeout_s)
        if self.weights_delta and self.weights != "filesystem":
            raise ConfigError(
                "weights_delta",
                True,
                "writes versions as files for generation servers: needs "
                "staleness.weights=filesystem",
            )
        if self.interrupt and self.regime != "async":
            raise ConfigError(
                "interrupt",
                True,
                "pauses the responses a generation worker is sampling when new weights arrive; "
                "only staleness.regime=async has a worker (in one process, staleness.regime="
                "partial continues responses with newer weights)",
            )
