"""The policy hook: the tensors that define a policy, and restoring them.

An ``nn.Module`` (or any object with ``state_dict()`` / ``load_state_dict()``) saves its
``state_dict()``. Other policies save the tensors of ``get_parameters()`` (a mapping name -> Tensor,
or an iterable: names ``"0"``, ``"1"``...), restored by copying in place (``tensor.copy_``) so that an
optimizer holding them stays valid. Either way a policy's state is a flat mapping name -> Tensor,
stored in ``policy.safetensors`` (``reference.safetensors`` for the reference policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo.state.checkpoint.errors import CheckpointError


def _has_state_dict(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def policy_state(policy: object, role: str = "policy") -> dict[str, Tensor]:
    """The tensors that define ``policy``: ``state_dict()`` if it has the pair of methods, else
    ``get_parameters()`` (keys = names of a mapping, or ``"0"``, ``"1"``... for an iterable)."""
    if _has_state_dict(policy):
        raw: Any = policy.state_dict()  # type: ignore[attr-defined]
        where = f"{type(policy).__name__}.state_dict()"
    else:
        raw = policy.get_parameters()  # type: ignore[attr-defined]
        where = f"{type(policy).__name__}.get_parameters()"
        if not isinstance(raw, Mapping):
            raw = {str(i): t for i, t in enumerate(raw)}
    if not isinstance(raw, Mapping):
        raise CheckpointError(
            f"{role} {where} returned {type(raw).__name__}; expected a mapping name -> Tensor."
        )
    out: dict[str, Tensor] = {}
    for k, v in raw.items():
        if not isinstance(v, Tensor):
            raise CheckpointError(
                f"{role} {where} holds {k!r} of type {type(v).__name__}; checkpoints store tensors only. "
                f"Return only tensors (keep other state in the object's constructor)."
            )
        out[str(k)] = v
    return out


def load_policy_state(policy: object, tensors: Mapping[str, Tensor], role: str = "policy") -> None:
    """Restore what `policy_state` saved (``load_state_dict``, or in-place copies into parameters)."""
    if _has_state_dict(policy):
        try:
            result = policy.load_state_dict(dict(tensors))  # type: ignore[attr-defined]
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{role} {type(policy).__name__}.load_state_dict refused the checkpoint's weights: {e}. "
                f"Build the {role} with the same architecture as the run that saved it."
            ) from e
        del result
        return
    raw: Any = policy.get_parameters()  # type: ignore[attr-defined]
    current: dict[str, Tensor] = (
        {str(k): v for k, v in raw.items()}
        if isinstance(raw, Mapping)
        else {str(i): t for i, t in enumerate(raw)}
    )
    if set(current) != set(tensors):
        raise CheckpointError(
            f"{role} {type(policy).__name__}.get_parameters() has tensors {sorted(current)[:8]} but the "
            f"checkpoint has {sorted(tensors)[:8]}; build the {role} like the run that saved it."
        )
    with torch.no_grad():
        for k, dst in current.items():
            src = tensors[k]
            if src.shape != dst.shape:
                raise CheckpointError(
                    f"{role} tensor {k!r} has shape {tuple(dst.shape)} but the checkpoint has "
                    f"{tuple(src.shape)}."
                )
            dst.copy_(src)
