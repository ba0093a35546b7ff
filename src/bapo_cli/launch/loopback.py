"""One machine's torchrun whose TCP store listens on 127.0.0.1 only: what `bapo train --nproc N`
runs (`python -m bapo_cli.launch.loopback <torchrun's flags> -m bapo_cli train ...`).

Why not `torchrun --standalone`: its c10d rendezvous creates two TCP stores (the rendezvous's and
the one it shares with the ranks), and PyTorch's TCPStore server binds every interface, IPv4 and
IPv6 (`*:PORT` in `ss -ltn`), whatever host it is given; `--rdzv-endpoint=127.0.0.1:PORT`,
`--master-addr` and `--local-addr` only change the address the ranks connect to. Anyone who
reaches the machine could then talk to an unauthenticated store while the run lasts (read and
write its keys; the c10d rendezvous keeps its state there pickled). A single node needs no
other interface, so this launcher is torchrun itself (`torch.distributed.run.main`) with one
rendezvous backend added, `bapo-loopback`: torchrun's static rendezvous for one node, whose
store is handed a socket already bound to 127.0.0.1 (TCPStore's `master_listen_fd`). The ranks
connect to that one store (torchrun's agent store: MASTER_ADDR=127.0.0.1); gloo's and NCCL's
own sockets are kept on the loopback interface too (`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME`,
unless already set).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from bapo_cli.launch.forward import exit_quietly_on_signal
from bapo_cli.launch.multinode import LOOPBACK_BACKEND as BACKEND
from bapo_cli.quick_exit import skip_last_collection

HOST = "127.0.0.1"
STORE_TIMEOUT_S = 600  # torchrun's static rendezvous default


class LoopbackRendezvous(StaticTCPRendezvous):
    """torchrun's static rendezvous of a single node, its store bound to 127.0.0.1."""

    def __init__(self, run_id: str, timeout: int) -> None:
        super().__init__(HOST, 0, 0, 1, run_id, timeout)

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> Any:
        if self._store is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((HOST, 0))
            listener.listen(socket.SOMAXCONN)
            self.master_port = listener.getsockname()[1]
            self._store = TCPStore(
                HOST,
                self.master_port,
                1,
                True,
                self.timeout,
                multi_tenant=True,
                master_listen_fd=listener.detach(),  # the store owns the socket from here
            )
        return super().next_rendezvous()  # the store exists: it only wraps it


def _create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError(f"--rdzv-backend={BACKEND} is for one node (--nnodes=1)")
    return LoopbackRendezvous(params.run_id, STORE_TIMEOUT_S)


def loopback_interface() -> str | None:
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS), None if neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def keep_sockets_local(env: Any = os.environ) -> None:
    """gloo and NCCL bind their own sockets to the interface of the host name unless told
    otherwise; one node talks to itself over the loopback."""
    lo = loopback_interface()
    if lo is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", lo)
        env.setdefault("NCCL_SOCKET_IFNAME", lo)


def main(argv: list[str] | None = None) -> None:
    """torchrun (`torch.distributed.run.main`) with the `bapo-loopback` backend registered.

    OMP_NUM_THREADS=1 for several processes, as torchrun would set it, without its banner on
    the console (bapo prints the thread count it trains with). A stop signal the agent passed
    on to the ranks ends it with 128 + N, without a traceback."""
    from torch.distributed import run

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    keep_sockets_local()
    args = run.parse_args(sys.argv[1:] if argv is None else argv)
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        exit_quietly_on_signal(lambda: record(run.run)(args))
    finally:
        skip_last_collection()  # the agent ends: its objects are the OS's to free


if __name__ == "__main__":
    main()
