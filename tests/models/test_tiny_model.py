"""The tiny model: char tokenizer, shape, deterministic cached build, warm-up target."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bapo_cli.data.tasks import ArithTask
from bapo_cli.models import tiny


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


# ------------------------------------------------------------------------------------ tokenizer


def ascii_id(c: str) -> int:
    return 4 + ord(c)


def test_bos_is_added_exactly_once(tok) -> None:
    ids = tok("37+45=").input_ids
    assert ids == [tiny.BOS_ID] + [ascii_id(c) for c in "37+45="]
    assert tok.encode("7*8=").count(tiny.BOS_ID) == 1
    assert tok("7*8=", add_special_tokens=False).input_ids.count(tiny.BOS_ID) == 0
    assert tok(["1+1=", "37+45="]).input_ids[1].count(tiny.BOS_ID) == 1


def test_one_token_per_ascii_character_and_round_trip(tok) -> None:
    text = "Let x = -12; then 3*x^2 \\in {1, 2}?\n  \\boxed{42} (ok)!"
    ids = tok(text).input_ids
    assert ids[1:] == [ascii_id(c) for c in text]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text


def test_unknown_characters_round_trip_as_bytes(tok) -> None:
    text = "1é∑2"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode()) == 7 and tiny.UNK_ID not in ids
    assert ids[0] == ascii_id("1") and ids[-1] == ascii_id("2")
    assert tok.decode(ids) == text


def test_special_ids_and_padding(tok) -> None:
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == tiny.VOCAB_SIZE == 260
    batch = tok(["1+1=", "37+45="], padding=True).input_ids
    assert batch[0][:2] == [tiny.PAD_ID, tiny.PAD_ID] and batch[0][2] == tiny.BOS_ID


def test_qwen2_tokenizer_class_gives_the_same_ids(tok, tmp_path: Path, tiny_settings) -> None:
    """transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer (its own pipeline)."""
    from transformers import AutoTokenizer

    tiny.build_config(tiny_settings()).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["37+45=", "a  b\n\n12-3=", "héllo ∑ 日本", "it's $x^2$ \\boxed{1}.", ""]:
        assert loaded(text).input_ids == tok(text).input_ids, text
        assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True) == text


# ---------------------------------------------------------------------------------------- shape


def test_shape_and_parameter_count(tiny_settings) -> None:
    from transformers import Qwen2ForCausalLM

    config = tiny.build_config(tiny_settings())
    assert config.head_dim == 64 and config.tie_word_embeddings
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    n = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert n == 329_344  # ~0.33M: the prototype's 0.31M plus a 260-token byte vocabulary
    default = Qwen2ForCausalLM(tiny.build_config(tiny_settings(intermediate_size=512)))
    assert sum(p.numel() for p in default.parameters()) == 525_952


def test_cache_key_covers_every_setting(tiny_settings) -> None:
    base = tiny.build_key(tiny_settings())
    assert base == tiny.build_key(tiny_settings())
    assert base != tiny.build_key(tiny_settings(seed=1))
    assert base != tiny.build_key(tiny_settings(sft_steps=41))
    assert base != tiny.build_key(tiny_settings(task="pairs"))


def test_cache_root_from_environment(monkeypatch, tmp_path: Path, tiny_settings) -> None:
    monkeypatch.setenv("BAPO_CACHE_DIR", str(tmp_path))
    assert tiny.tiny_dir(tiny_settings()).parent == tmp_path / "tiny"
    monkeypatch.delenv("BAPO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny.cache_root() == tmp_path / "xdg" / "bapo-cli"


# ---------------------------------------------------------------------------------------- build


def test_build_runs_exactly_its_steps_and_records_them(tiny_build) -> None:
    """The warm-up stops by step count (never at an accuracy threshold), checking held-out
    accuracy every EVAL_EVERY steps for the record only."""
    cfg, directory, info = tiny_build
    assert (directory / tiny.COMPLETE_MARKER).is_file()
    assert info["steps"] == cfg.sft_steps == 40
    assert [step for step, _ in info["history"]] == [20, 40]
    assert info["accuracy"] == info["history"][-1][1]
    assert info["parameters"] == 329_344
    assert info["key"] == tiny.build_key(cfg) == directory.name
    assert (info["threads"], info["deterministic_algorithms"]) == (1, True)
    assert info["torch"] == torch.__version__ and info["transformers"]
    assert not list(directory.parent.glob(".*tmp*"))  # the temporary build dir is gone


def test_build_restores_threads_and_determinism(tmp_path: Path, tiny_settings) -> None:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(False)  # (training tests may have left it on)
    try:
        tiny.build_tiny(tiny_settings(sft_steps=1, sft_batch_size=8), tmp_path, progress=False)
        assert torch.get_num_threads() == 2
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def test_built_dir_loads_with_auto_classes(tiny_build) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, directory, info = tiny_build
    model = AutoModelForCausalLM.from_pretrained(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    text = "a b\n12+3="
    assert tok(text).input_ids == tiny.build_tokenizer()(text).input_ids
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert model.config.head_dim == 64 and model.config.eos_token_id == tiny.EOS_ID
    held_out = ArithTask(0).held_out(tiny.EVAL_SIZE)
    threads = torch.get_num_threads()
    torch.set_num_threads(tiny.BUILD_THREADS)  # as in the build (and fast on a busy machine)
    try:
        assert tiny.greedy_accuracy(model, tok, held_out) == pytest.approx(info["accuracy"])
    finally:
        torch.set_num_threads(threads)


def test_cache_hit_returns_without_training(tiny_build, tiny_cache, monkeypatch) -> None:
    cfg, directory, _ = tiny_build

    def no_training(*args, **kwargs):
        raise AssertionError("a cache hit must not train")

    monkeypatch.setattr(tiny, "warm_up", no_training)
    started = time.perf_counter()
    assert tiny.ensure_tiny(cfg, cache_dir=tiny_cache, progress=False) == directory
    assert time.perf_counter() - started < 1.0


def test_incomplete_entry_is_rebuilt(tmp_path: Path, tiny_settings) -> None:
    cfg = tiny_settings(sft_steps=2, sft_batch_size=8)
    stale = tiny.tiny_dir(cfg, tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{half written")
    directory = tiny.ensure_tiny(cfg, cache_dir=tmp_path, progress=False)
    assert directory == stale and (directory / tiny.COMPLETE_MARKER).is_file()
    info = json.loads((directory / tiny.BUILD_INFO).read_text())
    assert info["steps"] == 2 and info["history"] == [[2, info["accuracy"]]]


def test_same_settings_build_identical_weights(tmp_path: Path, tiny_settings) -> None:
    from safetensors.torch import load_file

    cfg = tiny_settings(sft_steps=tiny.EVAL_EVERY, sft_batch_size=32, seed=3)
    a = tiny.ensure_tiny(cfg, cache_dir=tmp_path / "a", progress=False)
    b = tiny.ensure_tiny(cfg, cache_dir=tmp_path / "b", progress=False)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    init = tiny.ensure_tiny(tiny_settings(sft_steps=1, sft_batch_size=32, seed=4), cache_dir=a)
    other = load_file(init / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], wa["model.embed_tokens.weight"])


def test_build_shows_progress(tmp_path: Path, capsys, tiny_settings) -> None:
    cfg = tiny_settings(sft_steps=2, sft_batch_size=8)
    tiny.ensure_tiny(cfg, cache_dir=tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "warm-up" in err and "step 2/2" in err
