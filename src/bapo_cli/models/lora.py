"""LoRA adapters on the policy (`model.lora.rank > 0`), through PEFT.

    bapo train model.lora.rank=8 trainer.lr=1e-4               # adapters on every linear layer
    bapo train model.lora.rank=16 model.lora.alpha=32 'model.lora.target_modules=[q_proj,v_proj]'
    bapo merge-lora <run>/checkpoints/step_000010 merged/      # a plain HF model dir

Only the adapters train: `apply` freezes the base weights (PEFT does) and the trainer hands the
optimizer the parameters that still require a gradient, so AdamW state and DDP's all-reduce cover
the adapters alone. Dropout is fixed at 0: RL needs the policy that samples to be the policy that
is scored (`trainer.policy.disable_dropout` for the same reason).

The wrapped model is used where the plain one was: `ResponseLogits` calls `get_decoder()` and
`get_output_embeddings()`, which a `PeftModel` forwards to the base model, whose linear layers
PEFT replaced in place by LoRA layers; so the decoder's forward is the adapted one. The hf engine
generates with the PEFT model itself. The vLLM engine holds a plain copy of the base model, so
`engine_weights` gives it the merged weights `W + (alpha / rank) B A` under the base model's
names, one layer at a time, without touching the trainer's `W` (merging in place and unmerging
after, as TRL does, would add rounding to the base weights at every sync).

Checkpoints hold the adapter (`adapter_config.json`, `adapter_model.safetensors`) beside the
tokenizer and trainer state, not the base weights: a resume loads the base from `model.path` and
the adapter from the checkpoint (`load_adapter`). `merge` turns an adapter checkpoint into a plain
HF model directory that transformers, vLLM and `bapo eval` load as they are; `loading.
load_checkpoint` merges on the fly when given an adapter directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bapo_cli.models.loading import ModelLoadError

ADAPTER_CONFIG = "adapter_config.json"
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output layer


class LoraError(ModelLoadError):
    """LoRA cannot be set up as asked; the message is one line naming what and what to do (a
    model load error: the CLI reports it in one line, exit code 2)."""


def enabled(cfg: Any) -> bool:
    """Whether a `ModelConfig` asks for LoRA (`model.lora.rank > 0`)."""
    lora = getattr(cfg, "lora", None)
    return lora is not None and int(lora.rank) > 0


def is_adapter_dir(directory: Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def is_lora(model: torch.nn.Module) -> bool:
    """A PEFT-wrapped model (what `apply` and `load_adapter` return)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise LoraError(
            "model.lora.rank > 0 needs PEFT, which is not installed: pip install 'bapo-cli[lora]' "
            "(or pip install peft)"
        ) from None
    return peft


def peft_config(lora: Any) -> Any:
    """PEFT's LoraConfig for `model.lora` (rank, alpha, target modules; dropout 0, no bias)."""
    peft = _peft()
    targets = list(lora.target_modules)
    return peft.LoraConfig(
        r=int(lora.rank),
        lora_alpha=float(lora.alpha),
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """`model` with fresh adapters (B = 0: the same function as `model` until the first update);
    its base weights frozen."""
    peft = _peft()
    _inputs_need_grad(model)
    targets = list(lora.target_modules)
    try:
        wrapped = peft.get_peft_model(model, peft_config(lora))
    except ValueError as err:  # e.g. target modules that the model does not have
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LoraError(f"model.lora.target_modules={targets}: {first}") from None
    _only_decoder_linears(wrapped, targets)
    return wrapped


def _only_decoder_linears(model: Any, targets: list[str]) -> None:
    """Adapters on the decoder's linear layers only. The trainer applies the output layer's
    weight itself, in chunks (`trainer.policy.ResponseLogits`), so an adapter there would be
    trained by nobody yet merged into the engine's copy; an embedding adapter would, with tied
    embeddings, reach the engine's output layer but not the trainer's."""
    from peft.tuners.lora import LoraLayer

    head = model.get_output_embeddings()
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if module is head or base is head or not isinstance(base, torch.nn.Linear):
            raise LoraError(
                f"model.lora.target_modules={targets}: matches {name} "
                f"({type(base).__name__}); adapters go on the decoder's linear layers only "
                "(not the embeddings or the output layer): use [all-linear] or name those"
            )


def load_adapter(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """`model` (the base) with the adapter saved in `directory`, trainable (resume)."""
    peft = _peft()
    _inputs_need_grad(model)
    return peft.PeftModel.from_pretrained(model, str(directory), is_trainable=True)


def _inputs_need_grad(model: torch.nn.Module) -> None:
    """With gradient checkpointing, a checkpointed block whose inputs need no gradient (frozen
    embeddings) would give its adapters none: make the embedding output require one."""
    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them, or the adapters' under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in trainable(model)), total


# ----------------------------------------------------------------------------- merged weights


def engine_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the policy as a plain HF model, for an engine holding its own copy:
    the parameters themselves, or under LoRA the merged ones named as in the base model
    (`...q_proj.base_layer.weight` + its adapter -> `...q_proj.weight`). Lazy: one merged
    tensor exists at a time."""
    if not is_lora(model):
        for name, p in model.named_parameters():
            yield name, p.detach()
        return
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):
            layer_name = owner.removesuffix(".base_layer")
            tensor = p.detach()
            if leaf == "weight":
                tensor = _merged(modules[layer_name], tensor)
            yield f"{layer_name}.{leaf}", tensor
        else:
            yield name, p.detach()


@torch.no_grad()
def _merged(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """W + the active adapters' delta (`scaling * B @ A`), computed in float32."""
    delta = torch.zeros_like(weight, dtype=torch.float32)
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            delta += layer.get_delta_weight(adapter).float()
    return (weight.float() + delta).to(weight.dtype)


# ------------------------------------------------------------------------------------- merge


def base_of(directory: Path) -> str:
    """The base model an adapter directory was trained on (`base_model_name_or_path`)."""
    config = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise LoraError(
            f"{directory}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path): "
            "pass the base with --base"
        )
    return str(base)


def merged_model(
    directory: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    base: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """(plain HF model with the adapter merged in, tokenizer) from an adapter directory."""
    from bapo_cli.models import loading

    directory = Path(directory)
    source = base or base_of(directory)
    local = Path(source).expanduser()
    remote = trust_remote_code
    if local.is_dir():
        model, tokenizer = loading.load_checkpoint(local, device, dtype, trust_remote_code=remote)
    else:
        model, tokenizer = loading._load_hub(source, device, dtype, trust_remote_code=remote)
    peft = _peft()
    plain = peft.PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    plain.eval()
    return plain, tokenizer  # the base's: training never changes the tokenizer


def merge(
    directory: Path, out: Path, base: str | None = None, dtype: torch.dtype = torch.float32
) -> Path:
    """Write the adapter checkpoint `directory` merged into its base as a plain HF model dir at
    `out` (weights, config, tokenizer); returns `out`."""
    from bapo_cli.models import loading

    directory = Path(directory).expanduser()
    if not is_adapter_dir(directory):
        raise LoraError(f"{directory}: not a LoRA checkpoint (no {ADAPTER_CONFIG})")
    model, tokenizer = merged_model(directory, dtype=dtype, base=base)
    return loading.save_checkpoint(model, tokenizer, out)
