"""A torchrun rank that joins the process group, all-reduces its rank and reports.

`python -m tests.faults.rank_probe OUT [HOLD]`: writes `OUT.<rank>` (JSON: world size, the
all-reduced sum of ranks, MASTER_ADDR) once every rank has joined, then, with HOLD, waits until
the file HOLD exists (the test looks at the sockets meanwhile) and meets the others once more.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: str, hold: str | None = None) -> None:
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    report = {
        "world": dist.get_world_size(),
        "sum": total.item(),
        "master_addr": os.environ["MASTER_ADDR"],
    }
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(report))
    deadline = time.monotonic() + 120
    while hold is not None and not Path(hold).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
