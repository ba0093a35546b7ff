"""The lease table a generation server keeps (`rollout.lease`, held by the worker extension) and
the client's reading of its answers, driven with a hand-moved clock: one training run at a time,
a resumed run taking over from its killed process at once, a killed run's lease lapsing, shared
evaluations, and every change of holder visible to the holder that lost the server. The same
table in real servers: tests/servers/test_ownership.py."""

from __future__ import annotations

import pytest

from bapo_cli.rollout.lease import Grant, LeaseLost, LeaseRefused, LeaseTable, refusal


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def table() -> LeaseTable:
    return LeaseTable(Clock())


def grant_of(answer: dict) -> Grant:
    return Grant(answer["instance"], answer["epoch"])


def test_one_training_run_at_a_time(table) -> None:
    a = table.claim("host:/runs/a", "p1", "train", 60)
    assert a["granted"] and a["epoch"] == 1
    b = table.claim("host:/runs/b", "p2", "train", 60)
    assert b == {"granted": False, "holder": "host:/runs/a", "kind": "train", "left_s": 60.0}
    table.clock.t += 45
    assert table.claim("host:/runs/b", "p2", "train", 60)["left_s"] == 15.0
    # renewed by its heartbeat, the holder keeps the server and its epoch
    assert table.claim("host:/runs/a", "p1", "train", 60) == a
    table.clock.t += 59
    assert not table.claim("host:/runs/b", "p2", "train", 60)["granted"]
    # a killed run renews nothing: its lease lapses, the next run gets the server
    table.clock.t += 1
    b = table.claim("host:/runs/b", "p2", "train", 60)
    assert b["granted"] and b["epoch"] == 2
    # and the run that lapsed (if it was only stalled) sees the server taken
    assert not table.claim("host:/runs/a", "p1", "train", 60)["granted"]
    with pytest.raises(LeaseRefused):
        grant_of(a).check("http://s:1", table.claim("host:/runs/a", "p1", "train", 60), "hint")


def test_a_resumed_run_takes_over_at_once_and_its_old_process_knows(table) -> None:
    old = table.claim("host:/runs/a", "p1", "train", 60)
    new = table.claim("host:/runs/a", "p2", "train", 60)  # trainer.resume=true after kill -9
    assert new["granted"] and new["epoch"] == old["epoch"] + 1
    assert [h["run"] for h in table.state()["holders"]] == ["host:/runs/a"]
    # had the old process lived on, its next renewal shows another holder came in between
    again = table.claim("host:/runs/a", "p1", "train", 60)
    with pytest.raises(LeaseLost, match=r"held by another run or process .* epoch 1 -> 3"):
        grant_of(old).check("http://s:1", again, "hint")


def test_a_release_frees_the_server_at_once(table) -> None:
    table.claim("host:/runs/a", "p1", "train", 60)
    table.release("host:/runs/a", "p1")
    assert table.state()["holders"] == []
    assert table.claim("host:/runs/b", "p2", "train", 60)["granted"]


def test_evaluations_share_a_server_but_never_with_a_training_run(table) -> None:
    assert table.claim("bapo eval on h:/e1", "q1", "eval", 60)["granted"]
    assert table.claim("bapo eval on h:/e2", "q2", "eval", 60)["granted"]
    refused = table.claim("host:/runs/a", "p1", "train", 60)
    assert refused["granted"] is False and refused["kind"] == "eval"
    assert table.epoch == 0  # evaluations never change whose weights the server holds
    table.release("bapo eval on h:/e1", "q1")
    table.release("bapo eval on h:/e2", "q2")
    assert table.claim("host:/runs/a", "p1", "train", 60)["granted"]
    refused = table.claim("bapo eval on h:/e3", "q3", "eval", 60)
    assert refused == {"granted": False, "holder": "host:/runs/a", "kind": "train", "left_s": 60.0}


def test_loads_follow_the_lease(table) -> None:
    """A reload is the holder's (it renews the lease), refused for another run; one that names
    no run is loaded only while nobody holds the server, and moves the epoch on, so a holder
    whose lease lapsed meanwhile learns its weights were replaced."""
    a = table.claim("host:/runs/a", "p1", "train", 60)
    table.clock.t += 50
    assert table.load("host:/runs/a", "p1", 60) == a
    assert table.state()["holders"][0]["left_s"] == 60.0
    assert table.load("host:/runs/b", "p2", 60)["granted"] is False
    assert table.load(None, None, 60)["granted"] is False
    table.clock.t += 61
    anonymous = table.load(None, None, 60)
    assert anonymous["granted"] and anonymous["epoch"] == a["epoch"] + 1
    table.loaded(None, 4, None)
    assert table.holds == {"run": None, "version": 4, "base": None}
    with pytest.raises(LeaseLost):
        grant_of(a).check("http://s:1", table.claim("host:/runs/a", "p1", "train", 60), "hint")


def test_a_restarted_server_is_a_fresh_grant_not_a_theft(table) -> None:
    a = table.claim("host:/runs/a", "p1", "train", 60)
    restarted = LeaseTable(Clock())
    answer = restarted.claim("host:/runs/a", "p1", "train", 60)
    assert answer["epoch"] == a["epoch"] and answer["instance"] != a["instance"]
    assert grant_of(a).check("http://s:1", answer, "hint") == grant_of(answer)


def test_the_refusal_is_one_line_naming_holder_lapse_and_remedy(table) -> None:
    table.claim("host:/runs/a", "p1", "train", 60)
    table.clock.t += 12.34
    answer = table.claim("host:/runs/b", "p2", "train", 60)
    line = refusal("http://127.0.0.1:8001", answer, "give this run other servers")
    assert line == (
        "the generation server http://127.0.0.1:8001 is held by the training run host:/runs/a "
        "(renewed while it runs; if it was killed, its lease lapses in 47.7 s): a server belongs "
        "to one training run at a time; give this run other servers"
    )
    with pytest.raises(ValueError, match="kind 'admin'"):
        table.claim("x", "y", "admin", 60)
