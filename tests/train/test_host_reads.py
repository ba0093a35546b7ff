"""No host read per micro-batch in the update, scoring and recompute loops.

On a GPU every read of a tensor's value on the host (`.item()`, `float(t)`, `bool(t)`, `.tolist()`,
`.cpu()`) and every op whose output size is data (a boolean index, `nonzero`, `unique`,
`bincount`: each reads a count back) waits for the device's queue to drain: once per
micro-batch, it stalls every micro-batch. The real code runs here under a `TorchFunctionMode`
that records each such call and where it came from (the first frame outside torch): the same
update over 2 and over 4 micro-batches must make the same reads (so none per micro-batch, a
fixed number per update), and no read may come from inside a micro-batch's forward, loss or
backward. What reads remain, and why, is in docs/training.md ("Host reads in the update").

Not counted: reads inside transformers' forward (its SDPA mask preparation checks for padding,
`fast_all(padding_mask)`: two per forward, the model library's), and `collate`'s token list,
made on the host before the batch moves to the device."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch.overrides import TorchFunctionMode

from bapo_cli.algos.bapo_algorithm1 import BoundAccumulator
from bapo_cli.algos.bapo_locator import bin_sums
from bapo_cli.algos.bapo_recipe import RecipeAccumulator
from bapo_cli.algos.core import rounded
from bapo_cli.config.preflight import preflight
from bapo_cli.rollout import scoring
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import ResponseLogits, collate
from bapo_cli.staleness.source import sample_source
from bapo_cli.trainer import optimize as optimize_steps
from bapo_cli.trainer import seq_grads, update
from bapo_cli.trainer.off_policy import OffPolicy
from bapo_cli.trainer.optimize import advantages, optimize
from bapo_cli.trainer.setup import setup, start
from tests.train.conftest import FAST

TORCH = str(Path(torch.__file__).parent)
VALUE_READS = frozenset(
    {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu"}
    | {"__array__", "__repr__", "__format__", "equal", "allclose"}
)
SIZE_READS = frozenset(
    {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "histc"}
)
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_"})
# code that runs once per micro-batch (or per sequence): no read may have it on its stack
PER_MICRO = frozenset(
    f.__code__
    for f in (
        update._backward,  # forward, ratio inputs, loss, backward
        update._search_inputs,
        BoundAccumulator.add,  # BAPO's per-update search, fed per micro-batch
        RecipeAccumulator.add,
        scoring.token_logprobs,  # every forward: behaviour, proximal, opsm, search, update
        optimize_steps._prepare,
        seq_grads.score_grad_sq_norms,
    )
)
HOST_ONLY = {"collate"}  # builds the batch on the host, then moves it (module docstring)
# the per-micro-batch reads that remain, by the function they come from (docs/training.md)
REMAINING = {
    "clip_cov": {"clip_cov_drop", "_how_many"},  # verl's draw: randperm over the candidates
    "kl_cov": {"kl_cov_select", "_how_many"},  # topk's k from the valid tokens
    "bapo_recipe": {"_summed_to_host"},  # bound_scope=microbatch: a search per micro-batch
}


def _boolean(index: object) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    return isinstance(index, (tuple, list)) and any(_boolean(i) for i in index)


def _read(func, args, kwargs) -> str | None:
    """What kind of host read calling `func` is, or None."""
    name = getattr(func, "__name__", "")
    if name in VALUE_READS or name in SIZE_READS:
        return name
    if name in INDEXING and _boolean(args[1] if len(args) > 1 else kwargs.get("indices")):
        return f"{name}[bool]"
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where(cond)"
    return None


@dataclasses.dataclass(frozen=True)
class Read:
    what: str
    function: str  # the first function outside torch: the package's code that asked
    in_loop: bool  # a per-micro-batch function (PER_MICRO) is on the stack


class HostReads(TorchFunctionMode):
    """Records the host reads of tensor values the code under it makes (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[Read] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _read(func, args, kwargs)
        if what is not None:
            frame, caller, in_loop = sys._getframe(1), None, False
            while frame is not None:
                if caller is None and not frame.f_code.co_filename.startswith(TORCH):
                    caller = frame
                in_loop = in_loop or frame.f_code in PER_MICRO
                frame = frame.f_back
            path = caller.f_code.co_filename if caller else "torch"
            if "transformers" not in Path(path).parts and caller.f_code.co_name not in HOST_ONLY:
                self.reads[Read(what, caller.f_code.co_name, in_loop)] += 1
        return func(*args, **kwargs)


def _config(*overrides: str):
    return preflight("train", [*FAST, *overrides]).config


def _samples(n: int = 8, seed: int = 0) -> list[Sample]:
    """`n` samples in groups of 4 (rewards 0 or 1, advantages drawn), not scored yet."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        if i % 4 == 0:
            size = int(torch.randint(2, 6, (1,), generator=g))
            prompt = torch.randint(4, 60, (size,), generator=g).tolist()
        length = int(torch.randint(1, 9, (1,), generator=g))
        response = torch.randint(4, 60, (length,), generator=g).tolist()
        sample = Sample(prompt, i // 4, None, response, versions=[0] * length)
        sample.reward = float(torch.randint(0, 2, (), generator=g))
        sample.advantage = float(torch.randn((), generator=g))
        samples.append(sample)
    return samples


def _stale(scorer: torch.nn.Module, samples: list[Sample]) -> list[Sample]:
    """`samples` scored by `scorer` as the behaviour policy, then made stale (log-probs moved by
    noise: the ratios leave 1, bounds clip, M2PO masks)."""
    scoring.record_behaviour(scorer, collate(samples, 0, torch.device("cpu")), 1.0)
    g = torch.Generator().manual_seed(1)
    for s in samples:
        noise = 0.5 * torch.randn(len(s.logprobs), generator=g, dtype=torch.float64)
        s.logprobs = [x + float(e) for x, e in zip(s.logprobs, noise, strict=True)]
    return samples


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    """The shipped tiny model, as a run loads it."""
    from bapo_cli.models.loading import load_policy

    model, _ = load_policy(_config().model)
    return model


def _update_reads(policy, spec, samples, micro_size: int) -> Counter[Read]:
    model = copy.deepcopy(policy)
    learner = update.Learner(
        ResponseLogits(model), torch.optim.AdamW(model.parameters(), lr=1e-3), grad_clip=1.0
    )
    micro = [
        collate(samples[i : i + micro_size], 0, torch.device("cpu"))
        for i in range(0, len(samples), micro_size)
    ]
    mode = OffPolicy(ratio_against=spec.hooks.ratio_against)
    with HostReads() as recorder:
        result = update.optimizer_update(learner, spec, micro, version=1, mode=mode)
    assert not result.skipped and not result.no_grad  # the whole update ran
    return recorder.reads


@pytest.mark.parametrize(
    "preset",
    ["bapo", "topr", "dcpo", "vespo", "m2po", "grpo", "vcpo", "clip_cov", "kl_cov", "bapo_recipe"],
)
def test_an_update_reads_nothing_per_micro_batch(policy, preset: str) -> None:
    spec = update.loss_spec(_config(f"algo={preset}").algo, max_tokens=8)
    samples = _stale(ResponseLogits(policy), _samples())
    _update_reads(policy, spec, samples, 4)  # memos filled (BAPO's look-up tables)
    two, four = (_update_reads(policy, spec, samples, size) for size in (4, 2))
    allowed = REMAINING.get(preset, set())
    in_loop = {r: n for r, n in four.items() if r.in_loop and r.function not in allowed}
    assert not in_loop, f"host reads inside a micro-batch's work: {in_loop}"
    two, four = ({r: n for r, n in c.items() if r.function not in allowed} for c in (two, four))
    assert four == two, f"reads that grow with the micro-batches: 2 -> {two}, 4 -> {four}"
    # the recorder sees the reads an update does make (its gradient norm, its metrics, once)
    assert Read("__float__", "_grad_norm", False) in two
    assert Read("tolist", "_host_metrics", False) in two


def test_scoring_and_the_proximal_recompute_read_nothing_per_micro_batch(tmp_path) -> None:
    """A real run's step after its rollouts: behaviour scoring (`BatchLayout.score`), the
    proximal and opsm forwards (`optimize._prepare`), the engine log-probs of TIS, two updates;
    with 2 and with 4 micro-batches per update."""
    cfg = _config(
        "algo=bapo",
        "staleness=2",  # two updates per step
        "trainer.old_logprob=recompute",
        "algo.behav_weight_cap=5.0",
        "rollout.seq_mask=opsm",
        "rollout.seq_mask_threshold=0.05",
        "rollout.tis_cap=2.0",
        "trainer.prompts_per_step=4",
    )
    ctx, run_dir, console = start(cfg, tmp_path / "run", Console(file=io.StringIO()))
    run = setup(cfg, sample_source(cfg), ctx, run_dir, console)
    counts = []
    try:
        layout = run.batches
        for size in (4, 4, 2):  # the first fills the memos (BAPO's look-up tables)
            trainer = dataclasses.replace(layout.trainer, micro_batch_size=size)
            run.batches = dataclasses.replace(layout, trainer=trainer)
            batch = _samples(n=16)
            advantages(run, batch)
            with HostReads() as recorder:
                run.batches.score(batch)  # as the collector scores a rollout's samples
                optimize(run, batch)
            counts.append(recorder.reads)
    finally:
        run.regime.close()
        run.engine.close()
        run.prompts.close()
    _, two, four = counts
    assert not [r for r in four if r.in_loop], four
    assert four == two, f"reads that grow with the micro-batches: 2 -> {two}, 4 -> {four}"
    assert Read("tolist", "record_scored", False) in two  # scoring read once


def test_what_replaced_a_read_gives_the_same_numbers() -> None:
    """`rounded` without a tensor is torch's cast; `bin_sums` is bincount's float64 sums, bit
    for bit (the same additions in the same order on the CPU)."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(2000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -8, 9, (2000,), generator=g
    )
    for dtype in (torch.float32, torch.float64):
        like = torch.zeros(1, dtype=dtype)
        for v in [*values.tolist(), 1e39, -1e39, 3.4028235e38, math.inf, 0.8, 1.28]:
            assert rounded(v, like) == torch.tensor(v, dtype=dtype).item(), (v, dtype)
    for n, size in ((0, 5), (7, 3), (100_000, 57)):
        count = torch.randint(0, size, (n,), generator=g, dtype=torch.int32)
        mass = torch.rand(n, generator=g, dtype=torch.float64) * 1e3
        want = torch.bincount(count, weights=mass, minlength=size)
        assert torch.equal(bin_sums(count, mass, size), want)
