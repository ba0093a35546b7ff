"""Config rules of generation servers: `rollout.servers`, `staleness.weights`,
`staleness.weights_dir` (bapo train) and `eval.server` (bapo eval).

These are rules on the config alone (no network; torch only to resolve model.device=auto for
`nccl`): the schema calls them from its
`check()` methods so a bad combination costs one line before anything starts. Whether the
servers answer and serve the run's model, and whether the weights directory can be written, is
asked later by the CLI, still before the run dir is claimed (`staleness.server_setup.preflight`,
`evaluation.served.preflight`).

Why each rule:

- servers feed the async regime only: the other regimes generate inside the training loop, on
  the trainer's engine;
- `shm` moves weights through this machine's shared memory to a worker process: it cannot reach
  a server; `filesystem` (and `nccl`, `gloo`) push to servers and need some;
- `nccl` is refused off CUDA: vLLM's NCCL weight transfer needs CUDA on the trainer and every
  server, and off CUDA it reports success while moving nothing (open vLLM PRs 57022/57374). On
  CUDA it runs through `rollout.weights_transfer` (built, not run: no GPU with vLLM was
  available; its start-up canary stops a push that moves nothing, docs/engines.md); `gloo` is the
  same protocol with bapo-cli's gloo engine (any device); `staleness.nccl_master` must be
  HOST:PORT;
- vLLM takes temperatures 0-2 only (`SamplingParams` refuses more; a server answers each such
  request with HTTP 400): a run on servers or `rollout=vllm`, or an eval on a server or vLLM,
  would fail at its first request, after the engine or the servers started;
- `rollout.tis_cap` and `rollout.seq_mask=geo|icepop` weigh the trainer's log-probs against the
  engine's *under the same weights*; with servers the behaviour log-probs are the servers' own
  (the trainer never holds the weights that sampled an old token), so both would be weights of
  exactly 1: refused rather than silently doing nothing.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from bapo_cli.config.errors import ConfigError

WEIGHT_TRANSPORTS = ("shm", "filesystem", "nccl", "gloo")
VLLM_MAX_TEMPERATURE = 2.0  # vllm.SamplingParams: "temperature must be in [0, 2]"
URL_FORM = "give http://HOST:PORT, as `bapo serve` prints it"


def check_url(key: str, url: Any) -> None:
    """A server URL: http(s)://host:port with no path, query, fragment or credentials (the client
    would send none of them: a query or fragment would be glued into every route's path, and
    user:password@ would be read as part of the host name)."""
    text = str(url)
    parsed = urllib.parse.urlsplit(text)
    bad = parsed.scheme not in ("http", "https") or parsed.path not in ("", "/")
    if bad or not parsed.hostname:
        raise ConfigError(key, url, f"is not a server URL; {URL_FORM}")
    if "@" in parsed.netloc:
        raise ConfigError(
            key,
            url,
            "holds credentials (user:password@), which the client never sends (they would be "
            f"read as part of the host name); {URL_FORM} (it listens on loopback: reach another "
            "machine's through a private network or an ssh tunnel)",
        )
    if "?" in text or "#" in text:
        what = "a query string (?...)" if "?" in text else "a fragment (#...)"
        raise ConfigError(
            key, url, f"has {what}, which no route takes; {URL_FORM}, with nothing after the port"
        )
    try:
        parsed.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise ConfigError(key, url, f"is not a server URL; {URL_FORM}") from None


def check_master(key: str, value: Any) -> tuple[str, int]:
    """HOST:PORT of the NCCL weight group's rendezvous (the trainer's address as the servers
    reach it); (host, port)."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or port != str(int(port)):
        raise ConfigError(key, value, "give HOST:PORT, e.g. 127.0.0.1:29555 (the trainer's host)")
    if not 1 <= int(port) <= 65535:
        raise ConfigError(key, value, "the port must be 1-65535")
    return host.strip("[]"), int(port)


def _on_cuda(device: str) -> bool:
    """model.device names CUDA (auto: CUDA when torch sees one; torch is imported only then)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def check_train(cfg: Any) -> None:
    """Cross-group rules of a training config (a `TrainConfig`)."""
    servers = list(cfg.rollout.servers)
    weights = cfg.staleness.weights
    for url in servers:
        check_url("rollout.servers", url)
    stripped = [str(u).rstrip("/") for u in servers]
    if len(set(stripped)) != len(stripped):
        raise ConfigError("rollout.servers", servers, "names a server twice; list each once")
    if servers and cfg.staleness.regime != "async":
        raise ConfigError(
            "rollout.servers",
            servers,
            f"generation servers feed staleness.regime=async only (this run: "
            f"{cfg.staleness.regime}, which generates inside the training loop): add "
            "staleness.regime=async, or drop rollout.servers",
        )
    if cfg.model.lora.rank > 0 and cfg.staleness.regime == "async" and not servers:
        raise ConfigError(
            "model.lora.rank",
            cfg.model.lora.rank,
            "with staleness.regime=async needs generation servers (rollout.servers=[URL,...] "
            "staleness.weights=filesystem: they take the merged weights): the worker process "
            "loads a plain model and takes no adapter weights",
        )
    if weights == "nccl" and not _on_cuda(cfg.model.device):
        raise ConfigError(
            "staleness.weights",
            weights,
            "needs the trainer on CUDA (model.device=cuda) and servers on GPUs: off CUDA vLLM's "
            "NCCL weight transfer reports success and moves nothing (vLLM PRs 57022/57374); use "
            "staleness.weights=filesystem",
        )
    check_master("staleness.nccl_master", cfg.staleness.nccl_master)
    if weights == "shm" and servers:
        raise ConfigError(
            "staleness.weights",
            weights,
            "moves weights through this machine's shared memory to a worker process, not to "
            "generation servers: use staleness.weights=filesystem with rollout.servers",
        )
    if weights != "shm" and not servers:
        raise ConfigError(
            "staleness.weights",
            weights,
            "pushes weights to generation servers: needs rollout.servers=[URL,...] (start them "
            "with bapo serve), or staleness.weights=shm",
        )
    if cfg.staleness.weights_dir is not None and weights != "filesystem":
        raise ConfigError(
            "staleness.weights_dir",
            cfg.staleness.weights_dir,
            "only the filesystem transport writes weights: needs staleness.weights=filesystem",
        )
    if cfg.staleness.probe_tolerance is not None and not servers:
        raise ConfigError(
            "staleness.probe_tolerance",
            cfg.staleness.probe_tolerance,
            "checks the weight pushes to generation servers: needs rollout.servers=[URL,...]",
        )
    _check_min_servers(cfg.rollout.min_servers, servers, weights)
    _check_servers_file(cfg.rollout.servers_file, servers, weights)
    if servers:
        why = ("rollout.servers", "generate in this process (drop rollout.servers)")
        check_vllm_temperature("rollout.temperature", cfg.rollout.temperature, *why)
    elif cfg.rollout.name == "vllm":
        why = ("rollout=vllm", "generate with transformers (rollout=hf)")
        check_vllm_temperature("rollout.temperature", cfg.rollout.temperature, *why)
    if servers and cfg.rollout.tis_cap is not None:
        raise ConfigError(
            "rollout.tis_cap",
            cfg.rollout.tis_cap,
            "weighs the trainer's log-probs against the engine's under the same weights; with "
            "rollout.servers the behaviour log-probs are the servers' own, so every weight would "
            "be 1: use trainer.old_logprob=recompute with algo.behav_weight_cap (decoupled PPO), "
            "or drop rollout.tis_cap",
        )
    if servers and cfg.rollout.seq_mask in ("geo", "icepop"):
        raise ConfigError(
            "rollout.seq_mask",
            cfg.rollout.seq_mask,
            "compares the trainer's and the engine's log-probs under the same weights; with "
            "rollout.servers the behaviour log-probs are the servers' own: use seq_mask=opsm, "
            "kpop or none",
        )


def _check_servers_file(path: str | None, servers: list[str], weights: str) -> None:
    """rollout.servers_file changes a run's servers: it starts on rollout.servers; joins are
    tested with filesystem pushes only."""
    if path is None:
        return
    key = "rollout.servers_file"
    if not servers:
        raise ConfigError(
            key,
            path,
            "changes the servers of a run that starts on rollout.servers=[URL,...]: set them "
            "(the servers the run starts on; the file is read again before each unit)",
        )
    if weights in ("nccl", "gloo"):
        raise ConfigError(
            key,
            path,
            f"adds servers mid-run, which is built for weights by file only (a {weights} weight "
            "group is rebuilt when a server comes back, but a server joining one is not "
            "tested): drop it, or use staleness.weights=filesystem",
        )


def _check_min_servers(least: int | None, servers: list[str], weights: str) -> None:
    """rollout.min_servers counts the servers listed; NCCL weights need every one of them."""
    if least is None:
        return
    key = "rollout.min_servers"
    if not servers:
        raise ConfigError(key, least, "counts the servers of rollout.servers=[URL,...]: set them")
    if least > len(servers):
        raise ConfigError(key, least, f"is more than the {len(servers)} rollout.servers listed")
    if weights == "nccl" and least < len(servers):
        raise ConfigError(
            key,
            least,
            "staleness.weights=nccl needs every server at start (its group has no place for one "
            "that joins later): drop rollout.min_servers, or use staleness.weights=filesystem",
        )


def check_vllm_temperature(key: str, temperature: float, vllm: str, instead: str) -> None:
    """vLLM samples at temperatures 0-2 only: above, one line before any engine or server starts
    (`vllm` names what brings vLLM in, `instead` the way around it)."""
    if temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(
            key,
            temperature,
            f"vLLM ({vllm}) samples at temperatures 0-{VLLM_MAX_TEMPERATURE:g} only and refuses "
            f"every request above: lower it, or {instead}",
        )


def check_eval(cfg: Any) -> None:
    """Rules of an evaluation config (an `EvalRunConfig`)."""
    if cfg.rollout.servers:
        raise ConfigError(
            "rollout.servers",
            list(cfg.rollout.servers),
            "bapo eval scores through one server: eval.server=URL",
        )
    for key, value, verb in (
        ("rollout.min_servers", cfg.rollout.min_servers, "counts"),
        ("rollout.servers_file", cfg.rollout.servers_file, "changes"),
    ):
        if value is not None:
            raise ConfigError(
                key,
                value,
                f"{verb} a training run's rollout.servers; bapo eval scores through one server "
                "(eval.server=URL): drop it",
            )
    if cfg.eval.server is not None:
        check_url("eval.server", cfg.eval.server)
        why = ("eval.server", "score in this process (drop eval.server)")
        check_vllm_temperature("eval.temperature", cfg.eval.temperature, *why)
    elif cfg.rollout.name == "vllm":
        why = ("rollout=vllm", "generate with transformers (rollout=hf)")
        check_vllm_temperature("eval.temperature", cfg.eval.temperature, *why)
