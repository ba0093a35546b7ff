"""Training speed: `bapo train` against TRL's GRPOTrainer, and the default demo end to end.

    python benchmarks/bench_train.py                 # both tables
    python benchmarks/bench_train.py --only trl      # bapo vs TRL only (needs `pip install trl`)
    python benchmarks/bench_train.py --only trl --steps 150 --seeds 0,1,2 --plot curve.png
                                                     # reward curves over seeds, and a plot
    python benchmarks/bench_train.py --only demo     # the default `bapo train`: time, reward gain

bapo vs TRL: the same tiny checkpoint, 32 prompts × 8 samples, 8-token answers, lr 1e-4,
on-policy GRPO (`algo=grpo staleness=0 rollout=hf`; TRL: num_generations 8, one update per
generation batch, beta 0, same temperature), the same exact-match reward. Both run `--steps`
steps after a 3-step warm-up that is not timed, once per seed (`--seeds`: bapo's trainer.seed,
TRL's seed and arithmetic prompt set); steps/s, the mean reward of the last 10 steps and the
reward curve (mean over seeds, in tenths of the run) are printed. TRL is a benchmark-only
dependency (`pip install 'bapo-cli[bench]'`).

The demo: `bapo train` with no overrides (tiny model, arith, BAPO, staleness 4, 300 steps) run as
a subprocess, wall time including start-up, and the reward of the first and last tenth.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

PROMPTS, N, ANSWER_TOKENS, LR = 32, 8, 8, 1e-4


def bapo_steps(steps: int, seed: int = 0) -> tuple[float, list[float]]:
    """(steps/s after warm-up, reward of every step)."""
    from bapo_cli.config.preflight import preflight
    from bapo_cli.trainer.train import train

    overrides = [
        "algo=grpo",
        "staleness=0",
        "rollout=hf",
        "tracking=none",
        f"trainer.lr={LR}",
        f"trainer.prompts_per_step={PROMPTS}",
        f"rollout.n={N}",
        f"rollout.max_tokens={ANSWER_TOKENS}",
        f"trainer.max_steps={steps + 3}",
        "trainer.micro_batch_size=256",
        "trainer.log_samples=0",
        f"trainer.seed={seed}",
        f"data.seed={seed}",  # the prompt set, as TRL's ArithTask(seed) below
    ]
    cfg = preflight("train", overrides).config
    result = train(cfg, Path(tempfile.mkdtemp()) / "bapo", Console(quiet=True))
    timed = [h["perf/step_s"] for h in result.history[3:]]
    return len(timed) / sum(timed), [h["reward/mean"] for h in result.history]


def trl_steps(steps: int, seed: int = 0) -> tuple[float, list[float]]:
    """(steps/s after warm-up, reward of every step)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bapo_cli.config.preflight import preflight
    from bapo_cli.data.tasks import ArithTask, arith_reward
    from bapo_cli.models import loading as models

    cfg = preflight("train", []).config
    model, tokenizer = models.load_policy(cfg.model)
    model.train()
    problems = ArithTask(seed).prompts(PROMPTS * (steps + 3))
    dataset = Dataset.from_list(
        [{"prompt": f"{p.question}=", "answer": p.answer} for p in problems]
    )

    def reward(completions, answer, **_):
        return [arith_reward(c, a) for c, a in zip(completions, answer, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.rewards: list[float] = []

        def on_step_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    torch.manual_seed(seed)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=PROMPTS * N,
        num_generations=N,
        max_completion_length=ANSWER_TOKENS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=steps + 3,
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=seed,
    )
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    timed = clock.times[3:]
    return len(timed) / sum(timed), clock.rewards


def demo() -> tuple[float, float, float]:
    """Wall time of the default `bapo train` and its reward, read back from its MLflow run."""
    from mlflow.tracking import MlflowClient

    root = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "bapo_cli", "train", f"paths.output_root={root}"],
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - t0
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    history = sorted(
        client.get_metric_history(run.info.run_id, "reward/mean"), key=lambda m: m.step
    )
    h = [m.value for m in history]
    tenth = max(len(h) // 10, 1)
    return wall, statistics.mean(h[:tenth]), statistics.mean(h[-tenth:])


def curve(runs: list[list[float]], parts: int = 10) -> list[float]:
    """Mean reward per tenth of the run, averaged over seeds."""
    length = min(len(r) for r in runs)
    edges = [round(i * length / parts) for i in range(parts + 1)]
    return [
        statistics.mean(statistics.mean(r[a:b]) for r in runs)
        for a, b in zip(edges, edges[1:], strict=False)
        if b > a
    ]


def compare_with_trl(args: argparse.Namespace, console: Console) -> None:
    seeds = [int(x) for x in args.seeds.split(",")]
    ours = [bapo_steps(args.steps, seed) for seed in seeds]
    try:
        theirs = [trl_steps(args.steps, seed) for seed in seeds]
    except ImportError:
        theirs = []
    table = Table(
        title=f"GRPO, {PROMPTS} prompts × {N} samples, {ANSWER_TOKENS}-token answers, "
        f"{args.steps} timed steps (CPU), seeds {args.seeds}"
    )
    for col in ("trainer", "steps/s", "reward (last 10 steps)", "vs TRL"):
        table.add_column(col)
    speed = statistics.mean(r[0] for r in ours)
    last = statistics.mean(statistics.mean(r[1][-10:]) for r in ours)
    their_speed = statistics.mean(r[0] for r in theirs) if theirs else None
    vs = f"{speed / their_speed:.2f}x" if their_speed else "TRL not installed"
    table.add_row("bapo train", f"{speed:.2f}", f"{last:.3f}", vs)
    if theirs:
        their_last = statistics.mean(statistics.mean(r[1][-10:]) for r in theirs)
        table.add_row("TRL GRPOTrainer", f"{their_speed:.2f}", f"{their_last:.3f}", "1.00x")
    console.print(table)
    curves = {"bapo train": curve([r[1] for r in ours])}
    if theirs:
        curves["TRL GRPOTrainer"] = curve([r[1] for r in theirs])
    table = Table(title="reward per tenth of the run (mean over seeds)")
    table.add_column("trainer")
    for i in range(len(curves["bapo train"])):
        table.add_column(f"{i + 1}/10", justify="right")
    for name, values in curves.items():
        table.add_row(name, *(f"{v:.3f}" for v in values))
    console.print(table)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, runs in (("bapo train", ours), ("TRL GRPOTrainer", theirs)):
            for i, (_, rewards) in enumerate(runs):
                window = [
                    statistics.mean(rewards[max(0, j - 9) : j + 1]) for j in range(len(rewards))
                ]
                color = "tab:blue" if name == "bapo train" else "tab:orange"
                ax.plot(window, color=color, alpha=0.8, label=name if i == 0 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("reward (mean of 10 steps)")
        ax.set_title(f"GRPO on the tiny model, seeds {args.seeds}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        console.print(f"plot: {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (bapo vs TRL)")
    parser.add_argument("--plot", help="write the reward curves to this PNG")
    parser.add_argument("--only", choices=["trl", "demo"])
    args = parser.parse_args()
    console = Console(width=max(Console().width, 120))
    if args.only in (None, "trl"):
        compare_with_trl(args, console)
    if args.only in (None, "demo"):
        wall, first, last = demo()
        table = Table(title="default `bapo train` (tiny, arith, BAPO, staleness 4, 300 steps)")
        for col in ("wall s (subprocess, incl. start-up)", "reward first 10%", "reward last 10%"):
            table.add_column(col)
        table.add_row(f"{wall:.1f}", f"{first:.3f}", f"{last:.3f}")
        console.print(table)


if __name__ == "__main__":
    main()
