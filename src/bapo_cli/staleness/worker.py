"""The generation worker of `staleness.regime=async`: a separate process that samples while the
trainer trains.

Why a process and not a thread: generation and the optimizer step are both PyTorch compute that
holds the GIL between kernels; two processes with one core each really run at the same time.

    trainer ──units of started samples──▶ requests ─▶ worker: load newest weights, generate,
            ◀──────units of sampled samples─ results ◀─        score with those same weights

`requests` is a multiprocessing Queue (its feeder thread never blocks the trainer); `results` is a
one-way pipe whose write end only the worker holds, so a worker that dies, even halfway through
sending a unit, is an end-of-file for the trainer, never a read that waits forever. The worker
writes to it from a sender thread, so it can be up to the k + 1 admitted units ahead instead of
waiting for the trainer to read each one.

Weights travel through shared memory, not through the queues: the trainer copies its parameters
into tensors made with `share_memory_()` under a lock and bumps a version counter (`publish`,
milliseconds for the tiny model, and training never waits for the worker); the worker copies them
into its own model between units, under the same lock, so it never samples from half-written
weights. Every token is stamped with the version the worker's weights carry, and the worker scores
its own samples with those weights: the behaviour log-probs are the behaviour policy's.

Interruptible generation (`staleness.interrupt=true`, AReaL's interruptible rollout): the engine
asks after every token whether newer weights have been published; if so the unit's unfinished
responses stop, their tokens so far are scored with the weights that sampled them, the new
weights are loaded, and the responses continue from where they stopped (the prompt and the
partial response are re-encoded with the new weights: no key/value cache from the old ones is
reused). A response can then carry tokens of several versions, each with its own behaviour
log-prob, and the later tokens of a long response are fresher than its first.

Which units the worker may start is decided by the trainer (`AsyncRL._admit`, AReaL's rule); the
worker only takes what it is given, in order.

Shutdown: `close()` sets a stop event (seen before any queued unit: the worker closes its engine
and exits), waits up to STOP_WAIT_S, then SIGTERM, then, TERM_WAIT_S later, SIGKILL (the worker
holds nothing worth saving, and may be in the middle of a unit nobody will read). SIGTERM ends
the unit in progress but still closes the engine (a vLLM engine left open leaves semaphores that
Python's resource tracker reports as "leaked" at exit; under load the close takes seconds). A worker
whose trainer dies without cleaning up (kill -9) dies with it: Linux's parent-death signal
(`prctl(PR_SET_PDEATHSIG)`) kills it at once, and where that is missing it notices the new parent
process id within half a second while it waits for work.

The engine is the run's (`rollout=hf` samples from the worker's policy copy itself; `rollout=vllm`
builds a vLLM engine in the worker and loads each new version into it, its log-probs kept with the
samples for TIS and the mismatch metric). Behaviour log-probs are always the policy copy's forward.

CPU only. On GPUs (and across machines) vLLM generation servers take this worker's place
(`rollout.servers`: staleness/servers.py, the same surface), weights through files; docs/engines.md.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import torch

from bapo_cli.models import loading as models
from bapo_cli.parent_death import signal_on_parent_death
from bapo_cli.rollout.base import Sample, SamplingParams, make_engine
from bapo_cli.rollout.collect import Collector
from bapo_cli.rollout.scoring import (
    ResponseLogits,
    collate,
    disable_dropout,
    record_behaviour,
    split_micro,
)

POLL_S = 0.5  # how often a waiting side checks that the other is still alive
STOP_WAIT_S = 2.0  # how long `close()` waits for the worker to stop cleanly before signals
TERM_WAIT_S = 30.0  # after SIGTERM: time for the engine's close (seconds at load), then SIGKILL


class WorkerError(RuntimeError):
    """The generation worker failed or died; the message says how."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs to build its own policy copy and sample like the trainer would."""

    engine: str  # a rollout engine name (hf, vllm), resolved
    # TrainConfig: the model (architecture and tokenizer; its weights come from shared memory),
    # what an engine with weights of its own (vLLM) is built from, the trainer's micro-batch
    # layout (behaviour scoring) and staleness.interrupt
    cfg: Any
    dtype: torch.dtype  # the trainer's stored weight dtype (float32 under mixed precision)
    autocast: torch.dtype | None  # mixed precision: sample and score in this dtype
    params: SamplingParams
    seed: int
    threads: int = 1  # torch intra-op threads of the worker (AsyncRL.start: half the trainer's)


@dataclass(frozen=True)
class SharedWeights:
    """The published weights in shared memory, their version and the lock that guards both."""

    tensors: dict[str, torch.Tensor]
    version: Any  # a multiprocessing Value("q"): the version of `tensors`
    lock: Any


def unit_seed(seed: int, first_group: int) -> int:
    """The sampling seed of a unit: fixed by the run seed and the unit's first prompt group, so a
    unit's samples depend only on the weights it was sampled with (not on what ran before it)."""
    return (seed * 1_000_003 + first_group) % (2**63)


class GenerationWorker:
    """The trainer's handle on the worker process: publish weights, submit units, receive them."""

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module, version: int) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        with torch.no_grad():
            self.shared = {
                name: t.detach().to("cpu", copy=True).share_memory_()
                for name, t in model.state_dict().items()
            }
        self.version = ctx.Value("q", version, lock=False)  # guarded by self.lock
        self.lock = ctx.Lock()
        self.generated = ctx.Value("q", 0)  # units the worker has finished (sent or queued)
        self.stop = ctx.Event()  # close(): take no further unit, even if some are queued
        self.requests = ctx.Queue()
        self.results, results_end = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=worker_main,
            args=(
                spec,
                SharedWeights(self.shared, self.version, self.lock),
                self.requests,
                results_end,
                self.generated,
                self.stop,
            ),
            kwargs={"parent_pid": os.getpid()},
            name="bapo-generation",
            daemon=True,  # multiprocessing's exit handler ends it if close() never runs
        )
        self.proc.start()
        results_end.close()  # the worker's end: once it exits, reads here end instead of waiting

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's current weights into shared memory, stamped `version` (the worker takes
        them before its next unit)."""
        with self._weights_lock(), torch.no_grad():
            for name, t in model.state_dict().items():
                self.shared[name].copy_(t)
            self.version.value = version

    @contextlib.contextmanager
    def _weights_lock(self) -> Iterator[None]:
        """The weights' lock, or a WorkerError: a worker killed while it copied the weights in
        never releases the lock, and waiting on it without a timeout would hang the trainer."""
        while not self.lock.acquire(timeout=POLL_S):
            if not self.proc.is_alive():
                raise self._died()
        try:
            yield
        finally:
            self.lock.release()

    def _died(self) -> WorkerError:
        """The error for a worker that exited without reporting one (killed, or crashed hard)."""
        self.proc.join(timeout=5)
        return WorkerError(
            f"the generation worker (pid {self.proc.pid}) exited with code "
            f"{self.proc.exitcode} without an error report"
        )

    def submit(self, unit: list[Sample]) -> None:
        self.requests.put(unit)

    def receive(self) -> list[Sample]:
        """The next generated unit (units come back in the order they were submitted); a
        WorkerError if the worker failed or died."""
        while True:
            try:
                if not self.results.poll(POLL_S):
                    continue
                kind, payload = self.results.recv()
            except (EOFError, OSError):
                raise self._died() from None
            if kind == "error":
                last = payload.strip().splitlines()[-1] if payload.strip() else "unknown error"
                raise WorkerError(f"the generation worker failed: {last}")
            return payload

    def close(self, wait_s: float = TERM_WAIT_S) -> None:
        """Stop the worker: a stop request, then SIGTERM, then SIGKILL; no process is left."""
        if self.proc.pid is None or self.requests is None:
            return
        with contextlib.suppress(Exception):
            self.stop.set()
            self.requests.put(None)
        # an idle worker takes the stop request at once and exits cleanly (its engine closed);
        # one in the middle of a unit is stopped by signal below
        self.proc.join(timeout=STOP_WAIT_S)
        for stop in (self.proc.terminate, self.proc.kill):
            if not self.proc.is_alive():
                break
            stop()
            self.proc.join(timeout=wait_s)
        self.requests.cancel_join_thread()  # unread requests must not hold this process at exit
        self.requests.close()
        self.results.close()
        # drop the semaphores now: a traceback that keeps this handle alive until exit would
        # otherwise leave them to the resource tracker, which warns about "leaked" ones
        self.requests = self.results = self.lock = self.version = self.generated = None
        self.stop = None
        self.shared = {}


# ------------------------------------------------------------------------------ worker side


def worker_main(
    spec: WorkerSpec,
    weights: SharedWeights,
    requests: Any,
    results: Any,
    generated: Any,
    stop: Any,
    *,
    parent_pid: int,
) -> None:
    """The worker process: build a policy copy, then generate units until told to stop.

    Finished units go to a sender thread, so the worker starts its next unit while the trainer
    has not yet read the last one (a unit is larger than a pipe's buffer: sent from this thread,
    the write would wait for the trainer). How far ahead it may run is the trainer's admission
    rule: it submits at most k + 1 units."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which stops us
    signal.signal(signal.SIGTERM, _terminated)  # close(): the unit in progress ends here
    outbox: queue.Queue = queue.Queue()  # bounded by the admission rule: at most k + 1 units
    sender = threading.Thread(target=_send_all, args=(outbox, results), daemon=True)
    sender.start()
    generate = None
    try:
        generate = _build(spec)
        loaded = -1
        while True:
            unit = _next_request(requests, parent_pid, stop)
            if unit is None:
                break
            loaded = generate.refresh(weights, loaded)
            torch.manual_seed(unit_seed(spec.seed, unit[0].group))
            while True:
                newer = _newer(weights.version, loaded) if spec.cfg.staleness.interrupt else None
                generate.collector.advance(unit, interrupt=newer)
                if all(s.done for s in unit):
                    break
                loaded = generate.refresh(weights, loaded)  # interrupted
            with generated.get_lock():
                generated.value += 1
            outbox.put(("unit", unit))
        # asked to stop: shut the engine down (vLLM's releases its semaphores, which a killed
        # worker would leave to the resource tracker's "leaked" warning)
        _close_engine(generate)
    except _Terminated:  # close() gave up waiting: nobody reads this unit; the engine still
        _close_engine(generate)  # closes (its semaphores), and SIGKILL follows if it hangs
    except BaseException:  # noqa: BLE001  (reported to the trainer, then this process ends)
        outbox.put(("error", traceback.format_exc()))
        outbox.put(None)
        sender.join(timeout=5)
        raise SystemExit(1) from None


class _Terminated(Exception):
    """SIGTERM from `close()`: stop the unit in progress, close the engine, exit."""


def _terminated(_signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the engine's close is not interrupted
    raise _Terminated


def _close_engine(generate: _Generate | None) -> None:
    if generate is not None:
        generate.engine.close()


def _send_all(outbox: queue.Queue, results: Any) -> None:
    """The sender thread: units (and a failure report) to the trainer, in order."""
    while (item := outbox.get()) is not None:
        try:
            results.send(item)
        except OSError:  # the trainer closed its end: nobody is reading any more
            return


def _newer(version: Any, loaded: int) -> Any:
    """`interrupt` for the engine: have newer weights been published than the ones we sample
    with? (read without the lock: a stale read only pauses one token later)"""
    return lambda: version.value != loaded


@dataclass
class _Generate:
    model: torch.nn.Module
    engine: Any
    collector: Any

    def refresh(self, weights: SharedWeights, loaded: int) -> int:
        """Copy the newest published weights in if they are newer than ours; our version."""
        if weights.version.value == loaded:  # a stale read only delays the copy to the next unit
            return loaded
        with weights.lock, torch.no_grad():
            self.model.load_state_dict(weights.tensors)
            current = int(weights.version.value)
        self.engine.sync_weights(self.model, current)  # the version new tokens are stamped with
        return current


def _build(spec: WorkerSpec) -> _Generate:
    import transformers

    # no progress bars: the trainer's is the one to watch, and tqdm's lock is a semaphore that a
    # killed worker would leave to the resource tracker
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(spec.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model_cfg = spec.cfg.model
    if any(f.name == "gradient_checkpointing" for f in fields(model_cfg)):
        model_cfg = replace(model_cfg, gradient_checkpointing=False)  # no backward here
    model, tokenizer = models.load_policy(model_cfg, device=torch.device("cpu"), dtype=spec.dtype)
    disable_dropout(model)
    model.train()  # the trainer's mode: the engine switches to eval only inside generate()
    model.requires_grad_(False)
    # hf samples from `model` itself; vLLM holds its own copy, loaded from `model` at refresh
    engine = make_engine(
        spec.engine, model=model, tokenizer=tokenizer, cfg=spec.cfg, autocast=spec.autocast
    )
    scorer = ResponseLogits(model, spec.autocast, spec.cfg.trainer.logprob_chunk)
    score = partial(
        _score, scorer, tokenizer.pad_token_id, spec.cfg.trainer, spec.params.temperature
    )
    collector = Collector(
        engine=engine,
        tokenizer=tokenizer,
        params=spec.params,
        n=1,  # units arrive as started samples: the trainer made the groups
        encode=None,
        reward=None,  # graded by the trainer when it takes the unit
        score=score,
    )
    return _Generate(model, engine, collector)


def _score(scorer, pad_id: int, trainer: Any, temperature: float, samples: list[Sample]) -> None:
    """Behaviour log-probs with the weights that just sampled, split as the trainer splits
    micro-batches (trainer.micro_batch_size / micro_batch_tokens)."""
    size, tokens = trainer.micro_batch_size, trainer.micro_batch_tokens
    for micro in split_micro(samples, size=size, tokens=tokens):
        record_behaviour(scorer, collate(micro, pad_id, torch.device("cpu")), temperature)


def _next_request(requests: Any, parent_pid: int, stop: Any) -> list[Sample] | None:
    """The next unit, or None to stop (asked to, or the trainer is gone)."""
    while True:
        if stop.is_set():  # before any unit still queued: the trainer is closing
            return None
        try:
            return requests.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:  # orphaned: the trainer died without a word
                return None


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the trainer dies (Linux); elsewhere `_next_request` notices."""
    if not signal_on_parent_death(signal.SIGKILL, parent_pid):
        os._exit(0)
