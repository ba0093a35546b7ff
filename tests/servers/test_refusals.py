"""Bad input for generation servers, refused in one line before heavy work (no model loaded), exit
2, nothing written: config rules (`rollout.servers`, `staleness.weights`, `eval.server`), and at
`bapo train` / `bapo eval` start, before the run dir is claimed, an unreachable server and a
weights directory that cannot be written. No server is needed: a server with another model is
refused in tests/servers/test_eval_server.py and test_pool.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.staleness.source import sample_source
from tests.conftest import run_bapo
from tests.servers.conftest import free_port

ASYNC = ["staleness=2", "staleness.regime=async"]
URL = "http://127.0.0.1:9"  # a port nothing listens on (discard)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            [f"rollout.servers=[{URL}]"],
            f"rollout.servers=['{URL}']: generation servers feed staleness.regime=async only (this "
            "run: reuse, which generates inside the training loop): add staleness.regime=async, "
            "or drop rollout.servers",
        ),
        (
            [*ASYNC, f"rollout.servers=[{URL}]"],
            "staleness.weights=shm: moves weights through this machine's shared memory to a "
            "worker process, not to generation servers: use staleness.weights=filesystem with "
            "rollout.servers",
        ),
        (
            [*ASYNC, "staleness.weights=filesystem"],
            "staleness.weights=filesystem: pushes weights to generation servers: needs "
            "rollout.servers=[URL,...] (start them with bapo serve), or staleness.weights=shm",
        ),
        (
            [*ASYNC, f"rollout.servers=[{URL}]", "staleness.weights=nccl", "model.device=cpu"],
            "staleness.weights=nccl: needs the trainer on CUDA (model.device=cuda) and servers on "
            "GPUs: off CUDA vLLM's NCCL weight transfer reports success and moves nothing (vLLM "
            "PRs 57022/57374); use staleness.weights=filesystem",
        ),
        (
            [*ASYNC, "model.device=cuda", f"rollout.servers=[{URL}]", "staleness.weights=nccl"]
            + ["staleness.nccl_master=29555"],
            "staleness.nccl_master=29555: give HOST:PORT, e.g. 127.0.0.1:29555 (the trainer's "
            "host)",
        ),
        (
            [*ASYNC, "model.device=cuda", f"rollout.servers=[{URL}]", "staleness.weights=nccl"]
            + ["staleness.nccl_master=trainer:70000"],
            "staleness.nccl_master=trainer:70000: the port must be 1-65535",
        ),
        (
            [*ASYNC, "rollout.servers=[127.0.0.1:8001]", "staleness.weights=filesystem"],
            "rollout.servers=127.0.0.1:8001: is not a server URL; give http://HOST:PORT, as "
            "`bapo serve` prints it",
        ),
        (
            [*ASYNC, "rollout.servers=['http://127.0.0.1:8001/?token=x']"]
            + ["staleness.weights=filesystem"],
            "rollout.servers=http://127.0.0.1:8001/?token=x: has a query string (?...), which "
            "no route takes; give http://HOST:PORT, as `bapo serve` prints it, with nothing "
            "after the port",
        ),
        (
            [*ASYNC, "rollout.servers=['http://127.0.0.1:8001#x']", "staleness.weights=filesystem"],
            "rollout.servers=http://127.0.0.1:8001#x: has a fragment (#...), which no route "
            "takes; give http://HOST:PORT, as `bapo serve` prints it, with nothing after the port",
        ),
        (
            [*ASYNC, "rollout.servers=[http://user:pw@127.0.0.1:8001]"]
            + ["staleness.weights=filesystem"],
            "rollout.servers=http://user:pw@127.0.0.1:8001: holds credentials (user:password@), "
            "which the client never sends (they would be read as part of the host name); give "
            "http://HOST:PORT, as `bapo serve` prints it (it listens on loopback: reach another "
            "machine's through a private network or an ssh tunnel)",
        ),
        (
            [*ASYNC, f"rollout.servers=[{URL}]", "rollout.server_stall_s=-1"],
            "rollout.server_stall_s=-1.0: must be >= 0",
        ),
        (
            [*ASYNC, "rollout.servers=[http://a:1,http://a:1/]", "staleness.weights=filesystem"],
            "rollout.servers=['http://a:1', 'http://a:1/']: names a server twice; list each once",
        ),
        (
            [*ASYNC, "model.lora.rank=8"],
            "model.lora.rank=8: with staleness.regime=async needs generation servers "
            "(rollout.servers=[URL,...] staleness.weights=filesystem: they take the merged "
            "weights): the worker process loads a plain model and takes no adapter weights",
        ),
        (
            [*ASYNC, "staleness.weights_dir=/tmp/w"],
            "staleness.weights_dir=/tmp/w: only the filesystem transport writes weights: needs "
            "staleness.weights=filesystem",
        ),
        (
            [
                *ASYNC,
                f"rollout.servers=[{URL}]",
                "staleness.weights=filesystem",
                "rollout.tis_cap=2",
            ],
            "rollout.tis_cap=2.0: weighs the trainer's log-probs against the engine's under the "
            "same weights; with rollout.servers the behaviour log-probs are the servers' own, so "
            "every weight would be 1: use trainer.old_logprob=recompute with "
            "algo.behav_weight_cap (decoupled PPO), or drop rollout.tis_cap",
        ),
        (
            [*ASYNC, f"rollout.servers=[{URL}]", "staleness.weights=filesystem"]
            + ["rollout.temperature=2.5"],
            "rollout.temperature=2.5: vLLM (rollout.servers) samples at temperatures 0-2 only and "
            "refuses every request above: lower it, or generate in this process (drop "
            "rollout.servers)",
        ),
        (
            ["rollout=vllm", "rollout.temperature=2.01"],
            "rollout.temperature=2.01: vLLM (rollout=vllm) samples at temperatures 0-2 only and "
            "refuses every request above: lower it, or generate with transformers (rollout=hf)",
        ),
        (
            [*ASYNC, "staleness.weights=disk"],
            "staleness.weights=disk: must be one of shm, filesystem, nccl, gloo",
        ),
        (
            [*ASYNC, f"rollout.servers=[{URL}]", "rollout.min_servers=0"],
            "rollout.min_servers=0: must be >= 1 (or null)",
        ),
        (
            [*ASYNC, f"rollout.servers=[{URL}]", "staleness.weights=filesystem"]
            + ["rollout.min_servers=2"],
            "rollout.min_servers=2: is more than the 1 rollout.servers listed",
        ),
        (
            [*ASYNC, "rollout.min_servers=1"],
            "rollout.min_servers=1: counts the servers of rollout.servers=[URL,...]: set them",
        ),
        (
            [*ASYNC, "model.device=cuda", f"rollout.servers=[{URL},http://127.0.0.1:10]"]
            + ["staleness.weights=nccl", "rollout.min_servers=1"],
            "rollout.min_servers=1: staleness.weights=nccl needs every server at start (its group "
            "has no place for one that joins later): drop rollout.min_servers, or use "
            "staleness.weights=filesystem",
        ),
    ],
)
def test_config_rules_are_one_line(overrides, line) -> None:
    with pytest.raises(PreflightError) as info:
        preflight("train", overrides)
    assert str(info.value) == line


def test_cuda_async_with_servers_passes_the_config_check() -> None:
    # the refusal of CUDA async runs is lifted once servers generate
    cfg = preflight(
        "train",
        [*ASYNC, "model.device=cuda", f"rollout.servers=[{URL}]", "staleness.weights=filesystem"],
    ).config
    assert cfg.rollout.servers == [URL]
    # NCCL weights too, on CUDA (the servers' GPUs are checked when the group opens)
    cfg = preflight(
        "train",
        [*ASYNC, "model.device=cuda", f"rollout.servers=[{URL}]", "staleness.weights=nccl"]
        + ["staleness.nccl_master=trainer-0:29600"],
    ).config
    assert cfg.staleness.weights == "nccl"
    # and the vLLM engine's interrupt refusal does not apply: the servers pause and resume
    preflight(
        "train",
        [*ASYNC, "staleness.interrupt=true", f"rollout.servers=[{URL}]"]
        + ["rollout=vllm", "staleness.weights=filesystem"],  # config only
    )


def test_eval_rules_are_one_line() -> None:
    with pytest.raises(PreflightError, match=r"^eval.server=a:1: is not a server URL"):
        preflight("eval", ["eval.server=a:1"])
    with pytest.raises(PreflightError, match=r"^eval.server=http://a:1\?t=x: has a query string"):
        preflight("eval", ["eval.server='http://a:1?t=x'"])
    with pytest.raises(PreflightError, match=r"^eval.server=http://u:p@a:1: holds credentials"):
        preflight("eval", ["eval.server=http://u:p@a:1"])
    with pytest.raises(PreflightError) as info:
        preflight("eval", [f"rollout.servers=[{URL}]"])
    assert str(info.value) == (
        f"rollout.servers=['{URL}']: bapo eval scores through one server: eval.server=URL"
    )
    with pytest.raises(PreflightError) as info:
        preflight("eval", [f"eval.server={URL}", "eval.temperature=3"])
    assert str(info.value) == (
        "eval.temperature=3.0: vLLM (eval.server) samples at temperatures 0-2 only and refuses "
        "every request above: lower it, or score in this process (drop eval.server)"
    )
    with pytest.raises(PreflightError, match=r"^eval.temperature=2.5: vLLM \(rollout=vllm\)"):
        preflight("eval", ["rollout=vllm", "eval.temperature=2.5"])  # config only
    preflight("eval", [f"eval.server={URL}", "eval.temperature=2"])  # 2 itself is vLLM's own
    with pytest.raises(PreflightError) as info:
        preflight("eval", [f"eval.server={URL}", "rollout.min_servers=1"])
    assert str(info.value) == (
        "rollout.min_servers=1: counts a training run's rollout.servers; bapo eval scores "
        "through one server (eval.server=URL): drop it"
    )


def _nothing_written(root: Path) -> bool:
    return not root.exists() or not any(root.rglob("*"))


def test_an_unreachable_server_is_refused_before_the_run_dir(_output_root: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    res = run_bapo("train", *ASYNC, f"rollout.servers=[{url}]", "staleness.weights=filesystem")
    assert res.returncode == 2
    assert res.stderr == (
        f"error: cannot reach the generation server {url} (connection refused): 0 of 1 answer, "
        "fewer than 1 (rollout.min_servers=null: all for a new run); start one there with "
        "`bapo serve --port PORT` or fix rollout.servers\n"
    )
    assert _nothing_written(_output_root)  # no run dir claimed


def test_a_weights_dir_that_cannot_be_written_is_refused_first(
    tmp_path: Path, _output_root: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = run_bapo(
        "train",
        *ASYNC,
        f"rollout.servers=[{URL}]",
        "staleness.weights=filesystem",
        f"staleness.weights_dir={blocker}/weights",
    )
    assert res.returncode == 2
    assert res.stderr == (
        f"error: the weights directory {blocker}/weights is not writable (Not a directory); give "
        "a directory this process can write and every server can read\n"
    )
    assert _nothing_written(_output_root)
    assert blocker.read_text() == ""


def test_eval_with_an_unreachable_server_is_refused(_output_root: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    res = run_bapo("eval", f"eval.server={url}", "tracking=none")
    assert res.returncode == 2
    assert res.stderr.startswith(f"error: cannot reach the generation server {url}")
    assert res.stderr.count("\n") == 1
    assert _nothing_written(_output_root)


def test_the_plan_says_how_weights_reach_the_servers() -> None:
    base = [*ASYNC, "model.device=cuda", f"rollout.servers=[{URL}]"]
    cfg = preflight("train", [*base, "staleness.weights=filesystem"]).config
    assert sample_source(cfg).generation() == (
        f"1 vLLM server ({URL}), weights by file under <run dir>/weights"
    )
    cfg = preflight("train", [*base, "staleness.weights=nccl", "staleness.interrupt=true"]).config
    assert sample_source(cfg).generation() == (
        f"1 vLLM server ({URL}), weights by NCCL through vLLM's weight transfer (group at "
        "127.0.0.1:29555); a push pauses responses mid-way (interrupt)"
    )
    cfg = preflight("train", [*ASYNC, f"rollout.servers=[{URL}]", "staleness.weights=gloo"]).config
    assert sample_source(cfg).generation() == (
        f"1 vLLM server ({URL}), weights by gloo through vLLM's weight transfer (group at "
        "127.0.0.1:29555, a member waited for 60 s at most)"
    )
    deltas = ["staleness.weights=filesystem", "staleness.weights_delta=true"]
    cfg = preflight("train", [*base, *deltas, "staleness.weights_full_every=4"]).config
    assert sample_source(cfg).generation() == (
        f"1 vLLM server ({URL}), weights by file under <run dir>/weights, each version as a delta "
        "where fewer bytes than the full one (full at the start, after a server comes back, and "
        "every 4)"
    )


def test_a_sweep_whose_jobs_share_a_server_at_once_is_refused() -> None:
    """A server belongs to one training run at a time (rollout.lease): jobs that a launcher runs
    at once on one server are refused before anything runs; one after another, or each on its
    own server, they pass."""
    srv = [*ASYNC, "staleness.weights=filesystem"]
    parallel = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    seeds = "trainer.seed=1,2"
    with pytest.raises(PreflightError) as info:
        preflight("train", [*parallel, *srv, seeds, f"rollout.servers=[{URL}]"], multirun=True)
    assert str(info.value) == (
        f"rollout.servers: jobs 0 and 1 of this sweep both generate on {URL}, and "
        "hydra/launcher=joblib runs them at once (n_jobs=2): a server belongs to one training "
        "run at a time; give each job its own servers (sweep rollout.servers with the jobs), or "
        "run them one after another (hydra.launcher.n_jobs=1)"
    )
    for ok in (
        ["hydra/launcher=joblib", "hydra.launcher.n_jobs=1", seeds, f"rollout.servers=[{URL}]"],
        [seeds, f"rollout.servers=[{URL}]"],  # the basic launcher: one job after another
        [*parallel, f"rollout.servers=[{URL}],[http://127.0.0.1:10]"],  # one server each
    ):
        assert preflight("train", [*srv, *ok], multirun=True).num_jobs >= 2
