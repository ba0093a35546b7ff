"""LoRA against full fine-tuning: trainable parameters, memory and time of one optimizer update.

    python benchmarks/bench_lora.py                          # Qwen2.5-0.5B's shape, CPU
    python benchmarks/bench_lora.py --layers 8 --ranks 1,8,32 --steps 3
    python benchmarks/bench_lora.py --device cuda --shape 1.5b

Each row runs in a fresh process: a random model of the shape (Qwen2.5-0.5B: hidden 896,
24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings; `--layers`
keeps fewer of its layers), float32 on CPU, then `--steps` timed optimizer updates after one
warm-up update, each the trainer's own: `ResponseLogits` + `trainer.update.optimizer_update` with
BAPO's loss and bound search over a micro-batch of `--responses` responses of `--tokens`
tokens (prompt 32 tokens), AdamW over what trains (`models.lora.trainable`: everything, or the
adapters on every decoder linear layer, `all-linear`).

Columns: trainable and total parameters; peak RSS of the process (CPU) or peak allocated memory
(CUDA); "training overhead" is that peak minus the memory right after the model was built
(gradients, AdamW state, activations); step s is the mean wall time of the timed updates and
CPU s their mean process CPU time (all threads): on a shared machine wall time depends on the
load, CPU time much less.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "0.5b": (896, 24, 14, 2, 4864, 151_936),
    "1.5b": (1536, 28, 12, 2, 8960, 151_936),
}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _now_mib(device) -> float:
    import torch

    return torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else _rss_mib()


def child(spec: dict) -> dict:
    """One row: build, warm up, time `steps` updates; returns the measurements."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bapo_cli.config.schema import LoraConfig
    from bapo_cli.models import lora
    from bapo_cli.rollout.base import Sample
    from bapo_cli.rollout.scoring import ResponseLogits, collate
    from bapo_cli.trainer.update import Learner, LossSpec, optimizer_update

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    hidden, layers, heads, kv, inter, vocab = SHAPES[spec["shape"]]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=spec["layers"] or layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    if spec["rank"]:
        model = lora.apply(model, LoraConfig(rank=spec["rank"], alpha=2.0 * spec["rank"]))
    built = _now_mib(device)
    trainable, total = lora.counts(model)
    scorer = ResponseLogits(model)
    optimizer = torch.optim.AdamW(lora.trainable(model), lr=1e-5)
    spec_loss = LossSpec.of("bapo")  # the paper's search settings
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(spec["responses"]):
        prompt = torch.randint(10, vocab, (32,), generator=g).tolist()
        response = torch.randint(10, vocab, (spec["tokens"],), generator=g).tolist()
        logprobs = (-5.0 - torch.rand(spec["tokens"], generator=g)).tolist()
        s = Sample(prompt, i // 2, None, response, logprobs, versions=[0] * spec["tokens"])
        s.advantage = 1.0 if i % 2 else -1.0
        samples.append(s)
    mb = collate(samples, 0, device)  # advantages from the samples
    learner = Learner(scorer, optimizer, grad_clip=1.0)

    def update() -> None:
        result = optimizer_update(learner, spec_loss, [mb], version=0)
        assert not result.skipped

    update()  # warm-up: allocates AdamW's state
    if device.type == "cuda":
        torch.cuda.synchronize()
    times, cpu = [], []
    for _ in range(spec["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _peak_mib(device)
    return {
        "trainable": trainable,
        "total": total,
        "peak_mib": peak,
        "overhead_mib": peak - built,
        "step_s": sum(times) / len(times),
        "cpu_s": sum(cpu) / len(cpu),
        "threads": torch.get_num_threads(),
    }


def run_row(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"row {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--layers", type=int, default=0, help="keep this many layers (0: all)")
    parser.add_argument("--ranks", default="8", help="LoRA ranks to compare with full (comma)")
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96, help="response tokens each")
    parser.add_argument("--steps", type=int, default=3, help="timed updates (after 1 warm-up)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    try:
        ranks = [0] + [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--ranks {args.ranks}: must be comma-separated integers") from None
    if any(r < 1 for r in ranks[1:]):
        raise SystemExit(f"--ranks {args.ranks}: LoRA ranks must be >= 1")
    base = {
        "shape": args.shape,
        "layers": args.layers,
        "responses": args.responses,
        "tokens": args.tokens,
        "steps": args.steps,
        "device": args.device,
    }
    layers = args.layers or SHAPES[args.shape][1]
    table = Table(
        title=f"one BAPO update, {args.shape} shape ({layers} layers), {args.device}, "
        f"{args.responses} × ({32} + {args.tokens}) tokens"
    )
    cols = ("policy", "trainable", "total", "peak MiB", "training overhead MiB", "step s", "CPU s")
    for col in cols:
        table.add_column(col, justify="right")
    for rank in ranks:
        row = run_row({**base, "rank": rank})
        table.add_row(
            "full" if rank == 0 else f"LoRA r={rank}",
            f"{row['trainable']:,} ({100 * row['trainable'] / row['total']:.2f}%)",
            f"{row['total']:,}",
            f"{row['peak_mib']:.0f}",
            f"{row['overhead_mib']:.0f}",
            f"{row['step_s']:.2f}",
            f"{row['cpu_s']:.2f}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
