"""Speed of the policy losses and of BAPO's bound search (a script, not a timed test).

    python benchmarks/bench_loss.py                          # 2M tokens [1024, 2048], float32, CPU
    python benchmarks/bench_loss.py --device cuda            # on a GPU
    python benchmarks/bench_loss.py --batch 256 --seq 1024 --repeats 5 --threads 1

1. Loss: forward + backward of `ppo`, `clip_higher`, `bapo` (bound search included) and `bapo`
   with pre-solved bounds, on the same batch. Target: bapo / ppo <= 1.3.
2. Search: the one-pass `adaptive_bounds` vs an iterative search that re-evaluates rho over all
   tokens at every path step (one `.item()` per step), paper ranges. Target: >= 10x when the
   search walks the path. The iterative cost grows with the steps taken, the one-pass cost does
   not: cases that stop early, move c_low, walk the whole path (52 points) and on-policy data
   (r == 1: the one-pass search stops at once, the iterative one walks everything).

Data: stale ratios r = exp(N(0, 0.3)), one advantage per sequence (70% negative unless stated),
sequence lengths uniform in [T/4, T]. Timings are medians (or minima, --stat min) over
--repeats, the cases interleaved so that drift on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if importlib.util.find_spec("bapo_cli") is None:  # run from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bapo_cli.algos.bounds import BapoBounds, BoundPath, adaptive_bounds  # noqa: E402
from bapo_cli.algos.losses import policy_loss  # noqa: E402


def make_batch(batch: int, seq: int, device: str, p_pos: float = 0.3, stale: float = 0.3):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(batch, seq, generator=g) * 2 - 0.05
    log_prob = old + torch.randn(batch, seq, generator=g) * stale
    sign = torch.where(torch.rand(batch, generator=g) < p_pos, 1.0, -1.0)
    adv = sign * (0.2 + torch.rand(batch, generator=g))
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return [t.to(device) for t in (log_prob, old, adv, mask)]


def naive_search(ratio, adv, mask, rho0: float = 0.4):
    """Algorithm 1 as usually written: rho over all tokens at every path step, one host read
    per step (the same semantics as `adaptive_bounds`)."""
    path = BoundPath.build()
    mass = torch.where(mask, ratio * adv.abs(), 0.0).double()
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    for k in range(len(path)):
        c_low, c_high = path.point(k)
        p = torch.where(pos & (ratio < c_high), mass, 0.0).sum()
        n = torch.where(neg & (ratio > c_low), mass, 0.0).sum()
        total = (p + n).item()
        rho = p.item() / total if total > 0 else 1.0
        if rho >= rho0:
            break
    return k


def timed(fn: Callable[[], object], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def bench(
    cases: dict[str, Callable[[], object]], repeats: int, device: str, stat: str = "median"
) -> dict[str, float]:
    for fn in cases.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn, device))
    pick = min if stat == "min" else statistics.median
    return {name: pick(ts) for name, ts in times.items()}


def loss_cases(batch):
    log_prob, old, adv, mask = batch
    solved = policy_loss("bapo", log_prob, old, adv, mask)[1]
    bounds = BapoBounds(solved["c_low"], solved["c_high"], 0.0, 0.0, 0)

    def run(name, **params):
        def fn():
            lp = log_prob.detach().requires_grad_()
            loss, _ = policy_loss(name, lp, old, adv, mask, **params)
            loss.backward()

        return fn

    return {
        "ppo": run("ppo"),
        "clip_higher": run("clip_higher"),
        "bapo (search included)": run("bapo"),
        "bapo (bounds given)": run("bapo", bounds=bounds),
    }, solved


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        print(f"\n{title}")
        widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
        for row in [columns, *rows]:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--only", choices=["loss", "search"], default=None, help="one table")
    parser.add_argument(
        "--stat", choices=["median", "min"], default="median", help="min: best of --repeats"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokens = args.batch * args.seq
    where = args.device if args.device != "cpu" else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"torch {torch.__version__}, {where}, float32, [{args.batch}, {args.seq}] = "
        f"{tokens / 1e6:.2f}M tokens, {args.stat} of {args.repeats}"
    )

    if args.only != "search":
        bench_losses(args)
    if args.only != "loss":
        bench_search(args)


def bench_losses(args: argparse.Namespace) -> None:
    batch = make_batch(args.batch, args.seq, args.device)
    cases, solved = loss_cases(batch)
    ms = bench(cases, args.repeats, args.device, args.stat)
    rows = [[name, f"{t:.1f}", f"{t / ms['ppo']:.2f}x"] for name, t in ms.items()]
    print_table(
        f"Loss forward + backward (bapo walked {solved['search_steps']:.0f} steps)",
        ["loss", "ms", "vs ppo"],
        rows,
    )


def bench_search(args: argparse.Namespace) -> None:
    rows = []
    scenarios = {  # share of positive sequences decides how far the search walks
        "stops early (45% positive)": dict(p_pos=0.45),
        "c_low moves (36% positive)": dict(p_pos=0.36),
        "whole path (30% positive)": dict(p_pos=0.3),
        "on-policy, r == 1": dict(p_pos=0.3, stale=0.0),
    }
    for label, kw in scenarios.items():
        log_prob, old, adv, mask = make_batch(args.batch, args.seq, args.device, **kw)
        ratio = torch.exp(log_prob - old)
        adv_t = adv[:, None].expand_as(ratio)
        result = adaptive_bounds(ratio, adv_t, mask)
        steps = naive_search(ratio, adv_t, mask)
        assert steps == result.steps or label.startswith("on-policy"), (steps, result)
        del log_prob, old
        t = bench(
            {
                "one-pass": lambda r=ratio, a=adv_t, m=mask: adaptive_bounds(r, a, m),
                "iterative": lambda r=ratio, a=adv_t, m=mask: naive_search(r, a, m),
            },
            args.repeats,
            args.device,
            args.stat,
        )
        rows.append(
            [
                label,
                f"{result.steps} / {steps}",
                f"{t['one-pass']:.1f}",
                f"{t['iterative']:.1f}",
                f"{t['iterative'] / t['one-pass']:.1f}x",
            ]
        )
    print_table(
        "Bound search, paper ranges (52 path points)",
        ["case", "steps (one-pass / iterative)", "one-pass ms", "iterative ms", "speed-up"],
        rows,
    )


if __name__ == "__main__":
    main()
