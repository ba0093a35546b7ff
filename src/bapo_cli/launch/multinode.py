"""Data-parallel launch over one or more machines: torchrun's command line and its checks.

No new infrastructure: PyTorch's own launcher (torchrun) starts the processes on each node and
they meet at a rendezvous; `bapo_cli.trainer.distributed` does the rest (gloo / NCCL process
group, DDP or FSDP2), exactly as on one node.

    bapo train --nproc 2 ...                     one node, 2 processes (store on 127.0.0.1 only)
    bapo train --nnodes 2 --nproc 8 --rdzv-endpoint HEAD:29500 ...        on each of 2 nodes
    bapo train --nnodes 2 --nproc 8 --node-rank 1 --rdzv-endpoint HEAD:29500 ...   fixed ranks
    bapo train --nnodes 4 --nproc 8 --slurm-script job.sh ...   an sbatch script (slurm.py)

Rendezvous: without `--node-rank` the nodes meet through torchrun's c10d rendezvous (a TCP store
at the endpoint; the node whose address is HOST hosts it, the others connect) and are given their
ranks in the order they join, so any node may become global rank 0 (the one that writes the run
dir, checkpoints and MLflow; the others receive its run dir). torchrun ignores `--node-rank` with
c10d, so `--node-rank I` selects its static rendezvous instead: node I holds global ranks
I*G .. I*G+G-1 and node 0 must run on HOST, which then is the master address. Either way every
node must run the same command (same overrides), and they must see the same file system for the
run dir to be shared (only rank 0 writes into it).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import dataclass

DEFAULT_PORT = 29500


class LaunchError(ValueError):
    """A launch flag that cannot work; the message names it and what is allowed."""


@dataclass(frozen=True)
class Topology:
    """Where the processes run: `nnodes` machines × `nproc` processes each."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int | None = None  # None: c10d rendezvous assigns node ranks
    endpoint: str | None = None  # HOST:PORT of the rendezvous (multi-node)

    def check(self, *, script: bool = False) -> None:
        """One-line errors for flags that cannot work (`script`: a SLURM script is written, so
        the endpoint and node rank come from the allocation)."""
        if self.nproc < 1:
            raise LaunchError(f"--nproc {self.nproc}: processes per node must be >= 1")
        if self.nnodes < 1:
            raise LaunchError(f"--nnodes {self.nnodes}: must be >= 1")
        if self.endpoint is not None:
            parse_endpoint(self.endpoint)  # what is wrong with it, before where it may go
        if script:
            if self.node_rank is not None or self.endpoint is not None:
                raise LaunchError(
                    "--slurm-script with --node-rank / --rdzv-endpoint: the script takes both "
                    "from the SLURM allocation; drop them"
                )
            return
        if self.nnodes == 1:
            if self.node_rank is not None or self.endpoint is not None:
                raise LaunchError(
                    "--node-rank / --rdzv-endpoint need --nnodes > 1 (one node rendezvous "
                    "with itself)"
                )
            return
        if self.endpoint is None:
            raise LaunchError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (a node all of them "
                "reach; node 0's address with --node-rank)"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank}: must be within 0 .. {self.nnodes - 1} "
                f"(--nnodes {self.nnodes})"
            )


ENDPOINT_FORM = (
    "HOST:PORT (HOST a host name, an IPv4 address or a bracketed IPv6 address as in "
    "[::1]:29500; PORT 1-65535 in ASCII digits, no leading zeros)"
)
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)


@dataclass(frozen=True)
class Endpoint:
    """A checked `--rdzv-endpoint`: `host` is a host name, IPv4 or IPv6 address (no brackets)."""

    host: str
    port: int

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    def __str__(self) -> str:
        """As torchrun's `--rdzv-endpoint` takes it (its parser strips IPv6 brackets)."""
        return f"[{self.host}]:{self.port}" if self.ipv6 else f"{self.host}:{self.port}"


def parse_endpoint(endpoint: str) -> Endpoint:
    """`HOST:PORT` → Endpoint, or a one-line LaunchError saying what is wrong with it.

    Checked here because torch's own parser lets through what then fails late: a port in
    full-width digits or with leading zeros ends in a traceback, `host:29500:1` is taken as the
    host `host:29500` and waits 45 s on a name that never resolves."""
    shown = endpoint if endpoint.isascii() and endpoint.isprintable() else ascii(endpoint)

    def bad(why: str) -> LaunchError:
        return LaunchError(f"--rdzv-endpoint {shown}: {why}; give {ENDPOINT_FORM}")

    if not (endpoint.isascii() and endpoint.isprintable()) or any(c.isspace() for c in endpoint):
        raise bad("holds a space or a character outside printable ASCII")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        raise bad("no HOST:PORT")
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise bad(f"the port {port or '(empty)'} is not 1-65535 without leading zeros")
    if host.startswith("[") and host.endswith("]"):
        address = host[1:-1]
        if "%" in address:
            raise bad("an IPv6 zone index (%...) is not understood by torchrun's rendezvous")
        try:
            parsed = ipaddress.IPv6Address(address)
        except ValueError:
            raise bad(f"{host} is not an IPv6 address") from None
        return Endpoint(str(parsed), int(port))
    if ":" in host or "[" in host or "]" in host:
        raise bad(f"{host} is not a host name or an IPv4 address (an IPv6 address goes in [])")
    labels = host.split(".")
    if labels[-1].isdigit():  # RFC 1123 2.1: a name never looks like a dotted number
        try:
            return Endpoint(str(ipaddress.IPv4Address(host)), int(port))
        except ValueError:
            raise bad(f"{host} is not an IPv4 address") from None
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise bad(f"{host} is not a host name")
    return Endpoint(host, int(port))


def launched_already(flags: list[str], world_size: str | None = None) -> str:
    """The line for launch flags given to a process that WORLD_SIZE says is already one rank of
    a launch (torchrun's, or a variable left in the shell): they would be ignored and the run
    would train as that rank, or alone."""
    world_size = os.environ.get("WORLD_SIZE", "") if world_size is None else world_size
    shown = world_size if world_size.isascii() and world_size.isprintable() else ascii(world_size)
    return (
        f"{' / '.join(flags)} with WORLD_SIZE={shown} in the environment: this process is "
        "already a rank of a launch, so they would be ignored; drop them (under torchrun), or "
        "unset WORLD_SIZE to launch from here"
    )


def host_port(endpoint: str) -> tuple[str, int]:
    """`HOST:PORT` → (host, port), the host without IPv6 brackets; a one-line error for
    anything else (parse_endpoint)."""
    checked = parse_endpoint(endpoint)
    return checked.host, checked.port


LOOPBACK_MODULE = "bapo_cli.launch.loopback"
LOOPBACK_BACKEND = "bapo-loopback"
"""One node: torchrun run by bapo_cli.launch.loopback, whose rendezvous backend of this name
keeps the TCP store on 127.0.0.1 (torchrun's own, `--standalone`, listens on every interface)."""


def torchrun_args(topo: Topology) -> list[str]:
    """torchrun's own flags for `topo`: one node's store on the loopback; c10d, or static with
    a node rank, across nodes (a bracketed IPv6 HOST stays bracketed in `--rdzv-endpoint` and
    loses its brackets in `--master-addr`, as torchrun parses each)."""
    per_node = f"--nproc-per-node={topo.nproc}"
    if topo.nnodes == 1:
        return [
            "--nnodes=1",
            per_node,
            f"--rdzv-backend={LOOPBACK_BACKEND}",
            "--rdzv-endpoint=127.0.0.1:0",
        ]
    args = [f"--nnodes={topo.nnodes}", per_node]
    endpoint = parse_endpoint(topo.endpoint or "")
    if topo.node_rank is None:
        return [*args, "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    return [
        *args,
        "--rdzv-backend=static",
        f"--node-rank={topo.node_rank}",
        f"--master-addr={endpoint.host}",
        f"--master-port={endpoint.port}",
    ]


def torchrun_command(topo: Topology, program: list[str]) -> list[str]:
    """The full command: this python's torchrun with `topo`'s flags, running `program`
    (`["-m", "bapo_cli", "train", ...]` for bapo, or a script and its arguments)."""
    launcher = LOOPBACK_MODULE if topo.nnodes == 1 else "torch.distributed.run"
    return [sys.executable, "-m", launcher, *torchrun_args(topo), *program]


def train_program(overrides: list[str]) -> list[str]:
    """What each torchrun process runs: `bapo train` with the same overrides."""
    return ["-m", "bapo_cli", "train", *overrides]
