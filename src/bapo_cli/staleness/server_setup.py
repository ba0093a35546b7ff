"""The async regime's servers as a run configures them, and the pools made over them: what
`rollout.servers` and `staleness.*` say (`ServerSettings`, read once, so the run plan and the run
agree), where a run's versions are written (`weights_root`), the pool of each data-parallel rank
(`make_pool`; `FollowerPool` for the ranks that never push) and the look `bapo train` takes
before its run dir is claimed (`preflight`). The generation itself: `staleness.servers`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo_cli.config.servers import check_master
from bapo_cli.rollout import lease, membership, weights_fs
from bapo_cli.rollout.claims import Owner
from bapo_cli.rollout.pools import pool_for
from bapo_cli.rollout.quorum import Quorum
from bapo_cli.rollout.servers import ServerError, ServerPool, ServerTaken
from bapo_cli.rollout.weights_transfer import TRANSPORTS, TransferPool

__all__ = ["FollowerPool", "ServerSettings", "make_pool", "preflight", "weights_root"]


@dataclass(frozen=True)
class ServerSettings:
    """The async regime's servers and how weights reach them, read from the config once (`of`):
    the run plan describes them and the run uses them."""

    urls: tuple[str, ...]
    model: Any  # ModelConfig: the model every server must serve
    weights: str  # filesystem | nccl | gloo
    weights_dir: str | None  # staleness.weights_dir (None: the run dir's weights/)
    nccl_master: str | None
    stall_s: float
    timeout_s: float  # staleness.weights_timeout_s: the gloo group's wait for a member
    interrupt: bool
    probe_tolerance: float | None  # None: chosen from the dtypes at the first push
    quorum: Quorum  # how many must answer at start (rollout.min_servers)
    servers_file: str | None = None  # rollout.servers_file: read before each unit (join, leave)
    delta: bool = False  # staleness.weights_delta: versions as deltas when fewer bytes
    full_every: int = 10  # staleness.weights_full_every

    @classmethod
    def of(cls, cfg: Any) -> ServerSettings | None:
        """From a TrainConfig; None without rollout.servers."""
        if not cfg.rollout.servers:
            return None
        staleness = cfg.staleness
        return cls(
            urls=tuple(cfg.rollout.servers),
            model=cfg.model,
            weights=staleness.weights,
            weights_dir=staleness.weights_dir,
            nccl_master=staleness.nccl_master,
            stall_s=float(cfg.rollout.server_stall_s),
            timeout_s=float(staleness.weights_timeout_s),
            interrupt=bool(staleness.interrupt),
            probe_tolerance=staleness.probe_tolerance,
            quorum=Quorum.of(
                cfg.rollout.min_servers,
                len(cfg.rollout.servers),
                resume=bool(cfg.trainer.resume),
                every=staleness.weights == "nccl",
            ),
            servers_file=cfg.rollout.servers_file,
            delta=bool(staleness.weights_delta),
            full_every=int(staleness.weights_full_every),
        )

    def describe(self) -> str:
        """The run plan's line: the servers, how weights reach them, whether a push pauses."""
        if self.weights in TRANSPORTS:
            transport = TRANSPORTS[self.weights]
            weights = f"weights by {transport.label} through vLLM's weight transfer (group at "
            weights += f"{self.nccl_master}"
            if transport.timed:  # what a member that stops mid-push costs
                weights += f", a member waited for {self.timeout_s:g} s at most"
            weights += ")"
        else:
            weights = f"weights by file under {self.weights_dir or '<run dir>/weights'}"
            if self.delta:  # rollout.weights_delta says when a version is written full
                weights += (
                    ", each version as a delta where fewer bytes than the full one (full at the "
                    f"start, after a server comes back, and every {self.full_every})"
                )
        pause = "; a push pauses responses mid-way (interrupt)" if self.interrupt else ""
        quorum = self.quorum.describe()
        count = len(self.urls)
        joins = f"; then those {self.servers_file} lists" if self.servers_file else ""
        return (
            f"{count} vLLM server{'s' if count > 1 else ''} ({', '.join(self.urls)}"
            f"{'; ' + quorum if quorum else ''}{joins}), {weights}{pause}"
        )


def weights_root(settings: ServerSettings, run_dir: Path | None) -> Path:
    """Where this run's versions are written: `<staleness.weights_dir>/run-<id>` (a directory of
    its own, named for the run's identity: two runs given one weights_dir never touch each
    other's versions, and a resumed run finds its own), else `<run dir>/weights`; absolute,
    since the servers read the paths the trainer sends from their own working directories."""
    if run_dir is None:
        raise ValueError("the weights directory is named for the run: it needs the run dir")
    if settings.weights_dir is not None:
        run = Owner.of_run(run_dir).run
        key = hashlib.sha256(run.encode()).hexdigest()[:12]
        return (Path(settings.weights_dir).expanduser() / f"run-{key}").resolve()
    return (Path(run_dir) / "weights").resolve()


class FollowerPool(ServerPool):
    """The pool of a data-parallel rank other than 0: it sends requests but never loads weights
    (rank 0 does, module docstring); `adopt` takes rank 0's word after each push."""

    def push(self, directory: Path | None, version: int, *, interrupt: bool) -> None:
        raise RuntimeError("a follower rank's pool does not push weights (rank 0 does)")

    @property
    def newest_version(self) -> int | None:
        """Rank 0 may have pushed the next version before this rank adopts it (`_share`), never
        the one after: that push follows a step this rank takes part in."""
        return self.version + 1

    def adopt(self, version: int, alive: list[str]) -> None:
        """Rank 0 pushed `version` to the servers `alive`: the others are down here too (they
        come back through `revive`, once they hold it)."""
        with self.lock:
            self.version = version
            for server in self.servers:
                if server.url in alive:
                    server.version = version
                else:
                    self._down(server, ServerError(f"it missed rank 0's push of version {version}"))

    def _load_revived(self, server: Any) -> None:
        held = self.held_version(server)
        if held < self.version:
            raise ServerError(f"{server.url} holds version {held}, not yet {self.version}")
        server.version = held


def make_pool(
    settings: ServerSettings,
    root: Path | None = None,
    *,
    follower: bool = False,
    owner: Owner | None = None,
) -> ServerPool:
    """The pool over the servers (`pool_for`); `follower`: a data-parallel rank other than 0
    (`FollowerPool`); rank 0 under staleness.weights=nccl|gloo a `TransferPool`; `owner`: the
    run that claims the servers (rank 0's), None to claim nothing (the preflight's look)."""
    options: dict[str, Any] = {"weights_dir": root, "owner": owner}
    kind: type[ServerPool] = FollowerPool if follower else ServerPool
    if settings.weights in TRANSPORTS and not follower:  # rank 0 pushes through vLLM's API
        host, port = check_master("staleness.nccl_master", settings.nccl_master)
        kind = TransferPool  # on the policy's device, set by ServerWorker._start
        options.update(transport=settings.weights, device="cpu", master_address=host)
        options.update(master_port=port, timeout_s=settings.timeout_s)
    return pool_for(
        settings.urls,
        settings.model,
        stall_s=settings.stall_s,
        fingerprint=owner is not None,
        kind=kind,
        **options,
    )


def preflight(cfg: Any) -> None:
    """What the CLI asks before the run dir is claimed (no weights loaded): the weights directory
    can be written, enough servers answer (`rollout.min_servers`), every one that does serves the
    run's model and is held by no other run (a look, no claim: the run claims its servers when it
    starts; a resumed run may find its own killed process holding them, which it takes over
    then). `ServerError` or `weights_fs.WeightsDirError`, one line each; nothing for a run
    without servers. The servers that do not answer are warned of when the run starts."""
    settings = ServerSettings.of(cfg)
    if settings is None:
        return
    if settings.servers_file is not None:
        try:
            membership.read(settings.servers_file)
        except membership.ServersFileError as exc:
            raise ServerError(str(exc)) from None
    if settings.weights_dir is not None:
        weights_fs.check_writable(Path(settings.weights_dir).expanduser())
    pool = make_pool(settings)
    pool.check(settings.quorum)
    if cfg.trainer.resume:
        return
    hint = Owner("", "train").refused_hint()
    for server in (s for s in pool.servers if s.alive):
        state = pool.rpc(server.url, "bapo_leases", [])
        holders = state[0].get("holders", []) if state else []
        if holders:
            first = min(holders, key=lambda h: (h.get("kind") != "train", -h.get("left_s", 0)))
            answer = {"holder": first.get("run"), "kind": first.get("kind")}
            raise ServerTaken(lease.refusal(server.url, answer | first, hint))
