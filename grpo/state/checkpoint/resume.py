"""The saved ``GRPOConfig`` of a checkpoint, and the config `GRPOTrainer.from_checkpoint` builds with.

``state.json``'s ``config`` is plain values (checked by `grpo.state.checkpoint.meta`). A checkpoint
is untrusted input, so `resume_config` refuses a config whose path-valued field (`PATH_FIELDS`)
holds a path, and a saved device this machine lacks unless the caller names another.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from grpo.state.checkpoint.errors import CheckpointError, short
from grpo.state.checkpoint.layout import STATE_JSON
from grpo.state.checkpoint.verify import resolve_meta

PATH_FIELDS: dict[str, tuple[str, ...]] = {"deepspeed": ("auto", "off")}
"""GRPOConfig fields whose other values are file paths, with the values that are not paths.
`resume_config` refuses a checkpoint whose config holds a path in one of them."""


def read_checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``GRPOConfig`` fields stored in the newest complete checkpoint at ``path`` (plain
    values, checked to be numbers, strings, booleans or null; nothing in them is opened)."""
    return dict(resolve_meta(path)[1]["config"])


def _device_problem(device: object) -> str | None:
    """Why this machine cannot run a trainer on ``device`` (a saved config's), or None."""
    if not isinstance(device, str):
        return None  # GRPOConfig says what is wrong
    if device == "cuda" or device.startswith("cuda:"):
        index = device[5:] or "0"
        if not (index.isdigit() and len(index) < 6):
            return "is not a device name"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index) >= count:
            return f"names a CUDA device, but this machine has {count}"
    if device == "mps" and not torch.backends.mps.is_available():
        return "names Apple's MPS device, which this machine lacks"
    return None


def resume_config(path: str | os.PathLike[str], *, device: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `GRPOTrainer.from_checkpoint` loads (``path`` or its newest complete one) and
    the ``GRPOConfig`` fields to build its trainer with.

    A checkpoint is untrusted input, so no path written in it is opened: a config whose
    path-valued field (`PATH_FIELDS`: ``deepspeed``) holds anything but its non-path values
    (``'auto'``, ``'off'``) is refused with `CheckpointError` naming the field. Checkpoints are
    never saved under DeepSpeed, so a genuine one holds no such path. ``device`` replaces the
    saved ``device`` (load a CUDA run's checkpoint on a CPU machine with ``device='cpu'``);
    without it a saved device this machine lacks is refused, naming the override.
    """
    ckpt, meta = resolve_meta(path)
    cfg = dict(meta["config"])
    where = ckpt / STATE_JSON
    for name, plain in PATH_FIELDS.items():
        if name in cfg and cfg[name] not in plain:
            raise CheckpointError(
                f"{where}: config.{name}={short(cfg[name], 300)}: any value but {list(plain)} is the path "
                f"of a file to read, and from_checkpoint never opens a path written in a checkpoint (a "
                f"checkpoint is untrusted input; one saved by grpo never holds a path here, since "
                f"checkpoints are not saved under DeepSpeed). If you trust it, build the trainer yourself "
                f"(GRPOConfig.from_dict(read_checkpoint_config(path))) and call load_checkpoint(path)."
            )
    if device is not None:
        cfg["device"] = device
    else:
        problem = _device_problem(cfg.get("device"))
        if problem is not None:
            raise CheckpointError(
                f"{where}: config.device={short(cfg.get('device'))}: {problem}. Pass "
                f"from_checkpoint(..., device='cpu') (or another device this machine has) to load it here."
            )
    return ckpt, cfg
