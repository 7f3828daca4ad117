"""`load_checkpoint`: restore a trainer from a checkpoint, checking everything before anything changes.

Order: the manifest (`grpo.state.checkpoint.verify`), the weight files' headers against the live
models (`Restorable.weight_specs`), the state tensors against the sizes the live trainer holds
(optimizer state per parameter, RNG states), the RNG states
(`grpo.state.checkpoint.rng`), then the process-global RNG streams are set and the whole state goes
to ``trainer.load_state_dict`` (`grpo.state.trainer_state`), which checks it against the live
trainer. If that fails, the RNG streams are put back.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.state.checkpoint.codec import Bound, WeightSpecs, read_tree, read_weights
from grpo.state.checkpoint.config_diff import config_differences
from grpo.state.checkpoint.errors import BadField, CheckpointDir, CheckpointError, short
from grpo.state.checkpoint.layout import POLICY_FILE, REFERENCE_FILE, STATE_JSON
from grpo.state.checkpoint.rng import GENERATORS, capture_rng, check_rng, restore_rng, set_rng_state
from grpo.state.checkpoint.tree import tree_field
from grpo.state.checkpoint.verify import resolve_meta


class Restorable(Protocol):
    """What `load_checkpoint` needs of a trainer (`grpo.trainer.GRPOTrainer` has it).

    ``weight_specs``, ``optimizer`` and ``generator`` are read to check tensors before they are
    read; ``reference_policy`` is None when the trainer has none."""

    config: Any

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def generator(self) -> torch.Generator: ...

    @property
    def reference_policy(self) -> Any: ...

    def weight_specs(self, role: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """name -> (shape, dtype) of the live ``policy`` / ``reference_policy`` (``role``), or None
        when the trainer cannot say (no such model, or sharded)."""
        ...

    def load_state_dict(self, state: Any, *, source: str = ...) -> None: ...

    def stateful_components(self) -> dict[str, Any]: ...


def _bounds(trainer: Restorable) -> Bound:
    """The most bytes a tensor at a tree path may have for this trainer (None: the file bounds it).

    Optimizer state of parameter ``i``: 8 bytes per element of parameter ``i`` plus 64 (a float64
    moment, a scalar step); RNG states: the live sizes; a tensor where the trainer keeps none: 0."""
    sizes: list[int] = []
    opt = trainer.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        sizes = [8 * p.numel() + 64 for g in opt.param_groups for p in g["params"]]
    rng_bytes = torch.get_rng_state().numel()
    gen = trainer.generator
    gen_bytes = gen.get_state().numel() if isinstance(gen, torch.Generator) else rng_bytes

    def bound(path: tuple[Any, ...]) -> int | None:
        if path[:2] == ("optimizer", "state") and opt is not None:
            pid = path[2] if len(path) > 2 else None
            if type(pid) is int and 0 <= pid < len(sizes):
                return sizes[pid]
            raise BadField(
                STATE_JSON,
                tree_field(path[:3]),
                f"is state for the parameter {short(pid)}, but the optimizer has the parameters "
                f"0..{len(sizes) - 1}",
            )
        if path == ("rng", "torch"):
            return rng_bytes
        if path == ("rng", "generators", "_generator"):
            return gen_bytes
        if path[:2] == ("rng", "generators") and len(path) > 2:
            raise BadField(
                STATE_JSON,
                tree_field(path[:3]),
                f"is the RNG state of a generator {short(path[2])} that the trainer lacks (it has "
                f"{sorted(GENERATORS)})",
            )
        if path[:2] == ("rng", "cuda"):
            return 1024
        if path[:1] == ("rng",) or path[:2] == ("optimizer", "param_groups"):
            return 0
        return None

    return bound


def _read_state(trainer: Restorable, ckpt: Path, meta: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The trainer state (`grpo.state.trainer_state`) the checkpoint ``ckpt`` holds, and its checked
    RNG states (``tree.rng``); tensors are checked against ``trainer`` before they are read. Raises
    `BadField`."""
    specs: WeightSpecs | None = trainer.weight_specs("policy")
    policy_t = read_weights(ckpt, POLICY_FILE, meta["policy"]["aliases"], specs, "policy")
    ref_t: dict[str, Tensor] | None = None
    if meta["reference"] is not None:
        if trainer.reference_policy is None:
            ref_t = {}  # not read: load_state_dict says that this trainer has no reference
        else:
            specs = trainer.weight_specs("reference_policy")
            ref_t = read_weights(
                ckpt, REFERENCE_FILE, meta["reference"]["aliases"], specs, "reference_policy"
            )
    tree = read_tree(ckpt, meta, _bounds(trainer))
    rng = tree["rng"]
    check_rng(rng)
    scalars = meta["scalars"]
    state = {
        "step_count": scalars["step_count"],
        "non_finite_steps": scalars["non_finite_steps"],
        "policy": policy_t,
        "reference_policy": ref_t,
        "optimizer": tree["optimizer"],
        "scheduler": tree["scheduler"],
        "generator": rng["generators"]["_generator"],
        "components": tree["components"],
    }
    return state, rng


def load_checkpoint(trainer: Restorable, path: str | os.PathLike[str]) -> Path:
    """Restore ``trainer`` from the checkpoint at ``path`` (a root: its newest complete checkpoint,
    skipping newer malformed ones with a warning).

    Everything is checked before anything changes: ``state.json`` against its schema, the tensor
    headers against the live trainer (before any tensor is read), the RNG states, then the whole
    state by ``trainer.load_state_dict`` (`grpo.state.trainer_state`). A problem raises one
    `CheckpointError` naming the file and the field, and leaves the trainer, its policy and the
    process-global RNG streams as they were. The trainer keeps its own config; where the saved one
    differs (compared by the current field names, `grpo.state.checkpoint.config_diff`), a
    `UserWarning` after the load names the fields.
    """
    ckpt, meta = resolve_meta(path)
    try:
        state, rng = _read_state(trainer, ckpt, meta)
    except BadField as e:
        raise e.at(ckpt) from None
    differ = config_differences(meta["config"], trainer.config)
    before = capture_rng()
    try:
        set_rng_state(rng, stacklevel=3)  # checked by check_rng: not expected to fail
    except Exception as e:
        restore_rng(before)
        raise CheckpointError(
            f"{ckpt / STATE_JSON}: tree.rng: cannot be set ({type(e).__name__}: {e})."
        ) from e
    try:
        trainer.load_state_dict(state, source=CheckpointDir(ckpt))
    except BaseException:
        restore_rng(before)
        raise
    if differ.names:
        warnings.warn(differ.warning(ckpt), UserWarning, stacklevel=3)
    return ckpt
