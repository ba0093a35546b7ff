"""`bapo serve` and the pool's start-up refusals that need no running server: the command a
server is started with, a busy port or a bad override refused in one line, and an unreachable or
malformed server URL refused in one line."""

from __future__ import annotations

import shlex
import socket

import pytest

from bapo_cli.rollout import serve
from bapo_cli.rollout.servers import ServerError, ServerPool
from tests.conftest import run_bapo
from tests.servers.conftest import free_port


@pytest.mark.vllm
def test_print_command_names_every_flag_a_run_needs() -> None:
    pytest.importorskip("vllm")
    res = run_bapo("serve", "model.max_model_len=96", "--port", "8123", "--print-command")
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert "\n" not in line
    env, _, argv = line.partition(" /")
    assert env == "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1"
    args = ("/" + argv).split()
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(args[3::2], args[4::2], strict=False))
    for flag, value in {
        "--host": "127.0.0.1",  # loopback unless told otherwise
        "--port": "8123",
        "--max-model-len": "96",
        "--dtype": "float32",
        "--logprobs-mode": "processed_logprobs",
        "--generation-config": "vllm",
        "--worker-extension-cls": "bapo_cli.rollout.vllm_ext.BapoWorkerExtension",
        "--served-model-name": "tiny",
    }.items():
        assert args[args.index(flag) + 1] == value, (flag, flags)
    assert {"--enable-scale-out", "--enable-prefix-caching", "--enforce-eager"} <= set(args)
    assert args[args.index("--model") + 1].endswith("weights/tiny")  # the shipped tiny model


@pytest.mark.vllm
def test_nccl_weights_add_vllms_weight_transfer_flag_on_a_gpu_only() -> None:
    """`--weights nccl` starts the server with vLLM's NCCL weight-transfer routes; off CUDA it is
    refused in one line (the transfer would report success and move nothing). The flag is parsed
    by vLLM's own argument parser (0.32) into its weight-transfer config."""
    pytest.importorskip("vllm")
    res = run_bapo("serve", "--port", "8124", "--weights", "nccl")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (
        "error: --weights nccl needs the server on a GPU (model.device=cuda): off CUDA vLLM's "
        "NCCL weight transfer reports success and moves nothing; use --weights filesystem\n"
    )
    res = run_bapo(
        "serve", "model.device=cuda", "--port", "8124", "--weights", "nccl", "--print-command"
    )
    assert res.returncode == 0, res.stderr
    args = shlex.split(res.stdout)  # a shell line: the JSON is quoted
    assert args[args.index("--weight-transfer-config") + 1] == '{"backend":"nccl"}'
    assert "--gpu-memory-utilization" in args and "--enforce-eager" not in args
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = parser.parse_args(serve.transfer_flags("nccl"))
    engine = EngineArgs.from_cli_args(parsed)
    assert engine.weight_transfer_config.backend == "nccl"
    gloo = EngineArgs.from_cli_args(parser.parse_args(serve.transfer_flags("gloo")))
    assert gloo.weight_transfer_config.backend == "bapo_gloo"  # rollout.vllm_plugin.GLOO
    assert serve.transfer_flags("filesystem") == []


@pytest.mark.vllm
def test_the_extension_named_is_the_class() -> None:
    pytest.importorskip("vllm")
    from bapo_cli.rollout import vllm_ext

    assert serve.EXTENSION == vllm_ext.EXTENSION
    module, _, name = serve.EXTENSION.rpartition(".")
    assert module == vllm_ext.__name__ and getattr(vllm_ext, name) is vllm_ext.BapoWorkerExtension
    # vLLM mixes it into its worker and refuses names that clash: ours all start with bapo_
    # (a helper of its own, _bapo_)
    public = [a for a in vars(vllm_ext.BapoWorkerExtension) if not a.startswith("__")]
    assert public and all(a.startswith(("bapo_", "_bapo_")) for a in public)


@pytest.mark.vllm
def test_a_busy_port_is_refused_in_one_line() -> None:
    pytest.importorskip("vllm")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = run_bapo("serve", "--port", str(port))
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.strip() == (
        f"error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose a free port or another --host"
    )


def test_a_bad_override_is_refused_before_anything_starts() -> None:
    res = run_bapo("serve", "model.max_model_len=-3", "--port", "8124")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: model.max_model_len")


def test_an_unreachable_server_is_refused_in_one_line() -> None:
    port = free_port()  # nothing listens there
    pool = ServerPool([f"http://127.0.0.1:{port}"])
    with pytest.raises(ServerError) as info:
        pool.check()
    assert str(info.value) == (
        f"cannot reach the generation server http://127.0.0.1:{port} (connection refused); "
        "start one there with `bapo serve --port PORT` or fix rollout.servers"
    )


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        (["127.0.0.1:8000"], "'127.0.0.1:8000' is not a server URL; give http://HOST:PORT"),
        (["http://127.0.0.1:8000/v1"], "is not a server URL"),
        (["http://a:1", "http://a:1/"], "names a server twice"),
        ([], "rollout.servers is empty"),
    ],
)
def test_malformed_server_lists_are_refused(urls, message) -> None:
    with pytest.raises(ServerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerPool(urls)
