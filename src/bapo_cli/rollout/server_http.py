"""The HTTP client of the generation servers: one JSON request, bounded in what it reads and in
how long it waits, whatever the server sends.

    answer = call(url, "POST", "/collective_rpc", {"method": "bapo_model_info"}, CHECK_TIMEOUT_S)

**Bytes.** A body is read in chunks against a cap (`limit`), and refused past it
(`ServerFault`): an endless body costs at most the cap. Control routes (health, model info,
pause, ...) answer in well under a kilobyte: `CONTROL_LIMIT`, 1 MiB. A generate answer is capped
by what was asked (`generate_limit`): `GENERATE_FIXED` (64 KiB) plus `PER_TOKEN` (1 KiB) per
prompt token and per token asked for (vLLM 0.32 sends ~140 bytes per generated token, ~80 per
prompt token with log-probs). An error answer's body is read up to `DETAIL_LIMIT` for its
message.

**Time.** `timeout` is the wall clock of the whole call (connect, send, status, headers, body),
not a per-read timeout that a server dripping a byte every few seconds renews forever: each read
waits at most what is left, in slices of `SLICE_S`, so `cancel` (anything with `is_set()`: the
pool closed, the generation given up) is seen within a slice. Past the deadline, `Unreachable`
("no complete answer within N s").

**Slow or stalled** (`Watch`). A generation request may rightly run for minutes, so its deadline
is long (`servers.REQUEST_TIMEOUT_S`); a stopped server (SIGSTOP, a hung host) must not hold it
that long. While a watched call waits, its server is asked `GET /health` every `HEALTH_EVERY_S`
(once per server, whichever of its calls is due); vLLM answers health from its API process
whatever the engine is doing, so a server that does not answer within `stall_s` is stalled:
every call to it waiting since before that probe raises `Stalled` (an `Unreachable`: the pool
marks the server down and re-sends its requests whole to the others).

Errors, each one line: `Unreachable` (refused, reset; `TooLate`: no answer in time; `Stalled`),
`HTTPStatus` (an error status), `ServerFault` (an answer no healthy server sends: over the cap,
not JSON; the pool adds wrong shapes and values), `Cancelled` (`cancel` was set).
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
import urllib.parse
from typing import Any, Protocol

from bapo_cli.rollout import server_auth

CHECK_TIMEOUT_S = 10.0  # start-up questions and control calls on a healthy server take < 1 s
CONTROL_LIMIT = 1 << 20  # bytes: a control route's answer (model info, models list, pause, ...)
DETAIL_LIMIT = 4096  # bytes of an error answer read for its message
GENERATE_FIXED = 64 << 10  # bytes: a generate answer's envelope (ids, usage, metrics)
PER_TOKEN = 1 << 10  # bytes per prompt token and per token asked for (vLLM: ~80-140)
SLICE_S = 0.5  # longest single wait on the socket: how soon `cancel` and the watch are seen
HEALTH_EVERY_S = 10.0  # a server holding a watched call is asked GET /health this often
STALL_S = 30.0  # ... and is stalled when it does not answer within this (rollout.server_stall_s)
CHUNK = 64 << 10


class Flag(Protocol):
    """What `cancel` is asked: a threading.Event, or several read as one (`AnyOf`)."""

    def is_set(self) -> bool: ...


class AnyOf:
    """Set when any of its flags is."""

    def __init__(self, *flags: Flag) -> None:
        self.flags = flags

    def is_set(self) -> bool:
        return any(f.is_set() for f in self.flags)


class ServerError(RuntimeError):
    """A generation server that cannot be used (or none left); `str()` is one line."""


class Unreachable(ServerError):
    """The connection failed: refused, reset, no complete answer in time."""


class TooLate(Unreachable):
    """The call's deadline passed before its answer was complete."""


class Stalled(Unreachable):
    """The server did not answer GET /health while a call to it waited (`Watch`)."""


class Cancelled(ServerError):
    """The caller stopped waiting (`cancel` set: the pool was closed)."""


class ServerFault(ServerError):
    """The server answered, with something no healthy server sends (a body past its cap, not
    JSON, wrong shapes or values): a fault of that server, not of the connection."""


class HTTPStatus(ServerError):
    """The server answered with an error status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


def validate_url(url: str) -> str:
    """A server URL as given (`http://host:port`: no path, query, fragment or user:password@);
    ServerError if it is not one (the config rules, `config.servers.check_url`, say why)."""
    parsed = urllib.parse.urlsplit(url)
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or parsed.path not in ("", "/")
        or "?" in url
        or "#" in url
        or "@" in parsed.netloc
    ):
        raise ServerError(
            f"rollout.servers: {url!r} is not a server URL; give http://HOST:PORT (as printed by "
            "`bapo serve`)"
        )
    return url.rstrip("/")


def generate_limit(prompt_tokens: int, max_tokens: int) -> int:
    """The byte cap of a generate answer: the envelope plus `PER_TOKEN` per token (module
    docstring); prompt tokens count too (vLLM may echo them, with log-probs when asked)."""
    return GENERATE_FIXED + PER_TOKEN * (max(0, prompt_tokens) + max(0, max_tokens))


class Watch:
    """Tells a slow server from a stalled one for the calls that wait on it (module
    docstring): at most one health probe per server at a time, every `every_s`; a failed probe
    fails every call to that server that started before it."""

    def __init__(self, every_s: float = HEALTH_EVERY_S, stall_s: float = STALL_S) -> None:
        self.every_s, self.stall_s = every_s, stall_s
        self._lock = threading.Lock()
        self._ok: dict[str, float] = {}  # url -> when it last answered health
        self._failed: dict[str, tuple[float, str]] = {}  # url -> (when a probe began, why)
        self._probing: set[str] = set()

    def check(self, url: str, since: float, cancel: Flag | None = None) -> None:
        """For a call to `url` waiting since `since` (monotonic): Stalled if a probe begun
        after it failed; probe now if one is due (given up with the call, `cancel`: a probe
        given up says nothing); else nothing."""
        now = time.monotonic()
        with self._lock:
            failed = self._failed.get(url)
            if failed is not None and failed[0] >= since:
                raise Stalled(failed[1])
            last = max(self._ok.get(url, since), since)
            if url in self._probing or now - last < self.every_s:
                return
            self._probing.add(url)
        try:
            call(url, "GET", "/health", None, self.stall_s, cancel=cancel)
        except Cancelled:
            with self._lock:
                self._probing.discard(url)
            raise
        except ServerError as exc:
            detail = "" if isinstance(exc, TooLate) else f" ({exc})"
            why = f"stalled: no answer to GET /health within {self.stall_s:g} s{detail}"
            with self._lock:
                self._failed[url] = (now, why)
                self._probing.discard(url)
            raise Stalled(why) from None
        with self._lock:
            self._ok[url] = time.monotonic()
            self._probing.discard(url)


class _Clock:
    """One call's deadline, cancel event and watch, asked before every wait on the socket."""

    def __init__(self, url: str, timeout: float, cancel: Flag | None, watch: Watch | None) -> None:
        self.url, self.timeout, self.cancel, self.watch = url, timeout, cancel, watch
        self.started = time.monotonic()
        self.deadline = self.started + timeout

    def left(self) -> float:
        """Seconds left; raises when the call must stop waiting."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(f"{self.url}: the request was cancelled")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TooLate(f"no complete answer within {self.timeout:g} s")
        if self.watch is not None:
            self.watch.check(self.url, self.started, self.cancel)
        return left


class _ClockedSocket:
    """A connected socket whose every read and write waits at most what the call has left
    (reads in slices of SLICE_S); what http.client uses of a socket, nothing more."""

    def __init__(self, sock: socket.socket, clock: _Clock) -> None:
        self._sock, self._clock = sock, clock

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._clock.left())
        self._sock.sendall(data)

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        while True:
            self._sock.settimeout(min(SLICE_S, self._clock.left()))
            try:
                return self._sock.recv_into(buffer, nbytes)
            except TimeoutError:
                continue  # a slice passed: the clock decides whether to wait on

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]

    def _decref_socketios(self) -> None:
        """SocketIO's close calls this; `call` closes the socket itself (`shut`)."""

    def close(self) -> None:
        """http.client hands a `connection: close` socket to the response by closing it while
        the body is still to read: left open here, closed by `shut`."""

    def shut(self) -> None:
        self._sock.close()

    def __getattr__(self, name: str) -> Any:  # setsockopt, fileno, ...
        return getattr(self._sock, name)


def _connect(url: str, clock: _Clock) -> tuple[http.client.HTTPConnection, _ClockedSocket]:
    """A connection to `url` opened within what `clock` has left, and its clocked socket."""
    parsed = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = kind(parsed.hostname or "", parsed.port, timeout=clock.left())
    conn.connect()  # TCP (and TLS) within what is left
    conn.sock = sock = _ClockedSocket(conn.sock, clock)
    return conn, sock


def call(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    timeout: float = CHECK_TIMEOUT_S,
    *,
    limit: int = CONTROL_LIMIT,
    cancel: Flag | None = None,
    watch: Watch | None = None,
) -> Any:
    """One JSON request; the decoded answer ({} when empty). Within `timeout` seconds all told
    and `limit` bytes of body (module docstring): Unreachable, Stalled, Cancelled, HTTPStatus or
    ServerFault otherwise, each one line."""
    data = None if body is None else json.dumps(body).encode()
    if method == "POST" and data is None:
        data = b""
    clock = _Clock(url, timeout, cancel, watch)
    headers = {"content-type": "application/json", "connection": "close", **server_auth.bearer()}
    sock: _ClockedSocket | None = None
    try:
        conn, sock = _connect(url, clock)
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        if response.status >= 400:
            detail = response.read(DETAIL_LIMIT).decode(errors="replace")[:300]
            raise HTTPStatus(response.status, detail.replace("\n", " "))
        raw = _read_capped(response, limit, url, path)
    except ServerError:
        raise
    except (http.client.HTTPException, OSError) as exc:  # refused, reset, closed mid-answer
        raise Unreachable(_reason(exc)) from None
    finally:
        if sock is not None:
            sock.shut()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (or nested past the parser's depth)
        raise ServerFault(
            f"{url} answered {path} with a body that is not JSON: {raw[:80]!r}"
        ) from None


def _read_capped(response: http.client.HTTPResponse, limit: int, url: str, path: str) -> bytes:
    """The body, refused (ServerFault) once it passes `limit` bytes, as announced or as read."""
    announced = response.getheader("content-length")
    if announced is not None and announced.strip().isdigit() and int(announced) > limit:
        raise ServerFault(_too_large(url, path, f"announced {int(announced):,} bytes", limit))
    chunks, total = [], 0
    while chunk := response.read(min(CHUNK, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ServerFault(_too_large(url, path, "sent more", limit))
    return b"".join(chunks)


def _too_large(url: str, path: str, what: str, limit: int) -> str:
    return (
        f"{url} answered {path} with a body past the {limit:,}-byte cap ({what}): no healthy "
        "server sends that much for what was asked"
    )


def _reason(exc: Any) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, http.client.IncompleteRead):
        return "the connection closed mid-answer"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
