"""Speed of one optimizer update on a model of real shape (a script that prints a table).

One update = the trainer's `optimizer_update`: BAPO's bound search (when several micro-batches:
one extra no-grad forward each), forward + backward of every micro-batch, clip, AdamW step. The
model is a randomly initialised Qwen2 of the named shape (nothing is downloaded), the batch
random tokens with stale behaviour log-probs, so the search has work to do.

    python benchmarks/bench_update.py --shape 0.5b                        # one process
    python benchmarks/bench_update.py --shape 0.5b --precision pure       # bf16 weights
    torchrun --nproc_per_node 1 benchmarks/bench_update.py --strategy fsdp2 --shape 0.5b
    python benchmarks/bench_update.py --shape tiny --device cpu --seqs 8 --prompt 16 --response 16

It answers: what BAPO's search costs next to PPO once the model's forward and backward are in the
picture (the loss-only numbers are benchmarks/bench_loss.py), and what mixed precision (float32
weights, bfloat16 compute: autocast, or FSDP2's MixedPrecisionPolicy) costs next to plain
bfloat16 weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bapo_cli.algos.advantages import REGISTRY as ADVANTAGES
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import ResponseLogits, collate, token_logprobs
from bapo_cli.trainer import distributed
from bapo_cli.trainer.update import Learner, loss_spec, optimizer_update

# hidden, layers, heads, kv heads, intermediate, vocab (Qwen2.5 shapes; tiny = a test model)
SHAPES = {
    "tiny": (128, 2, 2, 1, 256, 512),
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "1.5b": (1536, 28, 12, 2, 8960, 151936),
}


def make_model(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).train()


def make_batch(model, args, device: torch.device) -> list[Sample]:
    """`seqs` responses in groups of 8, stale behaviour log-probs (ratios far from 1)."""
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape][5]
    samples = []
    for i in range(args.seqs):
        prompt = torch.randint(10, vocab, (args.prompt,), generator=g).tolist()
        response = torch.randint(10, vocab, (args.response,), generator=g).tolist()
        samples.append(Sample(prompt, i // 8, None, response, versions=[0] * args.response))
    rewards = torch.rand(len(samples), generator=g).round().double()
    adv, _ = ADVANTAGES.get("grpo")(rewards, torch.tensor([s.group for s in samples]))
    scorer = ResponseLogits(model)
    with torch.no_grad():
        for i in range(0, len(samples), args.micro):
            part = samples[i : i + args.micro]
            logp, _ = token_logprobs(scorer, collate(part, 0, device), 1.0)
            noise = 0.3 * torch.randn(logp.shape, generator=g).to(device)
            for s, row in zip(part, (logp + noise).float().cpu().tolist(), strict=True):
                s.logprobs = row[: len(s.response_ids)]
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantage = a
    return samples


def algo_config(name: str):
    from bapo_cli.config.schema import BapoAlgoConfig, PPOAlgoConfig

    if name == "bapo":
        return BapoAlgoConfig(name="bapo", loss="bapo", advantage="grpo")
    return PPOAlgoConfig(name="ppo", loss="ppo", advantage="grpo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--strategy", choices=distributed.STRATEGIES, default="ddp")
    parser.add_argument("--seqs", type=int, default=32, help="sequences per update")
    parser.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--algos", default="ppo,bapo")
    parser.add_argument(
        "--precision",
        choices=("mixed", "pure"),
        default="mixed",
        help="as trainer.precision: float32 weights + bf16 compute, or bf16 weights",
    )
    args = parser.parse_args()

    ctx = distributed.from_env(args.strategy)
    device = torch.device(args.device)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    mixed = args.precision == "mixed" and compute != torch.float32
    stored = torch.float32 if mixed else compute
    autocast = compute if mixed and not ctx.sharded else None
    rows = []
    for algo in args.algos.split(","):
        model = make_model(args.shape, device, stored)
        samples = make_batch(model, args, device)
        scorer = ctx.wrap(ResponseLogits(model, autocast), compute)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        spec = loss_spec(algo_config(algo))
        micro = [  # advantages from the samples
            collate(samples[i : i + args.micro], 0, device)
            for i in range(0, len(samples), args.micro)
        ]
        learner = Learner(scorer, optimizer, grad_clip=1.0, ctx=ctx)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, result = [], None
        for i in range(args.repeats + 1):  # the first is a warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = optimizer_update(learner, spec, micro, version=1)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        tokens = args.seqs * args.response * ctx.world_size
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        assert result is not None  # repeats + 1 >= 1 updates ran
        bounds = f"[{result.metrics['c_low']:.2f}, {result.metrics['c_high']:.2f}]"
        rows.append([algo, f"{ms:.1f}", f"{tokens / ms * 1e3:,.0f}", f"{peak:.1f}", bounds])
        del model, scorer, optimizer, micro, samples
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if ctx.is_main:
        from rich.console import Console
        from rich.table import Table

        where = f"{args.device}, {args.strategy if ctx.enabled else 'one process'}"
        table = Table(
            title=f"one optimizer update: Qwen2 {args.shape} shape, {args.seqs} seqs × "
            f"({args.prompt} + {args.response}) tokens, micro {args.micro}, {where}, "
            f"weights {str(stored).removeprefix('torch.')}, compute "
            f"{str(compute).removeprefix('torch.')}, median of {args.repeats}"
        )
        for column in ("algo", "ms / update", "response tokens / s", "peak GiB", "bounds"):
            table.add_column(column, justify="right" if column != "algo" else "left")
        for row in rows:
            table.add_row(*row)
        Console(width=140).print(table)
    distributed.shutdown(ctx)


if __name__ == "__main__":
    main()
