"""The filesystem weight transport (`staleness.weights=filesystem`): the trainer writes each new
policy version as a safetensors checkpoint under a directory every generation server can read;
each server reloads it in place (`rollout.vllm_ext.BapoWorkerExtension`).

    ROOT/
      step_00000007/            one version: complete, under its final name
        model.safetensors
        STABLE                  {"version": 7, "tensors": 24, "bytes": 1034240,
                                 "fingerprint": "9f2c..."}
      .tmp-step_00000008-...    being written (never read by a server)

Why a directory per version and a marker (prime-rl's `broadcast/step_N/` + `STABLE`): a server on
another machine sees the shared filesystem with its own caching, so it must never read a
half-written file. A version is written into a temporary sibling, its files flushed (fsync), the
marker written last, and the directory renamed into place in one `os.replace`: a reader either
finds no `step_N` or a complete one. A reader still checks the marker (`open_version`) so a copy
made by other tools (rsync of a half-written tree) is refused instead of loaded.

Old versions are removed by the trainer once every server has loaded a newer one (`cleanup`);
the newest is always kept, for a server that comes back and must catch up.

**Fingerprints** (`fingerprint`, `model_fingerprint`): a digest of every tensor's name, dtype,
shape and first values (the first `SAMPLED` of its first row), so two sets of weights of one
architecture (the tiny model and tiny_pairs) differ, and computing it reads a few bytes per tensor
(a model directory is read through safetensors' slices, never whole). The marker records the
fingerprint of what was written; the server's reload returns the fingerprint of what it read, so a
push that never reached the worker (a proxy answering for it, a stale copy) is caught by the
trainer at once, whatever the probe's tolerance.

This module runs on both sides (the trainer writes, the vLLM worker reads) and so imports neither
the trainer nor vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

MARKER = "STABLE"
WEIGHTS = "model.safetensors"
DELTA = "delta.safetensors"  # a delta version's file (rollout.weights_delta)
SAMPLED = 64  # values of each tensor's first row the fingerprint reads
_STEP = re.compile(r"^step_(\d{8,})$")


class WeightsDirError(ValueError):
    """A weights directory that cannot be written or a version that cannot be read; one line."""


def version_dir(root: Path | str, version: int) -> Path:
    return Path(root) / f"step_{version:08d}"


def check_writable(root: Path | str) -> Path:
    """The weights root, created if missing, after proving a file can be written in it (refused
    in one line before any model is loaded); nothing is left behind."""
    path = Path(root).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise WeightsDirError(
            f"the weights directory {path} is not writable ({reason}); give a directory this "
            "process can write and every server can read"
        ) from None
    return path


def write_version(
    named: Iterable[tuple[str, torch.Tensor]], root: Path | str, version: int
) -> Path:
    """Write one version atomically; returns its final directory. OSError when it cannot be
    written (a full disk: ENOSPC), nothing left behind.

    Tensors are written as they come (`lora.engine_weights` merges adapters lazily), made
    contiguous on the CPU; a name given twice is written once (its first tensor), and two names
    of one tensor (a state dict's tied lm_head) each get a copy."""
    tensors = gather(named)
    marker = {"tensors": len(tensors), "fingerprint": fingerprint(tensors.items())}
    return commit(root, version, WEIGHTS, tensors, marker)


def gather(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`named` as a dict of contiguous CPU tensors, as a version is written (`write_version`)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in named:
        if name in tensors:
            continue
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:  # tied (a state dict's lm_head):
            t = t.clone()  # safetensors refuses tensors sharing memory
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return tensors


def commit(
    root: Path | str, version: int, filename: str, tensors: dict[str, torch.Tensor], marker: dict
) -> Path:
    """`tensors` as `filename` in version `version`'s directory, with `marker` (plus the version
    and the bytes written) as its STABLE, made visible in one rename (module docstring)."""
    root = Path(root)
    final = version_dir(root, version)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        try:
            save_file(tensors, str(tmp / filename), metadata={"version": str(version)})
        except SafetensorError as exc:  # its I/O errors (a full disk) are not OSError
            raise _os_error(exc) from None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        marker = {"version": version, **marker, "bytes": size}
        _write_synced(tmp / filename, None)
        _write_synced(tmp / MARKER, json.dumps(marker).encode())
        if final.exists():  # the same version again (a resumed run): move the old one aside
            os.replace(final, tmp.with_name(tmp.name + "-old"))  # (no server is asked for it)
        os.replace(tmp, final)
        _fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-old"), ignore_errors=True)
    return final


def is_delta(directory: Path | str) -> bool:
    """Whether a complete version holds a delta (`rollout.weights_delta`) rather than every
    tensor; a version whose marker cannot be read counts as full (it is never loaded)."""
    with contextlib.suppress(WeightsDirError):
        return read_marker(directory).get("kind") == "delta"
    return False


def read_marker(directory: Path | str) -> dict:
    """The marker of a complete version; WeightsDirError if it is missing or unreadable."""
    path = Path(directory) / MARKER
    try:
        marker = json.loads(path.read_text())
        int(marker["version"])
    except (OSError, ValueError, KeyError, TypeError):
        raise WeightsDirError(
            f"{directory}: no complete weights version ({MARKER} missing or unreadable)"
        ) from None
    return marker


def open_version(directory: Path | str, version: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a complete version, read lazily (one tensor at a time in memory); a
    WeightsDirError if its marker is missing or names another version."""
    marker = read_marker(directory)
    if int(marker["version"]) != version:
        raise WeightsDirError(
            f"{directory}: holds version {marker['version']}, not the requested {version}"
        )
    return _tensors(Path(directory) / WEIGHTS)


def _tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
            yield name, f.get_tensor(name)


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of a set of weights (module docstring), whatever the order they come in."""
    return _combine((name, tuple(t.shape), _sample(t)) for name, t in named)


def model_fingerprint(source: Path | str) -> str | None:
    """The fingerprint of a model's safetensors files (a directory, or a hub id already in the
    local cache); None when there are none to read (another format, a hub id not downloaded)."""
    directory = Path(source).expanduser()
    if not directory.is_dir():
        try:
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(str(source), local_files_only=True))
        except Exception:  # noqa: BLE001  (not a hub id, or not in the cache: nothing to read)
            return None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None

    def sampled() -> Iterator[tuple[str, tuple[int, ...], torch.Tensor]]:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                    part = f.get_slice(name)
                    shape = tuple(part.get_shape())
                    if not shape:
                        yield name, shape, f.get_tensor(name).reshape(1)
                        continue
                    first = part[(slice(0, 1),) * (len(shape) - 1) + (slice(0, SAMPLED),)]
                    yield name, shape, first.reshape(-1)

    return _combine(sampled())


def _sample(t: torch.Tensor) -> torch.Tensor:
    """The values a fingerprint reads: the first SAMPLED of the first row, flat."""
    t = t.detach()
    first = t.reshape(1) if t.dim() == 0 else t[(0,) * (t.dim() - 1)][:SAMPLED]
    # a copy: numpy must not share the weights' storage (FSDP2 frees and resizes it later)
    return first.to("cpu", copy=True)


def _combine(samples: Iterable[tuple[str, tuple[int, ...], torch.Tensor]]) -> str:
    digests = []
    for name, shape, values in samples:
        h = hashlib.sha256(f"{name}|{values.dtype}|{list(shape)}".encode())
        h.update(values.contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(f"{name}:{h.hexdigest()}")
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()[:16]


def versions(root: Path | str) -> list[int]:
    """The complete versions under `root` (marker present), ascending."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in Path(root).iterdir():
            m = _STEP.match(entry.name)
            if m and (entry / MARKER).is_file():
                found.append(int(m.group(1)))
    return sorted(found)


def cleanup(root: Path | str, keep_from: int) -> list[int]:
    """Remove every complete version older than `keep_from` and any temporary directory a killed
    writer left (not one being written now: those of this process are kept); the removed
    versions. The newest version is never removed, nor the deltas' full version: `keep_from`
    is lowered to the newest full version at or below it (a server that comes back loads that
    full version and the deltas after it, `rollout.weights_delta`)."""
    root = Path(root)
    present = versions(root)
    newest = present[-1] if present else None
    first = min((v for v in present if v >= keep_from), default=newest)
    if first is not None and is_delta(version_dir(root, first)):  # its chain from a full one
        fulls = [v for v in present if v < first and not is_delta(version_dir(root, v))]
        keep_from = min(keep_from, fulls[-1] if fulls else 0)
    removed = []
    for v in present:
        if v < keep_from and v != newest:
            shutil.rmtree(version_dir(root, v), ignore_errors=True)
            removed.append(v)
    with contextlib.suppress(FileNotFoundError):
        for entry in root.iterdir():
            if entry.name.startswith(".tmp-step_") and not _written_by_live(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
    return removed


def remove(root: Path | str, versions: Iterable[int]) -> list[int]:
    """Remove these complete versions (the newest too): a resumed run's versions written after
    its checkpoint by the run that was killed, or a finished run's own. The removed ones."""
    removed = []
    for v in versions:
        path = version_dir(root, v)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(v)
    return removed


def _written_by_live(name: str) -> bool:
    """A temporary directory whose writer (pid in its name) is still running."""
    parts = name.split("-")
    try:
        pid = int(parts[2])  # .tmp-step_N-PID-HEX[-old]
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _os_error(exc: SafetensorError) -> OSError:
    """safetensors' I/O error as the OSError it wraps ("... (os error 28)": ENOSPC)."""
    m = re.search(r"os error (\d+)", str(exc))
    if m is None:
        return OSError(str(exc))
    return OSError(int(m.group(1)), os.strerror(int(m.group(1))))


def _write_synced(path: Path, data: bytes | None) -> None:
    """Write `data` (None: keep the file as it is) and flush it to the disk."""
    mode = "r+b" if data is None else "wb"
    with open(path, mode) as f:
        if data is not None:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
