"""The trainer's view of the model: samples → padded tensors → per-token log-probs and entropy.

One forward function serves both the behaviour log-probs recorded at sampling time (for engines
that do not report them) and the training forward, so the two agree bit for bit when they see the
same tensors: that is what makes the on-policy ratio exactly 1 (bapo_cli.rollout.hf).

Layout: each row is prompt + response, right-padded. Response token j of row i is predicted by the
hidden state at position len(prompt_i) + j - 1 (`gather_pos`). Only the real response tokens
(`token_rows`, `token_cols`, listed on the host when the batch is collated, so the forward needs no
device sync to find them) go through the output layer, and only `chunk` of them at a time
(`bapo_cli.rollout.logprobs`): no vocabulary-sized tensor grows with the number of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bapo_cli.models.loading import autocast_to
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.logprobs import DEFAULT_CHUNK, accumulate_dtype, chunked_logprobs

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """Samples as padded tensors, made by `collate` and never changed after: what the trainer
    measures about it later lives beside it (`trainer/off_policy.py` `Prepared`)."""

    samples: list[Sample]
    input_ids: Tensor  # [b, L] prompt + response, right-padded
    attention_mask: Tensor  # [b, L]
    gather_pos: Tensor  # [b, R] position whose hidden state predicts response token j
    targets: Tensor  # [b, R] response token ids (pad where masked)
    mask: Tensor  # [b, R] bool, True on real response tokens
    old_log_prob: Tensor  # [b, R] behaviour log-probs (0 where unknown or masked)
    versions: Tensor  # [b, R] policy version that sampled each token
    advantages: Tensor  # [b] one advantage per response (`Sample.advantage` when collated)
    token_rows: Tensor  # [N] row of each real response token (row-major order)
    token_cols: Tensor  # [N] its column in the [b, R] response layout

    @property
    def unscored(self) -> bool:
        """No behaviour log-prob recorded for any token (scoring was deferred to the update)."""
        return all(not s.logprobs for s in self.samples)

    @property
    def padded_tokens(self) -> int:
        """Positions the forward sees (rows × width, prompt + response, padding included)."""
        return self.input_ids.numel()

    @property
    def real_tokens(self) -> int:
        """Prompt + response tokens that are not padding (host count)."""
        return sum(len(s.prompt_ids) + len(s.response_ids) for s in self.samples)

    @property
    def num_tokens(self) -> int:
        """Response tokens, counted on the host (no device sync in the per-micro-batch loop)."""
        return sum(len(s.response_ids) for s in self.samples)


def collate(
    samples: Sequence[Sample],
    pad_id: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> MicroBatch:
    """Samples → tensors. Deterministic: the same samples give the same tensors. `dtype`: of the
    behaviour log-probs and advantages, the log-probs' dtype (`logprob_dtype` of the policy):
    float32, or float64 for a float64 policy, whose recorded log-probs would otherwise be rounded
    to float32 and make an on-policy ratio differ from 1."""
    b = len(samples)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp = max(max(len(s.response_ids) for s in samples), 1)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    gather_pos = torch.zeros((b, resp), dtype=torch.long)
    targets = torch.full((b, resp), pad_id, dtype=torch.long)
    mask = torch.zeros((b, resp), dtype=torch.bool)
    old = torch.zeros((b, resp), dtype=dtype)
    versions = torch.zeros((b, resp), dtype=torch.long)
    adv = torch.zeros(b, dtype=dtype)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention[i, : p + r] = 1
        gather_pos[i] = (p - 1 + torch.arange(resp)).clamp(max=width - 1)
        adv[i] = s.advantage
        if r:
            targets[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)
            mask[i, :r] = True
            versions[i, :r] = torch.tensor(s.versions, dtype=torch.long)
            known = len(s.logprobs)
            if known:
                old[i, :known] = torch.tensor(s.logprobs, dtype=dtype)
    token_rows, token_cols = mask.nonzero(as_tuple=True)  # on the host: no device sync later
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
        token_rows=token_rows.to(device),
        token_cols=token_cols.to(device),
    )


def logprob_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the log-probs `token_logprobs` gives for `model` (float64 for a float64
    policy, else float32): what `collate` stores the behaviour log-probs and advantages in."""
    return accumulate_dtype(next(model.parameters()).dtype)


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches of at most `budget` padded tokens.

    Sorted longest first (ties by index, so the split is deterministic), packed greedily: a
    micro-batch's padded size is its row count × its longest row, and the next sample joins
    while that stays within the budget. A sample longer than the budget gets a micro-batch of its
    own (it cannot be split; the caller states it, it is not an error)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = max(lengths[i], 1)
    return groups


def split_micro(
    samples: Sequence[Sample], *, size: int, tokens: int | None = None
) -> list[list[Sample]]:
    """One mini-batch's samples → micro-batches: `size` samples each in arrival order, or (with
    `tokens`, trainer.micro_batch_tokens) sorted by length and packed under a token budget so the
    padding share stays small with long-tailed response lengths. Scoring and training call this
    with the same arguments, so both see the same tensors (FSDP2 with several ranks: the updates
    may split further, `split_to_count`; the log-probs scored are kept per sample)."""
    if tokens is None:
        return [list(samples[i : i + size]) for i in range(0, len(samples), size)]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    return [[samples[i] for i in group] for group in pack_by_tokens(lengths, tokens)]


def split_to_count(micro: list[list[Sample]], count: int) -> list[list[Sample]]:
    """`micro` (one mini-batch's micro-batches) split until there are `count` of them, the
    widest in padded tokens (rows × longest row) halved first (ties: the first), so no
    micro-batch grows and the samples keep their order.

    Why: under FSDP2 every forward is a collective, so all ranks must run the same number of
    micro-batches, and a token budget packs each rank's own lengths into its own count. The
    updates agree on the largest count; a rank with fewer splits (its samples, not padding:
    no forward is wasted). Needs at least `count` samples."""
    total = sum(len(m) for m in micro)
    if total < count:
        raise ValueError(f"{total} samples cannot fill {count} micro-batches")
    out = [list(m) for m in micro]
    while len(out) < count:
        # a single sample cannot be halved: it ranks below every micro-batch that can
        splittable = [_padded_tokens(m) if len(m) > 1 else -1 for m in out]
        widest = max(range(len(out)), key=lambda i: (splittable[i], -i))
        rows = out[widest]
        half = (len(rows) + 1) // 2
        out[widest : widest + 1] = [rows[:half], rows[half:]]
    return out


def _padded_tokens(rows: Sequence[Sample]) -> int:
    """Positions a micro-batch of `rows` pads to: rows × its longest prompt + response."""
    return len(rows) * max(len(s.prompt_ids) + len(s.response_ids) for s in rows)


class ResponseLogits(torch.nn.Module):
    """The policy as one module whose forward returns per-token log-probs (and entropy) of the
    response tokens.

    This is what DistributedDataParallel wraps and FSDP2 shards (their hooks need the whole
    computation, output layer included, to run inside the wrapper's forward); a causal LM whose
    logits are `lm_head(hidden)` (Qwen, Llama, Mistral, ...). The output layer is applied to the
    real response tokens only, `chunk` tokens at a time (`bapo_cli.rollout.logprobs`): no
    [tokens, V] tensor is ever held. `autocast`: run the forward in this dtype over float32
    weights (mixed precision)."""

    def __init__(
        self,
        model: torch.nn.Module,
        autocast: torch.dtype | None = None,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        super().__init__()
        self.model = model
        self.autocast = autocast
        self.chunk = chunk
        head = model.get_output_embeddings()
        if not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise TypeError(
                f"{type(model).__name__}: the output layer must be a linear layer with a weight "
                f"(got {type(head).__name__}); the trainer applies it to hidden states in chunks"
            )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        gather_pos: Tensor,
        targets: Tensor,
        rows: Tensor,
        cols: Tensor,
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """(log-probs [b, R] float32 (float64 for a float64 policy), 0 except at the real
        response tokens (`rows`, `cols`); entropy [b, R] or None, no gradient)."""
        with autocast_to(self.autocast, input_ids.device):
            decoder = self.model.get_decoder()
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        picked = hidden[rows, gather_pos[rows, cols]]  # [N, H]
        head = self.model.get_output_embeddings()
        dtype = self.autocast  # None: the weight's own dtype (float32, or bfloat16 when pure)
        logp, ent = chunked_logprobs(
            picked,
            head.weight,
            getattr(head, "bias", None),
            targets[rows, cols],
            temperature=temperature,
            chunk=self.chunk,
            compute_dtype=dtype,
            entropy=entropy,
        )
        full = torch.zeros(targets.shape, dtype=logp.dtype, device=targets.device)
        out_ent = None
        if ent is not None:
            out_ent = full.index_put((rows, cols), ent)
        return full.index_put((rows, cols), logp), out_ent


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
    """log π(y_t | y_<t) of every response token, [b, R] float32, or float64 for a float64
    policy (and entropy, no grad).

    `model` is a HF causal LM or its `ResponseLogits` (possibly wrapped in DDP or sharded by
    FSDP2). Logits are divided by the sampling temperature, so the log-probs are those of the
    distribution the tokens were sampled from (top-p/top-k truncation aside). The one function
    behind behaviour scoring, the training forward, the KL reference and pi_old recomputation.
    """
    scorer = scorer_of(model)
    return scorer(
        mb.input_ids,
        mb.attention_mask,
        mb.gather_pos,
        mb.targets,
        mb.token_rows,
        mb.token_cols,
        temperature,
        entropy,
    )


@torch.no_grad()
def record_behaviour(model: torch.nn.Module, mb: MicroBatch, temperature: float) -> None:
    """Fill in the behaviour log-prob of every response token that has none yet.

    Called right after sampling with the weights that sampled (engines that report their own
    log-probs skip this). Tokens that already have one (earlier chunks of a partial rollout,
    sampled by older weights) keep theirs.
    """
    logp, _ = token_logprobs(model, mb, temperature)  # same mode as training: no dropout
    record_scored([(mb, logp)])


def record_scored(scored: Sequence[tuple[MicroBatch, Tensor]]) -> None:
    """`record_behaviour` of micro-batches already scored (each with its log-probs [b, R]), read
    to the host in one transfer: a scoring loop reads once, not once per micro-batch."""
    if not scored:
        return
    flat = torch.cat([logp.reshape(-1) for _, logp in scored]).cpu().tolist()
    start = 0
    for mb, logp in scored:
        width = logp.shape[1]
        for s in mb.samples:
            have = len(s.logprobs)
            s.logprobs.extend(flat[start + have : start + len(s.response_ids)])
            start += width


def disable_dropout(model: torch.nn.Module) -> None:
    """RL needs a deterministic policy function: π that samples must be π that is scored."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
