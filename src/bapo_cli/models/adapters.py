"""LoRA adapter checkpoints, checked before any of their weights is used.

An adapter directory is two files that anyone can write: `adapter_config.json` (rank, alpha,
base model, ...) and `adapter_model.safetensors` (the A and B matrices). PEFT trusts both: a
rank of 1e14 makes it allocate 512 TB, a base that names the adapter itself made loading recurse
until Python gave up, a header that lies about a tensor's shape fails deep inside. So `read`
checks them first, with plain file reads (no torch, no PEFT, no weights), and every problem is
one `LoraError` line naming the file and the field:

- `adapter_config.json`: a regular file of at most `MAX_CONFIG_BYTES`, valid JSON (no NaN or
  Infinity), an object; `peft_type` LORA; `r` and every `rank_pattern` value a whole number in
  [1, MAX_RANK]; `lora_alpha` and every `alpha_pattern` value finite in (0, MAX_ALPHA];
  `lora_dropout` in [0, 1); `init_lora_weights` one that leaves the base weights alone;
  `layer_replication` absent (it copies base layers, and this tool never writes one).
- `adapter_model.safetensors`: a regular file whose header is at most `MAX_HEADER_BYTES`, valid
  JSON, and whose tensors have known dtypes, non-negative shapes and byte ranges that match their
  shapes and lie inside the file; every LoRA A/B tensor has a rank the config allows. A pickled
  `adapter_model.bin` alone is refused (safetensors holds data only).
- `base_model_name_or_path` (or `--base`) is resolved once, by `base_source`: a plain HF model
  directory (config.json) or a hub id. It may not name the adapter itself nor another adapter
  directory, so a chain, and with it a cycle, never starts.

The bounds are config's (`MAX_LORA_RANK`, `MAX_LORA_ALPHA` in config.schema.model, a layer below
models) and hold for `model.lora.*` at config check, so a run cannot write an adapter that this
module would refuse. Why these bounds: an adapter of rank r on a d x d layer has 2rd parameters,
as many as the layer itself at r = d/2; 4,096 is that point for a 70B model (hidden size 8,192),
far above what LoRA is used at (8-256), and a wider adapter is no longer low-rank (the meta-device
check in models.lora also caps the rank at the model's hidden size). `alpha` scales the update by
alpha / rank and is usually rank or 2 x rank: 4 x MAX_RANK leaves room while keeping the scale far
from what overflows sampling (alpha=1e308 gave `inf` probabilities).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo_cli.config.schema.model import MAX_LORA_ALPHA as MAX_ALPHA
from bapo_cli.config.schema.model import MAX_LORA_RANK as MAX_RANK
from bapo_cli.models.errors import LoraError
from bapo_cli.models.pretrained import HUB_ID, looks_local

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes ~2 KB
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
# PEFT's initialisations that leave the base weights as they are (pissa, olora, corda, loftq, eva
# rewrite them or need data, at every load)
PLAIN_INITS = (True, False, "gaussian")
# bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
HIDDEN = object()  # a value too long to quote in an error line


@dataclass(frozen=True)
class Adapter:
    """A checked adapter directory: what `read` found in its two files."""

    directory: Path
    rank: int
    alpha: float
    base: str | None  # base_model_name_or_path as written
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)


def is_adapter_dir(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def is_adapter_only(directory: str | Path) -> bool:
    """An adapter checkpoint (adapter config, no model config.json): its base comes from
    elsewhere. A directory with both is a plain model that also carries an adapter's config."""
    directory = Path(directory)
    return is_adapter_dir(directory) and not (directory / "config.json").exists()


def read(directory: str | Path) -> Adapter:
    """The adapter in `directory`, checked as the module docstring says; LoraError otherwise."""
    directory = Path(directory).expanduser()
    config = _config(directory / ADAPTER_CONFIG)
    rank, alpha, ranks = _sizes(directory / ADAPTER_CONFIG, config)
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        _fail(directory / ADAPTER_CONFIG, "base_model_name_or_path", base, "must be a string")
    tensors = _tensors(directory, ranks)
    return Adapter(directory, rank, alpha, base or None, tensors)


def base_source(adapter: Adapter, override: str | None = None) -> Path | str:
    """The base model the adapter goes on, resolved once: a plain HF model directory (its real
    path) or a hub id. `override` is `--base`. Never the adapter itself nor another adapter."""
    config_file = adapter.directory / ADAPTER_CONFIG
    if override:
        where, source = "--base", str(override)
    elif adapter.base:
        where, source = f"{config_file}: base_model_name_or_path", adapter.base
    else:
        raise LoraError(
            f"{config_file}: base_model_name_or_path is missing; pass the base model with --base "
            "(a HF model directory or hub id)"
        )
    local = Path(source).expanduser()
    if not (local.exists() or looks_local(source)):
        if not HUB_ID.fullmatch(source):
            raise LoraError(
                f"{where}={source!r}: neither a local directory nor a HF hub id; name a HF model "
                "directory (config.json) or a hub id such as org/name"
            )
        return source
    if not local.is_dir():
        raise LoraError(f"{where}={source}: no such directory; name the base model's directory")
    real = local.resolve()
    if real == adapter.directory.resolve():
        raise LoraError(
            f"{where}={source}: names the adapter's own directory; the base is the model the "
            "adapter was trained on (a HF model directory or hub id)"
        )
    if is_adapter_only(real):
        raise LoraError(
            f"{where}={source}: is itself a LoRA adapter, not a base model (a base is resolved "
            f"once, never through another adapter); merge that one first (bapo merge-lora {real} "
            "MERGED) and pass --base MERGED"
        )
    if not (real / "config.json").is_file():
        raise LoraError(
            f"{where}={source}: not a HF model directory (no config.json); name the base model's "
            "directory or its hub id"
        )
    return real


# ----------------------------------------------------------------------------- adapter_config


def _config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LoraError(f"{path.parent}: not a LoRA checkpoint (no regular file {path.name})")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise LoraError(f"{path}: {size} bytes; an adapter config is at most {MAX_CONFIG_BYTES}")
    try:
        with path.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1).decode("utf-8")
        config = json.loads(text, parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        why = _one_line(err)
        raise LoraError(f"{path}: not valid JSON ({why}); a PEFT adapter config") from None
    if not isinstance(config, dict):
        raise LoraError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _sizes(path: Path, config: dict[str, Any]) -> tuple[int, float, set[int]]:
    """(r, lora_alpha, every rank a tensor may have), each in bounds."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        _fail(path, "peft_type", peft_type, "must be LORA (only LoRA adapters are loaded)")
    rank = config.get("r", 8)  # PEFT's defaults
    alpha = config.get("lora_alpha", 8)
    _rank(path, "r", rank)
    _alpha(path, "lora_alpha", alpha)
    ranks = {rank}
    for field, check in (("rank_pattern", _rank), ("alpha_pattern", _alpha)):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            _fail(path, field, pattern, "must be an object of module name -> value")
        for name, value in pattern.items():
            check(path, f"{field}[{name!r}]", value)
            if field == "rank_pattern":
                ranks.add(value)
    dropout = config.get("lora_dropout", 0.0)
    if not _finite(dropout) or not 0 <= dropout < 1:
        _fail(path, "lora_dropout", dropout, "must be a number in [0, 1)")
    init = config.get("init_lora_weights", True)
    if not any(init is p or (isinstance(p, str) and init == p) for p in PLAIN_INITS):
        _fail(
            path,
            "init_lora_weights",
            init,
            "must be true, false or gaussian (others rewrite the base weights when loaded)",
        )
    if config.get("layer_replication"):
        _fail(path, "layer_replication", HIDDEN, "must be null (it copies base layers)")
    return rank, float(alpha), ranks


def _rank(path: Path, field: str, value: Any) -> None:
    if not _whole(value) or not 1 <= value <= MAX_RANK:
        _fail(path, field, value, f"must be a whole number in [1, {MAX_RANK}]")


def _alpha(path: Path, field: str, value: Any) -> None:
    if not _finite(value) or not 0 < value <= MAX_ALPHA:
        _fail(path, field, value, f"must be a finite number in (0, {MAX_ALPHA:g}]")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------- safetensors


def _tensors(directory: Path, ranks: set[int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) from the weights file's header, every entry checked."""
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        if (directory / PICKLED_WEIGHTS).exists():
            raise LoraError(
                f"{directory / PICKLED_WEIGHTS}: a pickled adapter; only {ADAPTER_WEIGHTS} is "
                "loaded (convert it: PeftModel.save_pretrained(..., safe_serialization=True))"
            )
        raise LoraError(f"{directory}: no regular file {ADAPTER_WEIGHTS} (the adapter's weights)")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length).decode("utf-8"), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise LoraError(f"{path}: not a safetensors file ({_one_line(err)})") from None
    if not isinstance(header, dict):
        raise LoraError(f"{path}: not a safetensors file (its header is not a JSON object)")
    room = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = _entry(path, name, entry, room)
        _rank_of(path, name, shape, ranks)
        tensors[name] = (dtype, shape)
    if not tensors:
        raise LoraError(f"{path}: holds no tensors; an adapter holds its A and B matrices")
    return tensors


def _entry(path: Path, name: str, entry: Any, room: int) -> tuple[str, tuple[int, ...]]:
    if not isinstance(entry, dict):
        _fail(path, name, HIDDEN, "must be a tensor entry (dtype, shape, data_offsets)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        _fail(path, f"{name}.dtype", dtype, f"must be one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_whole(n) and n >= 0 for n in shape):
        _fail(path, f"{name}.shape", shape, "must be a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_whole(n) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= room
        or offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]
    ):
        _fail(
            path,
            f"{name}.data_offsets",
            offsets,
            f"must span the {math.prod(shape) * DTYPE_BYTES[dtype]} bytes of its shape, inside "
            "the file",
        )
    return dtype, tuple(shape)


def _rank_of(path: Path, name: str, shape: tuple[int, ...], ranks: set[int]) -> None:
    """A's first and B's second dimension is the adapter's rank (embedding adapters alike)."""
    parts = name.split(".")
    if "lora_A" in parts or "lora_embedding_A" in parts:
        axis = 0
    elif "lora_B" in parts or "lora_embedding_B" in parts:
        axis = 1
    else:
        return
    if len(shape) < 2 or shape[axis] not in ranks:
        allowed = ", ".join(str(r) for r in sorted(ranks))
        _fail(
            path,
            f"{name}.shape",
            list(shape),
            f"must have the adapter's rank ({allowed}, from {ADAPTER_CONFIG}) in dimension {axis}",
        )


# ---------------------------------------------------------------------------------- helpers


def _fail(path: Path, field: str, value: Any, allowed: str) -> None:
    """One line naming the file, the field, the value found (HIDDEN: not shown) and the rule."""
    if value is HIDDEN:
        raise LoraError(f"{path}: {field}: {allowed}")
    shown = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise LoraError(f"{path}: {field}={shown}: {allowed}")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] if text else type(err).__name__
