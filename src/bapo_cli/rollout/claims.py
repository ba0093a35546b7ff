"""A run's claims on its generation servers (`rollout.lease` says why and the rules): taken at
start, renewed by a heartbeat thread every `lease.RENEW_S`, checked on every reload answer and
after every unit, released at close.

    claims = Claims(Owner.of_run(run_dir), rpc)    # rpc(url, method, args) -> answers | None
    claims.claim(url)                              # LeaseRefused: another run holds it
    claims.start(lambda: live_urls)                # the heartbeat
    claims.lost                                    # one line, once a server was taken
    claims.release(urls)                           # the heartbeat stopped first

The pool (`rollout.servers.ServerPool`) hands in `rpc`: one `POST /collective_rpc` returning
every worker's answer, None when the server did not answer (a dead server is the pool's
business; its claim is taken again when it comes back).
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bapo_cli.rollout.lease import LEASE_S, RENEW_S, Grant, LeaseLost, LeaseRefused, refusal

JOIN_S = 15.0  # a renewal in progress: one claim call per server, each answered in < 1 s
Rpc = Callable[[str, str, list[str]], "list[dict[str, Any]] | None"]


@dataclass(frozen=True)
class Owner:
    """Who claims: a run's identity (the same when the run is resumed), this process's nonce,
    and the kind of use (train: exclusive; eval: shared with other evaluations)."""

    run: str
    kind: str = "train"
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @classmethod
    def of_run(cls, run_dir: Path | str) -> Owner:
        """A training run: its host and run dir (`trainer.resume=true` names the same dir)."""
        return cls(f"{socket.gethostname()}:{Path(run_dir).resolve()}", "train")

    @classmethod
    def evaluation(cls, out_dir: Path | str | None = None) -> Owner:
        where = f":{Path(out_dir).resolve()}" if out_dir is not None else ""
        return cls(f"bapo eval on {socket.gethostname()}{where}", "eval")

    def refused_hint(self) -> str:
        if self.kind == "eval":
            return "evaluate on a server of its own (bapo serve) or once the run has ended"
        return (
            "give this run other servers (rollout.servers), or wait for that run to end "
            "(a sweep: run its jobs one after another)"
        )


class Claims:
    """One owner's grants on several servers (module docstring)."""

    def __init__(self, owner: Owner, rpc: Rpc) -> None:
        self.owner = owner
        self.rpc = rpc
        self.grants: dict[str, Grant] = {}
        self.lost: str | None = None  # the first loss, one line
        self.released = False  # after `release`, nothing claims again (a push still running)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self, url: str) -> bool:
        """Claim `url`; False when it did not answer (or not as the worker extension does),
        LeaseRefused when another run holds it."""
        o = self.owner
        answers = self.rpc(url, "bapo_claim", [o.run, o.nonce, o.kind, str(LEASE_S)])
        if not answers or not all(isinstance(a.get("granted"), bool) for a in answers):
            return False  # no answer, or not the worker extension's to this method
        for answer in answers:  # every tensor-parallel worker keeps its own table
            if not answer.get("granted"):
                raise LeaseRefused(refusal(url, answer, o.refused_hint()))
        with self._lock:
            self.grants[url] = Grant(str(answers[0]["instance"]), int(answers[0]["epoch"]))
        return True

    def reload_args(self) -> list[str]:
        """What a reload carries: the holder it is for and the lease it renews (after the
        release, none: a push still running must not claim the server again)."""
        return ["", ""] if self.released else [self.owner.run, self.owner.nonce]

    def check(self, url: str, answers: list[dict[str, Any]]) -> None:
        """A renewal's or a reload's answers: LeaseRefused / LeaseLost (rollout.lease.Grant)."""
        with self._lock:
            grant = self.grants.get(url)
        for answer in answers:
            if not answer.get("granted"):
                raise LeaseRefused(refusal(url, answer, self.owner.refused_hint()))
            if grant is not None:
                grant = grant.check(url, answer, self.owner.refused_hint())
        if grant is None:
            grant = Grant(str(answers[0]["instance"]), int(answers[0]["epoch"]))
        with self._lock:
            self.grants[url] = grant

    def renew(self, urls: list[str]) -> str | None:
        """Renew every claim among `urls` now; the first loss (kept in `lost`), or None. A
        server that does not answer is left to the pool (down)."""
        o = self.owner
        for url in urls:
            if url not in self.grants or self.released:
                continue
            answers = self.rpc(url, "bapo_claim", [o.run, o.nonce, o.kind, str(LEASE_S)])
            if not answers:
                continue
            try:
                self.check(url, answers)
            except (LeaseRefused, LeaseLost) as exc:
                with self._lock:
                    self.lost = self.lost or str(exc)
        return self.lost

    def start(self, urls: Callable[[], list[str]]) -> None:
        """The heartbeat: `renew(urls())` every RENEW_S until `stop`."""
        if self._thread is not None:
            return

        def beat() -> None:
            while not self._stop.wait(RENEW_S):
                self.renew(urls())

        self._thread = threading.Thread(target=beat, name="bapo-lease", daemon=True)
        self._thread.start()

    def drop(self, url: str) -> None:
        """Give one server back while the others stay claimed (it left the run): no longer
        renewed, released on the server (one that does not answer lets the lease lapse)."""
        with self._lock:
            grant = self.grants.pop(url, None)
        if grant is not None and not self.released:
            self.rpc(url, "bapo_release", [self.owner.run, self.owner.nonce])

    def release(self, urls: list[str]) -> None:
        """Stop the heartbeat (a renewal after the release would claim again), then give the
        servers back (a server that does not answer lets the lease lapse)."""
        self.released = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=JOIN_S)
        o = self.owner
        for url in urls:
            if self.grants.pop(url, None) is not None:
                self.rpc(url, "bapo_release", [o.run, o.nonce])


def check_reload(
    claims: Claims | None, url: str, answers: list[dict[str, Any]], marker: dict[str, Any]
) -> str | None:
    """A reload's answers: LeaseRefused / LeaseLost for a holder (`Claims.check`; for a pool
    that claims nothing, a tool or a test, LeaseRefused when a run holds the server); the line
    saying the server did not read the version when the answers lack the fingerprint the
    marker records (an answer without a lease is not the extension's: the fingerprint tells)."""
    if answers and all("granted" in a for a in answers):
        if claims is not None:
            claims.check(url, answers)
        for answer in answers:
            if not answer["granted"]:
                raise LeaseRefused(refusal(url, answer, "a push that names no run is refused"))
    written = marker.get("fingerprint")
    read = {a.get("fingerprint") for a in answers}
    if written is None or (answers and read == {written}):
        return None
    version = marker.get("version")
    return (
        f"the generation server {url} answered the reload of version {version} without reading "
        f"it (fingerprint {sorted(map(str, read))} of what it read, {written} written): "
        "something between this run and its model answers for it; point rollout.servers at the "
        "server itself (bapo serve)"
    )
