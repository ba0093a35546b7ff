"""`bapo eval eval.server=URL`: score the model a running vLLM server serves, where it lives.

    bapo eval eval.server=http://gpu-node:8001 model.path=/models/mine benchmark=aime24 eval.n=16

The benchmark, prompts, sampling, grading and metrics are `bapo eval`'s own
(`evaluate.evaluate_benchmark`); only the engine differs: requests go to the server
(`rollout.servers.ServerEngine`, one URL) instead of an engine built in this process, so no
weights are loaded here, only the tokenizer and the generation config (the end tokens). The
model overrides still name the model: its tokenizer builds the prompts, and the server is
refused in one line unless it serves that architecture and vocabulary (`preflight`, asked by the
CLI before the run dir is claimed).

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
from bapo_cli.rollout.base import eos_ids
from bapo_cli.rollout.server_engine import ServerEngine
from bapo_cli.rollout.servers import ServerPool, model_identity

# a server paused this long is refused (a push pauses it for seconds; one left paused by a
# trainer killed mid-push would never answer): docs/evaluation.md
PAUSED_WAIT_S = 10.0


def _pool(cfg: Any) -> ServerPool:
    source = models.model_dir(cfg.model)
    identity = model_identity(source, trust_remote_code=bool(cfg.model.trust_remote_code))
    return ServerPool(
        [cfg.eval.server],
        expect=identity,
        max_model_len=cfg.model.max_model_len,
        stall_s=float(cfg.rollout.server_stall_s),
        wait_paused_s=PAUSED_WAIT_S,  # this pool never pushes, so never resumes the server
    )


def preflight(cfg: Any) -> None:
    """The server answers and serves the model of `cfg.model` (ServerError, one line)."""
    if cfg.eval.server is not None:
        _pool(cfg).check()


def served_engine(cfg: Any) -> tuple[ServerEngine, Any]:
    """(engine over the server, tokenizer): checked, nothing loaded but the tokenizer."""
    from transformers import AutoTokenizer

    source = models.model_dir(cfg.model)
    remote = bool(cfg.model.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=remote)
    except Exception as err:  # missing files, no network, unknown id
        raise ModelLoadError(
            f"model.path={source}: its tokenizer could not be loaded ({first_line(err)})"
        ) from None
    pool = _pool(cfg)
    pool.check()
    return ServerEngine(pool, end_tokens(source, tokenizer, remote), interrupt=False), tokenizer


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
