"""A delta push's cost in seconds on Qwen2.5-0.5B's shape (issue 47): the encode and the apply
before and after they were vectorised, side by side on the same versions, and the trainer's
write and the server's read of a delta against a full version. Results and the reading:
docs/benchmarks.md#delta-pushes.

    python benchmarks/bench_delta_speed.py                      # bf16, lr 1e-6,1e-5,1e-4
    python benchmarks/bench_delta_speed.py --lrs 1e-6 --steps 2 --threads 2

The model (494M parameters, random float32 weights, all 24 layers) takes real AdamW steps
(weight decay 0, random tokens 2 x 64, each lr from the same start), each parameter's step taken
as soon as its gradient is whole and the gradient freed (PyTorch's optimizer-in-backward recipe:
the same numbers as one AdamW, without 2 GB of gradients held); each lr runs in a process of its
own, whose peak resident memory is printed (about 9 GiB: 2 GB of float32 weights, 4 GB of
AdamW state, two versions in bf16). Per step, median over the steps:

- **changed**: the share of elements whose bits change in the serving dtype;
- **encode s**: `weights_delta.encode` of the two versions, as before (torch: bool `sum`,
  `nonzero`, `diff`, two casts; the code at 921b339, copied below) and now (numpy views), their
  outputs checked equal bit for bit;
- **apply s**: each changed tensor's delta applied to a copy of the version before, as before
  and now, checked equal to the new version bit for bit;
- **trainer write s**: a `VersionWriter` writing the version full (cast to the serving dtype,
  safetensors, fsync) and one writing it as a delta (the same plus the encode), this code;
- **server s**: a server's side without vLLM: reading the full version and copying each tensor
  (as vLLM's reload copies it into the parameters), against reading the delta, applying it to
  the version held and copying each tensor the same way.

The machine is shared: the load average is printed with every row.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from bench_push import build, load  # noqa: E402

from bapo_cli.rollout import weights_delta, weights_fs  # noqa: E402
from bapo_cli.rollout.weights_delta import GAP, STRIDE, VAL, VersionWriter, _bits  # noqa: E402

# ------------------------------------------------------- the code before (921b339), verbatim


def encode_before(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in new.items():
        moved = _bits(old[name]) != _bits(t)
        count = int(moved.sum())
        if count == 0:
            continue
        entries = count + -(-t.numel() // STRIDE)
        if entries * (2 + t.element_size()) >= t.numel() * t.element_size():
            out[name] = t
            continue
        out[name + GAP], out[name + VAL] = sparse_before(moved, t.reshape(-1))
    return out


def sparse_before(moved: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    moved[::STRIDE] = True
    positions = moved.nonzero().reshape(-1)
    gaps = torch.diff(positions, prepend=positions.new_zeros(1))
    return gaps.to(torch.int32).to(torch.int16), flat[positions]


def apply_before(held: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
    for key, t in delta.items():
        if key.endswith(GAP):
            name = key[: -len(GAP)]
            positions = torch.cumsum(t.to(torch.int64) & 0xFFFF, 0)
            held[name].reshape(-1)[positions] = delta[name + VAL]
        elif not key.endswith(VAL):
            held[key] = t.clone()


# ---------------------------------------------------------------------------------- steps


def adamw_in_backward(model: torch.nn.Module, lr: float) -> list:
    """One AdamW per parameter, stepped when its gradient is accumulated (a tied parameter's
    once, with both uses summed), the gradient then freed. The hooks' handles (each hook keeps
    its optimizer and so the model alive until they are removed, or the process ends)."""
    opts = {
        p: torch.optim.AdamW([p], lr=lr, weight_decay=0.0, foreach=False)
        for p in model.parameters()
    }

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    return [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]


def timed(f: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = f()
    return time.perf_counter() - t0, out


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a
    )


def measure_step(model, writer: VersionWriter, work: Path, version: int) -> dict[str, float]:
    """One version written as a delta and full, its encode and apply before and now, and the
    server's side of each; every output checked bit for bit. In this order so that at most two
    versions in the serving dtype are held at once."""
    serving = writer.dtype
    root = work / "delta"
    prev = writer._held  # the version before, as the writer keeps it (replaced, not changed)
    delta_s, w = timed(lambda: writer.write(model.named_parameters(), root, version))
    now = writer._held
    changed = sum(
        int(np.count_nonzero(_bits(prev[n]).numpy() != _bits(t).numpy())) for n, t in now.items()
    )
    t0 = time.perf_counter()
    d_before = encode_before(prev, now)
    t1 = time.perf_counter()
    d_after = weights_delta.encode(prev, now)
    t2 = time.perf_counter()
    before_s, after_s = t1 - t0, t2 - t1
    assert same_bits(d_before, d_after), "the encodes differ"
    del d_before
    applied = {apply_before: 0.0, weights_delta.apply: 0.0}
    for key in d_after:
        if key.endswith(VAL):
            continue
        name = key.removesuffix(GAP)
        sub = {k: d_after[k] for k in (key, name + VAL) if k in d_after}
        for f in applied:
            held = {name: prev[name].clone()}
            t0 = time.perf_counter()
            f(held, sub)
            applied[f] += time.perf_counter() - t0
            assert same_bits(held, {name: now[name]}), (f.__name__, name)
    del d_after
    scratch = torch.empty(max(t.numel() for t in now.values()), dtype=serving)
    if w.delta:  # a server holding `prev`: reads the delta, applies it, reloads every tensor
        t0 = time.perf_counter()
        weights_delta.apply(prev, weights_delta.read(w.directory))
        reload(scratch, prev.items())
        server_delta_s = time.perf_counter() - t0
        assert same_bits(prev, now), "the server's copy is not the new version"
    del prev
    full_s, w_full = timed(
        lambda: VersionWriter(dtype=serving).write(model.named_parameters(), work / "full", version)
    )
    server_full_s, _ = timed(
        lambda: reload(scratch, weights_fs.open_version(w_full.directory, version))
    )
    if not w.delta:
        server_delta_s = server_full_s  # the delta writer wrote it full: the same read
    weights_fs.remove(work / "full", [version])
    weights_fs.cleanup(root, keep_from=version)
    return {
        "changed": changed / sum(t.numel() for t in now.values()),
        "bytes": w.bytes / w.full_bytes,
        "delta": float(w.delta),
        "encode_before": before_s,
        "encode_after": after_s,
        "apply_before": applied[apply_before],
        "apply_after": applied[weights_delta.apply],
        "write_full": full_s,
        "write_delta": delta_s,
        "server_full": server_full_s,
        "server_delta": server_delta_s,
    }


def reload(scratch: torch.Tensor, named) -> None:
    """Every tensor copied into memory of its own, as vLLM's reload copies a version into the
    parameters (one buffer reused: the parameters are not what is measured)."""
    for _, t in named:
        scratch[: t.numel()].view(t.shape).copy_(t)


def save_model(work: Path) -> Path:
    return build("0.5B", work, 24)[1]


def one_lr(directory: Path, work: Path, lr: float, dtype: str, steps: int, threads: int) -> dict:
    """One lr's steps from the saved start, in a process of its own (spawned: the allocator's
    leftovers of the one before do not add up); the medians, the load average over them and
    this process's peak resident memory."""
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(threads)
    console = Console(width=180)
    model = Qwen2ForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    adamw_in_backward(model, lr)
    writer = VersionWriter(delta=True, full_every=steps + 2, dtype=getattr(torch, dtype))
    writer.write(model.named_parameters(), work / "delta", 0)  # the start: full
    ids = torch.randint(0, 151936, (2, 64), generator=torch.Generator().manual_seed(0))
    la = load()
    got: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        model(ids, labels=ids).loss.backward()  # each parameter stepped in its hook
        got.append(measure_step(model, writer, work, step))
        console.print(f"lr {lr:g} step {step}: {got[-1]}", style="dim")
    weights_fs.remove(work / "delta", weights_fs.versions(work / "delta"))
    out = {k: statistics.median(g[k] for g in got) for k in got[0]}
    out["all_delta"] = all(g["delta"] for g in got)
    out["load"] = f"{la} / {load()}"
    out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def rows(console: Console, work: Path, lrs: list[float], dtype: str, steps: int, threads: int):
    table = Table(
        title=f"delta pushes in seconds, 0.5B shape (24 layers), {dtype}, "
        f"{steps} AdamW steps per lr (median), {threads} torch thread(s)"
    )
    cols = (
        "lr",
        "changed",
        "delta bytes of full",
        "encode s before / now",
        "apply s before / now",
        "trainer write s full / delta",
        "server s full / delta",
        "load avg",
        "peak GiB",
    )
    for col in cols:
        table.add_column(col, justify="right")
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1, maxtasksperchild=1) as pool:  # the model saved, nothing kept
        directory = pool.apply(save_model, (work,))
    for lr in lrs:
        with spawn.Pool(1, maxtasksperchild=1) as pool:
            m = pool.apply(one_lr, (directory, work, lr, dtype, steps, threads))
        kind = "" if m["all_delta"] else " (written full: not fewer bytes)"
        table.add_row(
            f"{lr:g}",
            f"{m['changed']:.3f}",
            f"{m['bytes']:.4f}{kind}",
            f"{m['encode_before']:.2f} / {m['encode_after']:.2f}",
            f"{m['apply_before']:.2f} / {m['apply_after']:.2f}",
            f"{m['write_full']:.2f} / {m['write_delta']:.2f}",
            f"{m['server_full']:.2f} / {m['server_delta']:.2f}",
            m["load"],
            f"{m['peak_gib']:.1f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch's (numpy's ops use one)")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 180))
    work = Path(tempfile.mkdtemp(prefix="bench-delta-", dir=os.environ.get("BENCH_DIR")))
    console.print(f"load average at start: {load()}; work dir {work}")
    lrs = [float(x) for x in args.lrs.split(",")]
    console.print(rows(console, work, lrs, args.dtype, args.steps, args.threads))
    console.print(f"load average at the end: {load()}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
