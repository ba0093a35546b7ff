"""What a generation server sends, and how long the client waits for it, against `FakeServer`
(tests/servers/hostile.py): a server that answers as `bapo serve` does until a route is made
hostile. No vLLM. Each case of the audit (issue 48) is here: endless bodies, a drip feed, more
tokens than asked, model info in other shapes, ids outside the vocabulary, log-probs that are no
probabilities, aborted responses, versions from the future, a paused server, a stalled one.

Pool-level tests set the bounds small through the pool's parameters; the command-line tests run
with the defaults (docs/engines.md#limits-and-timeouts). A case that hung before the fix runs in
a thread (`within`), so it fails instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from pathlib import Path

import pytest

from bapo_cli.rollout.base import FINISH_BUDGET, Request, SamplingParams
from bapo_cli.rollout.server_push import CLOSE_TIMEOUT_S
from bapo_cli.rollout.servers import (
    GENERATE,
    ModelIdentity,
    NoServerLeft,
    ServerError,
    ServerFault,
    ServerPool,
    validate_url,
)
from tests.conftest import run_bapo
from tests.servers.hostile import (
    ARCH,
    VOCAB,
    Drip,
    Endless,
    FakeServer,
    Hang,
    generation,
    healthy_generate,
    wait_until,
)
from tests.train.conftest import FAST, train_in_background, wait_for

IDENTITY = ModelIdentity((ARCH,), VOCAB)
PARAMS = SamplingParams(temperature=1.0, max_tokens=16)
PROMPT = [1, 5, 6]


def make_pool(*fakes: FakeServer, **kwargs) -> ServerPool:
    return ServerPool([f.url for f in fakes], expect=IDENTITY, max_model_len=256, **kwargs)


def within(seconds: float, fn):
    """fn() in a thread: its result, or its exception raised here; fails if it runs longer."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def generate(pool: ServerPool, count: int = 1, max_tokens: int = 16):
    requests = [Request(prompt_ids=PROMPT, max_tokens=max_tokens) for _ in range(count)]
    return pool.generate(requests, PARAMS, list(range(count)))


def on_generate(answer):
    """A generate route that answers `answer(fake, body)` to generation requests; the check's
    empty body and the weight probe (prompt log-probs) get a healthy server's answers."""

    def route(fake, query, body):
        if not body or body["sampling_params"].get("prompt_logprobs") is not None:
            return healthy_generate(fake, query, body)
        return answer(fake, body)

    return route


# ------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("route", ["/health", "/collective_rpc", "/v1/models"])
def test_an_endless_answer_at_the_check_is_refused_at_its_cap(route, chunked) -> None:
    with FakeServer() as fake:
        fake.routes[route] = lambda *a: Endless(chunked=chunked)
        t0 = time.monotonic()
        with pytest.raises(ServerError) as info:
            within(30, make_pool(fake).check)
        line = str(info.value)
        assert "\n" not in line and fake.url in line
        assert "body past the 1,048,576-byte cap" in line, line
        assert fake.sent < 16 << 20  # the cap, and what the sockets' buffers took
        assert time.monotonic() - t0 < 10


def test_an_endless_generation_is_refused_at_its_cap() -> None:
    with FakeServer() as fake:
        fake.routes[GENERATE] = on_generate(lambda f, b: Endless())
        pool = make_pool(fake)
        pool.check()
        with pytest.raises(ServerFault) as info:
            within(30, lambda: generate(pool))
        # 64 KiB + 1 KiB for each of the 3 prompt tokens and 16 asked
        assert str(info.value) == (
            f"{fake.url} answered {GENERATE} with a body past the 84,992-byte cap (sent more): "
            "no healthy server sends that much for what was asked"
        )
        assert fake.sent < 16 << 20


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (17, "returned 17 tokens where at most 16 were asked (max_tokens)"),
        (5000, "body past the 84,992-byte cap (announced "),
    ],
)
def test_more_tokens_than_asked_are_refused(count, message) -> None:
    with FakeServer() as fake:
        fake.routes[GENERATE] = on_generate(lambda f, b: generation([5] * count))
        pool = make_pool(fake)
        pool.check()
        with pytest.raises(ServerFault, match=message.replace("(", r"\(").replace(")", r"\)")):
            generate(pool)


# ------------------------------------------------------------------------------------- time


def test_a_drip_fed_check_ends_at_its_deadline() -> None:
    with FakeServer() as fake:
        fake.routes["/collective_rpc"] = lambda *a: Drip()
        t0 = time.monotonic()
        with pytest.raises(ServerError) as info:
            within(20, make_pool(fake, check_timeout_s=1.0).check)
        assert str(info.value) == (
            f"the generation server {fake.url} failed its check at POST /collective_rpc (no "
            "complete answer within 1 s); restart it with `bapo serve` or drop it from "
            "rollout.servers"
        )
        assert time.monotonic() - t0 < 5


def test_a_drip_fed_generation_ends_at_its_deadline() -> None:
    with FakeServer() as fake:
        fake.routes[GENERATE] = on_generate(lambda f, b: Drip(b"{" + b" " * 9999, every_s=0.02))
        pool = make_pool(fake, request_timeout_s=1.0)
        pool.check()
        with pytest.raises(NoServerLeft) as info:
            within(20, lambda: generate(pool))
        assert str(info.value) == (
            f"every generation server is down ({fake.url}: no complete answer within 1 s)"
        )


def test_a_stalled_server_is_found_by_its_health_and_its_requests_resent() -> None:
    """Server A takes the requests and stops answering anything (SIGSTOP-like): its health goes
    unanswered, so it is down within health_every_s + stall_s and B answers everything."""
    with FakeServer() as a, FakeServer() as b:
        pool = make_pool(a, b, health_every_s=0.3, stall_s=0.5)
        pool.check()
        a.routes[GENERATE] = a.routes["/health"] = lambda *x: Hang()
        t0 = time.monotonic()
        gens = within(20, lambda: generate(pool, count=6))
        assert time.monotonic() - t0 < 5
        assert [g.server for g in gens] == [b.url] * 6
        assert [len(g.token_ids) for g in gens] == [16] * 6
        server_a = pool.servers[0]
        assert not server_a.alive and server_a.resent == 3  # the 3 it held, sent again to B
        assert server_a.last_error == "stalled: no answer to GET /health within 0.5 s"


def test_a_fault_ends_the_requests_still_waiting_on_another_server() -> None:
    """B's answer is refused while A drips: generate returns at once, not after A's 600 s."""
    with FakeServer() as a, FakeServer() as b:
        pool = make_pool(a, b, stall_s=0)
        pool.check()
        a.routes[GENERATE] = on_generate(lambda f, body: Drip(b"{" + b" " * 9999, every_s=0.05))
        b.routes[GENERATE] = on_generate(lambda f, body: generation([VOCAB]))
        t0 = time.monotonic()
        with pytest.raises(ServerFault, match=f"^{b.url} returned token id {VOCAB}"):
            within(30, lambda: generate(pool, count=4))
        assert time.monotonic() - t0 < 5


def test_a_slow_server_that_answers_its_health_is_waited_for() -> None:
    """Slow is not stalled: a response that takes longer than several health rounds comes back."""
    with FakeServer() as fake:

        def slow(f, body):
            time.sleep(1.5)
            return generation([5] * 16)

        fake.routes[GENERATE] = on_generate(slow)
        pool = make_pool(fake, health_every_s=0.2, stall_s=0.5)
        pool.check()
        (gen,) = within(20, lambda: generate(pool))
        assert gen.token_ids == [5] * 16 and pool.servers[0].alive
        assert fake.asked("/health") >= 3  # asked while the response ran, and answered


def test_a_pause_answered_late_at_close_is_still_followed_by_a_resume() -> None:
    """CI at 5a7827f: a run's close aborted its requests on a loaded server whose pause answered
    after the client's CLOSE_TIMEOUT_S; the resume was skipped, the server stayed paused, and
    the next run's requests waited 600 s on it (its log: `/pause?mode=abort` 200, no `/resume`)."""

    def late_pause(fake, query, body):
        fake.paused = True  # takes effect, answers after the client gave up
        time.sleep(CLOSE_TIMEOUT_S + 1)
        return {"status": "paused"}

    with FakeServer() as fake:
        pool = make_pool(fake)
        pool.check()
        fake.routes["/pause"] = late_pause
        fake.routes[GENERATE] = on_generate(lambda *a: Hang())
        waiting = threading.Thread(target=lambda: _quietly(generate, pool), daemon=True)
        waiting.start()
        assert wait_until(lambda: pool.servers[0].in_flight > 0, 10)
        t0 = time.monotonic()
        pool.close()
        took = time.monotonic() - t0
        assert fake.asked("/pause") == 1 and fake.asked("/resume") == 1
        assert not fake.paused
        assert took < 2 * CLOSE_TIMEOUT_S + 2, took  # still bounded


def _quietly(fn, *args) -> None:
    with contextlib.suppress(ServerError):
        fn(*args)


def test_a_paused_server_is_refused_by_a_pool_that_never_pushes() -> None:
    with FakeServer() as fake:
        fake.paused = True  # a trainer killed mid-push left it so
        with pytest.raises(ServerError) as info:
            within(20, make_pool(fake, wait_paused_s=0.5).check)
        assert str(info.value) == (
            f"the generation server {fake.url} is paused and stayed paused for 0.5 s (a weight "
            "push that never finished: its trainer stopped mid-push?), so it would answer "
            f"nothing; if no run uses it, resume it with `curl -X POST {fake.url}/resume` and "
            "run again"
        )
        assert fake.paused  # refused, not resumed
        threading.Timer(0.3, lambda: setattr(fake, "paused", False)).start()
        make_pool(fake, wait_paused_s=5.0).check()  # a push's pause ends: waited for
        fake.paused = True
        make_pool(fake).start(0)  # a training run's pool resumes it with its first push
        assert not fake.paused


# ---------------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "answer",
    [
        {},
        "a string",
        [1, 2],
        {"results": []},
        {"results": [{"architectures": [ARCH], "vocab_size": "260abc"}]},
        {"results": [{"architectures": ARCH, "vocab_size": VOCAB}]},
        {"results": [{"architectures": [ARCH], "vocab_size": True}]},
    ],
)
def test_model_info_in_another_shape_is_one_line(answer) -> None:
    with FakeServer() as fake:
        fake.routes["/collective_rpc"] = lambda *a: answer
        with pytest.raises(ServerError) as info:
            make_pool(fake).check()
        assert str(info.value) == (
            f"the server {fake.url} described its model as {answer!r}, not as "
            '{"results": [{"architectures": [names], "vocab_size": a positive integer}]}; start '
            "it with `bapo serve` (its worker extension answers that)"
        )


def test_json_nested_past_the_parsers_depth_is_not_json() -> None:
    with FakeServer() as fake:
        fake.routes["/collective_rpc"] = lambda *a: b"[" * 200_000
        with pytest.raises(ServerError, match=r"POST /collective_rpc \(.* is not JSON: b'\[\[\["):
            make_pool(fake).check()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (generation([VOCAB]), f"returned token id {VOCAB}, outside the vocabulary [0, {VOCAB})"),
        (generation([4, -1]), f"returned token id -1, outside the vocabulary [0, {VOCAB})"),
        (generation([4, 5], [-0.5, math.nan]), "returned log-prob nan for a sampled token"),
        (generation([4, 5], [-0.5, math.inf]), "returned log-prob inf for a sampled token"),
        (generation([4, 5], [-math.inf, -1.0]), "returned log-prob -inf for a sampled token"),
        (generation([4, 5], [3.0, -1.0]), "returned log-prob 3.0 for a sampled token"),
        (generation([4, 5], [-1.0]), "returned 2 tokens but 1 log-probs"),
        (generation([4, 5], versions=[{"version": "0", "start": 0, "end": 1}]), "did not say"),
        ({"choices": []}, "answered the generate route without a choice: {'choices': []}"),
        (generation(["4"]), "returned token ids that are not integers: ['4']"),
        (generation([4], ["-1"]), "returned log-probs in another shape"),
        (generation([4], versions=7), "returned weight-version spans in another shape: 7"),
    ],
)
def test_a_generation_no_healthy_server_sends_is_refused(answer, message) -> None:
    with FakeServer() as fake:
        fake.routes[GENERATE] = on_generate(lambda f, b: answer)
        pool = make_pool(fake)
        pool.check()
        with pytest.raises(ServerFault) as info:
            generate(pool)
        line = str(info.value)
        assert line.startswith(f"{fake.url} ") and message in line, line
        assert "\n" not in line


def test_log_probs_a_rounding_above_zero_pass() -> None:
    with FakeServer() as fake:
        fake.routes[GENERATE] = on_generate(lambda f, b: generation([4, 5], [1e-4, -2.0]))
        pool = make_pool(fake)
        pool.check()
        assert generate(pool)[0].logprobs == [1e-4, -2.0]


def test_a_version_newer_than_the_newest_pushed_is_refused(tmp_path: Path) -> None:
    with FakeServer() as fake:
        pool = make_pool(fake, weights_dir=tmp_path)
        pool.start(3)  # labels what it holds 3: the newest this run pushed
        assert [g.versions for g in generate(pool, max_tokens=2)] == [[3, 3]]
        fake.routes[GENERATE] = on_generate(lambda f, b: generation([4, 5], version="4"))
        with pytest.raises(ServerFault) as info:
            generate(pool)
        assert str(info.value) == (
            f"{fake.url} stamped tokens with weights version 4, newer than the newest pushed "
            "to it (3): does another run push weights to it?"
        )
        # a pool that never pushed (bapo eval) scores whatever version the server holds
        fresh = make_pool(fake)
        fresh.check()
        assert [g.versions for g in generate(fresh, max_tokens=2)] == [[4, 4]]


def test_an_aborted_response_is_sent_again_not_trained_as_cut() -> None:
    with FakeServer() as fake:
        answers = iter([generation([4, 5], finish="abort")])
        fake.routes[GENERATE] = on_generate(
            lambda f, b: next(answers, None) or generation([7] * b["sampling_params"]["max_tokens"])
        )
        pool = make_pool(fake)
        pool.check()
        (gen,) = generate(pool)
        assert gen.token_ids == [7] * 16 and gen.finish_reason == FINISH_BUDGET
        assert pool.servers[0].resent == 1
        fake.routes[GENERATE] = on_generate(lambda f, b: generation([4], finish="abort"))
        with pytest.raises(ServerFault, match=r"aborted a response .*, 3 times$"):
            generate(pool)


def test_urls_with_a_query_a_fragment_or_credentials_are_refused() -> None:
    for url in ["http://127.0.0.1:8001/?token=x", "http://127.0.0.1:8001#a", "http://u:p@h:1"]:
        with pytest.raises(ServerError, match="is not a server URL"):
            validate_url(url)
    assert validate_url("http://127.0.0.1:8001/") == "http://127.0.0.1:8001"


# ------------------------------------------------------------------------ the commands


EVAL_ROWS = [{"id": i, "problem": f"{i}+1", "answer": str(i + 1)} for i in range(4)]


def _eval_args(tmp_path: Path, url: str) -> list[str]:
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in EVAL_ROWS))
    return [
        f"eval.server={url}",
        f"benchmark.path={bench}",
        "benchmark.name=four",
        "eval.template='{problem}='",
        "tracking=none",
        "eval.n=2",
        "eval.max_tokens=8",
        "model.max_model_len=256",
    ]


# the fake's probe log-probs are not the trainer's (-1 each): the probe's stop is not these tests'
ASYNC_ON = [
    "staleness=2",
    "staleness.regime=async",
    "staleness.weights=filesystem",
    "staleness.probe_tolerance=1000",
]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_drip_fed_start_up_check_is_one_line_within_its_deadline(
    command, tmp_path, _output_root
) -> None:
    """The defaults: each check question within 10 s (CHECK_TIMEOUT_S)."""
    with FakeServer() as fake:
        fake.routes["/health"] = lambda *a: Drip()
        if command == "train":
            args = [*ASYNC_ON, f"rollout.servers=[{fake.url}]", "model.max_model_len=256"]
        else:
            args = _eval_args(tmp_path, fake.url)
        t0 = time.monotonic()
        res = run_bapo(command, *args, timeout=120)
        took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr[-2000:]
    # training counts the servers that answer (rollout.min_servers); eval has one server
    tally = ": 0 of 1 answer, fewer than 1 (rollout.min_servers=null: all for a new run)"
    assert res.stderr == (
        f"error: cannot reach the generation server {fake.url} (no complete answer within "
        f"10 s){tally if command == 'train' else ''}; start one there with `bapo serve --port "
        "PORT` or fix rollout.servers\n"
    )
    assert took < 60, took


@pytest.mark.slow
def test_eval_of_ids_outside_the_vocabulary_is_an_error_not_a_zero(tmp_path, _output_root):
    with FakeServer() as fake:
        fake.routes[GENERATE] = on_generate(lambda f, b: generation([300, 4]))
        res = run_bapo("eval", *_eval_args(tmp_path, fake.url), timeout=180)
    assert res.returncode == 1, res.stderr[-2000:]
    assert res.stderr.splitlines()[-1] == (
        f"error: {fake.url} returned token id 300, outside the vocabulary [0, {VOCAB})"
    )
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_training_on_log_probs_that_are_no_probabilities_stops_in_one_line(tmp_path) -> None:
    with FakeServer() as fake:
        bad = generation([4, 5, 6], [-1.0, math.nan, -1.0])
        fake.routes[GENERATE] = on_generate(lambda f, b: bad)
        trainer = train_in_background(
            tmp_path / "run", *ASYNC_ON, f"rollout.servers=[{fake.url}]", "model.max_model_len=256"
        )
        _, err = trainer.communicate(timeout=240)
    assert trainer.returncode == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: {fake.url} returned log-prob nan for a sampled token: a log-probability is "
        "finite and at most 0 (+0.001 is let through for rounding); nothing of it was trained: "
        "fix or replace that server, then resume (trainer.resume=true)"
    )
    assert "Traceback" not in err


@pytest.mark.slow
def test_sigterm_ends_a_run_whose_server_drips_and_closes_its_mlflow_run(tmp_path) -> None:
    """A server that trains fine, then drips every answer a byte at a time: SIGTERM's grace (3 s
    here) ends the run, exit 143, and its MLflow run is closed KILLED (it was left RUNNING)."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    with FakeServer() as fake:
        trainer = train_in_background(
            run_dir,
            *ASYNC_ON,
            f"rollout.servers=[{fake.url}]",
            "model.max_model_len=256",
            "trainer.max_steps=1000",
            "trainer.stop_grace_s=3",
            "tracking=mlflow",
            f"tracking.uri={store}",
            base=tuple(a for a in FAST if a != "tracking=none"),
        )
        samples = run_dir / "samples.jsonl"
        wait_for(lambda: samples.exists() and samples.stat().st_size > 0, 240, "a step", trainer)
        for route in list(fake.routes):  # within every cap: only the time is hostile
            fake.routes[route] = lambda *a: Drip(b"{" + b" " * 9999)
        assert wait_until(lambda: fake.asked(GENERATE) > 0 and trainer.poll() is None, 5)
        time.sleep(1.0)  # the generation thread is waiting on a dripping answer
        t0 = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=90)
        took = time.monotonic() - t0
    assert trainer.returncode == 128 + signal.SIGTERM, err[-3000:]
    print(f"\nSIGTERM to exit: {took:.1f} s")  # noqa: T201
    assert took < 3 + 20, took  # the grace, then closing: each abort within 2 s
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    assert run.info.status == "KILLED"


@pytest.mark.slow
def test_sigterm_ends_a_run_whose_server_hangs_at_its_start_push(tmp_path) -> None:
    """A server that answers its check and its health but never its pause (a push that would
    wait 600 s): SIGTERM's grace (3 s) ends the run at its start, its MLflow run KILLED."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    with FakeServer() as fake:
        fake.routes["/pause"] = lambda *a: Hang()
        trainer = train_in_background(
            tmp_path / "run",
            *ASYNC_ON,
            f"rollout.servers=[{fake.url}]",
            "model.max_model_len=256",
            "trainer.stop_grace_s=3",
            "tracking=mlflow",
            f"tracking.uri={store}",
            base=tuple(a for a in FAST if a != "tracking=none"),
        )
        wait_for(lambda: fake.asked("/pause") > 0, 240, "the start push", trainer)
        t0 = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=90)
        took = time.monotonic() - t0
    assert trainer.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 3 + 20, took
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    assert run.info.status == "KILLED"
