"""Per-token log-probs and entropy from hidden states, without vocabulary-sized activations.

The trainer needs log π(y_t) of each response token (and the entropy of π at that position, as a
metric). The plain way applies the output layer to every response position at once: float32
logits [tokens, V], their log_softmax, exp of that for the entropy, all kept by autograd for the
backward. At a 150k-token vocabulary that is ~2.4 MB per response token, so 8 responses of 8k
tokens need ~155 GB for these tensors alone.

`chunked_logprobs` computes the same numbers from the hidden states [N, H] in chunks of `chunk`
tokens through the output layer (weight [V, H], optional bias [V]), inside one autograd function
that keeps only its inputs for the backward and recomputes each chunk's logits there. At no time
does a tensor larger than [chunk, V] exist, so the memory added per response token no longer
depends on V (the same idea as verl's `FusedLinearForPPO` and Liger Kernel's fused linear cross-
entropy).

Backward of one token's log-prob with respect to its logits z (temperature T, p = softmax(z / T)):

    ∂ log p_y / ∂ z_v = (1[v = y] − p_v) / T

so grad_z = g / T · (onehot(y) − p) per chunk, then grad_hidden = grad_z · W and
grad_W += grad_zᵀ · hidden. The entropy is a no-gradient metric (`mark_non_differentiable`): no
loss in this project differentiates through it.

Precision: the logits of a chunk are computed in `compute_dtype` (the autocast dtype under mixed
precision, else the weight's dtype), exactly as `F.linear` under autocast computes them, then cast
to float32 for the softmax; the backward's matrix products run in the same dtype and the weight
gradient is accumulated over the chunks in float32, then cast to the weight's dtype. A float64
`compute_dtype` (the float64 testbed, `model.dtype=float64`) keeps everything in float64 instead:
softmax, log-probs, entropy and the accumulated gradients (`accumulate_dtype`); every narrower
dtype gives exactly the float32 computation above.

`full_vocab_logprobs` is the plain version (the trainer's path before this module): the oracle of
the tests and the "before" row of benchmarks/bench_memory.py. The trainer does not use it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Tokens per chunk through the output layer (trainer.logprob_chunk). Each chunk holds about two
# float32 [chunk, V] buffers at a time: 2 × 256 × 151,936 × 4 B ≈ 311 MB at Qwen's vocabulary.
# How it was chosen: benchmarks/bench_memory.py --chunks (docs/benchmarks.md).
DEFAULT_CHUNK = 256


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax, log-probs and gradient sums for matrix products in `dtype`: float64
    stays float64 (the testbed would lose its point in a float32 softmax); float32, bfloat16 and
    float16 are summed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, temperature: float
) -> Tensor:
    """[c, V] logits / T of a chunk in `accumulate_dtype(dtype)` (float32 unless float64), the
    matrix product in `dtype` (as autocast does). Called with autocast off (see
    `_ChunkedLogProbs`): every dtype here is chosen explicitly."""
    z = torch.nn.functional.linear(
        hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    ).to(accumulate_dtype(dtype))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, dtype, want_entropy):
        n, acc = hidden.shape[0], accumulate_dtype(dtype)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=acc, device=hidden.device)
        # autocast off: it would run the entropy's bmm in bfloat16 (the softmax stays float32)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _logits(hidden[s:e], weight, bias, dtype, temperature)  # [c, V]
                z = torch.log_softmax(z, dim=-1)  # raw logits freed here: two buffers at most
                logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1)
                if want_entropy:  # H = −Σ p log p, as a batched dot product (no third buffer)
                    p = z.exp()
                    ent[s:e] = -torch.bmm(p[:, None, :], z[:, :, None]).view(-1)
                    del p
                del z
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        t, dtype = ctx.temperature, ctx.dtype
        acc = accumulate_dtype(dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, hidden.shape[0])
                g = grad_logp[s:e, None].to(acc) / t  # [c, 1]
                # softmax as log_softmax computes it (max subtracted first): 1 − p of a token
                # with p ≈ 1 keeps its digits (exp(z − logsumexp) would lose them)
                z = torch.softmax(_logits(hidden[s:e], weight, bias, dtype, t), dim=-1)
                z.mul_(-g)  # −g/T · p
                z.scatter_add_(1, targets[s:e, None], g)  # + g/T at the sampled token
                if need_b:
                    grad_b += z.sum(0)
                gz = z.to(dtype)
                del z
                h = hidden[s:e].to(dtype)
                if need_h:
                    grad_h[s:e] = (gz @ w).to(hidden.dtype)
                if need_w:
                    grad_w += (gz.t() @ h).to(acc)
                del gz
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b and bias is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    compute_dtype: torch.dtype | None = None,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log π(targets) [N], entropy [N] or None) of hidden states [N, H] through the output layer
    `weight` [V, H] (+ `bias`), logits divided by `temperature`; differentiable in hidden, weight
    and bias, never holding more than [chunk, V]. Float32, or float64 when the matrix products
    are float64 (`accumulate_dtype`).

    `compute_dtype`: the dtype of the output layer's matrix products (the autocast dtype under
    mixed precision); None = the weight's dtype."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dtype = compute_dtype or weight.dtype
    t = float(temperature) if temperature > 0 else 1.0
    logp, ent = _ChunkedLogProbs.apply(
        hidden, weight, bias, targets, t, int(chunk), dtype, bool(entropy)
    )
    return logp, (ent if entropy else None)


def full_vocab_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The plain version on full logits [..., V]: float32 (float64 logits stay float64)
    log_softmax, gather, entropy from exp.
    What the trainer did before `chunked_logprobs`; kept as the tests' oracle and the benchmark's
    'before' row."""
    logits = logits.to(accumulate_dtype(logits.dtype))
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent
