"""Which servers serve a running job (`rollout.servers_file=PATH`): the file is read again
before each unit, and the URLs added to it join the run while the URLs taken out of it leave.
This module is the file and the difference; `ServerPool.join` / `leave` act on it.

The file: one `http(s)://HOST:PORT` a line, as `bapo serve` prints it; blank lines and lines
starting with `#` are skipped. A file that cannot be used (gone, unreadable, a line that is no
server URL, a URL twice, no URL at all) is one line naming the file and the line: refused at
start (`bapo train` checks it before the run dir), a warning mid-run, where the run keeps the
servers it has (a half-written file must never stop a run or drop its servers). The same fault
is warned of once, until the file changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.servers import check_url

KEY = "rollout.servers_file"


class ServersFileError(ValueError):
    """The servers file cannot be used; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class Change:
    """What a new reading of the file changes: servers to take in, servers to let go."""

    joins: tuple[str, ...]
    leaves: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.joins or self.leaves)


def parse(text: str, path: str) -> list[str]:
    """The URLs a servers file lists, in order, each as the pool names it (no trailing `/`);
    ServersFileError (one line, naming `path` and the line) for anything else."""
    urls: list[str] = []
    first: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            check_url(KEY, line)
        except ConfigError:
            raise ServersFileError(
                f"{KEY} {path} line {number}: {line!r} is not a server URL; give one "
                "http://HOST:PORT a line, as `bapo serve` prints it (# starts a comment line)"
            ) from None
        url = line.rstrip("/")
        if url in first:
            raise ServersFileError(
                f"{KEY} {path} line {number} names {url} again (line {first[url]}); list each "
                "server once"
            )
        first[url] = number
        urls.append(url)
    if not urls:
        raise ServersFileError(
            f"{KEY} {path} lists no server; give one http://HOST:PORT a line (a run needs one)"
        )
    return urls


def read(path: Path | str) -> list[str]:
    """`parse` of the file at `path`; a file that is gone or unreadable is a ServersFileError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ServersFileError(
            f"{KEY} {path} does not exist; write the servers' URLs there, one a line"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ServersFileError(f"{KEY} {path} cannot be read ({why})") from None
    return parse(text, str(path))


def diff(current: Sequence[str], wanted: Sequence[str]) -> Change:
    """Servers in `wanted` and not in `current` join, in the file's order; servers in `current`
    and not in `wanted` leave, in the pool's."""
    have, want = set(current), set(wanted)
    return Change(
        joins=tuple(u for u in wanted if u not in have),
        leaves=tuple(u for u in current if u not in want),
    )


class ServersFile:
    """The file as a running job reads it: `poll` before each unit (module docstring)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._warned: str | None = None  # the fault last warned of (warned once)

    def poll(self, current: Sequence[str]) -> tuple[Change, str | None]:
        """The change the file asks for against the servers `current`, and a warning line when
        the file cannot be used (no change then: the run keeps its servers)."""
        try:
            wanted = read(self.path)
        except ServersFileError as exc:
            line = (
                f"{exc}; the run keeps its {len(current)} server{'s' if len(current) != 1 else ''}"
            )
            if line == self._warned:
                return Change((), ()), None
            self._warned = line
            return Change((), ()), line
        self._warned = None
        return diff(current, wanted), None
