"""Same metrics before and after a refactor of the update path (issue 44): every logged metric of
the demo and of short runs of every algo preset, every `trainer.old_logprob` mode and every
off-policy correction, compared bit for bit with a recorded reference.

    python scripts/same_metrics.py                 # run every case, compare, exit 1 on any change
    python scripts/same_metrics.py --record        # run every case, write the reference
    python scripts/same_metrics.py --only tis,seq  # the cases whose name starts so
    python scripts/same_metrics.py --no-demo       # skip the demo (150 steps, ~2-4 minutes)
    python scripts/same_metrics.py --write new.json  # compare, and also write what this run got

`--write` saves a second run when a change is meant to move some cases (a fix): compare, read
the differences, then keep the new file as the reference.

Each case is one `bapo train` process (a Hydra multirun where it sweeps), on the shipped tiny
models, seed 0, one CPU thread (`BAPO_THREADS=1`: the thread count otherwise follows the load,
and a reduction over another count rounds differently), into a fresh output root. From each
run's MLflow store (`mlflow.db`, read directly, nothing rounded) it takes every metric at every
step but the timings (`perf/*_s`, `*_per_s`), and a hash of the final checkpoint's weights.
Bit-identity holds on one machine with the same kernels; the reference says which commit and
torch wrote it.

The hf engine reports no log-probs of its own, so TIS / MIS and the geo mask would weigh every
token 1. The cases marked `mismatch` run the CLI in a process whose hf engine also reports the
log-probs of its tokens under bfloat16 autocast (`_engine_logprobs`: a second, lower-precision
kernel of the same weights, as vLLM's bf16 is to the trainer's float32), so those corrections
have real weights to apply. Outputs: the table of differences (case, run, metric, first differing
step, reference and new value), then one line per case.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "scripts" / "same_metrics.json"

# three steps on the demo's testbed (pair search: wrong answers are longer, so the advantages
# are not all 0 and the clip has work): 32 samples a step, two updates per batch (reuse k=2:
# the first on-policy with deferred scoring, the second stale), two micro-batches per update,
# a learning rate 5x the demo's so the ratios move off 1
BASE = (
    "experiment=pairs",
    "staleness=2",
    "rollout.n=4",
    "trainer.max_steps=3",
    "trainer.prompts_per_step=8",
    "trainer.micro_batch_size=8",
    "trainer.lr=5e-4",
    "algo.resample_rounds=2",
)
TWO_EPOCHS = ("staleness.ppo_epochs=2",)  # later uses of a micro-batch (recompute's cache)


@dataclass(frozen=True)
class Case:
    """One `bapo train` process; `sweep` keys are the params that tell its runs apart."""

    name: str
    overrides: tuple[str, ...]
    sweep: tuple[str, ...] = ()
    mismatch: bool = False  # the hf engine reports bf16 log-probs (TIS, MIS, geo have work)
    base: tuple[str, ...] = field(default=BASE)


CASES = (
    Case("presets", ("algo=glob(*)",), sweep=("algo.name",)),
    Case(
        "old_logprob",
        ("algo=grpo,bapo,m2po,vcpo,gspo,minpro", "trainer.old_logprob=recompute,loglinear")
        + TWO_EPOCHS,
        sweep=("algo.name", "trainer.old_logprob"),
    ),
    Case(
        "behav_cap",
        (
            "algo=grpo,m2po,bapo",
            "trainer.old_logprob=recompute,loglinear",
            "algo.behav_weight_cap=1.5",
        )
        + TWO_EPOCHS,
        sweep=("algo.name", "trainer.old_logprob"),
    ),
    Case(
        "tis",
        (
            "algo=grpo,gspo",
            "rollout.tis_cap=1.002",
            "rollout.tis_level=token,sequence",
            "rollout.tis_mode=truncate,mask,mask_two_sided",
        ),
        sweep=("algo.name", "rollout.tis_level", "rollout.tis_mode"),
        mismatch=True,
    ),
    Case(
        "tis_recompute",
        (
            "algo=grpo,m2po",
            "rollout.tis_cap=1.002",
            "rollout.tis_mode=mask",
            "trainer.old_logprob=recompute,loglinear",
            "algo.behav_weight_cap=1.5",
        )
        + TWO_EPOCHS,
        sweep=("algo.name", "trainer.old_logprob"),
        mismatch=True,
    ),
    Case(
        "seq_geo",
        ("algo=grpo", "rollout.seq_mask=geo", "rollout.seq_mask_threshold=1.001,1.005"),
        sweep=("rollout.seq_mask_threshold",),
        mismatch=True,
    ),
    Case(
        "seq_opsm",
        (
            "algo=grpo,bapo",
            "rollout.seq_mask=opsm",
            "rollout.seq_mask_threshold=0.001",
            "trainer.old_logprob=behaviour,recompute,loglinear",
        )
        + TWO_EPOCHS,
        sweep=("algo.name", "trainer.old_logprob"),
    ),
    Case(
        "seq_opsm_tis",
        (
            "algo=grpo",
            "rollout.seq_mask=opsm",
            "rollout.seq_mask_threshold=0.001",
            "rollout.tis_cap=1.002",
            "rollout.tis_mode=truncate,mask",
        ),
        sweep=("rollout.tis_mode",),
        mismatch=True,
    ),
    Case(  # issue 45's token masks: IcePop's band on the engine's log-probs, KPop on pi_prox
        "seq_icepop",
        ("algo=grpo,gspo", "rollout.seq_mask=icepop", "rollout.seq_mask_threshold=1.004"),
        sweep=("algo.name",),
        mismatch=True,
    ),
    Case(
        "seq_kpop",
        (
            "algo=grpo,m2po",
            "rollout.seq_mask=kpop",
            "rollout.seq_mask_threshold=1e-4",
            "trainer.old_logprob=recompute",
        )
        + TWO_EPOCHS,
        sweep=("algo.name",),
    ),
    Case(  # issue 45's advantages under other presets: DCPO's smooth one, TOPR's signed one
        "advantages",
        ("algo=grpo,gspo", "algo.advantage=dcpo,signed", "data.num_prompts=8"),
        sweep=("algo.name", "algo.advantage"),
    ),
    Case(
        "prime",
        ("algo=prime_default", "algo.ratio_against=inference,old"),
        sweep=("algo.ratio_against",),
        mismatch=True,
    ),
    Case(
        "prime_recompute",
        ("algo=prime_default", "algo.ratio_against=old", "trainer.old_logprob=recompute"),
    ),
    Case(
        "vcpo",
        ("algo=vcpo", "algo.baseline=opob,none", "algo.ess_rule=sqrt,linear,none") + TWO_EPOCHS,
        sweep=("algo.baseline", "algo.ess_rule"),
    ),
    Case(
        "bapo",
        (
            "algo=bapo",
            "algo.bound_scope=minibatch,microbatch",
            "algo.weighting=none,rollout_prob",
        ),
        sweep=("algo.bound_scope", "algo.weighting"),
    ),
    Case("kl", ("algo=grpo,bapo", "algo.kl_coef=0.05"), sweep=("algo.name",)),
    Case(
        "regimes",
        ("algo=grpo,m2po", "staleness.regime=replay,partial,lag"),
        sweep=("algo.name", "staleness.regime"),
    ),
    Case(
        "agg",
        (
            "algo=grpo,m2po",
            "algo.agg=seq-mean-token-sum,seq-mean-token-mean,seq-mean-token-sum-norm",
        ),
        sweep=("algo.name", "algo.agg"),
    ),
    Case("float64", ("algo=bapo,grpo", "model.dtype=float64"), sweep=("algo.name",)),
    Case("demo", ("experiment=demo",), base=()),
)

TIMING_SUFFIXES = ("_s", "_per_s")


def _timing(key: str) -> bool:
    return key.endswith(TIMING_SUFFIXES)


def _weights_hash(run_dir: str) -> str:
    """sha256 of the final checkpoint's weights (tensor names, dtypes, shapes and bytes)."""
    import torch
    from safetensors.torch import load_file

    ckpts = sorted(Path(run_dir, "checkpoints").glob("step_*"))
    if not ckpts:
        return "no checkpoint"
    tensors = load_file(str(ckpts[-1] / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _runs(root: Path, case: Case) -> dict[str, dict]:
    """{run key: {"metrics": {metric: {step: value}}, "weights": hash}} of a case's store."""
    con = sqlite3.connect(f"file:{root / 'mlflow.db'}?mode=ro", uri=True)
    out: dict[str, dict] = {}
    for (run,) in con.execute("select run_uuid from runs where status = 'FINISHED'").fetchall():
        params = dict(con.execute("select key, value from params where run_uuid = ?", (run,)))
        tags = dict(con.execute("select key, value from tags where run_uuid = ?", (run,)))
        if "bapo.run_dir" not in tags:  # a sweep's parent run
            continue
        key = ",".join(f"{k}={params[k]}" for k in case.sweep) or case.name
        if key in out:
            raise SystemExit(f"error: case {case.name}: two runs are both {key}")
        metrics: dict[str, dict[str, float]] = {}
        rows = con.execute(
            "select key, step, value from metrics where run_uuid = ? order by key, step, timestamp",
            (run,),
        )
        for name, step, value in rows:
            if not _timing(name):
                metrics.setdefault(name, {})[str(step)] = float(value)
        out[key] = {"metrics": metrics, "weights": _weights_hash(tags["bapo.run_dir"])}
    return out


def _run_case(case: Case, workdir: Path) -> dict[str, dict]:
    root = workdir / case.name
    env = dict(os.environ, BAPO_OUTPUT_ROOT=str(root), BAPO_THREADS="1", PYTHONHASHSEED="0")
    args = ["train", *(["-m"] if case.sweep else []), *case.base, *case.overrides]
    cmd = [sys.executable, __file__, "--child", *(["--mismatch"] if case.mismatch else []), *args]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise SystemExit(f"error: case {case.name} failed ({proc.returncode}):\n{tail}")
    runs = _runs(root, case)
    print(f"  {case.name}: {len(runs)} runs in {time.monotonic() - started:.0f} s", flush=True)
    return runs


def _compare(ref: dict, new: dict) -> list[tuple[str, ...]]:
    """Rows (case, run, metric, first step, reference, new) of every difference."""
    rows: list[tuple[str, ...]] = []
    for case in sorted(set(ref) | set(new)):
        a, b = ref.get(case), new.get(case)
        if a is None or b is None:
            rows.append((case, "*", "case", "-", "absent" if a is None else "run", "absent"))
            continue
        for run in sorted(set(a) | set(b)):
            ra, rb = a.get(run), b.get(run)
            if ra is None or rb is None:
                rows.append((case, run, "run", "-", str(ra is not None), str(rb is not None)))
                continue
            if ra["weights"] != rb["weights"]:
                rows.append((case, run, "weights", "end", ra["weights"], rb["weights"]))
            ma, mb = ra["metrics"], rb["metrics"]
            for metric in sorted(set(ma) | set(mb)):
                sa, sb = ma.get(metric, {}), mb.get(metric, {})
                for step in sorted(set(sa) | set(sb), key=int):
                    va, vb = sa.get(step), sb.get(step)
                    same = va == vb or (va is not None and vb is not None and va != va and vb != vb)
                    if not same:
                        rows.append((case, run, metric, step, repr(va), repr(vb)))
                        break
    return rows


def _child(argv: list[str]) -> None:
    """Run the CLI here, with the hf engine also reporting bf16 log-probs under --mismatch."""
    if argv and argv[0] == "--mismatch":
        argv = argv[1:]
        _emulate_engine_logprobs()
    from bapo_cli.cli import main

    sys.argv = ["bapo", *argv]
    main()


def _emulate_engine_logprobs() -> None:
    import torch

    from bapo_cli.rollout import hf

    generate = hf.HFEngine.generate

    def with_logprobs(self, requests, params, interrupt=None):
        gens = generate(self, requests, params, interrupt)
        for req, gen in zip(requests, gens, strict=True):
            gen.logprobs = _engine_logprobs(self.model, req, gen.token_ids, params.temperature)
        return gens

    @torch.no_grad()
    def _engine_logprobs(model, req, tokens, temperature):
        if not tokens:
            return []
        ids = list(req.prompt_ids) + list(req.prefix_ids) + list(tokens)
        start = len(ids) - len(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[start - 1 : -1] / max(temperature, 1e-6), dim=-1)
        return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    hf.HFEngine.generate = with_logprobs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="write the reference instead")
    ap.add_argument("--only", default="", help="comma-separated case-name prefixes")
    ap.add_argument("--no-demo", action="store_true", help="skip the 150-step demo")
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument("--keep", type=Path, help="keep the runs under this directory")
    ap.add_argument("--write", type=Path, help="after comparing, write this run's values here")
    args = ap.parse_args(argv)
    prefixes = [p for p in args.only.split(",") if p]
    cases = [
        c
        for c in CASES
        if (not prefixes or c.name.startswith(tuple(prefixes)))
        and not (args.no_demo and c.name == "demo")
    ]
    import torch

    workdir = args.keep or Path(tempfile.mkdtemp(prefix="same_metrics-"))
    print(f"{len(cases)} cases under {workdir}", flush=True)
    new = {case.name: _run_case(case, workdir) for case in cases}
    if args.record or args.write:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        doc = {"commit": commit, "torch": torch.__version__, "cases": new}
        target = args.reference if args.record else args.write
        target.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
        print(f"written: {target} ({sum(map(len, new.values()))} runs)")
        if args.record:
            return 0
    ref_doc = json.loads(args.reference.read_text())
    ref = {name: ref_doc["cases"][name] for name in new if name in ref_doc["cases"]}
    rows = _compare(ref, new)
    print(f"reference: commit {ref_doc['commit']}, torch {ref_doc['torch']}")
    if rows:
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        head = ("case", "run", "metric", "step", "reference", "new")
        widths = [max(w, len(h)) for w, h in zip(widths, head, strict=True)]
        for row in (head, *rows):
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for name, runs in new.items():
        values = sum(len(s) for r in runs.values() for s in r["metrics"].values())
        bad = sum(1 for r in rows if r[0] == name)
        print(f"{name}: {len(runs)} runs, {values} values, {bad} differences")
    print("identical" if not rows else f"{len(rows)} differences")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
