"""The trainer's view of the model: samples → padded tensors → per-token log-probs and entropy.

One forward function serves both the behaviour log-probs recorded at sampling time (for engines
that do not report them) and the training forward, so the two agree bit for bit when they see the
same tensors: that is what makes the on-policy ratio exactly 1 (bapo_cli.rollout.hf).

Layout: each row is prompt + response, right-padded. Response token j of row i is predicted by the
hidden state at position len(prompt_i) + j - 1; only those positions go through the output layer
(`gather_pos`), so the vocabulary-sized logits are [rows, response length, V], never [rows,
prompt + response, V].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bapo_cli.models.loading import autocast_to
from bapo_cli.rollout.base import Sample

Tensor = torch.Tensor


@dataclass
class MicroBatch:
    samples: list[Sample]
    input_ids: Tensor  # [b, L] prompt + response, right-padded
    attention_mask: Tensor  # [b, L]
    gather_pos: Tensor  # [b, R] position whose hidden state predicts response token j
    targets: Tensor  # [b, R] response token ids (pad where masked)
    mask: Tensor  # [b, R] bool, True on real response tokens
    old_log_prob: Tensor  # [b, R] behaviour log-probs (0 where unknown or masked)
    versions: Tensor  # [b, R] policy version that sampled each token
    advantages: Tensor  # [b] one advantage per response
    old_is_current: bool = False  # behaviour log-probs are those of the weights that will train

    @property
    def unscored(self) -> bool:
        """No behaviour log-prob recorded for any token (scoring was deferred to the update)."""
        return all(not s.logprobs for s in self.samples)

    @property
    def num_tokens(self) -> int:
        """Response tokens, counted on the host (no device sync in the per-micro-batch loop)."""
        return sum(len(s.response_ids) for s in self.samples)


def collate(samples: Sequence[Sample], pad_id: int, device: torch.device) -> MicroBatch:
    """Samples → tensors. Deterministic: the same samples give the same tensors."""
    b = len(samples)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp = max(max(len(s.response_ids) for s in samples), 1)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    gather_pos = torch.zeros((b, resp), dtype=torch.long)
    targets = torch.full((b, resp), pad_id, dtype=torch.long)
    mask = torch.zeros((b, resp), dtype=torch.bool)
    old = torch.zeros((b, resp), dtype=torch.float32)
    versions = torch.zeros((b, resp), dtype=torch.long)
    adv = torch.zeros(b, dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention[i, : p + r] = 1
        gather_pos[i] = (p - 1 + torch.arange(resp)).clamp(max=width - 1)
        if r:
            targets[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)
            mask[i, :r] = True
            versions[i, :r] = torch.tensor(s.versions, dtype=torch.long)
            known = len(s.logprobs)
            if known:
                old[i, :known] = torch.tensor(s.logprobs, dtype=torch.float32)
    return MicroBatch(
        samples=list(samples),
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        gather_pos=gather_pos.to(device),
        targets=targets.to(device),
        mask=mask.to(device),
        old_log_prob=old.to(device),
        versions=versions.to(device),
        advantages=adv.to(device),
    )


class ResponseLogits(torch.nn.Module):
    """The policy as one module whose forward returns the logits at response positions.

    This is what DistributedDataParallel wraps (its gradient hooks need the forward to go through
    the wrapper); a causal LM whose logits are `lm_head(hidden)` (Qwen, Llama, Mistral, ...).
    `autocast`: run the forward in this dtype over float32 weights (mixed precision)."""

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.autocast = autocast

    def forward(self, input_ids: Tensor, attention_mask: Tensor, gather_pos: Tensor) -> Tensor:
        with autocast_to(self.autocast, input_ids.device):
            decoder = self.model.get_decoder()
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            index = gather_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            return self.model.get_output_embeddings()(hidden.gather(1, index))  # [b, R, V]


def scorer_of(model: torch.nn.Module) -> torch.nn.Module:
    """A HF causal LM → ResponseLogits; a ResponseLogits (or its DDP wrapper) as it is."""
    if isinstance(model, ResponseLogits) or isinstance(
        getattr(model, "module", None), ResponseLogits
    ):
        return model
    return ResponseLogits(model)


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log π(y_t | y_<t) of every response token, [b, R] float32 (and entropy, no grad).

    `model` is a HF causal LM or its `ResponseLogits` (possibly wrapped in DDP). Logits are divided
    by the sampling temperature, so the log-probs are those of the distribution the tokens were
    sampled from (top-p/top-k truncation aside).
    """
    scorer = scorer_of(model)
    logits = scorer(mb.input_ids, mb.attention_mask, mb.gather_pos).float()  # [b, R, V]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(mb.mask, logp, 0.0), ent


@torch.no_grad()
def record_behaviour(model: torch.nn.Module, mb: MicroBatch, temperature: float) -> None:
    """Fill in the behaviour log-prob of every response token that has none yet.

    Called right after sampling with the weights that sampled (engines that report their own
    log-probs skip this). Tokens that already have one (earlier chunks of a partial rollout,
    sampled by older weights) keep theirs.
    """
    logp, _ = token_logprobs(model, mb, temperature)  # same mode as training: no dropout
    rows = logp.cpu().tolist()
    for s, row in zip(mb.samples, rows, strict=True):
        have = len(s.logprobs)
        s.logprobs.extend(row[have : len(s.response_ids)])


def disable_dropout(model: torch.nn.Module) -> None:
    """RL needs a deterministic policy function: π that samples must be π that is scored."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
