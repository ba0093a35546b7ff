"""Rollout speed: tokens/s of the transformers engine vs vLLM on the same requests (a script, not
a timed test).

    python benchmarks/bench_rollout.py                       # tiny model, 32 prompts x 8, CPU
    python benchmarks/bench_rollout.py --prompts 64 --n 16 --max-tokens 32 --repeats 5
    python benchmarks/bench_rollout.py model=qwen2.5-math-1.5b   # any `bapo train` override

Both engines get the same requests (the training prompt stream's first `--prompts` problems, each
`--n` times, `--max-tokens` new tokens at temperature 1) and report new tokens per second of
`generate()` (median over `--repeats` after one warm-up call each, the engines taking turns so
that drift on a shared machine hits both), plus vLLM's weight-sync time (`perf/weight_sync_s`:
the trainer's weights copied in from memory). The counts include the end token; responses stop
early, so both engines' token counts are shown.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

if importlib.util.find_spec("bapo_cli") is None:  # run from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def bench(engines: dict, requests, params, repeats: int) -> dict[str, tuple[float, int]]:
    """Median tokens/s and tokens per call of each engine."""
    import torch

    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    for engine in engines.values():
        engine.generate(requests, params)  # warm-up (caches, first-call allocation)
    for _ in range(repeats):
        for name, engine in engines.items():
            torch.manual_seed(0)
            t0 = time.perf_counter()
            gens = engine.generate(requests, params)
            seconds = time.perf_counter() - t0
            tokens[name] = sum(len(g.token_ids) for g in gens)
            rates[name].append(tokens[name] / seconds)
    return {name: (statistics.median(r), tokens[name]) for name, r in rates.items()}


def main() -> None:
    import torch
    from rich.console import Console

    from bapo_cli.config.preflight import preflight
    from bapo_cli.models import loading as models
    from bapo_cli.rollout.base import Request, SamplingParams, make_engine
    from bapo_cli.trainer.prompts import PromptStream

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("overrides", nargs="*", help="bapo train overrides (model=..., ...)")
    args = parser.parse_args()

    cfg = preflight("train", ["tracking=none", *args.overrides]).config
    model, tokenizer = models.load_policy(cfg.model)
    model.eval()
    prompts = PromptStream(cfg, tokenizer, Console(quiet=True))
    requests = [
        Request(tuple(prompts.encode(p)), (), args.max_tokens)
        for p in prompts.prompt_set.take(0, args.prompts)
        for _ in range(args.n)
    ]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)
    device = next(model.parameters()).device
    print(
        f"{cfg.model.name} on {device} ({torch.get_num_threads()} threads): {len(requests)} "
        f"requests ({args.prompts} prompts x {args.n}), up to {args.max_tokens} new tokens"
    )
    engines = {
        name: make_engine(name, model=model, tokenizer=tokenizer, cfg=cfg)
        for name in args.engines.split(",")
    }
    try:
        results = bench(engines, requests, params, args.repeats)
        syncs = {
            n: [e.sync_weights(model, 1) for _ in range(args.repeats)] for n, e in engines.items()
        }
    finally:
        for engine in engines.values():
            engine.close()
    for name, (rate, tokens) in results.items():
        print(
            f"  {name:5s} {rate:10.0f} tokens/s   ({tokens} tokens per call; weight sync "
            f"{statistics.median(syncs[name]) * 1000:.1f} ms)"
        )
    if "hf" in results and "vllm" in results:
        print(f"  vllm / hf: {results['vllm'][0] / results['hf'][0]:.1f}x")


if __name__ == "__main__":  # vLLM may start worker processes that re-import this file
    main()
