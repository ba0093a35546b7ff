"""Memory and time per response token of one update, and padding of micro-batch splits.

    python benchmarks/bench_memory.py                         # both tables, CPU
    python benchmarks/bench_memory.py --only length --lengths 256,512,1024,2048,4096
    python benchmarks/bench_memory.py --only mix              # fixed-count vs token-budget split
    python benchmarks/bench_memory.py --only chunks           # how trainer.logprob_chunk was chosen
    python benchmarks/bench_memory.py --device cuda --lengths 1024,4096,8192,16384

Table 1 ("length"): one optimizer update (forward + backward + AdamW step) of a micro-batch of
`--responses` responses of each length, on a Qwen2-shaped random model with Qwen's vocabulary
(151,936; hidden 64, 2 layers, float32 on CPU: the vocabulary-sized tensors dominate, as they do
per token in a real model), for three ways of getting the per-token log-probs and entropy:

  - old:   today's path before the chunked one: the output layer on every response position,
           float32 logits [b, R, V], log_softmax, exp for the entropy (kept for the backward);
  - trl:   TRL's GRPOTrainer helpers on the same logits: `selective_log_softmax` and
           `entropy_from_logits` (no grad), TRL being a benchmark-only dependency
           (`pip install 'bapo-cli[bench]'`);
  - new:   `bapo_cli.rollout.logprobs.chunked_logprobs` through `ResponseLogits` (the trainer's).

Each configuration runs in a fresh process. Memory added: on CPU the peak RSS during the update
minus the RSS before it (after a 1-token warm-up update that allocates AdamW's state); on CUDA
`torch.cuda.max_memory_allocated` minus the allocation before it. The old path is skipped above
`--old-max` response tokens (it would need ~2.4 MB per token): extrapolate from the measured rows.

Table 2 ("mix"): a mini-batch of `--mix-samples` responses with long-tailed lengths (lognormal,
median a quarter of `--mix-max`), split into micro-batches by a fixed count
(trainer.micro_batch_size) or by a token budget (trainer.micro_batch_tokens, sorted and packed):
padding share of the positions the forward saw, micro-batches, peak memory and update time.

Table 3 ("chunks"): the new path at one length for several chunk sizes (trainer.logprob_chunk).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

QWEN_VOCAB = 151_936


# ------------------------------------------------------------------------------ child process


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --shape 1.5b: Qwen2.5-1.5B's (hidden, layers, heads, kv heads, intermediate; tied embeddings)
SHAPE_1P5B = (1536, 28, 12, 2, 8960)


def _model(spec: dict, device, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab, hidden, layers = spec["vocab"], spec["hidden"], spec["layers"]
    heads, kv, inter = max(hidden // 64, 1), 1, hidden * 4
    if spec.get("shape") == "1.5b":
        hidden, layers, heads, kv, inter = SHAPE_1P5B
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads if spec.get("shape") == "1.5b" else 64,
        max_position_embeddings=32_768,
        tie_word_embeddings=spec.get("shape") == "1.5b",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).train()


def _full_logits_scorer(model, how: str, autocast):
    """The old path or TRL's, as a ResponseLogits (what the trainer's update calls)."""
    from bapo_cli.rollout.scoring import ResponseLogits

    class FullLogits(ResponseLogits):
        def forward(self, input_ids, attention_mask, gather_pos, targets, rows, cols, t, entropy):
            return _full_logits(
                self, how, input_ids, attention_mask, gather_pos, targets, rows, cols, t, entropy
            )

    return FullLogits(model, autocast)


def _full_logits(
    scorer, how, input_ids, attention_mask, gather_pos, targets, rows, cols, t, entropy
):
    """Logits [b, R, V] of every response position, then the old path's or TRL's functions."""
    import torch

    from bapo_cli.models.loading import autocast_to
    from bapo_cli.rollout.logprobs import full_vocab_logprobs

    model = scorer.model
    with autocast_to(scorer.autocast, input_ids.device):
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state
        index = gather_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        logits = model.get_output_embeddings()(hidden.gather(1, index))
    if how == "old":
        logp, ent = full_vocab_logprobs(logits, targets, t, entropy=entropy)
    else:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        logp = selective_log_softmax(logits, targets, temperature=t if t > 0 else 1.0)
        ent = None
        if entropy:
            with torch.no_grad():
                ent = entropy_from_logits(logits / t if t > 0 else logits)
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[rows, cols] = True
    return torch.where(mask, logp, 0.0), ent


def _samples(lengths: list[int], prompt: int, vocab: int, seed: int = 1):
    import torch

    from bapo_cli.rollout.base import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, r in enumerate(lengths):
        s = Sample(
            torch.randint(10, vocab, (prompt,), generator=g).tolist(),
            i // 4,
            None,
            torch.randint(10, vocab, (r,), generator=g).tolist(),
            versions=[0] * r,
        )
        s.logprobs = (-5.0 - torch.rand(r, generator=g)).tolist()  # stale: ratios away from 1
        s.advantage = 1.0 if i % 2 else -1.0
        out.append(s)
    return out


def child(spec: dict) -> dict:
    """One configuration, in this fresh process: build, warm up, measure one update."""
    import torch

    from bapo_cli.rollout.scoring import ResponseLogits, collate, split_micro
    from bapo_cli.trainer.update import Learner, LossSpec, optimizer_update

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = _model(spec, device, torch.float32)
    if spec.get("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autocast = None if dtype == torch.float32 else dtype
    if spec["path"] == "new":
        scorer = ResponseLogits(model, autocast, chunk=spec["chunk"])
    else:
        scorer = _full_logits_scorer(model, spec["path"], autocast)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    spec_loss = LossSpec.of("ppo", eps=0.2)

    def update(samples) -> tuple[dict, float]:
        parts = split_micro(samples, size=spec["micro_size"], tokens=spec["micro_tokens"])
        micro = [collate(part, 0, device) for part in parts]  # advantages from the samples
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = optimizer_update(Learner(scorer, optimizer, grad_clip=1.0), spec_loss, micro, 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        padded = sum(mb.padded_tokens for mb in micro)
        real = sum(mb.real_tokens for mb in micro)
        layout = {"micro_batches": len(micro), "pad_frac": 1.0 - real / max(padded, 1)}
        assert not result.skipped, "the update was skipped (non-finite)"
        return layout, time.perf_counter() - t0

    update(_samples([1], spec["prompt"], spec["vocab"], seed=0))  # AdamW state, allocator
    samples = _samples(spec["lengths"], spec["prompt"], spec["vocab"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _rss_mib()
    layout, seconds = update(samples)
    if device.type == "cuda":
        added = torch.cuda.max_memory_allocated() / 2**20 - before
    else:
        added = _peak_rss_mib() - before
    tokens = sum(spec["lengths"])
    return {
        **layout,
        "added_mib": added,
        "seconds": seconds,
        "tokens": tokens,
        "flops": _model_flops(model, spec, samples),
    }


def _model_flops(model, spec: dict, samples) -> float:
    """Model FLOPs of one forward + backward (MFU's numerator; recomputation not counted):
    6 · N_body · T_all (every weight but the embeddings, over prompt + response tokens)
    + 6 · V · H · T_resp (the output layer, applied to response tokens only)
    + 6 · L · H · S · T_all (causal attention scores and values, S the sequence length)."""
    cfg = model.config
    v, h, layers = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    embed = v * h
    body = sum(p.numel() for p in model.parameters()) - embed * (
        1 if cfg.tie_word_embeddings else 2
    )
    flops = 0.0
    for s in samples:
        seq = len(s.prompt_ids) + len(s.response_ids)
        flops += 6 * body * seq + 6 * v * h * len(s.response_ids) + 6 * layers * h * seq * seq
    return flops


def run_child(spec: dict) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------- tables


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _base(args) -> dict:
    return {
        "device": args.device,
        "threads": args.threads,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "prompt": args.prompt,
        "chunk": args.chunk,
        "micro_size": 10**9,
        "micro_tokens": None,
        "shape": args.shape,
        "grad_ckpt": args.grad_ckpt,
    }


def length_table(args, console: Console) -> None:
    table = Table(
        title=f"one update: {args.responses} responses of each length, vocabulary {args.vocab}, "
        + (
            "Qwen2.5-1.5B shape"
            if args.shape == "1.5b"
            else f"hidden {args.hidden}, {args.layers} layers"
        )
        + f", {args.device} ({args.threads} threads)"
    )
    cols = ["response tokens", "path", "memory added MiB", "KB / extra token", "update s"]
    if args.device == "cuda":
        cols += ["tokens/s", f"MFU (of {args.peak_tflops:g} TFLOP/s)"]
    for col in cols:
        table.add_column(col, justify="right")
    paths = ["old", "trl", "new"] if args.trl else ["old", "new"]
    previous: dict[str, tuple[int, float]] = {}  # path -> (tokens, MiB) of its last row
    for length in args.lengths:
        tokens = length * args.responses
        for path in paths:
            if path != "new" and tokens > args.old_max:
                table.add_row(f"{tokens:,}", path, "not run", "", "")
                continue
            r = run_child({**_base(args), "path": path, "lengths": [length] * args.responses})
            if "error" in r:
                table.add_row(f"{tokens:,}", path, r["error"][:60], "", "")
                continue
            # the slope from this path's previous row: what one more response token costs
            slope = ""
            if path in previous:
                t0, m0 = previous[path]
                slope = f"{(r['added_mib'] - m0) * 1024 / (tokens - t0):,.1f}"
            previous[path] = (tokens, r["added_mib"])
            row = [f"{tokens:,}", path, f"{r['added_mib']:,.0f}", slope, f"{r['seconds']:.2f}"]
            if args.device == "cuda":
                mfu = r["flops"] / r["seconds"] / (args.peak_tflops * 1e12)
                row += [f"{tokens / r['seconds']:,.0f}", f"{mfu:.1%}"]
            table.add_row(*row)
        table.add_section()
    console.print(table)
    console.print(f"load average during the table: {_load()}")


def mix_table(args, console: Console) -> None:
    import random

    rng = random.Random(0)
    median = args.mix_max / 4
    lengths = [
        min(max(int(rng.lognormvariate(0, 0.8) * median), 1), args.mix_max)
        for _ in range(args.mix_samples)
    ]
    table = Table(
        title=f"{args.mix_samples} responses, lognormal lengths (median {int(median)}, max "
        f"{args.mix_max}, mean {sum(lengths) / len(lengths):.0f}), vocabulary {args.mix_vocab}, "
        f"hidden {args.hidden}, {args.layers} layers"
    )
    for col in ("split", "micro-batches", "padding share", "memory added MiB", "update s"):
        table.add_column(col, justify="right")
    budget = args.mix_size * (args.mix_max + args.prompt)
    for name, size, tokens in (
        (f"micro_batch_size={args.mix_size} (arrival order)", args.mix_size, None),
        (f"micro_batch_tokens={budget} (sorted, packed)", 10**9, budget),
    ):
        spec = {**_base(args), "vocab": args.mix_vocab, "path": "new", "lengths": lengths}
        r = run_child({**spec, "micro_size": size, "micro_tokens": tokens})
        if "error" in r:
            table.add_row(name, r["error"][:60], "", "", "")
            continue
        table.add_row(
            name,
            str(r["micro_batches"]),
            f"{r['pad_frac']:.1%}",
            f"{r['added_mib']:,.0f}",
            f"{r['seconds']:.2f}",
        )
    console.print(table)
    console.print(f"load average during the table: {_load()}")


def chunk_table(args, console: Console) -> None:
    length = args.chunk_length
    table = Table(
        title=f"new path, {args.responses} x {length} response tokens, vocabulary {args.vocab}"
    )
    for col in ("logprob_chunk", "memory added MiB", "update s"):
        table.add_column(col, justify="right")
    for chunk in args.chunks:
        spec = {**_base(args), "path": "new", "chunk": chunk}
        r = run_child({**spec, "lengths": [length] * args.responses})
        if "error" in r:
            table.add_row(str(chunk), r["error"][:60], "")
            continue
        table.add_row(str(chunk), f"{r['added_mib']:,.0f}", f"{r['seconds']:.2f}")
    console.print(table)
    console.print(f"load average during the table: {_load()}")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, at least one")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--only", choices=["length", "mix", "chunks"], action="append")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sample")
    p.add_argument("--responses", type=int, default=4, help="responses per micro-batch")
    p.add_argument("--lengths", type=_ints, default=_ints("256,512,1024,2048,4096"))
    p.add_argument("--chunk", type=int, default=None, help="logprob_chunk (default: trainer's)")
    p.add_argument("--old-max", type=int, default=2048, help="largest token count for old/trl")
    p.add_argument("--no-trl", dest="trl", action="store_false", help="skip TRL's path")
    p.add_argument("--mix-samples", type=int, default=256, help="one mini-batch")
    p.add_argument("--mix-max", type=int, default=1024)
    p.add_argument("--mix-size", type=int, default=8, help="micro_batch_size of the count split")
    p.add_argument("--mix-vocab", type=int, default=8192)
    p.add_argument("--chunks", type=_ints, default=_ints("64,128,256,512,1024"))
    p.add_argument("--chunk-length", type=int, default=1024)
    p.add_argument(
        "--shape",
        choices=["test", "1.5b"],
        default="test",
        help="test: --hidden/--layers; 1.5b: Qwen2.5-1.5B's shape (for a GPU)",
    )
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="the device's dense bf16 peak for MFU (H200/H100 SXM: 989)",
    )
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.chunk is None:
        from bapo_cli.rollout.logprobs import DEFAULT_CHUNK

        args.chunk = DEFAULT_CHUNK
    if args.trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            p.error("TRL's row needs `pip install 'bapo-cli[bench]'` (or pass --no-trl)")
    console = Console(width=160)
    only = set(args.only or ["length", "mix"])
    if "length" in only:
        length_table(args, console)
    if "mix" in only:
        mix_table(args, console)
    if "chunks" in only:
        chunk_table(args, console)


if __name__ == "__main__":
    main()
