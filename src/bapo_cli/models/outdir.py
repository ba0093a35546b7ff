"""Where `bapo merge-lora CKPT OUT` writes: checked before any weight loads, written through a
temporary sibling renamed into place, and never deleting what it did not write.

`check` decides, from the file system alone:

- OUT is never a symbolic link (a link is not followed: what it points to is not OUT), never a
  file or anything else that is not a directory, never CKPT, the base model's directory, the
  current directory or a parent of any of them, nor the home directory or a parent of it
  (compared as real paths, so `..`, `.` and links in the parents change nothing).
- A missing OUT is created (parents too); an empty directory is replaced.
- A non-empty OUT is refused unless `force`; with `force` its old contents are not deleted but
  renamed, whole, to the sibling `OUT.replaced-<time>`, and the caller says where.

`write` fills a fresh `.OUT.merge-<pid>-<random>` next to OUT (same file system, so the final
rename is atomic) and renames it to OUT. The only thing it ever deletes is that temporary, after a
failure. A rename onto OUT cannot replace a directory that became non-empty meanwhile (the
kernel refuses), so a race costs an error line, not data.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bapo_cli.models.errors import LoraError


@dataclass(frozen=True)
class Target:
    """A checked OUT: its absolute path as named (links in it not followed), and whether a
    non-empty directory there is to be set aside (`--force`)."""

    path: Path
    set_aside: bool


def check(out: str | Path, *, force: bool, protected: dict[str, Path]) -> Target:
    """OUT as a `Target`, or LoraError (one line) saying why it may not be written.
    `protected` maps a description (`the checkpoint`) to a directory OUT may not be or contain."""
    named = str(out)
    path = Path(os.path.abspath(os.path.expanduser(named)))
    if os.path.islink(path):
        raise LoraError(
            f"{named}: is a symbolic link; merge-lora does not write through links (name a "
            "directory that is not a link)"
        )
    real = path.resolve()
    guarded = {**protected, "the current directory": Path.cwd(), **_home()}
    for what, directory in guarded.items():
        inside = Path(directory).expanduser().resolve()
        if real == inside or real in inside.parents:
            same = "is" if real == inside else "holds"
            raise LoraError(
                f"{named}: {same} {what} ({inside}); merge-lora never replaces it, even with "
                "--force: name a new directory for the merged model"
            )
    if path.exists() and not path.is_dir():
        raise LoraError(
            f"{named}: exists and is not a directory; merge-lora writes a directory and never "
            "replaces a file: name a new directory"
        )
    entries = _entries(path) if path.is_dir() else 0
    if entries:
        if not force:
            held = f"{entries} {'entry' if entries == 1 else 'entries'}"
            raise LoraError(
                f"{named}: exists and is not empty ({held}); name a new or "
                "empty directory, or pass --force to set its contents aside (renamed to "
                f"{path.name}.replaced-<time>, not deleted)"
            )
        return Target(path, set_aside=True)
    _writable_parent(named, path)
    return Target(path, set_aside=False)


def write(target: Target, fill: Callable[[Path], None]) -> Path | None:
    """`fill(tmp)` writes the merged model into a temporary sibling of OUT, which is then renamed
    to OUT; returns where OUT's old contents were set aside (None when there were none)."""
    path = target.path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.merge-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # exclusive: ours alone, so ours to delete
    try:
        fill(tmp)
        aside = _set_aside(path) if target.set_aside else None
        try:
            os.rename(tmp, path)  # replaces at most an empty directory
        except OSError as err:
            if aside is not None:
                os.rename(aside, path)  # put the old contents back under their name
            raise LoraError(
                f"{path}: could not be put in place ({err.strerror}); it changed while merging "
                "and was left as it was"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return aside


def _home() -> dict[str, Path]:
    try:
        return {"your home directory": Path.home()}
    except RuntimeError:  # no HOME and no passwd entry
        return {}


def _set_aside(path: Path) -> Path:
    """Rename the non-empty OUT, whole, to a sibling name that is not taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.replaced-{stamp}")
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    try:
        os.rename(path, aside)
    except OSError as err:  # a mount point, a directory of someone else's, ...
        raise LoraError(
            f"{path}: could not be set aside as {aside.name} ({err.strerror}); it was left as "
            "it was: name a new directory"
        ) from None
    return aside


def _entries(path: Path) -> int:
    with os.scandir(path) as it:
        return sum(1 for _ in it)


def _writable_parent(named: str, path: Path) -> None:
    """The nearest existing parent of OUT is a directory this process may create entries in."""
    parent = path.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise LoraError(f"{named}: {parent} is not a directory; name a directory for the model")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LoraError(f"{named}: {parent} is not writable; name a directory you may write in")
