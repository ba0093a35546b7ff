"""The async regime's generator when it is a set of vLLM servers (`rollout.servers=[URL, ...]`,
`staleness.weights=filesystem`): `ServerWorker`, with the surface of the worker process
(`staleness.worker.GenerationWorker`: publish, submit, receive, close), so `AsyncRL` drives
either the same way and its admission rule (AReaL's) is unchanged.

    trainer thread                       generation thread (this process)
    ──────────────                       ─────────────────
    submit(unit) ─▶ queue ─────────────▶ catch up: every server loads the newest version written
                                         Collector(engine=ServerEngine).advance(unit): requests
                                         spread over the servers, tokens stamped by them
    receive() ◀──── queue ◀──────────── the unit (or the error that stopped generation)
    publish(model, v): write version v
      (interrupt: push it now, pausing
       the servers' running requests)

Where the generation happens is the servers' business: the thread here only sends requests and
waits, so the trainer keeps every core it has (the worker process took half).

**The staleness bound across servers.** `AsyncRL._admit` submits a unit only after the weights
of the last step are published (written), and the generation thread pushes the newest written
version to every server before it starts a unit. So every version published before a unit's
admission is loaded before any of its tokens is sampled: a unit admitted at version v has no
token older than v, and the admission rule trains it at most k versions later. The versions are
the servers' own stamps per token (vLLM's weight-version spans), so a server that came back and
caught up, or a push that landed mid-response (`staleness.interrupt`: `pause?mode=keep`), is
counted as it happened. Without interrupt a push waits for the unit in flight (the generation
thread pushes between units), so a response carries one version; with it, the trainer's thread
pushes at once and a response may carry several, each token its own.

**Behaviour log-probs are the servers'.** vLLM returns each sampled token's log-prob of the
distribution it sampled from (`processed_logprobs`); the trainer never holds the weights of an
older version, so these are the behaviour log-probs the loss divides by (AReaL, prime-rl and
slime do the same). The engine/trainer mismatch is measured where both hold the same weights:
after every push, each server's log-probs of a fixed probe text against the trainer's
(`servers/probe_abs_diff_max`), which also catches a push that moved nothing.

**Seeds.** Each unit's requests draw their seeds from `unit_seed(seed, first group)`, as the
worker process does: the samples of a unit depend on its prompts and the weights it met, not on
which server answered or when.

**Data-parallel ranks** (`bapo train --nproc N`, DDP or FSDP2). Every rank has a `ServerWorker` and
generates its own units (its share of the prompt stream) on the same servers; the ranks step
together, so each one's admission counts the same global version. Rank 0 alone writes and pushes
weights: in `publish`, after the step's all-reduce, it writes the version and pushes it to every
server at once (`pause?mode=wait`, or `keep` under interrupt: the other ranks' requests may be
running); then every rank meets in one gather: rank 0 hands out the version and the servers that
hold it, the others hand in their own probe log-probs (`servers/rank_probe_abs_diff_max`: rank r's
weights against rank 0's, equal under DDP and FSDP2). A rank other than 0 admits its next unit only
after that gather, so the servers hold every version its unit may be admitted at. Its pool
(`FollowerPool`) never loads weights: a server rank 0 found down is down for it too, and one that
comes back is used again once it holds the newest version (rank 0 gives it that). Under FSDP2
(`trainer.strategy=fsdp2`) the same, with every call that reads the weights (`_start` and `publish`:
the write and the probe forwards) made by the trainer inside `DistContext.gathered`, where each rank
holds the full weights and a forward is no collective.

**Membership.** With `rollout.servers_file` the generation thread reads the file before each
unit (`_membership`), when none of this run's requests is on a server: a server removed leaves
with nothing cut off, one added joins as a server that came back does. Every pool event (down,
back, join, leave, refused) is one console line (`take_notes`) and counted (`take_metrics`).

**Failures.** A server that dies or stalls has its requests re-sent to the others
(`ServerPool`); each request has one answer, so each prompt group is trained exactly once. With
none left, `receive` raises `ServersDown` (a `WorkerError` the trainer answers with one line and
a checkpoint of the last step, see `trainer.train`); a server that answers with what no healthy
server sends (`ServerFault`), `ServerFailed`, the same way. A push that finds every server down
is kept and raised by the next `receive`, so the step it ended is complete when the error
surfaces.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bapo_cli.models import lora
from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.base import Sample, eos_ids
from bapo_cli.rollout.claims import Owner
from bapo_cli.rollout.collect import Collector
from bapo_cli.rollout.membership import ServersFile
from bapo_cli.rollout.server_engine import ServerEngine
from bapo_cli.rollout.servers import (
    NoServerLeft,
    PoolClosed,
    PushMissed,
    ServerError,
    ServerFault,
    ServerPool,
    ServerTaken,
)
from bapo_cli.rollout.weights_delta import VersionWriter, serving_dtype
from bapo_cli.rollout.weights_transfer import TransferPool
from bapo_cli.staleness import probe
from bapo_cli.staleness.probe import probe_ids, trainer_logprobs
from bapo_cli.staleness.server_setup import FollowerPool, ServerSettings, make_pool, weights_root
from bapo_cli.staleness.worker import POLL_S, WorkerError, unit_seed

CLOSE_WAIT_S = 10.0  # how long close() waits for the generation thread (it sees the close <= 2 s)
RUN_FILE = "RUN"  # in a run's own weights directory: which run writes there


EVENT_METRICS = {"down": "downs", "back": "backs", "join": "joins", "leave": "leaves"}
EVENT_WORDS = {
    "down": "server down: {}; its requests go to the others, and it is asked every 2 s",
    "back": "server back: {}",
    "join": "server joined: {}",
    "leave": "server left: {} (it takes no more requests; none was cut off)",
    "refused": "warning: server not taken in: {}",
}


def event_line(event: str) -> str:
    """The console's line for a pool event (`ServerPool.events`: its kind, then the rest)."""
    kind, _, rest = event.partition(" ")
    if kind == "refused":  # the check's own line names the server
        rest = rest.partition(": ")[2]
    return EVENT_WORDS.get(kind, "server {}").format(rest if kind in EVENT_WORDS else event)


class ServingStopped(WorkerError):
    """The servers cannot go on serving this run (none left, a push that did not reach one,
    one taken by another run, weights that cannot be written); the message is one line. The
    trainer writes a checkpoint of the last step before it stops (`checkpoint_first`), so
    fixing the cause and resuming loses nothing."""

    checkpoint_first = True


class ServersDown(ServingStopped):
    """No generation server is left."""


class ServerFailed(ServingStopped):
    """A server answered with what no healthy server sends (`ServerFault`: tokens not asked
    for, ids outside the vocabulary, log-probs that are no probabilities, ...): nothing of it was
    trained."""


class PushFailed(ServerError):
    """A probe after a push shows a server without this run's weights (staleness.probe)."""


def _servers_logprobs(samples: list[Sample]) -> None:
    """The Collector's `score` under servers: the behaviour log-probs are the servers' own
    (module docstring); moved, so the trainer's mismatch metric does not compare them with
    themselves."""
    for s in samples:
        s.logprobs.extend(s.engine_logprobs)
        s.engine_logprobs = []


class ServerWorker:
    """The trainer's handle on the generation servers (module docstring)."""

    def __init__(
        self,
        pool: ServerPool,
        settings: ServerSettings,
        collector: Collector,
        model: torch.nn.Module,
        version: int,
        group: Any = None,
    ) -> None:
        """`collector`: the trainer's (tokenizer, sampling); `group`: the trainer's DistContext
        when data-parallel ranks share the servers, None for one process."""
        if pool.weights_dir is None:
            raise ValueError("a ServerWorker needs a pool with a weights directory")
        self.group = group if group is not None and group.world_size > 1 else None
        self.leader = self.group is None or self.group.rank == 0
        if self.leader != (not isinstance(pool, FollowerPool)):
            raise ValueError("rank 0 pushes through a ServerPool, the other ranks a FollowerPool")
        if self.group is not None:
            pool.revive_mode = "wait"  # other ranks' requests may be running on a revived server
        self.pool = pool
        self.root = pool.weights_dir
        self.writer = VersionWriter(settings.delta, settings.full_every, pool=pool)
        self.interrupt = settings.interrupt
        self.seed = collector.params.seed or 0
        self.probe = probe_ids(collector.tokenizer, int(settings.model.max_model_len))
        self.probe_tolerance = settings.probe_tolerance  # None: chosen in _start
        self.quorum = settings.quorum
        self.notes: list[str] = []  # warnings for the trainer to show (servers left down)
        # rollout.servers_file: read before each unit; servers added join, servers removed leave
        self.members = ServersFile(settings.servers_file) if settings.servers_file else None
        self._said: list[str] = []  # lines for the console not yet taken (`take_notes`)
        self._noted = self._counted = 0  # pool events taken as lines, as metrics
        self.engine = ServerEngine(
            pool, eos_ids(model, collector.tokenizer), interrupt=self.interrupt
        )
        self.collector = Collector(
            engine=self.engine,
            tokenizer=collector.tokenizer,
            params=collector.params,
            n=1,  # units arrive as started samples: the trainer made the groups
            encode=None,
            reward=None,  # graded by the trainer when it takes the unit
            score=_servers_logprobs,
        )
        self._lock = threading.Lock()  # the fields below, between the two threads
        self._push_lock = threading.Lock()  # one catch-up at a time
        self._written: tuple[Path, int] | None = None  # the newest version written
        self._want: dict[int, torch.Tensor] = {}  # the trainer's probe log-probs per version
        self._held: torch.Tensor | None = None  # ... of the version the servers hold
        self._mine: list[int] = []  # versions this run wrote (removed at close)
        # a push that found no server, or a write that failed: raised by the next receive
        self._failure: ServerError | WorkerError | None = None
        self._stats: dict[str, float] = {}
        self._resent = 0
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._begin(model, version)

    def _begin(self, model: torch.nn.Module, version: int) -> None:
        """The servers loaded with `version` (`_start`), then the generation thread."""
        try:
            self._start(model, version)
        except (ServerError, WorkerError) as exc:
            self.pool.close()  # the servers it claimed are free again at once
            raise WorkerError(str(exc)) from None
        except BaseException:  # a stop signal's abandonment: the pushes still waiting end now
            self.pool.close()
            raise
        self._noted = self._counted = len(self.pool.events)  # the start's: in the warning
        self._thread = threading.Thread(target=self._run, name="bapo-servers", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(
        cls,
        settings: ServerSettings,
        model: torch.nn.Module,
        version: int,
        collector: Collector,
        run_dir: Path,
        group: Any = None,
    ) -> ServerWorker:
        """The worker of a training run (of one data-parallel rank, `group`: the trainer's
        DistContext): its servers, weights directory and sampling."""
        root = weights_root(settings, run_dir)
        follower = group is not None and group.world_size > 1 and group.rank > 0
        if settings.servers_file and group is not None and group.world_size > 1:
            raise WorkerError(
                "rollout.servers_file is not supported under --nproc (the ranks would have to "
                "agree on each change); list the servers in rollout.servers, or use one process"
            )
        owner = None if follower else Owner.of_run(run_dir)  # rank 0 alone claims and writes
        try:
            if owner is not None:
                weights_fs.check_writable(root)
                if settings.weights_dir is not None:  # a shared parent: say whose it is
                    (root / RUN_FILE).write_text(owner.run + "\n")
            pool = make_pool(settings, root, follower=follower, owner=owner)
        except (weights_fs.WeightsDirError, ServerError, OSError) as exc:
            raise WorkerError(str(exc)) from None
        return cls(pool, settings, collector, model, version, group=group)

    # ------------------------------------------------------------------------ trainer side

    def _start(self, model: torch.nn.Module, version: int) -> None:
        """Every server checked and loaded with the trainer's weights as `version` (a server
        may hold another run's weights; a resumed run's are its checkpoint's). Versions a killed
        run wrote after that point are removed first. Data-parallel: rank 0 does this, the
        other ranks check the servers and wait for it (`_share`)."""
        if not self.leader:
            self.pool.check(self.quorum)
            self._share(model, version)
            return
        weights_fs.remove(self.root, [v for v in weights_fs.versions(self.root) if v >= version])
        if isinstance(self.pool, TransferPool):  # the canary's probe; the policy's device
            self.pool.probe_ids = self.probe
            self.pool.device = next(model.parameters()).device
        delta = self.writer.delta
        if delta:  # checked first: deltas are taken in the servers' dtype, the start's version too
            down = self.pool.check(self.quorum)
            self.writer.dtype = serving_dtype(self._served())
        try:
            directory = self._write(model, version)
        except OSError as exc:
            raise WorkerError(self._write_error(exc, version)) from None
        if delta:  # the rest of `pool.start`
            self.pool.push(directory, version, interrupt=False)
        else:
            down = self.pool.start(version, directory, self.quorum)
        warning = self.quorum.warning([(s.url, s.last_error) for s in down])
        if warning is not None:
            self.notes.append(warning)
        dtypes = [str(next(model.parameters()).dtype), *[d for d in self._served() if d]]
        self.probe_tolerance = probe.tolerance(self.probe_tolerance, dtypes)
        self._record_probe(version)
        weights_fs.cleanup(self.root, keep_from=version)
        self._share(model, version)

    def _served(self) -> list[str | None]:
        """The dtypes the servers reported at their check (`bapo_model_info`)."""
        return [s.info.get("dtype") for s in self.pool.servers if s.info]

    def _share(self, model: torch.nn.Module, version: int) -> None:
        """Data-parallel ranks, all of them, after rank 0 pushed `version`: one gather. Rank 0
        hands out the version and the servers that hold it; every other rank adopts them (only
        then does it admit a unit) and hands in its trainer's probe log-probs, which rank 0
        compares with its own (`servers/rank_probe_abs_diff_max`)."""
        if self.group is None:
            return
        if self.leader:
            alive = [s.url for s in self.pool.servers if s.alive]
            mine: dict[str, Any] = {"version": version, "alive": alive}
        else:
            mine = {"probe": trainer_logprobs(model, self.probe).tolist()}
        every = self.group.gather(mine)
        if not self.leader:
            self.pool.adopt(every[0]["version"], every[0]["alive"])
            with self._lock:
                self._written = (self.root, version)
            return
        with self._lock:
            want = self._want.get(version)
        if want is not None:
            diffs = [(torch.tensor(e["probe"]) - want).abs().max().item() for e in every[1:]]
            with self._lock:
                self._stats["rank_probe_abs_diff_max"] = max(diffs)

    def _write(self, model: torch.nn.Module, version: int) -> Path | None:
        """The version made ready to push: written under the weights directory, or under
        staleness.weights=nccl copied on the trainer's device (under the push lock: a push in
        progress sends the version it was asked for, whole)."""
        t0 = time.perf_counter()
        nccl = isinstance(self.pool, TransferPool)
        with self._push_lock if nccl else contextlib.nullcontext():
            if nccl:
                directory, note = None, None
                self.pool.stage(lora.engine_weights(model), version)
            else:
                written = self.writer.write(lora.engine_weights(model), self.root, version)
                directory, note = written.directory, written.note
            want = trainer_logprobs(model, self.probe)
            with self._lock:
                self._written = (directory, version)
                self._want = {version: want}
                self._mine.append(version)
                self._stats["write_s"] = time.perf_counter() - t0
                for key, value in self.writer.metrics.items():  # summed over the step's versions
                    self._stats[key] = self._stats.get(key, 0.0) + value  # (the start's too)
                if note is not None:  # the choice by bytes turned
                    self._said.append(note)
        return directory

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's weights after a step, as `version`: written now (the servers load them
        before the next unit starts); under staleness.interrupt pushed now as well, pausing the
        requests in flight. Data-parallel: rank 0 writes and pushes now (the other ranks' units
        share the servers), then every rank meets in `_share`."""
        if self.leader:
            try:
                self._write(model, version)
            except OSError as exc:
                fault = ServingStopped(self._write_error(exc, version))
                if self.group is not None:  # the other ranks wait for this version: stop now
                    raise fault from None
                with self._lock:  # raised by the next receive: this step is complete
                    self._failure = fault
                return
        if self.leader and (self.interrupt or self.group is not None):
            try:
                self._catch_up()
            except ServerError as exc:  # raised by the next receive: this step is complete
                with self._lock:
                    self._failure = exc
        self._share(model, version)

    def submit(self, unit: list[Sample]) -> None:
        """Queue a unit; a copy is generated (as the worker process gets a copy), so the unit the
        trainer keeps for its checkpoint stays as submitted."""
        with self._lock:
            required = self._written[1] if self._written is not None else 0
        self._requests.put((copy.deepcopy(unit), required))

    def receive(self) -> list[Sample]:
        """The next generated unit, in submission order; ServersDown when no server is left,
        WorkerError when generation failed otherwise."""
        while True:
            with self._lock:
                failure, self._failure = self._failure, None
            if failure is not None:
                raise self._error(failure)
            try:
                kind, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise WorkerError("the server generation thread stopped") from None
                continue
            if kind == "error":
                raise self._error(payload)
            return payload

    def take_metrics(self) -> dict[str, float]:
        """`servers/*` since the last call: live servers, requests re-sent, the last write and
        push seconds, and the largest probe difference |server - trainer| after a push (rank 0's;
        data-parallel, also |rank r - rank 0| of the trainers' probe)."""
        with self._lock:
            stats, self._stats = self._stats, {}
            resent = sum(s.resent for s in self.pool.servers)
            new, self._resent = resent - self._resent, resent
            events, self._counted = self.pool.events[self._counted :], len(self.pool.events)
        out = {f"servers/{k}": v for k, v in stats.items()}
        out["servers/alive"] = float(sum(s.alive for s in self.pool.servers))
        out["servers/resent"] = float(new)
        kinds = [e.split(" ", 1)[0] for e in events]
        for kind, key in EVENT_METRICS.items():
            out[f"servers/{key}"] = float(kinds.count(kind))
        return out

    def take_notes(self) -> list[str]:
        """One console line per server event since the last call (down, back, join, leave, a
        server refused when it answered again) and the servers file's warnings."""
        with self._lock:
            events, self._noted = self.pool.events[self._noted :], len(self.pool.events)
            said, self._said = self._said, []
        return said + [event_line(e) for e in events]

    def close(self) -> None:
        """Stop the generation thread (answers still coming are not waited for), release the
        servers and remove the versions this run wrote (and its own directory under a shared
        staleness.weights_dir, once empty); the servers keep running, holding the last
        version."""
        self.pool.close()
        self._requests.put(None)
        self._thread.join(timeout=CLOSE_WAIT_S)
        with self._lock:
            mine, self._mine = self._mine, []
        with contextlib.suppress(OSError):
            weights_fs.remove(self.root, mine)
            if not [p for p in self.root.iterdir() if p.name != RUN_FILE]:  # its own, now empty
                (self.root / RUN_FILE).unlink(missing_ok=True)
                self.root.rmdir()

    def _write_error(self, exc: OSError, version: int) -> str:
        return (
            f"cannot write weights version {version} under {self.root} "
            f"({exc.strerror or type(exc).__name__}); free space there (or give "
            "staleness.weights_dir on another disk) and resume (trainer.resume=true)"
        )

    def _error(self, exc: BaseException) -> WorkerError:
        if isinstance(exc, NoServerLeft):
            return ServersDown(f"{exc}; restart them and resume (trainer.resume=true)")
        if isinstance(exc, ServerFault):
            return ServerFailed(
                f"{exc}; nothing of it was trained: fix or replace that server, then resume "
                "(trainer.resume=true)"
            )
        if isinstance(exc, ServerTaken | PushMissed | PushFailed):
            return ServingStopped(str(exc))
        if isinstance(exc, WorkerError):
            return exc
        if isinstance(exc, ServerError):
            return WorkerError(str(exc))
        return WorkerError(f"server generation failed: {type(exc).__name__}: {exc}")

    # --------------------------------------------------------------------- generation side

    def _run(self) -> None:
        """The generation thread: units in order, each after the servers caught up."""
        try:
            while (item := self._requests.get()) is not None:
                unit, required = item
                self._membership()
                self._catch_up()
                if self.pool.version < required:  # the invariant the staleness bound rests on
                    raise RuntimeError(
                        f"a unit admitted at version {required} would start on version "
                        f"{self.pool.version}"
                    )
                self.engine.seed_rng = random.Random(unit_seed(self.seed, unit[0].group))
                self.collector.advance(unit)
                self.pool.confirm()  # ServerTaken: another run held a server during the unit
                oldest = min((v for s in unit for v in s.versions), default=required)
                if oldest < required:  # the servers' own stamps, checked: never a quiet breach
                    held = ", ".join(f"{s.url}: {s.version}" for s in self.pool.servers)
                    raise RuntimeError(
                        f"a unit admitted at version {required} has tokens of version {oldest} "
                        f"(servers hold {held}; pool at {self.pool.version})"
                    )
                self._results.put(("unit", unit))
        except PoolClosed:
            return
        except BaseException as exc:  # noqa: BLE001  (handed to the trainer by receive)
            self._results.put(("error", exc))

    def _membership(self) -> None:
        """rollout.servers_file read again, between units: none of this run's requests is on a
        server then, so a server that leaves loses nothing; one that joins is taken in as a
        server that came back is (checked, claimed, given the newest version) before it gets a
        request. A file that cannot be used is a warning: the run keeps its servers."""
        if self.members is None:
            return
        change, warning = self.members.poll([s.url for s in self.pool.servers])
        if warning is not None:
            with self._lock:
                self._said.append(f"warning: {warning}")
        for url in change.leaves:
            self.pool.leave(url)
        for url in change.joins:
            self.pool.join(url)

    def _catch_up(self) -> None:
        """Push the newest written version to every live server if they hold an older one (from
        either thread, one at a time), then probe them and drop the versions left behind.
        Only rank 0 pushes: another rank's servers hold what rank 0 told it (`_share`)."""
        if not self.leader:
            return
        with self._push_lock:
            with self._lock:
                directory, version = self._written
                want = self._want.get(version)
            if self.pool.version >= version:
                return
            t0 = time.perf_counter()
            self.pool.push(directory, version, interrupt=self.interrupt)
            with self._lock:
                self._stats["push_s"] = time.perf_counter() - t0
            self._record_probe(version, want)
            weights_fs.cleanup(self.root, keep_from=version)

    def _record_probe(self, version: int, want: torch.Tensor | None = None) -> None:
        """Each live server's probe log-probs against the trainer's of `version`: the largest
        difference goes to `servers/probe_abs_diff_max`; a server whose probe shows the push
        failed (`staleness.probe.verdict`: above the tolerance, or still at the version before)
        raises PushFailed, which stops the run. A probe that fails (a busy or dying server)
        records nothing: generation notices a dead server on its own."""
        with self._lock:
            want = self._want.get(version) if want is None else want
            before = self._held
        if want is None:
            return
        try:
            answers = self.pool.probe(self.probe)
        except ServerError:
            return
        limit = self.probe_tolerance if self.probe_tolerance is not None else probe.HALF_TOLERANCE
        diffs = []
        for url, (held, lps) in answers.items():
            served = torch.tensor(lps)
            wrong = probe.verdict(url, version, held, served, want, before, limit)
            if wrong is not None:
                raise PushFailed(wrong)
            diffs.append((served - want).abs().max().item())
        with self._lock:
            self._held = want
            if diffs:
                worst = max(diffs + [self._stats.get("probe_abs_diff_max", 0.0)])
                self._stats["probe_abs_diff_max"] = worst
