"""Checkpoint directories on disk: atomic publication, the ``latest`` pointer, keep-last-K, listing.

A save writes into a temporary directory ``<root>/.tmp-*`` (files fsynced), `publish` renames it
to ``<root>/step-XXXXXXXX`` in one ``os.replace`` and only then replaces ``<root>/latest`` (a text
file holding the directory's name, ``step-XXXXXXXX\\n``), again atomically. `keep_newest` renames
older checkpoints to ``.tmp-*`` before deleting them, so that a half-deleted checkpoint never
carries a ``step-*`` name; `clean_temps` removes the ``.tmp-*`` leftovers of a crashed save.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from grpo.state.checkpoint.layout import LATEST, PREFIX, TMP_PREFIX


def fsync_file(path: Path) -> None:
    """Flush ``path``'s contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk, where the filesystem can."""
    with contextlib.suppress(OSError):  # some filesystems cannot fsync directories
        fsync_file(path)


def step_of(path: Path) -> int | None:
    """The step of a ``step-XXXXXXXX`` directory's name, else None."""
    name = path.name
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX) :])
    except ValueError:
        return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """``step-*`` directories under ``root``, oldest first (complete or not; see
    `find_latest_checkpoint`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def clean_temps(root: Path) -> None:
    """Remove every ``.tmp-*`` file and directory directly under ``root``."""
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def publish(tmp: Path, root: Path, name: str) -> Path:
    """Rename the complete checkpoint ``tmp`` to ``root/name`` (moving aside one already there),
    then point ``root/latest`` at it. Returns ``root/name``."""
    final = root / name
    if final.exists():  # the same step saved again: move the old one out of the way first
        old = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-", dir=root))
        os.replace(final, old / name)
    os.replace(tmp, final)
    fsync_dir(root)

    pointer = root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    pointer.write_text(name + "\n", encoding="utf-8")
    fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    return final


def keep_newest(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints under ``root`` (each renamed to
    ``.tmp-del-*`` first)."""
    for stale in list_checkpoints(root)[:-keep_last]:
        trash = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}del-", dir=root))
        os.replace(stale, trash / stale.name)
        shutil.rmtree(trash, ignore_errors=True)
