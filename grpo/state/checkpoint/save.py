"""`save_checkpoint`: a trainer's state to ``<root>/step-XXXXXXXX/``, atomically.

The state (`grpo.state.trainer_state`: ``step_count``, ``non_finite_steps``, ``policy``,
``reference_policy``, ``optimizer``, ``scheduler``, ``generator``, ``components``) is split into
``policy.safetensors`` and ``reference.safetensors`` (name -> Tensor), ``state.safetensors`` (the
tensors of the optimizer, scheduler, RNG and components trees) and ``state.json`` (everything else,
with the trees' tensors as references; `grpo.state.checkpoint.meta`). The files are written and
fsynced in ``<root>/.tmp-*``, then published (`grpo.state.checkpoint.files`).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo.state.checkpoint.codec import TensorTable, write_tensors
from grpo.state.checkpoint.files import clean_temps, fsync_dir, fsync_file, keep_newest, publish
from grpo.state.checkpoint.layout import (
    FORMAT,
    POLICY_FILE,
    PREFIX,
    REFERENCE_FILE,
    STATE_FILE,
    STATE_JSON,
    TMP_PREFIX,
    VERSION,
)
from grpo.state.checkpoint.rng import rng_state
from grpo.state.checkpoint.tree import encode


def save_checkpoint(
    state: Mapping[str, Any] | Any,
    config: Mapping[str, Any] | str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    keep_last: int | None = None,
) -> Path:
    """Write a trainer's ``state`` (`grpo.state.trainer_state`) and ``config`` (``GRPOConfig.to_dict()``)
    to ``<root>/step-<step_count>/`` atomically with the process-global RNG streams, update
    ``latest``, keep the last K. Returns the path of the new checkpoint. ``keep_last=None`` keeps
    every checkpoint.

    The earlier form ``save_checkpoint(trainer, root)`` still works (deprecated: it calls
    ``trainer.save_checkpoint(root)``)."""
    if not isinstance(state, Mapping):
        warnings.warn(
            "grpo.state.checkpoint.save_checkpoint(trainer, root) is deprecated; call "
            "trainer.save_checkpoint(root), or save_checkpoint(trainer.state_dict(), "
            "trainer.config.to_dict(), root).",
            DeprecationWarning,
            stacklevel=2,
        )
        saved: Path = state.save_checkpoint(config, keep_last=keep_last)
        return saved
    if root is None or not isinstance(config, Mapping):
        raise TypeError("save_checkpoint(state, config, root): give the trainer's config dict and a root.")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_temps(root)
    step = int(state["step_count"])
    name = f"{PREFIX}{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=root))
    _write_files(tmp, state, config, step)
    final = publish(tmp, root, name)
    if keep_last is not None:
        keep_newest(root, keep_last)
    clean_temps(root)
    return final


def _write_files(directory: Path, state: Mapping[str, Any], config: Mapping[str, Any], step: int) -> None:
    """Write the files of a checkpoint of ``state`` at ``step`` into ``directory`` and fsync them."""
    files: dict[str, int] = {}
    policy_aliases = _write_weights(directory, POLICY_FILE, state["policy"], files)
    ref_aliases: dict[str, str] | None = None
    if state["reference_policy"] is not None:
        ref_aliases = _write_weights(directory, REFERENCE_FILE, state["reference_policy"], files)

    table = TensorTable()
    rest = {
        "optimizer": state["optimizer"],
        "scheduler": state["scheduler"],
        "rng": {**rng_state(), "generators": {"_generator": state["generator"]}},
        "components": state["components"],
    }
    tree = encode(rest, table.add, "state")
    write_tensors(directory / STATE_FILE, table)
    files[STATE_FILE] = (directory / STATE_FILE).stat().st_size

    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "torch_version": torch.__version__,
        "config": encode(dict(config), TensorTable().add, "config"),
        "scalars": {"step_count": step, "non_finite_steps": int(state["non_finite_steps"])},
        "policy": {"aliases": policy_aliases},
        "reference": None if ref_aliases is None else {"aliases": ref_aliases},
        "state_aliases": table.aliases,
        "tree": tree,
        "files": files,
    }
    (directory / STATE_JSON).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    fsync_file(directory / STATE_JSON)
    fsync_dir(directory)


def _write_weights(
    directory: Path, file: str, tensors: Mapping[str, Tensor], files: dict[str, int]
) -> dict[str, str]:
    """Write ``tensors`` (name -> Tensor) to ``directory/file``, record its size in ``files``, and
    return the aliases of tied tensors (name -> stored name)."""
    table = TensorTable()
    for k, v in tensors.items():
        table.add(k, v)
    write_tensors(directory / file, table)
    files[file] = (directory / file).stat().st_size
    return table.aliases
