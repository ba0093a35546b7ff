"""Who may use a generation server: one training run at a time, by lease (`LeaseTable`, kept by
the server's worker extension, `rollout.vllm_ext`), and the client's word for each answer.

Why: two runs on one server train on each other's weights. Both number their versions 1, 2, 3,
so neither the servers' version stamps nor the probe (each run compares the server with its own
weights right after its own push) can tell (docs/engines.md has what it cost).

A holder is a run (`run`: its identity, `host:run dir`, the same when `trainer.resume=true`
starts it again) in one process (`nonce`), of a kind:

- `train`: exclusive. The only holder whose weight pushes (`bapo_reload`) the server takes. A
  second run's claim is refused, naming the holder and when its lease lapses. Another process of
  the *same* run (a resume after kill -9) takes the server over at once.
- `eval` (`bapo eval eval.server=URL`): shared with other evaluations, never with a training run
  (whose pushes would change the weights under the evaluation).

A lease lasts `LEASE_S` unless renewed; holders renew every `RENEW_S` (a heartbeat thread) and
release at close, so a killed process holds the server `LEASE_S` at most. 60 s: a live run must
miss six renewals in a row to lose its server (a server busy reloading a large model answers the
queued renewal when it is done, and the reload itself renews), while a run that was killed and
is not resumed keeps other runs waiting one minute at most.

`epoch` counts the changes of the training holder (a claim by another run or process, a load by
nobody's claim). A holder keeps the epoch it was granted and compares it with each later answer:
a different one means someone else held the server in between, so what it sampled since may be
another run's (`lost`). `instance` tells a restarted server (a fresh table) from a stolen one.

Pure (a clock is passed in): the worker extension holds the table; the tests drive it directly.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LEASE_S = 60.0
RENEW_S = 10.0
KINDS = ("train", "eval")


@dataclass
class Holder:
    run: str  # the run's identity (host:run dir), or an evaluation's
    nonce: str  # the process's: a resumed run is another process of the same run
    kind: str  # train | eval
    until: float  # the clock's time the lease lapses at


class LeaseTable:
    """A server's holders (module docstring); `clock`: seconds, monotonic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.instance = uuid.uuid4().hex[:12]
        self.epoch = 0
        self.last_train: tuple[str, str] | None = None  # kept after a release or a lapse
        self.holders: dict[tuple[str, str], Holder] = {}
        self.holds: dict[str, Any] | None = None  # the weights pushed last (`loaded`)

    def claim(self, run: str, nonce: str, kind: str, lease_s: float) -> dict[str, Any]:
        """Grant or renew a lease: {granted, instance, epoch, lease_s}; else {granted: False,
        holder, kind, left_s} naming the holder that blocks it."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
        now = self._expire()
        key = (run, nonce)
        if kind == "train":  # another process of the same run is taken over
            blocking = [h for k, h in self.holders.items() if k != key and h.run != run]
        else:
            blocking = [h for k, h in self.holders.items() if k != key and h.kind == "train"]
        if blocking:
            first = min(blocking, key=lambda h: (h.kind != "train", -h.until))
            return {
                "granted": False,
                "holder": first.run,
                "kind": first.kind,
                "left_s": round(max(0.0, first.until - now), 1),
            }
        if kind == "train":
            for k in [k for k, h in self.holders.items() if h.run == run and k != key]:
                del self.holders[k]
            if self.last_train != key:
                self.epoch += 1
                self.last_train = key
        self.holders[key] = Holder(run, nonce, kind, now + lease_s)
        return self.granted(lease_s)

    def granted(self, lease_s: float) -> dict[str, Any]:
        return {"granted": True, "instance": self.instance, "epoch": self.epoch, "lease_s": lease_s}

    def release(self, run: str, nonce: str) -> None:
        self.holders.pop((run, nonce), None)

    def load(self, run: str | None, nonce: str | None, lease_s: float) -> dict[str, Any]:
        """May these weights be loaded? A holder's training claim renewed (refused as `claim`
        refuses), or, for a caller that names no run, only while nobody holds the server (the
        epoch then moves on: a holder whose lease lapsed must not take these weights for its
        own)."""
        if run is not None and nonce is not None:
            return self.claim(run, nonce, "train", lease_s)
        now = self._expire()
        if self.holders:
            first = min(self.holders.values(), key=lambda h: (h.kind != "train", -h.until))
            return {
                "granted": False,
                "holder": first.run,
                "kind": first.kind,
                "left_s": round(max(0.0, first.until - now), 1),
            }
        self.epoch += 1
        self.last_train = None
        return self.granted(lease_s)

    def loaded(self, run: str | None, version: int, base: str | None) -> None:
        """Record whose weights the server holds now, and the fingerprint of the model they
        derive from (`base`, for `bapo eval`'s identity check; None: not said)."""
        self.holds = {"run": run, "version": version, "base": base}

    def state(self) -> dict[str, Any]:
        """The live holders (for a look without a claim: `bapo train`'s preflight)."""
        now = self._expire()
        holders = [
            {"run": h.run, "kind": h.kind, "left_s": round(h.until - now, 1)}
            for h in self.holders.values()
        ]
        return {"instance": self.instance, "epoch": self.epoch, "holders": holders}

    def _expire(self) -> float:
        now = self.clock()
        for key in [k for k, h in self.holders.items() if h.until <= now]:
            del self.holders[key]
        return now


# ------------------------------------------------------------------------------- the client


class LeaseRefused(Exception):
    """A claim or a load refused: another run holds the server; `str()` is one line."""


class LeaseLost(Exception):
    """Someone else held the server since this holder's grant; `str()` is one line."""


def refusal(url: str, answer: dict[str, Any], what: str) -> str:
    """One line: who holds the server, until when, and what to do."""
    holder, kind, left = answer.get("holder"), answer.get("kind"), answer.get("left_s")
    who = f"the training run {holder}" if kind == "train" else f"an evaluation ({holder})"
    why = (
        "a server belongs to one training run at a time"
        if kind == "train"
        else "its weights must not change under an evaluation"
    )
    return (
        f"the generation server {url} is held by {who} (renewed while it runs; if it was killed, "
        f"its lease lapses in {left} s): {why}; {what}"
    )


@dataclass
class Grant:
    """What a holder was granted by one server: the table it lives in and its epoch there."""

    instance: str
    epoch: int

    def check(self, url: str, answer: dict[str, Any], what: str) -> Grant:
        """The grant after a renewal or a load: LeaseRefused, or LeaseLost when the epoch moved
        (another holder in between); a restarted server (another instance) is a fresh grant."""
        if not answer.get("granted"):
            raise LeaseRefused(refusal(url, answer, what))
        grant = Grant(str(answer["instance"]), int(answer["epoch"]))
        if grant.instance == self.instance and grant.epoch != self.epoch:
            raise LeaseLost(
                f"the generation server {url} was held by another run or process since this "
                f"run's last renewal (lease epoch {self.epoch} -> {grant.epoch}): what it sampled "
                "since may be another run's weights; give each run its own servers"
            )
        return grant
