"""What a generation server serves, against what a run expects: the model's architecture,
vocabulary and shapes (`ModelIdentity`, from the config: no weights loaded), and its context
window. Split from `rollout.servers` (the pool) so each module keeps one job; the pool asks the
server (`bapo_model_info`, `/v1/models`) and refuses with the line `mismatch` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# compared beside architecture and vocabulary (the worker extension reports them): a push of
# other shapes would fail inside the reload
SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


@dataclass(frozen=True)
class ModelIdentity:
    """What must match between the run's model and a server's: architecture, vocabulary and
    the config's shapes (`shape`: (field, value) pairs; compared where both sides give one)."""

    architectures: tuple[str, ...]
    vocab_size: int
    shape: tuple[tuple[str, int], ...] = ()

    def matches(self, other: ModelIdentity) -> bool:
        mine, theirs = dict(self.shape), dict(other.shape)
        return (self.architectures, self.vocab_size) == (
            other.architectures,
            other.vocab_size,
        ) and all(mine[f] == theirs[f] for f in mine.keys() & theirs.keys())

    def describe(self, other: ModelIdentity | None = None) -> str:
        """Architecture and vocabulary, and the shape fields that differ from `other`'s."""
        theirs = dict(other.shape) if other is not None else {}
        shown = [f"{f} {v}" for f, v in self.shape if f in theirs and theirs[f] != v]
        head = f"{'/'.join(self.architectures) or 'unknown architecture'}, vocab {self.vocab_size}"
        return ", ".join([head, *shown])


def model_identity(source: Path | str, trust_remote_code: bool = False) -> ModelIdentity:
    """The run's model identity from its config (no weights loaded)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    shape = tuple((f, int(getattr(text, f))) for f in SHAPE_FIELDS if getattr(text, f, None))
    return ModelIdentity(tuple(cfg.architectures or ()), int(text.vocab_size), shape)


def served_identity(info: dict[str, Any]) -> ModelIdentity:
    """The identity a server's worker extension reports (`bapo_model_info`)."""
    shape = tuple((f, int(v)) for f, v in (info.get("shape") or {}).items() if v)
    return ModelIdentity(tuple(info["architectures"]), int(info["vocab_size"]), shape)


def mismatch(url: str, info: dict[str, Any], expect: ModelIdentity | None) -> str | None:
    """The one line refusing a server whose model is not `expect`; None when it is (or when
    nothing is expected)."""
    served = served_identity(info)
    if expect is None or served.matches(expect):
        return None
    return (
        f"the server {url} serves another model ({served.describe(expect)}) than the run's "
        f"({expect.describe(served)}); start it for this run's model (bapo serve with the same "
        "model overrides)"
    )


def weights_mismatch(
    url: str, info: dict[str, Any], expected: str | None, model: str
) -> str | None:
    """The one line refusing a server whose weights are not those of `model` (fingerprint
    `expected`): the files it started from, or the model the run that pushed to it last started
    from (`holds`); None when they are, or when either fingerprint is unknown."""
    holds = info.get("holds")
    served = holds.get("base") if holds else info.get("fingerprint")
    if expected is None or served is None or served == expected:
        return None
    what = (
        f"version {holds.get('version')} pushed by {holds.get('run') or 'a tool'}"
        if holds
        else f"the weights of {info.get('source')}"
    )
    return (
        f"the server {url} holds other weights than model.path={model} ({what}; fingerprint "
        f"{served}, the model's {expected}); start a server for this model (bapo serve with the "
        "same model overrides), or give the model the server serves"
    )


def served_window(url: str, call: Callable[..., Any], timeout_s: float = 10.0) -> int | None:
    """The served model's context window (`/v1/models`, asked through the pool's `call`), or
    None if it does not say."""
    with contextlib.suppress(Exception):  # no answer or another shape: the window is unknown
        return int(call(url, "GET", "/v1/models", None, timeout_s)["data"][0]["max_model_len"])
    return None
