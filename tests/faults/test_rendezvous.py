"""Rendezvous flags and exposure (issue 33 items 6 and 8): a bad `--rdzv-endpoint` is one line
before torchrun starts, WORLD_SIZE beside launch flags is one line, bracketed IPv6 works with
real torchrun agents, and one node's torchrun listens on the loopback only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bapo_cli.launch import forward, multinode
from bapo_cli.launch.multinode import Endpoint, LaunchError, Topology, parse_endpoint
from tests.conftest import REPO, run_bapo
from tests.faults.sockets import Listening

ENV = {"OMP_NUM_THREADS": "1"}
PROBE = ["-m", "tests.faults.rank_probe"]


def _error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("http://evil:29500", "http://evil is not a host name"),
        ("a b:29500", "holds a space"),
        ("host:０２９５００", r"'host:\uff10\uff12\uff19\uff15\uff10\uff10'"),
        ("host:0029500", "the port 0029500 is not 1-65535 without leading zeros"),
        ("host:29500:1", "host:29500 is not a host name or an IPv4 address"),
        ("host:65536", "the port 65536 is not 1-65535"),
    ],
)
def test_a_bad_rdzv_endpoint_is_one_line_before_torchrun_starts(
    endpoint: str, says: str, _output_root: Path
) -> None:
    started = time.monotonic()
    result = run_bapo("train", "--nnodes", "2", "--rdzv-endpoint", endpoint, "experiment=smoke")
    line = _error_line(result)
    assert line.startswith("error: --rdzv-endpoint ") and says in line, line
    assert "HOST:PORT" in line  # what is allowed
    assert not _output_root.exists()  # nothing started, nothing written
    assert time.monotonic() - started < 60  # not torch's 45 s wait on a name that never resolves


@pytest.mark.parametrize(
    ("endpoint", "host", "port", "c10d"),
    [
        ("node01:29500", "node01", 29500, "node01:29500"),
        ("gpu-7.cluster.example.org:1", "gpu-7.cluster.example.org", 1, None),
        ("10.0.0.12:65535", "10.0.0.12", 65535, None),
        ("[::1]:29500", "::1", 29500, "[::1]:29500"),
        ("[fd00:0:0::2]:29500", "fd00::2", 29500, "[fd00::2]:29500"),
    ],
)
def test_good_endpoints_and_what_torchrun_is_given(endpoint, host, port, c10d) -> None:
    assert parse_endpoint(endpoint) == Endpoint(host, port)
    assert multinode.host_port(endpoint) == (host, port)
    if c10d is not None:
        args = multinode.torchrun_args(Topology(2, 2, None, endpoint))
        assert f"--rdzv-endpoint={c10d}" in args  # torchrun strips IPv6 brackets itself
    static = multinode.torchrun_args(Topology(2, 2, 1, endpoint))
    assert f"--master-addr={host}" in static and f"--master-port={port}" in static


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("[fe80::1%eth0]:29500", "zone index"),
        ("::1:29500", "an IPv6 address goes in []"),
        ("[::g]:29500", "[::g] is not an IPv6 address"),
        ("1.2.3:29500", "1.2.3 is not an IPv4 address"),
        ("010.0.0.1:29500", "is not an IPv4 address"),
        ("under_score:29500", "is not a host name"),
        ("-lead:29500", "is not a host name"),
        (f"{'a' * 64}:29500", "is not a host name"),
        ("host:0", "the port 0 is not 1-65535"),
        ("host:", "the port (empty)"),
        (":29500", "no HOST:PORT"),
        ("host\t:1", "holds a space"),
    ],
)
def test_bad_endpoints_say_what_is_wrong_in_one_line(endpoint: str, says: str) -> None:
    with pytest.raises(LaunchError) as err:
        Topology(1, 2, None, endpoint).check()
    assert says in str(err.value) and "\n" not in str(err.value)


_label = st.from_regex(r"[a-z]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


@given(labels=st.lists(_label, min_size=1, max_size=4), port=st.integers(1, 65535))
def test_any_rfc1123_host_and_port_round_trips(labels: list[str], port: int) -> None:
    host = ".".join(labels)
    assert parse_endpoint(f"{host}:{port}") == Endpoint(host, port)


@given(
    port=st.text(min_size=1, max_size=7).filter(
        lambda p: not (p.isascii() and p.isdigit() and p[0] != "0" and 0 < int(p) < 65536)
    )
)
def test_any_port_but_ascii_1_to_65535_without_leading_zeros_is_refused(port: str) -> None:
    with pytest.raises(LaunchError):
        parse_endpoint(f"node01:{port}")


@pytest.mark.parametrize(
    "flags",
    [
        ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500"],
        ["--nnodes", "2", "--slurm-script", "job.sh"],
        ["--nproc", "2"],
    ],
)
def test_world_size_in_the_environment_refuses_launch_flags(flags, tmp_path: Path) -> None:
    result = run_bapo("train", *flags, "experiment=smoke", cwd=tmp_path, env={"WORLD_SIZE": "2"})
    line = _error_line(result)
    assert f"{flags[0]} " in line and "WORLD_SIZE=2 in the environment" in line, line
    assert "unset WORLD_SIZE" in line
    assert not (tmp_path / "job.sh").exists()  # no script written, no local training either


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("node_ranks", [(None, None), (0, 1)], ids=["c10d", "static"])
def test_two_torchrun_agents_meet_at_a_bracketed_ipv6_endpoint(tmp_path: Path, node_ranks):
    endpoint = f"[::1]:{_free_port()}"
    out = tmp_path / "rank"
    agents = [
        subprocess.Popen(
            multinode.torchrun_command(Topology(1, 2, rank, endpoint), [*PROBE, str(out)]),
            cwd=REPO,
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in node_ranks
    ]
    try:
        for agent in agents:
            _, err = agent.communicate(timeout=240)
            assert agent.returncode == 0, err[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    reports = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [r["world"] for r in reports] == [2, 2] and [r["sum"] for r in reports] == [1.0, 1.0]


@pytest.mark.slow
def test_one_node_torchrun_listens_on_the_loopback_only(tmp_path: Path) -> None:
    """`bapo train --nproc 2`'s launch (the command `torchrun_command` builds for one node),
    two gloo ranks: while both are in the process group, every listening socket of the
    agent and the ranks is on 127.0.0.1 / ::1 (torchrun --standalone: its stores on `*`)."""
    out, hold = tmp_path / "rank", tmp_path / "hold"
    command = multinode.torchrun_command(Topology(2), [*PROBE, str(out), str(hold)])
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    launch = subprocess.Popen(
        command, cwd=REPO, env={**env, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    listening = Listening()
    try:
        deadline = time.monotonic() + 240
        while not all(Path(f"{out}.{r}").exists() for r in range(2)):
            assert launch.poll() is None, launch.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            listening.sample(launch.pid)
            time.sleep(0.1)
        listening.sample(launch.pid)  # both ranks joined: the store and gloo are all up
        hold.touch()
        _, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, err[-3000:]
    assert any(name == "pt_elastic" for _, _, name in listening.seen)  # the agent's store
    assert listening.exposed() == set(), listening.seen
    reports = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [r["world"] for r in reports] == [2, 2]
    assert {r["master_addr"] for r in reports} == {"127.0.0.1"}  # the ranks' store, too


def test_one_node_torchrun_ends_a_forwarded_stop_signal_without_a_traceback(
    tmp_path: Path,
) -> None:
    """The one-node launch `bapo train --nproc N` runs (the loopback launcher, with the agent
    environment bapo gives it): SIGUSR1 to the agent reaches the ranks and the agent exits
    128 + 10, not with torchrun's SignalException traceback (CI of fe9abc4 printed one)."""
    out, hold = tmp_path / "rank", tmp_path / "hold"
    command = forward.agent_command(
        multinode.torchrun_command(Topology(2), [*PROBE, str(out), str(hold)])
    )
    env = forward.agent_env(grace_s=5, env={**os.environ, **ENV})
    launch = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not all(Path(f"{out}.{r}").exists() for r in range(2)):
            assert launch.poll() is None, launch.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        launch.send_signal(signal.SIGUSR1)  # the ranks wait on HOLD: only the signal ends them
        _, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
