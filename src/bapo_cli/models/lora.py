"""LoRA adapters on the policy (`model.lora.rank > 0`), through PEFT.

    bapo train model.lora.rank=8 trainer.lr=1e-4               # adapters on every linear layer
    bapo train model.lora.rank=16 model.lora.alpha=32 'model.lora.target_modules=[q_proj,v_proj]'
    bapo merge-lora <run>/checkpoints/step_000010 merged/      # a plain HF model dir

Only the adapters train: `apply` freezes the base weights (PEFT does) and the trainer hands the
optimizer the parameters that still require a gradient, so AdamW state and DDP's all-reduce cover
the adapters alone. Dropout is fixed at 0: RL needs the policy that samples to be the policy that
is scored (`rollout.scoring.disable_dropout` for the same reason).

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

Nothing here trusts an adapter or a target list before checking it without weights: the adapter's
files are read and bounded first (models.adapters), its base resolved once, and its tensors and
`model.lora.target_modules` matched against the base model built on the meta device from its
config alone (`skeleton`), so a bad adapter or target costs one line before any weight loads.
`merge` writes where nothing is lost (models.outdir). This module loads plain models through
models.pretrained and never imports models.loading (which imports it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo_cli.models import adapters, outdir, pretrained
from bapo_cli.models.errors import LoraError
from bapo_cli.models.errors import ModelLoadError as ModelLoadError  # the CLI catches it here

ADAPTER_CONFIG = adapters.ADAPTER_CONFIG
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output layer
OUTER = "base_model.model."  # PEFT's prefix of the base model's names in an adapter file
is_adapter_dir = adapters.is_adapter_dir


def enabled(cfg: Any) -> bool:
    """Whether a `ModelConfig` asks for LoRA (`model.lora.rank > 0`)."""
    lora = getattr(cfg, "lora", None)
    return lora is not None and int(lora.rank) > 0


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
    weight itself, in chunks (`rollout.scoring.ResponseLogits`), so an adapter there would be
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


def check_adapter(directory: Path) -> None:
    """The adapter checkpoint's files, checked without loading anything (models.adapters): a
    resume calls this before the base model's weights load."""
    adapters.read(directory)


def load_adapter(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """`model` (the base) with the adapter saved in `directory`, trainable (resume); the
    adapter's files checked first and its tensors matched against `model`."""
    peft = _peft()
    adapter = adapters.read(directory)
    _fits(adapter, model)
    _inputs_need_grad(model)
    return _peft_load(peft, model, adapter, is_trainable=True)


def _peft_load(peft: Any, model: torch.nn.Module, adapter: Any, **kwargs: Any) -> Any:
    try:
        return peft.PeftModel.from_pretrained(model, str(adapter.directory), **kwargs)
    except (ValueError, RuntimeError, KeyError, OSError) as err:  # what the checks cannot see
        raise LoraError(
            f"{adapter.directory}: the adapter could not be put on its base model "
            f"({pretrained.first_line(err)})"
        ) from None


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


@dataclass(frozen=True)
class Merged:
    """What `merge` wrote: the model directory, and where OUT's old contents went (--force)."""

    path: Path
    set_aside: Path | None


def merged_model(
    directory: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    base: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """(plain HF model with the adapter merged in, tokenizer) from an adapter directory; the
    adapter checked and its base resolved once (never through another adapter) before any
    weight loads."""
    adapter = adapters.read(directory)
    source = adapters.base_source(adapter, base)
    return _merged_model(adapter, source, device, dtype, trust_remote_code)


def _merged_model(
    adapter: adapters.Adapter,
    source: Path | str,
    device: torch.device | str,
    dtype: torch.dtype,
    trust_remote_code: bool,
) -> tuple[Any, Any]:
    peft = _peft()
    meta = skeleton(source, trust_remote_code)
    if meta is not None:
        _fits(adapter, meta, source)
    if isinstance(source, Path):
        what = f"the base model of {adapter.directory} could not be loaded"
        model, tokenizer = pretrained.from_pretrained(
            str(source), device, dtype, trust_remote_code, what
        )
    else:
        model, tokenizer = pretrained.load_hub(
            source, device, dtype, trust_remote_code=trust_remote_code
        )
    plain = _peft_load(peft, model, adapter).merge_and_unload()
    plain.eval()
    return plain, tokenizer  # the base's: training never changes the tokenizer


def merge(
    directory: Path,
    out: Path,
    base: str | None = None,
    dtype: torch.dtype = torch.float32,
    force: bool = False,
) -> Merged:
    """Write the adapter checkpoint `directory` merged into its base as a plain HF model dir at
    `out` (weights, config, tokenizer). Everything is checked before any weight loads: the
    adapter, its base, and `out` (models.outdir: never a link, a file, the checkpoint, the base,
    the current or home directory or a parent of them; non-empty only with `force`, and then set
    aside, not deleted)."""
    directory = Path(directory).expanduser()
    if not adapters.is_adapter_dir(directory):
        raise LoraError(f"{directory}: not a LoRA checkpoint (no {ADAPTER_CONFIG})")
    adapter = adapters.read(directory)
    source = adapters.base_source(adapter, base)
    protected = {"the checkpoint": directory}
    if isinstance(source, Path):
        protected["the base model"] = source
    target = outdir.check(out, force=force, protected=protected)
    model, tokenizer = _merged_model(adapter, source, "cpu", dtype, False)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return Merged(target.path, outdir.write(target, fill))


# ------------------------------------------------------------------- checks without weights


def skeleton(source: Path | str, trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The model `source` names, built on the meta device from its config alone (no weights, no
    memory, a fraction of a second): its module names and shapes, to match adapters and target
    modules against before the weights load. None where the config cannot be read without a
    network (a hub id not in the cache) or names an architecture transformers does not build:
    the load itself then reports, in one line, and `apply` / PEFT check after it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(
            str(source), trust_remote_code=trust_remote_code, local_files_only=True
        )
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # unreadable or unknown config: not ours to report twice
        return None


def check_targets(source: Path | str, lora: Any, trust_remote_code: bool = False) -> bool:
    """`model.lora` against the model at `source` before its weights load: every target module
    names a decoder linear layer that exists (one line listing those that do, otherwise) and
    the rank is at most the model's hidden size (a wider adapter is a full-rank update with more
    parameters than the layer). False when the model cannot be built without its weights."""
    if isinstance(source, Path) and adapters.is_adapter_only(source):
        source = adapters.base_source(adapters.read(source))  # an adapter's base, merged on load
    meta = skeleton(source, trust_remote_code)
    if meta is None:
        return False
    hidden = getattr(meta.config, "hidden_size", None)
    if isinstance(hidden, int) and int(lora.rank) > hidden:
        raise LoraError(
            f"model.lora.rank={lora.rank}: above the hidden size of {source} ({hidden}); a "
            f"rank in [1, {hidden}]"
        )
    targets = [str(t) for t in lora.target_modules]
    if targets == [ALL_LINEAR]:
        return True
    head = meta.get_output_embeddings()
    modules = {name: m for name, m in meta.named_modules() if name}
    linears = sorted({n.rpartition(".")[2] for n, m in modules.items() if _decoder_linear(m, head)})
    allowed = f"its decoder's linear layers are {', '.join(linears)} (or use [all-linear])"
    for target in targets:
        matched = [n for n in modules if n == target or n.endswith("." + target)]
        if not matched:
            raise LoraError(
                f"model.lora.target_modules={targets}: {target} matches no module of {source}; "
                + allowed
            )
        for name in matched:
            if not _decoder_linear(modules[name], head):
                raise LoraError(
                    f"model.lora.target_modules={targets}: matches {name} "
                    f"({type(modules[name]).__name__}); adapters go on the decoder's linear "
                    f"layers only (not the embeddings or the output layer): {allowed}"
                )
    return True


def _decoder_linear(module: torch.nn.Module, head: Any) -> bool:
    return isinstance(module, torch.nn.Linear) and module is not head


def _fits(adapter: adapters.Adapter, model: torch.nn.Module, source: Any = None) -> None:
    """Every A/B tensor of the adapter belongs to a layer of `model` with the matching width:
    A is (rank, in_features), B is (out_features, rank). A real model or its meta skeleton."""
    weights = adapter.directory / adapters.ADAPTER_WEIGHTS
    of = f" of {source}" if source is not None else ""
    modules = dict(model.named_modules())
    for name, (_dtype, shape) in adapter.tensors.items():
        parts = name.removeprefix(OUTER).split(".")
        kind = next((p for p in parts if p in ("lora_A", "lora_B")), None)
        if kind is None:
            continue
        layer = ".".join(parts[: parts.index(kind)])
        module = modules.get(layer)
        if not isinstance(module, torch.nn.Linear):
            found = "no such layer" if module is None else type(module).__name__
            raise LoraError(
                f"{weights}: {name}: the base model{of} has {found} at {layer}; an adapter "
                "trained on another model (pass its base with --base)"
            )
        if kind == "lora_A":
            wide = (shape[-1], module.in_features)
        else:
            wide = (shape[0], module.out_features)
        if len(shape) != 2 or wide[0] != wide[1]:
            raise LoraError(
                f"{weights}: {name}.shape={list(shape)}: {layer} of the base model{of} takes "
                f"{wide[1]} features there; an adapter trained on another model (pass its base "
                "with --base)"
            )
