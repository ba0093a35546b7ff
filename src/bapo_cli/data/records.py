"""Rows of text fields from a local file or a HF dataset, shared by prompt sets and benchmarks.

`load_records(path=..., hf_id=..., split=..., fields={"problem": "question", ...})` reads local
.jsonl / .json / .parquet / .csv files, or (only when no path is given) a HF dataset by id, and maps
each row to the canonical names in `fields` (canonical name -> column name). Every value is kept
as a string: ints and integral floats are converted, anything else (null, lists, dicts, NaN,
blank strings) makes the row unusable.

Bad input never stops a run that still has usable rows: rows lacking a field or holding an
unusable value -- and unparsable .jsonl lines -- are skipped, counted per reason and reported in
one warning. A .jsonl file is decoded line by line, so an invalid UTF-8 byte costs its line, not
the file; the warning names the line numbers of the .jsonl lines it skipped. Only when no row is
usable, or the file / dataset cannot be read at all, does `DataError` (a ValueError) say so in one
line naming the source and the fields looked for.

The canonical field `id` is optional: when it is not configured, or a row lacks it, the row's
index in the source (0-based) is its id.

A path `shipped:<name>` (e.g. `shipped:aime24`) reads a benchmark that ships with the package
(`shipped`): the presets in conf/benchmark use them, so evaluation works offline.

`format` picks how a row is read (`formats`): plain fields as above, or a chat prompt -- verl's
parquet rows or OpenAI-style `messages` -- whose row gets `messages` (a tuple of {role, content})
next to `problem` (its last user message) and `answer`. `auto` looks at the first row.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bapo_cli.data import formats, shipped

log = logging.getLogger(__name__)

ID_FIELD = "id"
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(ValueError):
    """Prompt or benchmark data that cannot be used; the message is one line."""


@dataclass
class Records:
    """Usable rows (canonical field -> string) and what was skipped, per reason."""

    rows: list[dict[str, str]]
    skipped: int
    source: str
    reasons: Counter[str] = field(default_factory=Counter)
    lines: dict[str, list[int]] = field(default_factory=dict)
    """Where the skipped rows were, per reason: 1-based .jsonl line numbers, else row numbers."""
    originals: list[dict[str, Any]] = field(default_factory=list)
    """The source row of each usable row, as plain JSON data (reward=python's record)."""
    format: str = "plain"
    """How the rows were read: plain, verl or messages (`formats`)."""

    def __len__(self) -> int:
        return len(self.rows)


def load_records(
    *,
    path: str | Path | None,
    hf_id: str | None,
    split: str,
    fields: Mapping[str, str],
    config_name: str | None = None,
    format: str = "plain",
) -> Records:
    """Read rows from `path` (wins) or the HF dataset `hf_id` and keep those with every field.

    `fields` maps canonical names to column names, e.g.
    {"id": "unique_id", "problem": "problem", "answer": "answer"}; every field but `id` is required
    in the plain format (verl / messages rows use `answer` as the messages format's answer column).
    """
    if format not in formats.FORMATS:
        raise DataError(f"data.format={format}: must be one of {', '.join(formats.FORMATS)}")
    unit = "row"
    if path is not None and str(path):
        source = str(path)
        file = _local_file(path)
        raw = _read_file(file, split)
        unit = "line" if file.suffix.lower() == ".jsonl" else "row"
    elif hf_id:
        source = f"{hf_id} (split {split})"
        raw = _read_hub(hf_id, split, config_name)
    else:
        raise DataError("no data source: set a local path or a HF dataset id")
    if format == "auto":
        format = formats.detect([r.row if isinstance(r, _Line) else r for r in raw])
    return _select(raw, fields, source, format, unit)


# ------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _BadLine:
    """A .jsonl line that gives no row: its 1-based number and why (the reason counted)."""

    number: int
    reason: str


@dataclass(frozen=True)
class _Line:
    """A .jsonl row with its 1-based line number (blank lines do not count as rows)."""

    number: int
    row: Any


def _local_file(path: str | Path) -> Path:
    """The file a data path names: `shipped:<name>` is a benchmark shipped with the package."""
    if shipped.is_shipped(path):
        try:
            return shipped.path_of(path)
        except KeyError as err:
            raise DataError(err.args[0]) from None
    return Path(path).expanduser()


def _read_file(path: Path, split: str) -> list[Any]:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give a {'/'.join(SUFFIXES)} file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix!r}; use {', '.join(SUFFIXES)}")
    try:
        if suffix == ".jsonl":
            return list(_jsonl_rows(path))
        if suffix == ".json":
            return _json_rows(path, split)
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                return list(csv.DictReader(f))
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: cannot read ({_first_line(err)})") from None
    except Exception as err:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path}: cannot read ({type(err).__name__}: {_first_line(err)})") from None


def _jsonl_rows(path: Path) -> Iterable[Any]:
    """One row per non-blank line, or a `_BadLine`: each line is decoded on its own."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield _BadLine(number, "invalid UTF-8")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield _BadLine(number, "unparsable row")
                continue
            yield (
                _Line(number, row)
                if isinstance(row, Mapping)
                else _BadLine(number, "unparsable row")
            )


def _json_rows(path: Path, split: str) -> list[Any]:
    """A list of objects, {split|"data"|"rows": [...]}, or columns {name: [values, ...]}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for key in (split, "data", "rows"):
            if isinstance(data.get(key), list):
                return data[key]
        columns = [v for v in data.values() if isinstance(v, list)]
        if columns and len(columns) == len(data) and len({len(c) for c in columns}) == 1:
            names = list(data)
            return [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]
    raise DataError(
        f"{path}: expected a list of objects, {{{split!r}: [...]}} or columns of equal length"
    )


def _read_hub(hf_id: str, split: str, config_name: str | None) -> list[Any]:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is a dependency
        raise DataError(f"{hf_id}: loading a HF dataset needs `datasets` ({err})") from None
    what = f"{hf_id}" + (f" (config {config_name})" if config_name else "")
    try:
        dataset = datasets.load_dataset(hf_id, config_name, split=split)
    except Exception as err:  # offline, unknown id, unknown split: all end the same way
        raise DataError(
            f"HF dataset {what}, split {split!r}: could not be loaded ({_first_line(err)}); "
            "with no network, download it elsewhere and pass a local file as the path"
        ) from None
    return list(dataset)


# ----------------------------------------------------------------------------------- selection


def _as_text(value: Any) -> str | None:
    """The value as a non-blank string, or None when it cannot be one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    return None


def _select(
    raw: list[Any], fields: Mapping[str, str], source: str, fmt: str = "plain", unit: str = "row"
) -> Records:
    required = {name: column for name, column in fields.items() if name != ID_FIELD}
    id_column = fields.get(ID_FIELD)
    rows: list[dict[str, Any]] = []
    originals: list[dict[str, Any]] = []
    reasons: Counter[str] = Counter()
    lines: dict[str, list[int]] = {}

    def skip(reason: str, number: int) -> None:
        reasons[reason] += 1
        lines.setdefault(reason, []).append(number)

    for index, item in enumerate(raw):
        number = index + 1
        if isinstance(item, _Line):
            number, item = item.number, item.row
        if isinstance(item, _BadLine):
            skip(item.reason, item.number)
            continue
        if not isinstance(item, Mapping):
            skip("unparsable row", number)
            continue
        try:
            row = _plain_row(item, required) if fmt == "plain" else _chat_row(item, fmt, required)
        except formats.RowError as err:
            skip(str(err), number)
            continue
        ident = _as_text(item.get(id_column)) if id_column else None
        if ident is None and fmt == "verl":  # verl keeps the source's index in extra_info
            extra = item.get("extra_info")
            ident = _as_text(extra.get("index")) if isinstance(extra, Mapping) else None
        rows.append({ID_FIELD: ident if ident is not None else str(index), **row})
        originals.append(json_data(item))
    skipped = sum(reasons.values())
    looked_for = (
        ", ".join(f"{name}={column!r}" for name, column in fields.items())
        if fmt == "plain"
        else f"{fmt} format: {_CHAT_NEEDS[fmt]}"
    )
    if not rows:
        found = _columns_seen(raw)
        common = reasons.most_common(1)
        raise DataError(
            f"{source}: no usable rows among {len(raw)} (looked for {looked_for}"
            + (f"; columns found: {', '.join(found)}" if found else "")
            + (f"; most rows: {common[0][0]}" if common and fmt != "plain" else "")
            + ")"
        )
    if skipped:
        detail = ", ".join(
            f"{reason}: {count}{_where(lines.get(reason), unit)}"
            for reason, count in sorted(reasons.items())
        )
        log.warning(
            "%s: skipped %d of %d rows (%s%s)",
            source,
            skipped,
            len(raw),
            detail,
            "" if fmt == "plain" else f"; {fmt} format: {_CHAT_NEEDS[fmt]}",
        )
    return Records(rows, skipped, source, reasons, lines, originals, fmt)


_CHAT_NEEDS = {
    "verl": f"'prompt' as {formats.MESSAGE_SHAPE} and 'reward_model.ground_truth'",
    "messages": f"'messages' as {formats.MESSAGE_SHAPE} and a reference",
}


def _plain_row(item: Mapping[str, Any], required: Mapping[str, str]) -> dict[str, str]:
    row: dict[str, str] = {}
    for name, column in required.items():
        if column not in item:
            raise formats.RowError(f"missing {column!r}")
        text = _as_text(item[column])
        if text is None:
            raise formats.RowError(f"unusable {column!r}")
        row[name] = text
    return row


def _chat_row(item: Mapping[str, Any], fmt: str, required: Mapping[str, str]) -> dict[str, Any]:
    if fmt == "verl":
        messages, answer = formats.verl_row(item)
    else:
        messages, answer = formats.messages_row(item, required.get("answer", "answer"))
    text = _as_text(answer)
    if text is None:
        raise formats.RowError(f"unusable reference {answer!r:.40} ({fmt} format)")
    return {"problem": formats.question_of(messages), "answer": text, "messages": messages}


def _where(numbers: list[int] | None, unit: str = "line", shown: int = 5) -> str:
    """` (line 3)`, ` (rows 3, 8, ...)` or nothing."""
    if not numbers:
        return ""
    listed = ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")
    return f" ({unit}{'s' if len(numbers) > 1 else ''} {listed})"


def _columns_seen(raw: list[Any]) -> list[str]:
    for item in raw:
        item = item.row if isinstance(item, _Line) else item
        if isinstance(item, Mapping):
            return [str(k) for k in item]
    return []


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def json_data(row: Mapping[str, Any]) -> dict[str, Any]:
    """A source row as plain JSON data: dates, bytes and other objects become strings."""
    return json.loads(json.dumps(dict(row), default=str))
