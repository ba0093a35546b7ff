"""Two processes on gloo holding different halves of a batch get identical bounds, equal to one
process on the whole batch (the K-length sums are all-reduced before the solve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bapo_cli
from bapo_cli.algos.bounds import adaptive_bounds
from bapo_cli.algos.losses import policy_loss

WORKER = r"""
import json, sys
import torch
import torch.distributed as dist
from bapo_cli.algos.bounds import BoundAccumulator, adaptive_bounds
from bapo_cli.algos.losses import policy_loss

rank, world, store, data = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
batch = torch.load(data)
rows = slice(rank * 20, (rank + 1) * 20)  # this rank's half
ratio, adv, mask = (batch[k][rows] for k in ("ratio", "adv", "mask"))
group = dist.group.WORLD
one_shot = adaptive_bounds(ratio, adv, mask, group=group)
acc = BoundAccumulator()
for part in (slice(0, 7), slice(7, 20)):  # micro-batches on this rank
    acc.add(ratio[part], adv[part], mask[part])
accumulated = acc.solve(0.4, group=group)
lp, old = batch["log_prob"][rows], batch["old"][rows]
_, metrics = policy_loss("bapo", lp, old, batch["adv_seq"][rows], mask, group=group)
print(json.dumps({
    "one_shot": one_shot.__dict__,
    "accumulated": accumulated.__dict__,
    "loss": {k: metrics[k] for k in ("c_low", "c_high", "rho", "search_steps")},
}), flush=True)
dist.barrier()  # no rank tears gloo down while the other still talks (seen: abort at exit)
dist.destroy_process_group()
# skip the interpreter's exit-time destructors: a gloo thread torn down there aborted a rank with
# "terminate called without an active exception" after its result was printed (seen twice in CI)
sys.stdout.flush()
import os
os._exit(0)
"""


def make_batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(40, 64, generator=g) * 3
    log_prob = old + torch.randn(40, 64, generator=g) * 0.3
    # the two halves differ: rank 0 mostly positive, rank 1 mostly negative
    p_pos = torch.cat([torch.full((20,), 0.7), torch.full((20,), 0.1)])
    adv_seq = torch.where(torch.rand(40, generator=g) < p_pos, 1.0, -1.0)
    mask = torch.rand(40, 64, generator=g) < 0.9
    ratio = torch.exp(log_prob - old)
    adv = adv_seq[:, None].expand(40, 64).contiguous()
    return dict(ratio=ratio, adv=adv, mask=mask, log_prob=log_prob, old=old, adv_seq=adv_seq)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_two_gloo_ranks_get_the_bounds_of_the_whole_batch(tmp_path: Path):
    batch = make_batch()
    torch.save(batch, tmp_path / "batch.pt")
    src = str(Path(bapo_cli.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), "2", str(store), str(tmp_path / "batch.pt")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))

    whole = adaptive_bounds(batch["ratio"], batch["adv"], batch["mask"])
    halves = [
        adaptive_bounds(batch["ratio"][rows], batch["adv"][rows], batch["mask"][rows])
        for rows in (slice(0, 20), slice(20, 40))
    ]
    assert halves[0].c_high != halves[1].c_high  # the halves alone disagree
    _, whole_loss = policy_loss(
        "bapo", batch["log_prob"], batch["old"], batch["adv_seq"], batch["mask"]
    )
    for res in results:
        assert res == results[0]  # bit-identical on every rank: one all-reduced vector
        for key in ("one_shot", "accumulated"):
            got = res[key]
            assert (got["c_low"], got["c_high"], got["steps"]) == (
                whole.c_low,
                whole.c_high,
                whole.steps,
            )
            # the same float32 masses summed in float64 in another order (two halves, then the
            # all-reduce): relative error about n * 2^-53 = 2.8e-13 for n = 40 * 64 tokens
            assert got["rho"] == pytest.approx(whole.rho, rel=1e-12)
        assert res["loss"]["c_high"] == whole_loss["c_high"]
        assert res["loss"]["c_low"] == whole_loss["c_low"]
        assert res["loss"]["search_steps"] == whole_loss["search_steps"]
    assert whole.steps > 0
