"""One-line config errors: ours, and Hydra's/OmegaConf's translated into the same shape.

Every rejected config reaches the user as a single line `error: <key>...: <what is allowed>` with
exit code 2 and no traceback (set HYDRA_FULL_ERROR=1 to see one).
"""

from __future__ import annotations

import re
from typing import Any

USAGE_EXIT_CODE = 2


class ConfigError(ValueError):
    """A config value that is not allowed. `key` is the dotted path, filled in from the top."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        self.key, self.value, self.message = key, value, message
        super().__init__(self.line())

    def under(self, prefix: str) -> ConfigError:
        """The same error, its key prefixed with the enclosing section (e.g. `algo.`)."""
        if not prefix or self.key.startswith(prefix + "."):
            return self
        return ConfigError(f"{prefix}.{self.key}", self.value, self.message)

    def line(self) -> str:
        if self.value is None:
            return f"{self.key}: {self.message}"
        return f"{self.key}={_show(self.value)}: {self.message}"


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value if value and " " not in value else repr(value)
    return str(value)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def explain(exc: BaseException) -> str:
    """A one-line explanation of a composition failure from Hydra or OmegaConf."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, ConfigError):
        return exc.line()
    # Hydra wraps OmegaConf's errors; the cause holds the key and the type problem.
    chain: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in chain:
        chain.append(node)
        node = node.__cause__ or node.__context__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            return _explain_omegaconf(err)
    text = str(exc)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing:
        return f"{missing.group(1)}={missing.group(2)}: no such option"
    could_not = re.search(r"Could not override '([^']+)'", text)
    if could_not:
        detail = _first_line(text.split("\n", 1)[1]) if "\n" in text else ""
        return f"{could_not.group(1)}: cannot override ({detail or 'unknown key'})"
    return _first_line(text)


def _explain_omegaconf(err: Any) -> str:
    key = err.full_key
    msg = _first_line(getattr(err, "msg", "") or str(err))
    not_in = re.search(r"Key '([^']+)' not in '([^']+)'", msg)
    if not_in or "not in struct" in msg:
        return unknown_key(key, getattr(err, "object_type", None)).line()
    converted = re.search(r"Value '(.*)' of type '([^']+)' could not be converted to (\w+)", msg)
    if converted:
        value, _, target = converted.groups()
        return f"{key}={value}: must be {_type_word(target)}"
    incompatible = re.search(
        r"Value '(.*)' \((\w+)\) is incompatible with type hint '([^']+)'", msg
    )
    if incompatible:
        value, _, hint = incompatible.groups()
        return f"{key}={value}: must be {_type_word(hint)}"
    not_bool = re.search(r"Value '(.*)' is not a valid bool", msg)
    if not_bool:
        return f"{key}={not_bool.group(1)}: must be true or false"
    if "Non optional field cannot be assigned None" in msg:
        return f"{key}=null: this option cannot be null"
    if "Missing mandatory value" in msg:
        return f"{key}: missing value (set {key}=...)"
    return f"{key}: {msg}"


def _staleness_hint(value: str) -> str:
    if not value.isdigit():
        return ""
    hint = f"; to set k itself: staleness.k={value}"
    if int(value) > 1:  # reuse, the presets' regime, splits a batch into k mini-batches
        hint += f" (reuse also needs trainer.prompts_per_step to be a multiple of {value})"
    return hint


OPTION_HINTS = {"staleness": _staleness_hint}
"""Per config group: what an unknown option probably meant (`staleness=3` is a k with no preset
file of its own, `staleness.k=3` sets it), appended to the `unknown option` line."""


def unknown_option(group: str, value: Any, valid: list[str]) -> str:
    """`staleness=3: unknown option; valid: 0, 1, 2, 4, 8; for k=3 ... staleness.k=3`."""
    hint = OPTION_HINTS.get(group)
    return f"{group}={value}: unknown option; valid: {', '.join(valid)}" + (
        hint(str(value)) if hint else ""
    )


def unknown_key(key: str, schema: Any) -> ConfigError:
    """`trainer.max_stepz: unknown key in trainer; valid keys: max_steps, ...` (the valid keys
    when the schema dataclass of the enclosing node is known)."""
    import dataclasses

    parent = key.rsplit(".", 1)[0] if "." in key else ""
    message = "unknown key" + (f" in {parent}" if parent else "")
    if schema is not None and dataclasses.is_dataclass(schema):
        message += "; valid keys: " + ", ".join(f.name for f in dataclasses.fields(schema))
    return ConfigError(key, None, message)


def _type_word(name: str) -> str:
    words = {
        "Float": "a number",
        "float": "a number",
        "Integer": "an integer",
        "int": "an integer",
        "Boolean": "true or false",
        "bool": "true or false",
        "String": "a string",
        "str": "a string",
    }
    for raw, word in words.items():
        if name.startswith(raw):
            return word
    return f"of type {name}"
