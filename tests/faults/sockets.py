"""What a process tree listens on, read from /proc as `ss -ltnp` reads it (Linux).

`Listening.sample(root_pid)` adds, each time it is called, every TCP socket in LISTEN state held
by `root_pid` or a descendant: (address, port, process name). Sampled in a loop while a launch
runs, it sees the stores and the gloo listeners of the agent and of every rank.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def descendants(root: int) -> set[int]:
    """`root` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _socket_inodes(pids: set[int]) -> dict[int, str]:
    """socket inode -> the name of a process holding it."""
    held = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                held[int(link[8:-1])] = name
    return held


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} local address (host byte order per 32-bit word) -> text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@dataclass
class Listening:
    seen: set[tuple[str, int, str]] = field(default_factory=set)

    def sample(self, root: int) -> None:
        held = _socket_inodes(descendants(root))
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                rows = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == LISTEN and inode in held:
                    host, port = local.split(":")
                    self.seen.add((_address(host), int(port, 16), held[inode]))

    def exposed(self) -> set[tuple[str, int, str]]:
        """The sockets seen listening on anything but the loopback (`0.0.0.0`, `::`, an
        interface's address)."""
        return {s for s in self.seen if not is_loopback(s[0])}
