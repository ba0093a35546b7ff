"""`bapo eval eval.server=URL`: score the model a running vLLM server serves, where it lives.

    bapo eval eval.server=http://gpu-node:8001 model.path=/models/mine benchmark=aime24 eval.n=16

The benchmark, prompts, sampling, grading and metrics are `bapo eval`'s own
(`evaluate.evaluate_benchmark`); only the engine differs: requests go to the server
(`rollout.servers.ServerEngine`, one URL) instead of an engine built in this process, so no
weights are loaded here, only the tokenizer and the generation config (the end tokens). The
model overrides still name the model: its tokenizer builds the prompts, and the server is
refused in one line unless it serves that model (`preflight`, asked by the CLI before the run dir
is claimed): the architecture, vocabulary and shapes of its config, and its weights, by
fingerprint (`weights_fs.model_fingerprint`, a few bytes of every tensor): the files the server
started from, or, once a training run pushed to it, the model that run started from (a server
that holds a run's trained weights is still serving that run's model). Where either side has no
safetensors files to read, only the config is compared.

A server a training run holds is refused (its pushes would change the weights under the
evaluation); while the evaluation runs it holds the server itself (`rollout.lease`, kind eval:
shared with other evaluations), so a training run cannot take it mid-way. The tokens' weight
versions are not read: a fresh server labels its weights 'default', not a version.

Each request carries its own seed, drawn as the colocated vLLM engine draws them (torch's RNG
after `eval.seed`), so the same model, seed and sampling give the same samples as
`rollout=vllm` in this process up to the server's batching (tests/servers/test_eval_server.py
measures it). The server must hold the weights you mean to score: a training run's servers hold
its last pushed version.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from bapo_cli.models import loading as models
from bapo_cli.models.errors import ModelLoadError
from bapo_cli.models.pretrained import first_line
from bapo_cli.rollout import identity, lease
from bapo_cli.rollout.base import eos_ids
from bapo_cli.rollout.claims import Owner
from bapo_cli.rollout.pools import pool_for
from bapo_cli.rollout.server_engine import ServerEngine
from bapo_cli.rollout.servers import ServerError, ServerPool, ServerTaken

# a server paused this long is refused (a push pauses it for seconds; one left paused by a
# trainer killed mid-push would never answer): docs/evaluation.md
PAUSED_WAIT_S = 10.0


def _pool(cfg: Any, owner: Owner | None = None) -> ServerPool:
    """The checked pool over eval.server (the weights' identity included); with an `owner`,
    claimed for the evaluation."""
    pool = pool_for(
        [cfg.eval.server],
        cfg.model,
        stall_s=cfg.rollout.server_stall_s,
        fingerprint=True,
        owner=owner,
        stamped=False,
        wait_paused_s=PAUSED_WAIT_S,  # this pool never pushes, so never resumes the server
    )
    try:
        pool.check()
        server = pool.servers[0]
        source = str(models.model_dir(cfg.model))
        wrong = identity.weights_mismatch(server.url, server.info or {}, pool.base, source)
        if wrong is not None:
            raise ServerError(wrong)
    except ServerError:
        pool.close()
        raise
    return pool


def preflight(cfg: Any) -> None:
    """The server answers, serves the model of `cfg.model` and no training run holds it
    (ServerError, one line): a look, nothing claimed."""
    if cfg.eval.server is None:
        return
    pool = _pool(cfg)
    url = pool.servers[0].url
    state = pool.rpc(url, "bapo_leases", [])
    for holder in state[0].get("holders", []) if state else []:
        if holder.get("kind") == "train":
            answer = {"holder": holder.get("run"), "kind": "train", "left_s": holder["left_s"]}
            raise ServerTaken(lease.refusal(url, answer, Owner("", "eval").refused_hint()))


def served_engine(cfg: Any, run_dir: Any = None) -> tuple[ServerEngine, Any]:
    """(engine over the server, tokenizer): checked and held for the evaluation (released by
    the engine's close), nothing loaded but the tokenizer."""
    tokenizer, ends = tokenizer_of(cfg.model)
    pool = _pool(cfg, Owner.evaluation(run_dir))
    return ServerEngine(pool, ends, interrupt=False), tokenizer


def tokenizer_of(model: Any) -> tuple[Any, list[int]]:
    """(tokenizer, end-of-sequence ids) of a ModelConfig, no weights loaded."""
    from transformers import AutoTokenizer

    source = models.model_dir(model)
    remote = bool(model.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=remote)
    except Exception as err:  # missing files, no network, unknown id
        raise ModelLoadError(
            f"model.path={source}: its tokenizer could not be loaded ({first_line(err)})"
        ) from None
    return tokenizer, end_tokens(source, tokenizer, remote)


def end_tokens(source: Any, tokenizer: Any, trust_remote_code: bool) -> list[int]:
    """The end-of-sequence ids `rollout.base.eos_ids` finds on a loaded model, whose generation
    config comes from generation_config.json, else from config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(str(source))
    except OSError:  # no generation_config.json: what from_pretrained derives from config.json
        config = AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
        generation = GenerationConfig.from_model_config(config)
    return eos_ids(SimpleNamespace(generation_config=generation), tokenizer)
