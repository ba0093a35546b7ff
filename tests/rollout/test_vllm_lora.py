"""vLLM under LoRA: after a real update of the adapters, the sync pushes the merged weights and
the engine's log-probs are the trainer's again (the trainer scores through the PEFT model).

One engine for the module (see conftest); it is given the original weights back at the end.
"""

from __future__ import annotations

import copy

import pytest
import torch
from rich.console import Console

from bapo_cli.config.schema import LoraConfig
from bapo_cli.models import lora
from bapo_cli.rollout.base import Request, Sample, SamplingParams
from bapo_cli.rollout.scoring import ResponseLogits, collate
from bapo_cli.trainer.update import Learner, LossSpec, optimizer_update
from tests.rollout.conftest import trainer_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

LOGPROB_TOL = 1e-4  # float32 on CPU, as tests/rollout/test_vllm_engine.py


def test_engine_samples_the_merged_policy_after_a_lora_update(engine, policy, train_cfg) -> None:
    from bapo_cli.trainer.prompts import PromptStream

    model, tokenizer = policy
    prompts = PromptStream(train_cfg, tokenizer, Console(quiet=True))
    reqs = [Request(tuple(prompts.encode(p)), (), 8) for p in prompts.prompt_set.take(0, 8)] * 2
    params = SamplingParams(max_tokens=8)
    adapted = lora.apply(copy.deepcopy(model), LoraConfig(rank=4, alpha=8.0))
    adapted.train()

    def error() -> float:
        gens = engine.generate(reqs, params)
        trainer, reported = trainer_logprobs(adapted, tokenizer, reqs, gens, 1.0)
        return (trainer - reported).abs().max().item()

    assert error() < LOGPROB_TOL  # fresh adapters (B = 0): the base model's function
    # one real optimizer update of the adapters (GRPO loss on the engine's own samples)
    gens = engine.generate(reqs, params)
    samples = [
        Sample(
            list(r.prompt_ids),
            i % 8,
            None,
            response_ids=list(g.token_ids),
            logprobs=list(g.logprobs),
            versions=[0] * len(g.token_ids),
            advantage=1.0 if i % 2 else -1.0,
        )
        for i, (r, g) in enumerate(zip(reqs, gens, strict=True))
    ]
    mb = collate(samples, tokenizer.pad_token_id, torch.device("cpu"))
    optimizer = torch.optim.AdamW(lora.trainable(adapted), lr=0.05)
    base_before = {n: p.detach().clone() for n, p in adapted.named_parameters() if "lora_" not in n}
    learner = Learner(ResponseLogits(adapted), optimizer)
    result = optimizer_update(learner, LossSpec.of("ppo", eps=0.2), [mb], version=0)
    assert not result.skipped
    for n, p in adapted.named_parameters():  # only the adapters moved
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n
    try:
        assert error() > 1e-2  # the engine still samples from the base weights
        engine.sync_weights(adapted, 1)
        assert error() < LOGPROB_TOL  # merged weights in: engine and trainer agree
    finally:
        engine.sync_weights(model, 0)
