"""Sleep mode's call order (CUDA only, so checked here against a recording stand-in for vLLM's
`LLM`): generate, then sleep (GPU free for training); sync wakes the weights, loads them, then
wakes the KV cache and resets the prefix cache; generation wakes whatever still sleeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from bapo_cli.rollout.base import FINISH_STOP, Request, SamplingParams  # noqa: E402
from bapo_cli.rollout.vllm import VLLMEngine  # noqa: E402


class _LLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate(self, prompts, sampling, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        done = SimpleNamespace(
            token_ids=[5, 2],
            logprobs=[{5: SimpleNamespace(logprob=-0.5)}, {2: SimpleNamespace(logprob=-0.1)}],
            finish_reason="stop",
        )
        return [SimpleNamespace(outputs=[done]) for _ in prompts]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, fn, args=()):
        self.calls.append(("rpc", fn.__name__, len(list(args[0]))))  # a list or a lazy iterator

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _engine(sleep_mode: bool) -> VLLMEngine:
    engine = object.__new__(VLLMEngine)  # the bookkeeping only, no real vLLM behind it
    engine.llm, engine.sleep_mode, engine.sleeping = _LLM(), sleep_mode, set()
    engine.max_model_len, engine.eos_ids, engine.version = 64, [2], 0
    engine.tensor_parallel_size = 1
    return engine


def test_sleep_mode_frees_the_gpu_between_generation_and_sync() -> None:
    engine = _engine(sleep_mode=True)
    gens = engine.generate([Request((1, 7), (), 4)] * 2, SamplingParams(max_tokens=4))
    assert [g.finish_reason for g in gens] == [FINISH_STOP] * 2 and gens[0].logprobs == [-0.5, -0.1]
    engine.sync_weights(torch.nn.Linear(2, 2), 3)  # two parameters: weight, bias
    engine.generate([Request((1, 7), (), 4)], SamplingParams(max_tokens=4))
    assert engine.llm.calls == [
        ("generate", 2),
        ("sleep", 1),  # training gets the GPU
        ("wake_up", ("weights",)),
        ("rpc", "_reload", 2),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("generate", 1),
        ("sleep", 1),
    ]
    assert engine.version == 3 and engine.sleeping == {"weights", "kv_cache"}
    engine._wake("weights", "kv_cache")  # a generation after sleeping wakes both first
    assert engine.llm.calls[-1] == ("wake_up", ("weights", "kv_cache")) and not engine.sleeping


def test_without_sleep_mode_nothing_sleeps() -> None:
    engine = _engine(sleep_mode=False)
    engine.generate([Request((1, 7), (), 4)], SamplingParams(max_tokens=4))
    engine.sync_weights(torch.nn.Linear(2, 2), 1)
    assert engine.llm.calls == [("generate", 1), ("rpc", "_reload", 2), ("reset_prefix_cache",)]
