"""A training step on a busy machine: its slowdown beside busy loops vs a fair share's prediction.

    python benchmarks/bench_load.py                    # 12 steps, alone and beside 2 busy loops
    python benchmarks/bench_load.py --steps 20 --hogs 2 --modes legacy,new
    just bench-load

Each row runs the real command, `bapo train trainer.max_steps=N tracking=none` (the default demo
config: tiny model, BAPO, staleness 4), in a fresh process, twice: alone, then beside `--hogs`
single-threaded busy loops this script starts (and stops) itself. The step time is read from the
command's own status lines (`step i/N`, one per step for N <= 20): the time from step 1's line
to step N's over N - 1 steps, so start-up and the first step are not in it.

Modes (one row each, same run):
- legacy: `BAPO_THREADS=legacy`, the behaviour before issue 21: torch's defaults, one intra-op
  thread per core whatever else runs, OpenMP threads spinning while they wait.
- new: what `bapo train` does now (`bapo_cli.threads`): threads = cores free at start, at least
  1; waiting threads sleep (`OMP_WAIT_POLICY=PASSIVE`).
- passive2: `BAPO_THREADS=2`: sleeping waits but two threads whatever the load (which of the two
  changes matters).

The prediction: with T runnable threads of ours and L runnable tasks of everyone else on C cores,
a fair scheduler gives us min(T, C * T / (T + L)) cores. Predicted slowdown = the cores we had
alone / the cores we have beside the hogs, L = the 1-minute load average before the alone run
(+ the loops when loaded; the machine may be shared: /proc/loadavg is printed with every timing
and the ambient load is in the prediction). A slowdown near the prediction means the load costs
what it must and no more.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOG = "while True: pass"
MODES = {"legacy": "legacy", "new": None, "passive2": "2"}
"""Mode -> BAPO_THREADS (None: unset, what `bapo train` does by default)."""


def load_now() -> tuple[float, int]:
    """(1-minute load average, tasks runnable now)."""
    fields = Path("/proc/loadavg").read_text().split()
    return float(fields[0]), int(fields[3].split("/")[0])


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def run_train(steps: int, mode: str, out_root: Path) -> dict:
    """One `bapo train`; (per-step seconds, wall seconds, threads it chose, load before/after)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.pop("KMP_BLOCKTIME", None)
    env["BAPO_OUTPUT_ROOT"] = str(out_root)
    env["COLUMNS"] = "200"
    env.pop("BAPO_THREADS", None)
    if MODES[mode]:
        env["BAPO_THREADS"] = MODES[mode]
    cmd = [
        str(REPO / ".venv" / "bin" / "bapo"),
        "train",
        f"trainer.max_steps={steps}",
        "tracking=none",
    ]
    before = Path("/proc/loadavg").read_text().strip()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=out_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    stamps: dict[int, float] = {}
    threads = "?"
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(rf"step (\d+)/{steps}\b", line)
        if m:
            stamps[int(m.group(1))] = time.perf_counter()
        t = re.match(r"torch threads: (\d+)", line)
        if t:
            threads = t.group(1)
    proc.wait()
    wall = time.perf_counter() - t0
    after = Path("/proc/loadavg").read_text().strip()
    if proc.returncode != 0 or 1 not in stamps or steps not in stamps:
        tail = "".join(lines[-15:])
        raise SystemExit(f"bapo train ({mode}) failed, rc={proc.returncode}:\n{tail}")
    step_s = (stamps[steps] - stamps[1]) / (steps - 1)
    return {"step_s": step_s, "wall_s": wall, "threads": threads, "before": before, "after": after}


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.send_signal(signal.SIGKILL)
        hog.wait()


def fair_cores(threads: int, others: float, cores: int) -> float:
    """Cores a fair scheduler gives `threads` runnable threads beside `others` runnable tasks."""
    return min(threads, cores, cores * threads / (threads + max(others, 0.0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run (2..20)")
    parser.add_argument("--hogs", type=int, default=2, help="busy loops beside the loaded run")
    parser.add_argument("--modes", default="legacy,new", help="comma list: legacy, new, passive2")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_load"))
    args = parser.parse_args()
    if not 2 <= args.steps <= 20:
        parser.error(f"--steps {args.steps}: must be within [2, 20] (one status line per step)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes {args.modes}: a comma list of {', '.join(MODES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    print(f"{cores} usable cores; {args.steps} steps per run; {args.hogs} busy loops when loaded")
    print("the machine may be shared: /proc/loadavg is printed before and after every run\n")
    rows = []
    for mode in modes:
        load_alone = load_now()
        alone = run_train(args.steps, mode, args.out)
        print(
            f"{mode:6s} alone   {alone['step_s']:.3f} s/step  wall {alone['wall_s']:.1f} s  "
            f"threads {alone['threads']}  loadavg {alone['before']} -> {alone['after']}"
        )
        hogs = start_hogs(args.hogs)
        try:
            time.sleep(2.0)  # the loops are running before the run starts
            busy = run_train(args.steps, mode, args.out)
        finally:
            stop_hogs(hogs)
        print(
            f"{mode:6s} loaded  {busy['step_s']:.3f} s/step  wall {busy['wall_s']:.1f} s  "
            f"threads {busy['threads']}  loadavg {busy['before']} -> {busy['after']}"
        )
        t_alone = int(alone["threads"]) if alone["threads"].isdigit() else cores
        t_busy = int(busy["threads"]) if busy["threads"].isdigit() else cores
        # everyone else's runnable tasks: the ambient 1-minute load average before the alone
        # run, plus the loops (the average lags them by a minute, so they are added as known)
        others_alone = load_alone[0]
        others_busy = load_alone[0] + args.hogs
        predicted = fair_cores(t_alone, others_alone, cores) / fair_cores(
            t_busy, others_busy, cores
        )
        rows.append((mode, alone, busy, busy["step_s"] / alone["step_s"], predicted))
        time.sleep(5.0)
    print()
    print(
        "| mode | threads alone / loaded | step s alone | step s beside "
        f"{args.hogs} loops | slowdown | fair-share prediction | slowdown / prediction |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, alone, busy, slow, pred in rows:
        print(
            f"| {mode} | {alone['threads']} / {busy['threads']} | {alone['step_s']:.3f} | "
            f"{busy['step_s']:.3f} | {slow:.2f}x | {pred:.2f}x | {slow / pred:.2f} |"
        )
    by_mode = {mode: busy["step_s"] for mode, _, busy, _, _ in rows}
    if "legacy" in by_mode and "new" in by_mode:
        print(f"\nloaded step, legacy / new: {by_mode['legacy'] / by_mode['new']:.2f}x")


if __name__ == "__main__":
    main()
