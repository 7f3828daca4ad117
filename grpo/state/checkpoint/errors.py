"""The errors of a checkpoint, and the short descriptions of values their messages quote.

`CheckpointError` is what callers see: one message naming the file and the field
(``<dir>/state.json: tree.rng.python: is not ...``). Inside the package a problem is first a
`BadField` (file, field, problem, relative to the checkpoint directory); `BadField.at` turns it into
a `CheckpointError` once the directory is known.
"""

from __future__ import annotations

import os
import reprlib
from pathlib import Path

from torch import Tensor


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, malformed, not in grpo's format, or does not fit the
    trainer. The message names the file and the field."""


class CheckpointDir(str):
    """The ``source`` `load_checkpoint` gives ``load_state_dict``: a checkpoint directory, so that
    its errors can name the file holding a field (`in_file`)."""


def in_file(source: str, file: str) -> str:
    """``source/file`` when ``source`` is a `CheckpointDir`, else ``source`` (a state dict)."""
    return os.path.join(source, file) if isinstance(source, CheckpointDir) else source


class BadField(Exception):
    """A problem of one field of one file of a checkpoint (relative: `at` adds the directory)."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(file, field, problem)
        self.file, self.field, self.problem = file, field, problem

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.problem}" if self.field else f"{self.file} {self.problem}"

    def at(self, ckpt: Path) -> CheckpointError:
        where = ckpt / self.file
        msg = f"{where}: {self.field}: {self.problem}" if self.field else f"{where} {self.problem}"
        return CheckpointError(msg if msg.endswith(".") else msg + ".")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 300
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3


def short(v: object, n: int = 60) -> str:
    """``repr(v)`` cut to ``n`` characters, without building the repr of a huge value first."""
    r = _REPR.repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def kind(v: object) -> str:
    """``v``'s type (and a tensor's shape and dtype) for messages."""
    if isinstance(v, Tensor):
        return f"a {str(v.dtype).removeprefix('torch.')} tensor of shape {tuple(v.shape)}"
    return f"{type(v).__name__} {short(v)}"
