"""LoRA (PEFT) on the real tiny model: what trains, what the trainer's scorer computes through the
PEFT wrapper, the merged weights an engine receives, and merging a checkpoint into a plain model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bapo_cli.config.schema import LoraConfig
from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import collate, token_logprobs

SAMPLES = [  # prompt + response token ids of the tiny vocabulary
    Sample([1, 52, 43, 56], 0, None, [57, 58, 59, 2], versions=[0] * 4),
    Sample([1, 60, 61], 1, None, [62, 63, 64, 65, 66, 2], versions=[0] * 6),
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A random (unwarmed) model of the tiny shape with the tiny tokenizer, saved as a HF dir:
    LoRA's mechanics need no warm-up, and this keeps the module to seconds."""
    from transformers import Qwen2ForCausalLM

    from bapo_cli.config.schema import TinyModelConfig
    from bapo_cli.models import tiny

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny.build_config(TinyModelConfig())).float()
    directory = tmp_path_factory.mktemp("lora-base")
    model.save_pretrained(directory, safe_serialization=True)
    tiny.build_tokenizer().save_pretrained(directory)
    return directory


def _base(base_dir):
    return models.load_checkpoint(base_dir)


def _randomise_adapters(model, seed: int = 0) -> None:
    """Non-zero B (fresh adapters have B = 0: the base function) so the adapters show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _logp(model, grad: bool = False) -> torch.Tensor:
    """The trainer's log-probs of the response tokens (through `ResponseLogits`)."""
    mb = collate(SAMPLES, 0, torch.device("cpu"))
    with torch.set_grad_enabled(grad):
        logp, _ = token_logprobs(model, mb, 1.0)
    return logp


def test_only_adapters_train_and_fresh_ones_leave_the_function_unchanged(base_dir) -> None:
    model, _ = _base(base_dir)
    before = _logp(model)
    total = sum(p.numel() for p in model.parameters())
    wrapped = lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # all-linear on the tiny Qwen2: q, k, v, o, gate, up, down in each of the 2 layers
    assert len(names) == 2 * 7 * 2
    trainable, everything = lora.counts(wrapped)
    assert everything == total + trainable and 0 < trainable < total / 5
    assert lora.trainable(wrapped) == [p for p in wrapped.parameters() if p.requires_grad]
    torch.testing.assert_close(_logp(wrapped), before, rtol=0, atol=0)  # B = 0


def test_the_scorer_goes_through_the_adapters(base_dir) -> None:
    """ResponseLogits calls get_decoder() / get_output_embeddings() on the PEFT model: both reach
    the base model, whose linear layers are the LoRA ones, so the adapters change its output and
    their gradients flow."""
    model, _ = _base(base_dir)
    before = _logp(model)
    wrapped = lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    assert type(wrapped.get_decoder()).__name__ == "Qwen2Model"
    assert wrapped.get_output_embeddings() is wrapped.get_base_model().lm_head
    _randomise_adapters(wrapped)
    after = _logp(wrapped)
    assert (after - before).abs().max() > 1e-2
    _logp(wrapped, grad=True).sum().backward()
    grads = [p.grad for p in lora.trainable(wrapped)]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in wrapped.parameters() if not p.requires_grad)


def test_engine_weights_are_the_merged_policy_under_the_base_names(base_dir) -> None:
    model, _ = _base(base_dir)
    plain, _ = _base(base_dir)
    plain_names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in lora.engine_weights(plain)] == plain_names  # no LoRA: as they are
    wrapped = lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    _randomise_adapters(wrapped)
    named = list(lora.engine_weights(wrapped))
    assert [n for n, _ in named] == plain_names
    weights = dict(named)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(weights[name])
    torch.testing.assert_close(_logp(plain), _logp(wrapped), rtol=1e-5, atol=1e-5)
    # the trainer's base weights are untouched (merged copies, no merge in place)
    q = wrapped.get_base_model().model.layers[0].self_attn.q_proj
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight)


def test_unknown_target_module_is_one_line(base_dir) -> None:
    model, _ = _base(base_dir)
    with pytest.raises(lora.LoraError) as err:
        lora.apply(model, LoraConfig(rank=4, target_modules=["qq_proj"]))
    text = str(err.value)
    assert text.startswith("model.lora.target_modules=['qq_proj']:") and "\n" not in text
    assert isinstance(err.value, models.ModelLoadError)  # the CLI's one-line user error


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_adapters_off_the_decoders_linear_layers_are_refused(base_dir, target) -> None:
    """The trainer applies the output layer's weight itself, in chunks: an adapter there (or on
    the tied embedding) would reach the engine's merged copy but not the trainer's forward."""
    model, _ = _base(base_dir)
    with pytest.raises(lora.LoraError) as err:
        lora.apply(model, LoraConfig(rank=4, target_modules=["q_proj", target]))
    assert f"{target} (" in str(err.value) and "\n" not in str(err.value)


def test_adapters_get_gradients_under_gradient_checkpointing(base_dir) -> None:
    model, _ = _base(base_dir)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    wrapped = lora.apply(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
    _randomise_adapters(wrapped)
    _logp(wrapped, grad=True).sum().backward()
    a_grads = [p.grad for n, p in wrapped.named_parameters() if "lora_A" in n]
    assert a_grads and all(g is not None and g.abs().sum() > 0 for g in a_grads)


def test_merge_writes_a_plain_model_that_equals_the_adapted_one(base_dir, tmp_path) -> None:
    model, tokenizer = _base(base_dir)
    wrapped = lora.apply(model, LoraConfig(rank=4, alpha=8.0))
    _randomise_adapters(wrapped)
    adapter = tmp_path / "ckpt"
    wrapped.save_pretrained(adapter, safe_serialization=True)
    tokenizer.save_pretrained(adapter)
    assert not (adapter / "config.json").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    expected = _logp(wrapped)

    merged_dir = lora.merge(adapter, tmp_path / "merged").path
    assert (merged_dir / "config.json").is_file()
    assert not (merged_dir / "adapter_config.json").exists()
    plain, _ = models.load_checkpoint(merged_dir)
    assert not lora.is_lora(plain)
    torch.testing.assert_close(_logp(plain), expected, rtol=1e-5, atol=1e-5)
    # model.path=<adapter checkpoint> loads the same merged policy (bapo eval on a LoRA run)
    direct, _ = models.load_checkpoint(adapter)
    torch.testing.assert_close(_logp(direct), expected, rtol=1e-5, atol=1e-5)


def test_merge_refuses_a_dir_that_is_no_adapter(tmp_path: Path) -> None:
    with pytest.raises(lora.LoraError, match="not a LoRA checkpoint"):
        lora.merge(tmp_path, tmp_path / "out")
