"""Rebuild the tiny models that ship with the package, and record how they were made.

    python -m bapo_cli.launch.testbed build tiny_pairs   # rewrites models/weights/tiny_pairs
    python -m bapo_cli.launch.testbed build tiny --out /tmp/tiny   # compared with the shipped

`model=tiny` and `model=tiny_pairs` load the warmed-up weights under `models/weights/<name>/`
instead of building them on first use (`tiny.ensure_tiny`), so every machine starts from the same
bits. This command is how those files were made and how to remake them: it builds the preset's
settings (`conf/model/<name>.yaml`) with `tiny.build_tiny`, measures the held-out accuracy the
docs quote (greedy, and avg@8 at temperature 0.6 / top-p 0.95 for seeds 0-4, as `bapo train`'s
step-0 validation does), and writes everything into the directory's `build_info.json`: command,
settings, steps, torch and transformers versions, threads, CPU kernels, the accuracy history,
those metrics and the sha256 of each file. Then it says whether the weights match the shipped
record bit for bit.

Why the pinned environment (`PINNED_ENV`): with one thread and deterministic algorithms the
build is the same on one machine, but the CPU kernels are chosen by instruction set -- MKL's GEMM
(AVX-512 vs AVX2 code paths) and torch's vectorised reductions (`ATEN_CPU_CAPABILITY`) -- and each
choice rounds differently (a 30-step pairs build gave four different weight hashes here for the
four combinations). Both are read once, when torch loads, so the command re-executes itself with
them pinned to AVX2 (any x86-64 CPU since 2013). What stays machine-dependent: a CPU without AVX2,
another architecture (ARM has no MKL), another torch, MKL or transformers version; the record
names the versions and kernels it was made with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# torch and the package modules this tool drives (most of them load torch) are imported inside
# the functions that use them: `main` re-executes itself with PINNED_ENV before torch loads, and
# module-level imports would load torch in the first process too (seconds, for nothing).

PINNED_ENV = {
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: the AVX2 code path
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorised kernels at AVX2
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
"""Read once when torch loads, so set before: the process re-executes itself with them."""
SHIPPED = ("tiny", "tiny_pairs")
"""The presets whose warmed-up weights ship (conf/model/<name>.yaml, models/weights/<name>/)."""
VAL_SEEDS = (0, 1, 2, 3, 4)
VAL_N = 8
VAL_MAX_TOKENS = {"arith": 16, "pairs": 40}
"""Response budget of the held-out avg@8: what training uses (`rollout.max_tokens` of the default
run, of `experiment=pairs`)."""
WEIGHT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")


def preset(name: str) -> tuple[Any, int]:
    """(TinyModelConfig, max_model_len) of `conf/model/<name>.yaml`: what `model=<name>` gives."""
    from omegaconf import OmegaConf

    from bapo_cli.config.hydra_runner import config_dir
    from bapo_cli.config.schema import TinyModelConfig

    if name not in SHIPPED:
        raise SystemExit(f"testbed: {name}: not a shipped tiny model (one of {', '.join(SHIPPED)})")
    yaml = OmegaConf.load(Path(config_dir()) / "model" / f"{name}.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(TinyModelConfig), yaml.tiny)
    cfg = TinyModelConfig(**OmegaConf.to_container(merged))  # type: ignore[arg-type]
    cfg.check()
    return cfg, int(yaml.max_model_len)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def heldout_avg(directory: Path, task: str, max_model_len: int, seeds=VAL_SEEDS) -> dict[str, Any]:
    """avg@8 at T 0.6 / top-p 0.95 on the task's held-out split per seed, measured as `bapo
    train`'s step-0 validation does (`evaluate.validate` on the transformers engine, on every
    held-out problem up to 200; data seed 0)."""
    import torch

    from bapo_cli.data.datasets import SYNTHETIC
    from bapo_cli.evaluation import evaluate
    from bapo_cli.models.loading import load_checkpoint
    from bapo_cli.rollout.hf import HFEngine
    from bapo_cli.seeding import seed_everything

    model, tokenizer = load_checkpoint(directory)
    spec = SYNTHETIC[task]
    problems = spec.make(0).held_out(evaluate.SYNTHETIC_VAL_PROBLEMS)
    sets = [
        (
            task,
            problems,
            {
                "template": spec.template,
                "grader": evaluate._reward_grader(spec.reward),
                "answer_of": spec.answer_of,
            },
        )
    ]
    engine = HFEngine(model, tokenizer)
    per_seed = {}
    for seed in seeds:
        seed_everything(seed)
        metrics = evaluate.validate(
            sets,
            engine,
            tokenizer,
            n=VAL_N,
            max_tokens=VAL_MAX_TOKENS[task],
            max_model_len=max_model_len,
        )
        per_seed[str(seed)] = round(metrics[f"val/{task}/avg_at_{VAL_N}"], 4)
    values = list(per_seed.values())
    mean = sum(values) / len(values)
    return {
        "metric": f"val/{task}/avg_at_{VAL_N}",
        "temperature": evaluate.VAL_SAMPLING.temperature,
        "top_p": evaluate.VAL_SAMPLING.top_p,
        "max_tokens": VAL_MAX_TOKENS[task],
        "problems": len(problems),
        "threads": torch.get_num_threads(),
        "per_seed": per_seed,
        "mean": round(mean, 4),
    }


def build(name: str, out: Path, argv: list[str], steps: int | None = None) -> dict[str, Any]:
    """Build preset `name` into `out` (replaced when complete) and write its record; `steps`
    replaces the preset's sft_steps (to try another length: the preset loads the result only
    once conf/model/<name>.yaml says the same)."""
    import dataclasses

    from bapo_cli.models import tiny

    cfg, max_model_len = preset(name)
    if steps is not None:
        cfg = dataclasses.replace(cfg, sft_steps=steps)
    out = out.expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))  # renamed into place
    try:
        info = tiny.build_tiny(cfg, tmp, progress=sys.stderr.isatty())
        info["preset"] = name
        info["command"] = "python -m bapo_cli.launch.testbed " + shlex.join(argv)
        info["environment"] = {k: os.environ.get(k) for k in PINNED_ENV}
        info["heldout_avg_at_8"] = heldout_avg(tmp, cfg.task, max_model_len)
        info["sha256"] = {f: sha256(tmp / f) for f in WEIGHT_FILES}
        (tmp / tiny.COMPLETE_MARKER).unlink(missing_ok=True)  # a cache entry's marker only
        (tmp / tiny.BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        for path in (tmp, *tmp.iterdir()):  # package data: readable by all (mkdtemp: 0700)
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def shipped_record(name: str) -> dict[str, Any] | None:
    """The shipped build_info.json of `name` (None: nothing ships yet)."""
    from bapo_cli.models.tiny import BUILD_INFO, SHIPPED_ROOT

    record = SHIPPED_ROOT / name / BUILD_INFO
    return json.loads(record.read_text()) if record.is_file() else None


def compare(name: str, built: str, shipped: str | None) -> str:
    """One line: did this build give the shipped weights bit for bit?"""
    if shipped is None:
        return f"{name}: no shipped record to compare with"
    if built == shipped:
        return f"{name}: weights identical to the shipped ones (sha256 {built[:16]})"
    return (
        f"{name}: weights differ from the shipped ones (sha256 {built[:16]} vs {shipped[:16]}): "
        "another CPU, torch, MKL or transformers (compare build_info.json)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bapo_cli.launch.testbed", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build a shipped tiny model and write its record")
    b.add_argument("name", choices=SHIPPED)
    b.add_argument("--out", type=Path, default=None, help="default: the shipped directory")
    b.add_argument("--steps", type=int, default=None, help="warm-up steps (default: the preset's)")
    args = parser.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in PINNED_ENV.items()):
        env = {**os.environ, **PINNED_ENV}
        cmd = [sys.executable, "-m", "bapo_cli.launch.testbed", *argv]
        os.execve(sys.executable, cmd, env)  # torch reads the pins when it loads
    from bapo_cli.models.tiny import SHIPPED_ROOT

    out = args.out if args.out is not None else SHIPPED_ROOT / args.name
    shipped = shipped_record(args.name)  # before a build into the shipped directory replaces it
    info = build(args.name, out, argv, args.steps)
    avg = info["heldout_avg_at_8"]
    print(
        f"{args.name}: {info['steps']} steps in {info['seconds']:.0f} s, held-out greedy "
        f"{info['accuracy']:.3f}, {avg['metric']} {avg['mean']:.3f} (seeds "
        f"{', '.join(f'{v:.3f}' for v in avg['per_seed'].values())}) -> {out}"
    )
    if shipped is not None and shipped["key"] != info["key"]:
        print(f"{args.name}: other settings than the shipped build (--steps?): not compared")
    else:
        digest = shipped["sha256"]["model.safetensors"] if shipped else None
        print(compare(args.name, info["sha256"]["model.safetensors"], digest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
