"""load_policy / checkpoints / device, dtype and prompt formatting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bapo_cli.config.schema import ModelConfig
from bapo_cli.models import loading as models
from bapo_cli.models import tiny


def test_device_and_dtype_auto() -> None:
    cfg = ModelConfig()
    device = models.resolve_device(cfg)
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert models.resolve_dtype(cfg, torch.device("cpu")) == torch.float32
    assert models.resolve_dtype(cfg, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype(ModelConfig(dtype="float16"), device) == torch.float16
    assert models.resolve_device(ModelConfig(device="cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_clear_error() -> None:
    with pytest.raises(models.ModelLoadError, match="model.device=cuda: CUDA is not available"):
        models.resolve_device(ModelConfig(device="cuda"))


def test_missing_local_dir_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(models.ModelLoadError) as err:
        models.load_policy(ModelConfig(path=str(missing)))
    assert str(missing) in str(err.value) and "no such directory" in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_dir_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(models.ModelLoadError, match="no config.json"):
        models.load_policy(ModelConfig(path=str(tmp_path)))


def test_unreachable_hub_id_says_what_was_tried(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network attempts, no retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(models.ModelLoadError) as err:
        models.load_policy(ModelConfig(path="bapo-nobody/not-a-model"))
    text = str(err.value)
    assert text.startswith("model.path=bapo-nobody/not-a-model: not a local directory")
    assert "HF hub cannot be used (HF_HUB_OFFLINE=1)" in text and "\n" not in text
    assert "model.path=/path/to/model" in text  # how to pass a local path


def test_model_dir(tiny_build, tmp_path: Path, monkeypatch) -> None:
    cfg, directory, _ = tiny_build
    monkeypatch.setenv("BAPO_CACHE_DIR", str(directory.parents[1]))
    assert models.model_dir(ModelConfig(tiny=cfg)) == directory
    assert models.model_dir(ModelConfig(path=str(tmp_path))) == tmp_path
    assert models.model_dir(ModelConfig(path="Qwen/Qwen2.5-Math-1.5B")) == "Qwen/Qwen2.5-Math-1.5B"


def test_load_policy_tiny_is_a_cache_hit(tiny_build, monkeypatch) -> None:
    cfg, directory, _ = tiny_build
    monkeypatch.setenv("BAPO_CACHE_DIR", str(directory.parents[1]))
    monkeypatch.setattr(tiny, "warm_up", lambda *a, **k: pytest.fail("must not rebuild"))
    model, tok = models.load_policy(ModelConfig(tiny=cfg, gradient_checkpointing=True))
    assert model.dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    assert model.is_gradient_checkpointing if checkpointing is None else checkpointing
    assert not model.training
    assert tok.padding_side == "left" and tok.pad_token_id == tiny.PAD_ID
    assert tok("1+1=").input_ids[0] == tiny.BOS_ID


def test_checkpoint_round_trip_gives_the_same_logits(tiny_build, tmp_path: Path) -> None:
    _, directory, _ = tiny_build
    model, tok = models.load_checkpoint(directory)
    with torch.no_grad():
        for p in model.parameters():  # a trained policy differs from the cached one
            p.add_(0.01 * torch.randn_like(p))
    target = tmp_path / "checkpoints" / "step-000010"
    extra = lambda tmp: (tmp / "trainer_state.json").write_text("{}")  # noqa: E731
    assert models.save_checkpoint(model, tok, target, extra=extra) == target
    assert (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()
    assert (target / "trainer_state.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == ["step-000010"]  # no temp dirs left
    loaded, loaded_tok = models.load_checkpoint(target, "cpu", torch.float32)
    ids = torch.tensor([tok("37+45=82").input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tok("a b\n").input_ids == tok("a b\n").input_ids


def test_save_replaces_and_a_failed_save_keeps_the_old(tiny_build, tmp_path: Path) -> None:
    _, directory, _ = tiny_build
    model, tok = models.load_checkpoint(directory)
    target = models.save_checkpoint(model, tok, tmp_path / "last")
    before = (target / "model.safetensors").read_bytes()

    class Broken:
        def save_pretrained(self, path, **kwargs):
            Path(path).mkdir(parents=True)
            (Path(path) / "config.json").write_text("{")
            raise KeyboardInterrupt  # killed while writing

    with pytest.raises(KeyboardInterrupt):
        models.save_checkpoint(Broken(), tok, target)
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    models.save_checkpoint(model, tok, target)
    assert (target / "model.safetensors").read_bytes() != before


def test_format_prompt_without_and_with_a_chat_template() -> None:
    tok = tiny.build_tokenizer()
    assert models.format_prompt(tok, "37+45=") == "37+45="
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    text = models.format_prompt(tok, "2+2=")
    assert text == "<user>2+2=<assistant>"  # the template's BOS dropped: the tokenizer adds it
    assert tok(text).input_ids.count(tiny.BOS_ID) == 1
