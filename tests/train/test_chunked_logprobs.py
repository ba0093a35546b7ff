"""Log-probs and entropy through the output layer in chunks equal the full-vocabulary path.

The oracle is `full_vocab_logprobs` on the full logits [tokens, V] (the trainer's path before the
chunked one). Tolerances, relative to each tensor's largest entry: float32 results differ only by
summation order (the chunked log-softmax and matrix products reduce in other orders, and the weight
gradient is a sum over chunks that then flows back through every layer), so they agree to 1e-5
(float32's epsilon is 1.2e-7; sums of ~40 tokens and two layers of products grow it ~100x); under
bfloat16 autocast both paths round the output layer's products to bfloat16 (8 bits of mantissa),
and the weight gradient is rounded once per chunk instead of once, so gradients agree to bfloat16
rounding (relative 2^-7).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.algos import losses
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.logprobs import chunked_logprobs, full_vocab_logprobs
from bapo_cli.rollout.scoring import ResponseLogits, collate, token_logprobs

F32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2**-7, "atol": 2**-7}


def _close(a: torch.Tensor, b: torch.Tensor, tol: dict) -> None:
    """Agree elementwise, relative to the larger tensor's scale (gradients span decades)."""
    scale = max(float(b.detach().abs().max()), 1e-12)
    torch.testing.assert_close(a / scale, b / scale, rtol=tol["rtol"], atol=tol["atol"])


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    vocab=st.integers(2, 70),
    chunk=st.integers(1, 50),
    temperature=st.sampled_from([0.0, 0.6, 1.0, 1.7]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_is_as_exact_as_the_full_vocab_path_in_float32(
    n, vocab, chunk, temperature, bias, seed
) -> None:
    """Against a float64 oracle, the chunked path errs no more than the full-vocabulary float32
    path does (within 2x, plus 2e-6 of the scale: ~16 float32 epsilons, as a gradient sums up to
    40 tokens' products in another order). A plain elementwise comparison of
    the two float32 paths would demand more than float32 can give: the gradient of a token with
    p ≈ 1 is g·(1 − p), and both paths round p to 6e-8 near 1 before that subtraction."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, 8, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    def run(path: str, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight, b) if t is not None]
        h, w, bb = leaves[0], leaves[1], leaves[2] if bias else None
        if path == "chunked":
            logp, ent = chunked_logprobs(
                h, w, bb, targets, temperature=temperature, chunk=chunk, entropy=True
            )
            assert logp.dtype == torch.float32 and not ent.requires_grad
        else:
            logits = torch.nn.functional.linear(h, w, bb)
            logp, ent = full_vocab_logprobs(logits, targets, temperature, entropy=True)
        grads = torch.autograd.grad((logp.double() * upstream).sum(), leaves)
        return [logp.detach().double(), ent.double(), *(x.double() for x in grads)]

    exact = run("full", torch.float64)
    full = run("full", torch.float32)
    chunked = run("chunked", torch.float32)
    for c, f, x in zip(chunked, full, exact, strict=True):
        scale = float(x.abs().max()) + 1e-30
        assert float((c - x).abs().max()) <= 2 * float((f - x).abs().max()) + 2e-6 * scale


def _qwen(tied: bool, dtype: torch.dtype = torch.float32, vocab: int = 97) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = Qwen2ForCausalLM(config).to(dtype)
    model.train()
    return model


def _batch(vocab: int = 97, seed: int = 1) -> list[Sample]:
    """Ragged prompts and responses (one empty response), stale log-probs, +/- advantages."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate([(3, 7), (5, 0), (2, 11), (6, 1), (4, 9), (3, 4)]):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        response = torch.randint(3, vocab, (r,), generator=g).tolist()
        s = Sample(prompt, i // 2, None, response, versions=[0] * r)
        s.logprobs = (-2.0 - torch.rand(r, generator=g) * 3).tolist()
        s.advantage = [1.0, -0.5, 0.7, -1.2, 0.3, -0.8][i]
        samples.append(s)
    return samples


def _reference_logprobs(model, mb, temperature, autocast):
    """The full-vocabulary path: decoder, gathered positions, output layer on all of them."""
    from bapo_cli.models.loading import autocast_to

    with autocast_to(autocast, mb.input_ids.device):
        hidden = model.get_decoder()(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask
        ).last_hidden_state
        index = mb.gather_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        logits = model.get_output_embeddings()(hidden.gather(1, index))
    logp, ent = full_vocab_logprobs(logits, mb.targets, temperature, entropy=True)
    return torch.where(mb.mask, logp, 0.0), ent


def _loss_kwargs(name: str) -> dict:
    """Each loss at its params' defaults (`policy_loss` drops dual_clip where unused)."""
    return {"dual_clip": 3.0, "agg": "token-mean"}


def _loss_and_grads(model, name, logp, mb):
    kwargs = _loss_kwargs(name)
    tokens = float(mb.mask.sum())
    adv = torch.tensor([s.advantage for s in mb.samples])
    loss, _ = losses.policy_loss(
        name,
        logp,
        mb.old_log_prob,
        adv,
        mb.mask,
        **kwargs,
        global_tokens=tokens,
        global_seqs=float(len(mb.samples)),
        norm_len=float(mb.mask.shape[1]),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)


CASES = [
    # (tied output layer, weights dtype, autocast dtype, tolerance)
    pytest.param(True, torch.float32, None, F32, id="tied-float32"),
    pytest.param(False, torch.float32, None, F32, id="untied-float32"),
    pytest.param(False, torch.float32, torch.bfloat16, BF16, id="untied-bf16-autocast"),
    pytest.param(True, torch.float32, torch.bfloat16, BF16, id="tied-bf16-autocast"),
    pytest.param(False, torch.bfloat16, None, BF16, id="pure-bf16"),
]


@pytest.mark.parametrize(("tied", "dtype", "autocast", "tol"), CASES)
@pytest.mark.parametrize("name", losses.REGISTRY.names())
def test_every_loss_and_every_gradient_match_the_full_vocabulary_path(
    name, tied, dtype, autocast, tol
) -> None:
    model = _qwen(tied, dtype)
    mb = collate(_batch(), 0, torch.device("cpu"))
    logp, ent = token_logprobs(ResponseLogits(model, autocast, chunk=5), mb, 0.7, entropy=True)
    loss, grads = _loss_and_grads(model, name, logp, mb)
    ref_logp, ref_ent = _reference_logprobs(model, mb, 0.7, autocast)
    ref_loss, ref_grads = _loss_and_grads(model, name, ref_logp, mb)

    _close(logp, ref_logp, tol)
    _close(ent[mb.mask], ref_ent[mb.mask], tol)
    _close(loss, ref_loss, tol)
    assert (logp[~mb.mask] == 0).all()
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            _close(got, want, tol)


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    mb = collate(_batch(), 0, torch.device("cpu"))
    plain = _qwen(tied=False)
    ckpt = _qwen(tied=False)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results = []
    for model in (plain, ckpt):
        logp, _ = token_logprobs(ResponseLogits(model, chunk=4), mb, 1.0)
        results.append(_loss_and_grads(model, "bapo", logp, mb))
    (loss_a, grads_a), (loss_b, grads_b) = results
    _close(loss_b, loss_a, F32)
    for a, b in zip(grads_a, grads_b, strict=True):
        _close(b, a, F32)


def test_the_chunk_size_does_not_change_the_numbers() -> None:
    """Chunks of 1, 3 and all tokens: the same log-probs and (float32 rounding) gradients."""
    model = _qwen(tied=True)
    mb = collate(_batch(), 0, torch.device("cpu"))
    out = []
    for chunk in (1, 3, 10_000):
        logp, _ = token_logprobs(ResponseLogits(model, chunk=chunk), mb, 1.0)
        out.append((logp.detach(), _loss_and_grads(model, "ppo", logp, mb)[1]))
    for logp, grads in out[1:]:
        _close(logp, out[0][0], F32)
        for a, b in zip(grads, out[0][1], strict=True):
            _close(a, b, F32)


def test_no_tensor_of_tokens_by_vocabulary_is_kept_for_the_backward() -> None:
    """What autograd saves is the hidden states and the weights, never logits-shaped [.., V]
    tensors (the memory per token then does not grow with V: benchmarks/bench_memory.py)."""
    vocab = 3001
    model = _qwen(tied=False, vocab=vocab)
    mb = collate(_batch(vocab), 0, torch.device("cpu"))
    tokens = int(mb.mask.sum())
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = token_logprobs(ResponseLogits(model, chunk=4), mb, 1.0, entropy=True)
    assert saved, "the forward saved nothing: the hook did not see the graph"
    assert tokens * vocab > 90_000  # what a [tokens, V] tensor would hold
    assert not any(len(s) >= 2 and s[-1] == vocab for s in saved)  # no logits-shaped tensor
    # and the full-vocabulary path does keep one: the check can fail
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference_logprobs(model, mb, 1.0, None)
    assert any(len(s) >= 2 and s[-1] == vocab for s in saved)


def test_a_model_without_a_linear_output_layer_is_refused_in_one_line() -> None:
    model = _qwen(tied=False)
    model.lm_head = torch.nn.Identity()
    with pytest.raises(TypeError, match="output layer must be a linear layer"):
        ResponseLogits(model)
