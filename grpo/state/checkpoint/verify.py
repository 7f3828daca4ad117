"""Which checkpoint is complete: the manifest check, and the newest complete checkpoint of a root.

A checkpoint directory is complete when ``state.json`` parses and fits its schema
(`grpo.state.checkpoint.meta`), every file it lists exists with its recorded size, every
safetensors header parses, each alias names a stored tensor, and every ``{"__tensor__": key}`` of
the tree names a tensor ``state.safetensors`` holds. No tensor is read. `find_latest_checkpoint`
scans ``step-*`` directories newest first and skips incomplete ones with a `RuntimeWarning`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from grpo.state.checkpoint.codec import Header, check_aliases, open_tensors
from grpo.state.checkpoint.errors import BadField, CheckpointError, short
from grpo.state.checkpoint.files import list_checkpoints
from grpo.state.checkpoint.layout import POLICY_FILE, REFERENCE_FILE, STATE_FILE, STATE_JSON
from grpo.state.checkpoint.meta import read_meta
from grpo.state.checkpoint.tree import decode, tree_field


def check_complete(path: Path) -> dict[str, Any]:
    """The checked ``state.json`` of the checkpoint at ``path``; raises `BadField` if it is incomplete
    or malformed: schema, file sizes, safetensors headers, tensor references."""
    meta = read_meta(path / STATE_JSON)
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise BadField(name, "", "is missing")
        actual = f.stat().st_size
        if actual != size:
            raise BadField(name, "", f"has {actual} bytes, the manifest says {size}")
    headers: dict[str, Header] = {}
    for name in meta["files"]:
        with open_tensors(path / name) as (_, header):
            headers[name] = header
    check_aliases(meta["policy"]["aliases"], headers[POLICY_FILE], POLICY_FILE, "policy.aliases")
    if meta["reference"] is not None:
        check_aliases(
            meta["reference"]["aliases"], headers[REFERENCE_FILE], REFERENCE_FILE, "reference.aliases"
        )
    state_header, state_aliases = headers[STATE_FILE], meta["state_aliases"]
    check_aliases(state_aliases, state_header, STATE_FILE, "state_aliases")

    def exists(key: str, at: tuple[Any, ...]) -> None:
        if state_aliases.get(key, key) not in state_header:
            raise BadField(
                STATE_JSON,
                tree_field(at),
                f"refers to the tensor {short(key)}, which {STATE_FILE} does not hold",
            )

    decode(meta["tree"], exists)
    return meta


def manifest_problem(path: Path) -> str | None:
    """None if ``path`` is a complete, well-formed grpo checkpoint, else what is wrong with it."""
    try:
        check_complete(path)
    except BadField as e:
        return str(e)
    except OSError as e:
        return f"cannot be read ({e})"
    return None


def newest_complete(root: Path, stacklevel: int) -> tuple[tuple[Path, dict[str, Any]] | None, list[str]]:
    """The newest complete checkpoint under ``root`` with its manifest (or None), and the problems
    of the newer ones skipped (each also a `RuntimeWarning` at ``stacklevel``)."""
    skipped: list[str] = []
    for path in reversed(list_checkpoints(root)):
        try:
            return (path, check_complete(path)), skipped
        except BadField as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot be read ({e})"
        skipped.append(f"{path.name}: {problem}")
        warnings.warn(
            f"skipping the checkpoint {path}: {problem.rstrip('.')}. Looking for an older complete one.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    return None, skipped


def find_latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one), else None.
    Newer ``step-*`` directories that are incomplete or malformed are skipped with a
    `RuntimeWarning` saying what is wrong with each."""
    root = Path(root)
    if (root / STATE_JSON).is_file():
        problem = manifest_problem(root)
        if problem is not None:
            warnings.warn(
                f"{root} is not a complete grpo checkpoint: {problem}", RuntimeWarning, stacklevel=2
            )
        return root if problem is None else None
    found, _ = newest_complete(root, stacklevel=3)
    return None if found is None else found[0]


def resolve_meta(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``path`` names (a checkpoint, or a root: its newest complete one) and its
    checked manifest; `CheckpointError` if there is none."""
    p = Path(path)
    if (p / STATE_JSON).is_file():
        try:
            return p, check_complete(p)
        except (BadField, OSError) as e:
            raise CheckpointError(f"{p} is not a complete grpo checkpoint: {str(e).rstrip('.')}.") from None
    found, skipped = newest_complete(p, stacklevel=5)  # load_checkpoint <- trainer.load_checkpoint <- caller
    if found is None:
        seen = [c.name for c in list_checkpoints(p)]
        why = f"; the newest, {skipped[0]}" if skipped else ""
        raise CheckpointError(
            f"no complete grpo checkpoint in {p} (step directories seen: {seen[-5:]}{why}). Pass the "
            f"directory given to save_checkpoint(), or one of its step-XXXXXXXX subdirectories."
        )
    return found
