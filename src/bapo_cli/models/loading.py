"""The policy: load it by HF id, local directory or `tiny`; save and load checkpoints.

    model.path=tiny                      the locally built, warmed-up tiny Qwen2 (models/tiny.py)
    model.path=/path/to/checkpoint       any HF directory (config.json + weights + tokenizer)
    model.path=/path/to/lora/checkpoint  a LoRA checkpoint: its base with the adapter merged in
    model.path=Qwen/Qwen2.5-Math-1.5B    a hub id, through the HF cache (needs a network once)

Device `auto` is CUDA when available, else CPU; dtype `auto` is bfloat16 on CUDA and float32 on
CPU. Tokenizers are returned with a pad token and left padding (for batched generation). Prompts
go through `format_prompt` -- the chat template when the tokenizer has one -- and are then encoded
with special tokens, which is also what vLLM does with a text prompt, so both engines see the same
ids. Checkpoints are written to a temporary sibling and renamed into place, so a kill never leaves
a half-written checkpoint under its final name.

Under LoRA (`model.lora.rank > 0`) the target modules are matched against the model built on the
meta device before its weights load (models.lora.check_targets). Imports go one way: this module
uses models.lora and models.pretrained; neither imports it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bapo_cli.config.schema.model import FLOAT64_ON_CUDA
from bapo_cli.models import adapters, lora, pretrained
from bapo_cli.models.errors import ModelLoadError as ModelLoadError  # launch.jobs catches it here

TINY = "tiny"


def resolve_device(cfg: Any) -> torch.device:
    """`model.device`: auto = cuda when available, else cpu."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device=cuda: CUDA is not available here (use auto or cpu)")
    return torch.device(cfg.device)


def resolve_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """`model.dtype`: auto = bfloat16 on CUDA, float32 elsewhere. float64 only on the CPU (the
    config refuses model.device=cuda; this refuses device auto once it resolves to CUDA)."""
    if cfg.dtype == "float64" and device.type == "cuda":
        raise ModelLoadError(f"model.dtype=float64 on {device}: {FLOAT64_ON_CUDA}")
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(f"model.dtype={cfg.dtype}: not a torch dtype")
    return dtype


def model_dir(cfg: Any) -> Path | str:
    """What an engine (vLLM) loads for this config: the tiny cache dir (built if missing) or the
    local directory as a Path; a hub id is returned unchanged as a string."""
    if cfg.path == TINY:
        from bapo_cli.models.tiny import ensure_tiny

        return ensure_tiny(cfg.tiny)
    local = Path(cfg.path).expanduser()
    if local.exists() or pretrained.looks_local(cfg.path):
        return local
    return cfg.path


def load_policy(
    cfg: Any, *, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> tuple[Any, Any]:
    """(model, tokenizer) for a `ModelConfig`, on `device` in `dtype` (resolved from cfg if None).

    The model comes back in eval mode; gradient checkpointing is enabled when the config asks.
    """
    device = device if device is not None else resolve_device(cfg)
    dtype = dtype if dtype is not None else resolve_dtype(cfg, device)
    source = model_dir(cfg)
    remote = bool(getattr(cfg, "trust_remote_code", False))
    if lora.enabled(cfg):  # targets and rank against the model's shape, before its weights
        lora.check_targets(source, cfg.lora, trust_remote_code=remote)
    if isinstance(source, Path):
        model, tokenizer = load_checkpoint(source, device, dtype, trust_remote_code=remote)
    else:
        model, tokenizer = pretrained.load_hub(source, device, dtype, trust_remote_code=remote)
    if getattr(cfg, "gradient_checkpointing", False):
        # transformers 5 renamed it (the old name warns); 4.x only has the old one
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    return model, tokenizer


def load_checkpoint(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """(model, tokenizer) from a HF-format directory (as written by `save_checkpoint`)."""
    directory = Path(directory).expanduser()
    _check_dir(directory)
    if adapters.is_adapter_only(directory):  # a LoRA checkpoint: its base with the adapter merged
        return lora.merged_model(directory, device, dtype, trust_remote_code=trust_remote_code)
    _check_config(directory)
    what = "the local directory could not be loaded"
    return pretrained.from_pretrained(str(directory), device, dtype, trust_remote_code, what)


def check_servable(source: Path | str, *, trust_remote_code: bool = False) -> None:
    """`model_dir`'s answer checked as a vLLM server will load it, before one starts (bapo serve):
    a directory that exists, holds config.json and weight files, and whose config and tokenizer
    transformers reads; a hub id whose config and tokenizer can be had. One ModelLoadError line
    otherwise (pretrained.check_servable)."""
    local = isinstance(source, Path)
    if local:
        _check_dir(source)
        _check_config(source)
    pretrained.check_servable(str(source), trust_remote_code, local=local)


def _check_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise ModelLoadError(f"model.path={directory}: no such directory")


def _check_config(directory: Path) -> None:
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"model.path={directory}: not a HF model directory (no config.json)")


def save_checkpoint(
    model: Any,
    tokenizer: Any,
    directory: str | Path,
    *,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write model (safetensors) and tokenizer to `directory` atomically; returns the directory.

    Everything goes to a temporary sibling first (`extra(tmp)` may add files there, e.g. trainer
    state); the final name appears only when complete. An existing checkpoint of the same name is
    moved aside, replaced, then deleted: a kill between those two renames leaves it as the sibling
    `.<name>.old-*` rather than under its name, never half-written. Only for directories this
    tool owns: a directory a user names (`bapo merge-lora ... OUT`) goes through models.outdir,
    which deletes nothing it did not write.
    """
    directory = Path(directory).expanduser()
    directory.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = directory.parent / f".{directory.name}.tmp-{token}"
    old = directory.parent / f".{directory.name}.old-{token}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return directory


def format_prompt(tokenizer: Any, text: str) -> str:
    """The prompt text an engine encodes: the chat template (one user turn, generation prompt
    added) when the tokenizer has one, else `text`. A leading BOS written by the template is
    removed when the tokenizer adds BOS itself, so encoding with special tokens gives one BOS."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return _chat(tokenizer, [{"role": "user", "content": text}])


def format_messages(tokenizer: Any, messages: Any) -> str:
    """The prompt text of a chat-message prompt (verl / messages data): the chat template with
    the generation prompt added; a tokenizer without one (the tiny model's) gets the contents
    joined by newlines (`data.formats.render_plain`)."""
    if not getattr(tokenizer, "chat_template", None):
        from bapo_cli.data.formats import render_plain

        return render_plain(messages)
    return _chat(tokenizer, [dict(m) for m in messages])


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and rendered.startswith(bos) and _adds_bos(tokenizer):
        rendered = rendered[len(bos) :]
    return rendered


# ------------------------------------------------------------------------------------- helpers


def _adds_bos(tokenizer: Any) -> bool:
    ids = tokenizer("x")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def autocast_to(dtype: torch.dtype | None, device: torch.device):
    """torch.autocast to `dtype` on `device`; a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
