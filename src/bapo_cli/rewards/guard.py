"""A hard time limit for a Python function, from any thread and any process.

Why not signals or threads: ``signal.alarm`` (math-verify's own timeout) only works in the main
thread of the main interpreter, so it fails inside a rollout thread, a Ray actor or a data-loader
worker; and a Python thread that is stuck in sympy cannot be interrupted at all. The only limit that
always holds is a separate process that can be killed.

`TimeLimitedWorker` keeps one such process alive and sends it requests one at a time:

    parent ──{"id": 7, "args": [...]}\\n──▶ python -m <module>   (calls handler(*args))
           ◀──{"id": 7, "ok": result}\\n──

over the child's stdin/stdout as JSON lines (strings only; nothing is pickled, nothing is eval'd).
`call(args, timeout_s)` waits at most ``timeout_s`` for the answer. If none comes, the child
is killed (SIGKILL) and the call returns ``Outcome("timeout")``; the next call starts a fresh
child, and its start-up (interpreter + imports, seconds) is waited for separately, never charged
to a request's limit. `start(wait_s)` starts a child ahead of a call and waits at most ``wait_s``
for it: a caller with a deadline stops waiting at the deadline while the child goes on starting.
A child that dies (segfault, out of memory) gives ``Outcome("crashed")``. Calls are serialised
by a lock, so one worker is safe to share between threads; after ``os.fork`` the child process
notices that the worker belongs to its parent and starts its own.

The child side is `serve(handler)`: the worker module's ``main`` calls it. It keeps the protocol on
a private copy of stdout (stray prints from libraries go to stderr), ignores SIGINT (Ctrl-C in the
terminal stops the parent, which then closes the pipe) and exits when stdin closes, so a parent that
dies without cleaning up does not leave it behind. If the parent dies *during* a request, an
``alarm`` set to the request's limit plus `BACKSTOP_EXTRA_S` ends the child (SIGALRM's default
action works even inside a long C call, where a Python-level check would never run). Workers are
also killed at interpreter exit and when their `TimeLimitedWorker` is garbage-collected.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Outcome",
    "TimeLimitedWorker",
    "WorkerStartError",
    "child_env",
    "limit_memory",
    "serve",
]

# The directory that holds the ``bapo_cli`` package: put on the child's PYTHONPATH so that
# ``python -m bapo_cli...`` works from a source checkout that is not installed.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# The child ends itself this long after a request's own limit: the parent normally kills it at
# the limit, so this only fires when the parent died (SIGKILL, OOM) during a hostile request.
BACKSTOP_EXTRA_S = 2


class WorkerStartError(RuntimeError):
    """The worker process did not come up (missing dependency, import error, start-up timeout)."""


@dataclass(frozen=True)
class Outcome:
    """How a call ended: ``ok`` (``value`` holds the result), ``timeout``, ``crashed`` (the child
    died) or ``error`` (the handler raised; ``value`` names the exception type)."""

    status: Literal["ok", "timeout", "crashed", "error"]
    value: Any = None
    seconds: float = 0.0


def child_env() -> dict[str, str]:
    """This process's environment, with the ``bapo_cli`` package importable by a child
    ``python -m bapo_cli...`` (a source checkout that is not installed)."""
    env = dict(os.environ)
    if Path(_PACKAGE_ROOT).name not in ("site-packages", "dist-packages"):
        # a source checkout (src/ layout); never put site-packages ahead of the stdlib
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Kill a child and reap it (used directly and as the weakref finalizer)."""
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.close()


def _read_lines(stream, out: queue.Queue) -> None:
    """Reader thread: one decoded message per line into ``out``; ``None`` once the child is gone."""
    try:
        for line in stream:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not ours; the protocol channel carries only our JSON objects
            if isinstance(message, dict):
                out.put(message)
    except (OSError, ValueError):
        pass
    out.put(None)


class TimeLimitedWorker:
    """One persistent child process running ``python -m <module> [args]`` (see module docstring)."""

    def __init__(
        self,
        module: str,
        *,
        args: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.module = module
        self.args = tuple(args)
        self.startup_timeout_s = float(startup_timeout_s)
        self.starts = 0  # how many children were started (restarts included)
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue | None = None
        self._finalizer: weakref.finalize | None = None
        self._ready = False  # the current child has said it is ready
        self._spawned_at = 0.0
        self._next_id = 0

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The child's pid while one is running (None before the first call and after a kill)."""
        return self._proc.pid if self._proc is not None else None

    def _forget_after_fork(self) -> None:
        if self._owner != os.getpid():  # we are a forked child: that process is our parent's
            self._owner = os.getpid()
            self._lock = threading.Lock()
            if self._finalizer is not None:
                self._finalizer.detach()  # never kill the parent's child from here
            if self._proc is not None and self._proc.stdin is not None:
                # Close our copy of its stdin so it still sees EOF when the parent dies. (Not
                # stdout: the parent's reader thread held its lock at the fork, so closing it
                # here would deadlock; every request is flushed whole, so stdin's lock is free.)
                with contextlib.suppress(Exception):
                    self._proc.stdin.close()
            self._proc, self._replies, self._finalizer = None, None, None

    def _spawn(self) -> None:
        """Start a child without waiting for it (`_await_ready` waits)."""
        env = child_env()
        proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="ascii",
            bufsize=1,
            close_fds=True,
        )
        replies: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stdout, replies), daemon=True).start()
        self._proc, self._replies = proc, replies
        self._finalizer = weakref.finalize(self, _kill, proc)
        self._ready = False
        self._spawned_at = time.monotonic()
        self.starts += 1

    def _await_ready(self, wait_s: float | None = None) -> bool:
        """Wait for the child's ready line, at most ``wait_s`` (None: the rest of the start-up
        limit). False if it is still starting; WorkerStartError once the start-up limit is spent
        or the child died."""
        if self._ready:
            return True
        left = self.startup_timeout_s - (time.monotonic() - self._spawned_at)
        wait = left if wait_s is None else min(wait_s, left)
        try:
            ready = self._replies.get(timeout=max(wait, 0.0))
        except queue.Empty:
            if wait < left:
                return False  # still starting: the caller stopped waiting, the child did not
            ready = None
        if not (isinstance(ready, dict) and ready.get("ready")):
            self._stop()
            raise WorkerStartError(
                f"worker `python -m {self.module}` did not start within "
                f"{self.startup_timeout_s:.0f} s (its stderr above says why: a missing "
                "dependency such as math-verify, or an import error)"
            )
        self._ready = True
        return True

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the child, once
        self._proc, self._replies, self._finalizer = None, None, None

    def start(self, wait_s: float | None = None) -> bool:
        """Start the child unless one is running or starting, and wait for it to be ready: at most
        ``wait_s`` seconds (None: up to the start-up limit). True when it is ready; False when
        it is still starting (it goes on starting, and a later `start` or `call` waits for the
        rest). Lets a caller with a deadline pay the start-up from its own clock."""
        self._forget_after_fork()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._stop()
                self._spawn()
            return self._await_ready(wait_s)

    def close(self) -> None:
        """Kill the child (if any). The worker stays usable: the next call starts a new one."""
        self._forget_after_fork()
        with self._lock:
            self._stop()

    def __enter__(self) -> TimeLimitedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------------

    def call(self, args: Sequence[Any], timeout_s: float) -> Outcome:
        """Run ``handler(*args)`` in the child, waiting at most ``timeout_s`` seconds for it."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._forget_after_fork()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._stop()
                self._spawn()
            self._await_ready()  # a child still starting (see `start`) is waited for here
            self._next_id += 1
            rid = self._next_id
            request = {"id": rid, "args": list(args), "limit": timeout_s}
            message = json.dumps(request, ensure_ascii=True) + "\n"
            t0 = time.perf_counter()
            try:
                self._proc.stdin.write(message)
                self._proc.stdin.flush()
            except (OSError, ValueError):
                self._stop()
                return Outcome("crashed", seconds=time.perf_counter() - t0)
            while True:
                left = timeout_s - (time.perf_counter() - t0)
                try:
                    reply = self._replies.get(timeout=left) if left > 0 else "timeout"
                except queue.Empty:
                    reply = "timeout"
                if reply is None or reply == "timeout":  # the reader saw EOF, or out of time
                    self._stop()
                    status = "crashed" if reply is None else "timeout"
                    return Outcome(status, seconds=time.perf_counter() - t0)
                if reply.get("id") != rid:
                    continue  # a late answer to an earlier request
                seconds = time.perf_counter() - t0
                if "error" in reply:
                    return Outcome("error", reply["error"], seconds)
                return Outcome("ok", reply.get("ok"), seconds)


# -- child side ----------------------------------------------------------------------------------


def limit_memory(megabytes: int) -> None:
    """Cap this process's address space (POSIX RLIMIT_AS); allocations beyond raise MemoryError."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    limit = int(megabytes) * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def serve(handler: Callable[..., Any], *, warmup: Callable[[], Any] | None = None) -> None:
    """Child main loop: answer JSON-line requests on stdin with ``handler(*args)`` until EOF."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="ascii", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library prints cannot corrupt replies
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    backstop = hasattr(signal, "alarm")
    if backstop:  # SIGALRM's default action ends the process in the kernel, even inside C code
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    if warmup is not None:
        warmup()
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            rid = request["id"]
        except (ValueError, KeyError, TypeError):
            continue
        limit = request.get("limit")
        if backstop and isinstance(limit, (int, float)) and 0 < limit < 1e6:
            signal.alarm(math.ceil(limit) + BACKSTOP_EXTRA_S)
        try:
            reply = {"id": rid, "ok": handler(*request.get("args", ()))}
        except Exception as exc:  # the handler's bug must not take the worker down
            reply = {"id": rid, "error": type(exc).__name__}
        finally:
            if backstop:
                signal.alarm(0)
        protocol.write(json.dumps(reply, ensure_ascii=True) + "\n")


def fan_out(
    workers: list[TimeLimitedWorker],
    items: list[Any],
    call: Callable[[TimeLimitedWorker, Any], None],
) -> None:
    """`call(worker, item)` for every item, from min(len(workers), len(items)) threads, one per
    worker, each taking the next item as it frees up (a slow item holds one worker, not the
    rest). The first exception any thread raised (e.g. WorkerStartError) is re-raised here."""
    pending = iter(items)
    take = threading.Lock()
    errors: list[BaseException] = []

    def drain(worker: TimeLimitedWorker) -> None:
        try:
            while True:
                with take:
                    item = next(pending, _DONE)
                if item is _DONE:
                    return
                call(worker, item)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    used = workers[: min(len(workers), len(items))]
    if len(used) == 1:
        drain(used[0])
    elif used:
        threads = [threading.Thread(target=drain, args=(w,), daemon=True) for w in used]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


_DONE = object()
