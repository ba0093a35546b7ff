"""Transformers' `from_pretrained` as the project calls it: one line on failure, a pad token and
left padding on the tokenizer, the model on its device in eval mode; by hub id through the HF
cache with a fast answer when the hub is out of reach.

A module below both `loading` (policies and checkpoints) and `lora` (adapters merged into their
base): each loads plain HF models through here, so neither imports the other's callers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from bapo_cli.models import hub
from bapo_cli.models.errors import ModelLoadError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
"""What a Hugging Face hub id looks like (`name` or `org/name`)."""


def looks_local(path: str) -> bool:
    """A path that cannot be a hub id (`org/name`): absolute, ~, ./, ../ or several slashes."""
    return (
        path.startswith(("/", "~", "./", "../", ".\\"))
        or path.count("/") > 1
        or path.endswith("/")
        or (os.sep != "/" and os.sep in path)
    )


def load_hub(hf_id: str, device: Any, dtype: Any, *, trust_remote_code: bool) -> tuple[Any, Any]:
    """By hub id, through the HF cache. With the hub out of reach (models.hub: HF_HUB_OFFLINE,
    or no connection within seconds) only the cache is tried, and the error says how to pass a
    local directory instead of retrying for a minute."""
    offline = hub.go_offline_if_unreachable()
    if offline is None:
        what = "no local directory of that name, and the HF hub id could not be loaded"
        return from_pretrained(hf_id, device, dtype, trust_remote_code, what)
    try:
        return from_pretrained(hf_id, device, dtype, trust_remote_code, "")
    except ModelLoadError:
        raise ModelLoadError(
            f"model.path={hf_id}: not a local directory and not in the HF cache, and the HF hub "
            f"cannot be used ({offline}); pass a local directory: model.path=/path/to/model "
            f"(on a machine with a network: hf download {hf_id} --local-dir /path/to/model)"
        ) from None


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")  # what vLLM's default loader looks for


def check_servable(source: str, trust_remote_code: bool, *, local: bool) -> None:
    """What an engine in another process (a vLLM server) will load, checked here without the
    weights, in seconds instead of the server's minute and its tracebacks: transformers reads the
    config (a known architecture) and the tokenizer, and a local directory holds weight files.
    A hub id is read through the HF cache (models.hub: offline when the hub is out of reach).
    One ModelLoadError line otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    offline = None if local else hub.go_offline_if_unreachable()
    loaded = []
    for what, load in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            loaded.append(load.from_pretrained(source, trust_remote_code=trust_remote_code))
        except Exception as err:  # unknown architecture, broken JSON, missing files, no network
            where = f"its {what} cannot be loaded ({first_line(err)})"
            if offline is not None:
                where = f"not in the HF cache, and the HF hub cannot be used ({offline})"
            raise ModelLoadError(f"model.path={source}: {where}") from None
    if len(loaded[1]) < 2:  # transformers 5 builds an empty tokenizer when its files are missing
        raise ModelLoadError(
            f"model.path={source}: its tokenizer is empty (no tokenizer.json, vocab.json or "
            "tokenizer.model); name a HF model directory with its tokenizer files"
        )
    if local and not any(any(Path(source).glob(p)) for p in WEIGHT_FILES):
        raise ModelLoadError(
            f"model.path={source}: no weight files ({', '.join(WEIGHT_FILES)}); name a HF model "
            "directory with its weights"
        )


def from_pretrained(
    source: str, device: Any, dtype: Any, trust_remote_code: bool, what: str
) -> tuple[Any, Any]:
    """(model, tokenizer) from a HF directory or hub id; any failure is one ModelLoadError line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except Exception as err:  # missing files, no network, unknown id, bad weights
        raise ModelLoadError(f"model.path={source}: {what} ({first_line(err)})") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
