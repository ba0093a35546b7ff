"""Time per stage of a training step, as tokens per second (what users compare frameworks by,
NeMo-RL's way), and the update's model FLOPs utilisation where the chip's peak is known.

Stages and their metrics (docs/tracking.md#time-per-stage):

- generation: `perf/rollout_tokens_per_s`, tokens sampled ÷ the rollout's seconds less the
  trainer's scoring inside it (under the async regime the rollout's seconds are the trainer's
  wait for the batch, so this is what the trainer sees, not the generator's own rate);
- scoring: `perf/score_tokens_per_s`, response tokens of the trainer's no-grad log-prob forwards
  (behaviour, proximal, opsm) ÷ their seconds;
- update: `perf/update_tokens_per_s`, response tokens trained ÷ the updates' seconds less the
  scoring between them;
- push: `perf/weight_sync_s`, seconds the new weights took on the trainer's side;
- `perf/update_mfu`: the update's FLOPs ÷ (its seconds × the chip's peak), logged only for a chip
  in `PEAK_FLOPS` (the summary prints n/a otherwise, never a guess: CPU, an unlisted GPU).

FLOPs per trained token (`flops_per_token`): forward 2·N, backward 2·N for the activations'
gradients plus 2·N_trained for the weights' (Kaplan et al. 2020's 6·N under full fine-tuning;
≈ 4·N under LoRA), N the parameters that take part in a matmul (the input embedding is a lookup:
left out unless the output layer is tied to it), one more forward (2·N) under gradient
checkpointing. Only the trained (response) tokens are counted, as the tokens/s are, and the
attention's sequence-length term is left out: the prompts' forward and backward and the
attention make the true FLOPs larger, so the MFU is a lower bound.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "PEAK_FLOPS",
    "ScoreClock",
    "StepTimes",
    "flops_per_token",
    "mfu",
    "peak_flops",
    "stage_metrics",
]

TERA = 1e12
# dense peak FLOP/s per GPU (no structured sparsity): (name fragment, bf16/fp16 tensor core,
# fp32 without TF32 (PyTorch's default for matmuls)); the first fragment found as whole words in
# torch.cuda.get_device_name() wins, so variants come before their family. Sources: NVIDIA's
# datasheets, docs/tracking.md#peak-flops.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835 * TERA, 60 * TERA),
    ("H200", 989 * TERA, 67 * TERA),  # SXM
    ("H100 NVL", 835 * TERA, 60 * TERA),
    ("H100 PCIe", 756 * TERA, 51 * TERA),
    ("H100", 989 * TERA, 67 * TERA),  # SXM (HBM3)
    ("A100", 312 * TERA, 19.5 * TERA),  # SXM and PCIe
    ("L40S", 362 * TERA, 91.6 * TERA),
    ("L4", 121 * TERA, 30.3 * TERA),
    ("RTX 4090", 165.2 * TERA, 82.6 * TERA),  # bf16 with fp32 accumulate (Ada whitepaper)
)


def peak_flops(device_name: str | None, dtype: torch.dtype) -> float | None:
    """The chip's dense peak for `dtype` (bf16/fp16 on tensor cores, or fp32); None for a chip
    not in the table, a CPU (`device_name` None) or another dtype."""
    if device_name is None:
        return None
    for fragment, half, single in PEAK_FLOPS:
        if re.search(rf"\b{re.escape(fragment)}\b", device_name):
            if dtype in (torch.bfloat16, torch.float16):
                return half
            return single if dtype == torch.float32 else None
    return None


def flops_per_token(model: torch.nn.Module, *, checkpointing: bool = False) -> float:
    """Training FLOPs per token (module docstring): 4·N + 2·N_trained (+ 2·N when activations
    are recomputed), N counting each shared tensor once and the input embedding only when the
    output layer is tied to it."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookup = getattr(embed, "weight", None)
    tied = lookup is not None and getattr(head, "weight", None) is lookup
    n = trained = 0
    for p in model.parameters():  # each shared tensor once
        if p is lookup and not tied:
            continue
        n += p.numel()
        trained += p.numel() if p.requires_grad else 0
    return float(4 * n + 2 * trained + (2 * n if checkpointing else 0))


def mfu(tokens: float, seconds: float, per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: the FLOPs the tokens cost ÷ what the chip could do in `seconds`."""
    return tokens * per_token / (max(seconds, 1e-9) * peak)


@dataclass
class ScoreClock:
    """Seconds and response tokens of the trainer's scoring forwards, read per stage (`take`).

    On a CUDA device a block is timed by a pair of CUDA events and read at `take`, once a stage:
    synchronising at each block's end would add a host sync to every micro-batch."""

    seconds: float = 0.0
    tokens: int = 0
    events: list[tuple[Any, Any]] = field(default_factory=list)  # CUDA (start, end) unread

    @contextmanager
    def timing(self, tokens: int, device: torch.device | None = None) -> Iterator[None]:
        """Time the block (its kernels, on a CUDA `device`)."""
        self.tokens += int(tokens)
        if device is not None and device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self.events.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - t0

    def take(self) -> tuple[float, int]:
        """(seconds, tokens) since the last take."""
        for start, end in self.events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000.0  # ms
        out = (self.seconds, self.tokens)
        self.seconds, self.tokens, self.events = 0.0, 0, []
        return out


@dataclass(frozen=True)
class StepTimes:
    """One step's seconds and token counts, which its time per stage is computed from.
    `scored`: the scoring clock's (seconds, tokens) inside the rollout and inside the updates;
    `per_token`: the update's FLOPs per trained token; `peak`: the chip's (None: no MFU)."""

    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    new_tokens: float
    trained_tokens: float
    scored: tuple[tuple[float, int], tuple[float, int]] = ((0.0, 0), (0.0, 0))
    per_token: float = 0.0
    peak: float | None = None


def stage_metrics(t: StepTimes) -> dict[str, float]:
    """The step's stage metrics (module docstring)."""
    (roll_score_s, roll_tokens), (train_score_s, train_tokens) = t.scored
    score_s, score_tokens = roll_score_s + train_score_s, roll_tokens + train_tokens
    update_s = max(t.train_s - train_score_s, 1e-9)
    out = {
        "perf/rollout_tokens_per_s": t.new_tokens / max(t.rollout_s - roll_score_s, 1e-9),
        "perf/update_tokens_per_s": t.trained_tokens / update_s,
        "perf/weight_sync_s": t.sync_s,
    }
    if score_tokens:
        out["perf/score_tokens_per_s"] = score_tokens / max(score_s, 1e-9)
    if t.peak is not None:
        out["perf/update_mfu"] = mfu(t.trained_tokens, update_s, t.per_token, t.peak)
    return out
