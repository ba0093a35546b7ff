"""The model layer's user errors, in a module of their own so that every module of the layer can
raise them without importing another that does more (loading imports lora; lora never imports
loading). The CLI reports them in one line, exit code 2 (launch.jobs, cli)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded; the message is one line naming what was tried."""


class LoraError(ModelLoadError):
    """LoRA cannot be set up as asked, or an adapter checkpoint is unusable; the message is one
    line naming the file or option, the field and what is allowed."""
