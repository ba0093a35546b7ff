"""The tiny model's warm-up task setting (`model.tiny.task`): cache keys, SFT batches, pairs."""

from __future__ import annotations

import random
import re

import pytest
import torch

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.preflight import preflight
from bapo_cli.config.schema import TinyModelConfig
from bapo_cli.data.pairs import PAIRS_MAX_TOKENS, PairTask, named_pair
from bapo_cli.data.tasks import ArithTask
from bapo_cli.models import tiny

ATTEMPTS = re.compile(r"([0-9]\+[0-9]=[0-9]{1,2}[<>]){2}")


def test_the_task_setting_enters_the_key() -> None:
    """The schema's defaults are the default preset's (model=tiny): the same key."""
    default = tiny.build_key(TinyModelConfig())
    assert tiny.build_key(TinyModelConfig(task="arith")) == default
    assert tiny.build_key(preflight("train", []).config.model.tiny) == default
    assert tiny.build_key(TinyModelConfig(task="pairs")) != default


def test_task_setting_is_validated() -> None:
    assert set(tiny.WARMUP_TASKS) == {"arith", "pairs"}
    with pytest.raises(ConfigError, match="task=nope: must be one of arith, pairs"):
        TinyModelConfig(task="nope").check()
    preset = preflight("train", ["model=tiny_pairs"]).config.model
    assert (preset.tiny.task, preset.tiny.sft_steps) == ("pairs", 1600)
    assert preset.name == "tiny_pairs" and preset.max_model_len == 96


def test_arith_sft_batch_is_answer_then_eos() -> None:
    tok = tiny.build_tokenizer()
    problems = ArithTask(0).prompts(4)
    ids, labels = tiny._sft_batch(tok, problems, tiny.WARMUP_TASKS["arith"], random.Random(0))
    for row, p in enumerate(problems):
        target = [t for t in labels[row].tolist() if t != -100]
        assert target == tok(p.answer, add_special_tokens=False).input_ids + [tiny.EOS_ID]


def test_pairs_sft_batch_is_a_search_trace_cut_at_the_budget() -> None:
    tok = tiny.build_tokenizer()
    problems = PairTask(0).prompts(64)
    ids, labels = tiny._sft_batch(tok, problems, tiny.WARMUP_TASKS["pairs"], random.Random(0))
    ended = cut = 0
    for row, p in enumerate(problems):
        target = [t for t in labels[row].tolist() if t != -100]
        assert len(target) <= PAIRS_MAX_TOKENS
        prompt = tok(f"{p.question}!").input_ids
        assert ids[row, : len(prompt)].tolist() == prompt
        if target[-1] == tiny.EOS_ID:  # the search hit in time: a complete, right response
            ended += 1
            assert named_pair(tok.decode(target[:-1])) == p.answer
        else:  # cut where the budget runs out: no <eos> (a hit may fill it exactly)
            cut += 1
            assert len(target) == PAIRS_MAX_TOKENS
            assert named_pair(tok.decode(target)) in (None, p.answer)
            assert ATTEMPTS.match(tok.decode(target))
    assert ended and cut


@pytest.mark.slow  # trains the warm-up: ~30 s
def test_pairs_warm_up_learns_the_format(tmp_path) -> None:
    """A short warm-up (seconds): greedy answers are already lists of attempts."""
    cfg = TinyModelConfig(task="pairs", sft_steps=150, sft_batch_size=64, sft_lr=1e-3)
    directory = tiny.ensure_tiny(cfg, cache_dir=tmp_path, progress=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    problems = PairTask(0).held_out(64)
    threads = torch.get_num_threads()
    torch.set_num_threads(tiny.BUILD_THREADS)
    try:
        answers = tiny.greedy_answers(model, tiny.build_tokenizer(), problems, "pairs")
    finally:
        torch.set_num_threads(threads)
    formatted = [text for text, _ in answers if ATTEMPTS.match(text)]
    assert len(formatted) >= 0.9 * len(problems), answers[:4]
