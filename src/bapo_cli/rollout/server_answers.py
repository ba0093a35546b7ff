"""What a generation server is asked and what its answers mean, checked: the model it serves
(`model_info`), the generate route's request (`generate_body`) and response (`served`), the
weights version of each token (`token_versions`).

Every answer is checked before anything of it is used; what no healthy vLLM server sends is a
`ServerFault`, one line naming the server and what is allowed:
- token ids that are not integers, or outside [0, vocab_size) of the model the server described
  at its check: the trainer would index its embedding out of range; eval would decode them to
  nothing and score a silent 0;
- more tokens than asked (max_tokens): the step's size bound would not hold;
- a log-prob that is not finite or above `LOGPROB_SLACK` (a probability above 1): the ratio the
  loss divides by would be NaN, or would be trained as if the behaviour policy were more certain
  than certain;
- a weights version newer than the newest pushed: tokens from weights this run never wrote;
- token ids, log-probs and version spans that do not line up, or other shapes.
A response vLLM aborted (`finish_reason` abort) is `Aborted`: a fault of nobody's weights, so
the pool sends it again (`rollout.servers`), never trained as if cut at the length limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bapo_cli.rollout.base import (
    FINISH_BUDGET,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Request,
    SamplingParams,
)
from bapo_cli.rollout.server_http import ServerError, ServerFault

# a log-prob above 0 is a probability above 1; vLLM computes them in float32, where log_softmax
# stays <= 0: this much is let through for another kernel's rounding, far below a real fault
LOGPROB_SLACK = 1e-3


class Aborted(ServerError):
    """vLLM aborted the response (`finish_reason` abort): it is sent again, whole."""


def model_info(url: str, answer: Any) -> dict[str, Any]:
    """A server's `bapo_model_info` (the first worker's of {"results": [{...}, ...]}), its
    shapes checked: architecture names, a positive vocabulary size, shape fields that are
    integers; ServerError (one line) otherwise. `rollout.identity` compares it with the run's."""
    try:
        info = answer["results"][0]
        names, vocab = info["architectures"], info["vocab_size"]
        shape = info.get("shape") or {}
    except (KeyError, IndexError, TypeError, AttributeError):
        info = names = vocab = shape = None
    well_formed = (
        isinstance(names, list)
        and all(isinstance(n, str) for n in names)
        and _is_int(vocab)
        and vocab > 0
        and isinstance(shape, dict)
        and all(v is None or _is_int(v) for v in shape.values())
    )
    if not well_formed:
        raise ServerError(
            f"the server {url} described its model as {short(answer)}, not as "
            '{"results": [{"architectures": [names], "vocab_size": a positive integer}]}; '
            "start it with `bapo serve` (its worker extension answers that)"
        )
    return info


@dataclass
class ServedGeneration(Generation):
    """A Generation (with the version of each token) and the server that made it."""

    server: str = ""


def short(value: Any, width: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def generate_body(
    req: Request, params: SamplingParams, seed: int, eos_ids: Sequence[int], ignore_eos: bool
) -> dict[str, Any]:
    """The request for one sample: prompt + partial response as ids, the run's sampling."""
    sampling: dict[str, Any] = {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_tokens": req.max_tokens,
        "stop_token_ids": list(eos_ids),
        "logprobs": 0,  # the sampled token's own log-prob (and none other)
        "seed": seed,
        "detokenize": bool(params.stop),  # stop strings are matched on text
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if ignore_eos:
        sampling.update(ignore_eos=True, stop_token_ids=[])
    return {
        "token_ids": list(req.prompt_ids) + list(req.prefix_ids),
        "sampling_params": sampling,
    }


def first_choice(answer: Any, url: str) -> dict[str, Any]:
    """The answer's first choice; ServerFault when the answer has none."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        choice = None
    if not isinstance(choice, dict):
        raise ServerFault(f"{url} answered the generate route without a choice: {short(answer)}")
    return choice


def served(
    answer: Any,
    max_tokens: int,
    url: str,
    vocab: int | None,
    newest: int | None,
    stamped: bool = True,
) -> ServedGeneration:
    """The server's answer to a request of `max_tokens` → tokens, their log-probs and versions,
    and why it stopped (as rollout.vllm's `_generation`: end token or stop string; this round's
    budget; else the context window). Checked first (module docstring): Aborted for a response
    vLLM aborted, ServerFault for what no healthy server sends (`vocab`: the server's vocabulary
    size; `newest`: the newest version it may stamp, None when any may be; `stamped` False: no
    versions read, for an evaluation, which needs none: a fresh server labels its weights
    'default')."""
    choice = first_choice(answer, url)
    tokens = choice.get("token_ids") or []
    if not (isinstance(tokens, list) and all(_is_int(t) for t in tokens)):
        raise ServerFault(f"{url} returned token ids that are not integers: {short(tokens)}")
    block = choice.get("logprobs") or {}
    content = block.get("content") or [] if isinstance(block, dict) else block
    logprobs = [_logprob_of(c) for c in content] if isinstance(content, list) else [None]
    if any(lp is None for lp in logprobs):
        raise ServerFault(f"{url} returned log-probs in another shape: {short(block)}")
    if len(logprobs) != len(tokens):
        raise ServerFault(f"{url} returned {len(tokens)} tokens but {len(logprobs)} log-probs")
    if len(tokens) > max_tokens:
        raise ServerFault(
            f"{url} returned {len(tokens):,} tokens where at most {max_tokens:,} were "
            "asked (max_tokens)"
        )
    bad = next((t for t in tokens if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ServerFault(
            f"{url} returned token id {bad}, outside the vocabulary "
            f"[0, {vocab if vocab is not None else 'vocab_size'})"
        )
    odd = next((lp for lp in logprobs if not (math.isfinite(lp) and lp <= LOGPROB_SLACK)), None)
    if odd is not None:
        raise ServerFault(
            f"{url} returned log-prob {odd} for a sampled token: a log-probability is finite and "
            f"at most 0 (+{LOGPROB_SLACK:g} is let through for rounding)"
        )
    versions = token_versions(choice.get("weight_versions"), len(tokens), url) if stamped else None
    if versions and newest is not None and max(versions) > newest:
        raise ServerFault(
            f"{url} stamped tokens with weights version {max(versions)}, newer than the newest "
            f"pushed to it ({newest}): does another run push weights to it?"
        )
    finish = choice.get("finish_reason")
    if finish == "abort":
        raise Aborted(f"{url} aborted a response (finish_reason abort, {len(tokens)} tokens)")
    if finish == "stop":
        reason = FINISH_STOP
    elif len(tokens) >= max_tokens:
        reason = FINISH_BUDGET  # the Collector turns this into `length` at rollout.max_tokens
    else:
        reason = FINISH_LENGTH
    numbers = [float(lp) for lp in logprobs if lp is not None]
    return ServedGeneration(list(tokens), numbers, reason, versions=versions, server=url)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprob_of(entry: Any) -> float | None:
    """A log-prob entry's number ({"logprob": x, ...}); None when it is not one."""
    value = entry.get("logprob") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def token_versions(spans: Any, count: int, url: str) -> list[int]:
    """Per-token versions from vLLM's spans [{version, start, end}, ...]."""
    if count == 0:
        return []
    out: list[int | None] = [None] * count
    if not isinstance(spans, list | None):
        raise ServerFault(f"{url} returned weight-version spans in another shape: {short(spans)}")
    for span in spans or []:
        try:
            v = int(span["version"])
        except (TypeError, ValueError, KeyError):
            label = span.get("version") if isinstance(span, dict) else span
            raise ServerFault(
                f"{url} sampled with weights labelled {label!r}, not a version"
            ) from None
        try:
            first, end = int(span["start"]), int(span["end"])
        except (TypeError, ValueError, KeyError):
            raise ServerFault(f"{url} returned a weight-version span {short(span)}") from None
        for t in range(max(first, 0), min(end, count)):
            out[t] = v
    if any(v is None for v in out):
        raise ServerFault(f"{url} did not say which weights sampled every token")
    return [int(v) for v in out if v is not None]
