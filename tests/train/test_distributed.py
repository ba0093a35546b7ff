"""Data parallelism on gloo: two ranks equal one process on the same global batch."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bapo_cli.algos.advantages import REGISTRY as ADVANTAGES
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import ResponseLogits, collate, token_logprobs
from bapo_cli.trainer.distributed import DistContext
from bapo_cli.trainer.update import Learner, LossSpec, optimizer_update
from tests.conftest import run_bapo

GROUPS, N = 8, 4


def _model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).float()


def _global_batch(model: torch.nn.Module) -> list[Sample]:
    """GROUPS prompts × N samples with stale behaviour log-probs (ratios far from 1)."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for group in range(GROUPS):
        prompt = torch.randint(4, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for _ in range(N):
            length = int(torch.randint(1, 7, (1,), generator=g))
            response = torch.randint(4, 40, (length,), generator=g).tolist()
            samples.append(Sample(prompt.tolist(), group, None, response, versions=[0] * length))
    rewards = torch.rand(len(samples), generator=g).round().double()
    adv, _ = ADVANTAGES.get("grpo")(rewards, torch.tensor([s.group for s in samples]))
    with torch.no_grad():
        mb = collate(samples, 0, torch.device("cpu"))
        logp, _ = token_logprobs(model, mb, 1.0)
        noise = 0.4 * torch.randn(logp.shape, generator=g)
    for i, s in enumerate(samples):
        s.advantage = float(adv[i])
        s.logprobs = (logp[i, : len(s.response_ids)] + noise[i, : len(s.response_ids)]).tolist()
    return samples


SEARCH = {
    "rho0": 0.6,
    "low_range": (0.6, 0.9),
    "high_range": (1.2, 3.0),
    "low_step": 0.02,
    "high_step": 0.05,
    "weighting": "none",
}
SPEC = LossSpec.of("bapo", dual_clip=3.0, agg="token-mean", **SEARCH)


def _chunks(samples: list[Sample], micro_size: int) -> list[list[Sample]]:
    return [samples[i : i + micro_size] for i in range(0, len(samples), micro_size)]


def _update(
    samples: list[Sample], ctx: DistContext, micro_size: int, spec: LossSpec = SPEC
) -> tuple[dict, list]:
    return _update_chunks(_chunks(samples, micro_size), ctx, spec)


def _update_chunks(
    chunks: list[list[Sample]], ctx: DistContext, spec: LossSpec = SPEC
) -> tuple[dict, list]:
    model = _model()
    scorer = ctx.wrap(ResponseLogits(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    micro = [collate(chunk, 0, torch.device("cpu")) for chunk in chunks]  # A_i from samples
    result = optimizer_update(Learner(scorer, optimizer, ctx=ctx), spec, micro, version=0)
    # the share of the weights this rank stores: all of them (DDP) or about 1/W (FSDP2)
    local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    result.metrics["stored_fraction"] = local / sum(p.numel() for p in model.parameters())
    return result.metrics, [_full(p).detach().clone() for p in model.parameters()]


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one whole tensor (FSDP2 keeps each rank's shard in a DTensor)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _rank(rank: int, world: int, init_file: str, out: str, strategy: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, strategy=strategy)
    samples = _global_batch(_model())
    mine = [s for s in samples if s.group % world == rank]  # whole groups per rank
    metrics, params = _update(mine, ctx, micro_size=6)  # several micro-batches per rank
    torch.save({"metrics": metrics, "params": params}, f"{out}.{rank}")
    dist.barrier()  # no rank tears gloo down while the other still talks
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_gloo_ranks_match_one_process_on_the_global_batch(tmp_path: Path, strategy) -> None:
    out = str(tmp_path / "rank")
    init = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_rank, args=(2, init, out, strategy), nprocs=2, join=True)
    single_metrics, single_params = _update(_global_batch(_model()), DistContext(), micro_size=64)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for key in ("c_low", "c_high", "rho", "rho_before", "search_steps"):
        # bit-identical by design: both ranks solve the one all-reduced vector
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key], key
    for r in ranks:
        for key in ("c_low", "c_high", "search_steps"):  # path points: discrete, exact
            assert r["metrics"][key] == single_metrics[key], key  # identical bounds
        # rho against one process is a float from different summation orders: each rank's
        # forward runs on other batch shapes (micro-batches of 6, other padding) than the
        # single one, so float32 dot products sum in another order; a float32 sum of n terms
        # has relative error about n * 2^-24 (n = hidden size 128: 7.6e-6), which reaches the
        # ratios and so the masses in rho (the float64 sums over tokens and ranks add only
        # n * 2^-53). Seen: 0.6128610181156522 vs 0.61286102258768 (7e-9 relative).
        for key in ("rho", "rho_before"):
            assert r["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-5), key
        for a, b in zip(r["params"], single_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same update
    assert single_metrics["search_steps"] > 0  # the search really walked
    # the ESS of the update's sequences is all-reduced: the whole batch's value on every rank
    assert ranks[0]["metrics"]["ess"] == ranks[1]["metrics"]["ess"]
    assert ranks[0]["metrics"]["ess"] == pytest.approx(single_metrics["ess"], rel=1e-5)
    assert single_metrics["ess"] < 1.0  # off-policy data: the check is not 1 == 1
    stored = [r["metrics"]["stored_fraction"] for r in ranks]
    if strategy == "fsdp2":  # really sharded: each rank stores about half, together all
        assert all(0.4 < f < 0.6 for f in stored) and sum(stored) == pytest.approx(1.0)
    else:
        assert stored == [1.0, 1.0]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # ranks stay in lockstep


MICRO_SPEC = LossSpec.of("bapo", dual_clip=3.0, bound_scope="microbatch", **SEARCH)
UNEVEN = {0: {0, 1, 2, 3, 4, 5}, 1: {6, 7}}  # groups per rank: 4 micro-batches vs 2


def _uneven_rank(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world)
    mine = [s for s in _global_batch(_model()) if s.group in UNEVEN[rank]]
    metrics, params = _update(mine, ctx, micro_size=6, spec=MICRO_SPEC)
    torch.save({"metrics": metrics, "params": params}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_per_micro_batch_search_is_rank_local_and_allows_uneven_micro_batch_counts(
    tmp_path: Path,
) -> None:
    """Partial rollouts leave ranks with different numbers of micro-batches; a search that
    all-reduced per micro-batch mismatched gloo's collectives. Rank-local, two ranks equal one
    process that searches each of the ranks' micro-batches on its own."""
    out = str(tmp_path / "rank")
    init = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_uneven_rank, args=(2, init, out), nprocs=2, join=True)
    samples = _global_batch(_model())
    chunks = [
        chunk
        for rank in (0, 1)
        for chunk in _chunks([s for s in samples if s.group in UNEVEN[rank]], 6)
    ]
    assert len(chunks) == 6
    single_metrics, single_params = _update_chunks(chunks, DistContext(), MICRO_SPEC)
    assert single_metrics["search_steps"] > 0  # the per-micro-batch searches really walked
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r in ranks:
        for a, b in zip(r["params"], single_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same update
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # ranks stay in lockstep


@pytest.mark.slow
def test_bapo_train_nproc_2_runs_data_parallel(_output_root: Path) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    more = ("trainer.log_samples=64",)  # every sample of a step (2 ranks x 4 prompts x 4)
    result = run_bapo("train", "--nproc", "2", "experiment=smoke", *more, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((_output_root / "runs").glob("*/*"))
    assert len(runs) == 1  # one run dir: rank 0's
    # samples.jsonl holds both ranks' samples; group ids are unique across ranks (rank r's are
    # r, r + 2, ...): each of the 2 steps x 8 prompts once, with its 4 samples
    rows = [json.loads(x) for x in (runs[0] / "samples.jsonl").read_text().splitlines()]
    assert Counter((r["step"], r["group"]) for r in rows) == {
        (step, g): 4 for step in (1, 2) for g in range(8 * (step - 1), 8 * step)
    }
    state = torch.load(
        runs[0] / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False
    )
    assert len(state["ranks"]) == 2
    assert state["ranks"][0]["prompts"] == state["ranks"][1]["prompts"]  # same global stream
    assert state["ranks"][0]["rng"]["torch"].ne(state["ranks"][1]["rng"]["torch"]).any()
    assert "bapo train: summary" in result.stdout


def test_data_parallel_refuses_what_it_cannot_split(_output_root: Path) -> None:
    result = run_bapo(
        "train",
        "--nproc",
        "2",
        "experiment=smoke",
        "trainer.prompts_per_step=6",
        "staleness=2",
        timeout=600,
    )
    assert result.returncode != 0
    assert "must split into 2 ranks" in result.stderr


def _nproc_2(run_dir: Path, *overrides: str):
    return run_bapo(
        "train",
        "--nproc",
        "2",
        "experiment=smoke",
        f"hydra.run.dir={run_dir}",
        *overrides,
        env={"OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def _trained(path: Path) -> dict:
    """The last step's metrics (timings aside) and the weights of a checkpoint."""
    from safetensors.torch import load_file

    state = torch.load(path / "trainer_state.pt", weights_only=False)
    last = {k: v for k, v in state["state"]["history"][-1].items() if not k.startswith("perf/")}
    return {"metrics": last, "weights": load_file(path / "model.safetensors"), "state": state}


@pytest.mark.slow
def test_dcpo_prompt_statistics_are_one_table_over_the_ranks(tmp_path: Path) -> None:
    """algo.advantage=dcpo keeps each prompt's reward statistics across steps (issue 45); its
    prompts move between ranks at each epoch's reshuffle, so every rank's statistics are
    gathered each step: both ranks hold the same table, every prompt of both ranks in it."""
    from bapo_cli.trainer import checkpoint

    args = ("algo=grpo", "algo.advantage=dcpo", "data.num_prompts=8", "trainer.log_samples=64")
    result = _nproc_2(tmp_path / "run", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    state = checkpoint.load_state(checkpoint.step_dir(tmp_path / "run" / "checkpoints", 2))
    table, other = (rank["prompt_stats"] for rank in state["ranks"])
    assert table == other
    assert set(table) == {r["id"] for r in rows} and len(table) == 8
    for pid, (times, mean, _) in table.items():  # each prompt once a step, 4 samples each time
        rewards = [r["reward"] for r in rows if r["id"] == pid]
        assert times == 2.0 and len(rewards) == 8
        assert mean == pytest.approx(sum(rewards) / 8, abs=1e-12)


@pytest.mark.slow
def test_fsdp2_two_ranks_checkpoint_whole_weights_and_resume_like_an_unbroken_run(
    tmp_path: Path,
) -> None:
    """Also under trainer.micro_batch_tokens: 36 tokens pack the smoke run's mini-batches into
    1 or 2 micro-batches, differently on the two ranks at every step (seen), which hung both
    ranks before the updates agreed on one count (`split_to_count`)."""
    from bapo_cli.trainer import checkpoint

    args = (
        "trainer.strategy=fsdp2",
        "trainer.max_steps=3",
        "trainer.save_every=1",
        "trainer.micro_batch_tokens=36",
    )
    whole = _nproc_2(tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    # a run killed right after its step-2 checkpoint: only that checkpoint survives
    ckpts = tmp_path / "whole" / "checkpoints"
    broken = tmp_path / "broken" / "checkpoints"
    shutil.copytree(checkpoint.step_dir(ckpts, 2), checkpoint.step_dir(broken, 2))
    resumed = _nproc_2(tmp_path / "broken", *args, "trainer.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a = _trained(checkpoint.step_dir(ckpts, 3))
    b = _trained(checkpoint.step_dir(broken, 3))
    assert a["state"]["strategy"] == "fsdp2" and len(a["state"]["ranks"]) == 2
    assert a["metrics"] == b["metrics"]  # step 3 after a resume: the same numbers
    assert a["weights"].keys() == b["weights"].keys()
    for name, tensor in a["weights"].items():
        assert torch.equal(tensor, b["weights"][name]), name
    # whole weights (gathered from the shards), loadable by transformers as they are
    from bapo_cli.models.loading import load_checkpoint

    model, _ = load_checkpoint(checkpoint.step_dir(ckpts, 3))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), a["weights"][name].to(p.dtype)), name
    # the optimizer state is stored whole (by parameter name), not one rank's shard
    optim = a["state"]["optimizer"]["state"]
    embed = optim["model.embed_tokens.weight"]["exp_avg"]
    assert embed.shape == model.get_input_embeddings().weight.shape


@pytest.mark.slow
@pytest.mark.parametrize(
    "scope",
    [(), ("algo.bound_scope=microbatch", "trainer.micro_batch_size=4")],
    ids=["minibatch", "microbatch"],  # microbatch: ranks run different micro-batch counts
)
def test_partial_rollouts_run_data_parallel_on_disjoint_prompts(tmp_path: Path, scope) -> None:
    # budget ceil(4 / 3) = 2 tokens per round: answers of 3+ tokens need two or three rounds
    result = _nproc_2(
        tmp_path / "run",
        "staleness.regime=partial",
        "staleness.k=2",
        "rollout.max_tokens=4",
        "trainer.max_steps=3",
        *scope,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(
        tmp_path / "run" / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=True
    )
    history = state["state"]["history"]
    assert len(history) == 3 and max(h["staleness/max"] for h in history) >= 1  # spans versions
    pools = [r["regime"]["pool"] for r in state["ranks"]]
    problems = [{s["problem"]["id"] for s in pool} for pool in pools]  # plain data (weights_only)
    assert all(problems)  # both ranks hold unfinished groups, so the check below has content
    assert problems[0].isdisjoint(problems[1])  # ranks never hold the same prompt


def test_fsdp2_without_torchrun_says_how_to_launch(_output_root: Path) -> None:
    result = run_bapo("train", "experiment=smoke", "trainer.strategy=fsdp2", timeout=300)
    assert result.returncode != 0
    assert "trainer.strategy=fsdp2 shards the model over torchrun's processes" in result.stderr
    assert "--nproc N" in result.stderr


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_vllm_engine_per_rank_gets_the_trained_weights(
    tmp_path: Path, strategy, monkeypatch
) -> None:
    """Each rank runs its own colocated vLLM engine; after every update the full weights (FSDP2:
    gathered from the shards) reach it: its log-probs of the tokens it sampled stay equal to the
    trainer's. Stale weights put them ~0.04 apart on average (tests/rollout).

    The real CLI's whole output (torchrun's and both ranks', stdout and stderr) over three steps
    with weight syncs: vLLM's INFO lines and its false "Failed to load weights" warnings stay out
    (VLLM_LOGGING_LEVEL unset; this check ran as a one-process run of its own before)."""
    pytest.importorskip("vllm")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # this process's engine may set it
    run_dir = tmp_path / "run"
    result = run_bapo(
        "train",
        "--nproc",
        "2",
        "experiment=smoke",
        "rollout=vllm",
        f"trainer.strategy={strategy}",
        "trainer.max_steps=3",
        f"hydra.run.dir={run_dir}",
        env={"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollout engine: vllm" in result.stdout and "bapo train: summary" in result.stdout
    output = (result.stdout + result.stderr).splitlines()
    assert [line for line in output if " INFO " in line] == []
    assert [line for line in output if "Failed to load weights" in line] == []
    assert [line for line in output if "Loading safetensors checkpoint shards" in line] == []
    state = torch.load(
        run_dir / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=False
    )
    history = state["state"]["history"]
    assert len(history) == 3
    for h in history:  # steps 2 and 3 sample with weights synced after updates
        assert h["rollout/logprob_abs_diff_max"] < 1e-4, h["rollout/logprob_abs_diff_max"]


def _wait_for_rank_0(rank: int, port: int, timeout_min: float, out: str) -> None:
    import os
    import time

    from bapo_cli.trainer import distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    ctx = distributed.from_env("ddp", timeout_min)
    if rank == 0:
        time.sleep(4.0)  # rank 0 validating alone
    try:
        ctx.barrier()
        result = "ok"
    except RuntimeError as err:
        result = f"error: {err}"
    Path(f"{out}.{rank}").write_text(result)
    os._exit(0)  # no teardown handshake with a peer that may have given up


@pytest.mark.slow
@pytest.mark.parametrize(("timeout_min", "waits"), [(0.02, False), (1.0, True)])
def test_dist_timeout_is_how_long_ranks_wait_for_rank_0(tmp_path: Path, timeout_min, waits):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank")
    mp.spawn(_wait_for_rank_0, args=(port, timeout_min, out), nprocs=2, join=True)
    waited = Path(f"{out}.1").read_text()
    if waits:
        assert waited == "ok"
    else:  # 1.2 s < rank 0's 4 s: rank 1 gives up with an error, it does not hang
        assert waited.startswith("error:") and "timed out" in waited.lower(), waited
