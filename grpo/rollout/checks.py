"""Checks of what a user's policy and reward return at collection, with errors that name them.

Every error names the user's object and method (`method_name`), what was seen and what was
expected: rewards (`to_reward_tensor`, `checked_step_rewards`) and states (`states_type_error`,
`stack_hint`). Log-probs are checked in `grpo.rollout.log_probs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.reward_model_base import FunctionReward

__all__ = [
    "checked_step_rewards",
    "method_name",
    "stack_hint",
    "states_type_error",
    "to_reward_tensor",
]


def method_name(obj: object, method: str) -> str:
    """``Class.method`` naming the user's object in messages (a wrapped function by its name)."""
    name = repr(obj) if isinstance(obj, FunctionReward) else type(obj).__name__
    return f"{name}.{method}"


def to_reward_tensor(
    values: Any,
    n: int,
    where: str,
    device: torch.device,
    *,
    allow_invalid: bool = False,
    per_step: bool = False,
) -> Tensor:
    """Turn what a reward returned into a finite float32 (n,) tensor, or raise naming the problem.

    ``allow_invalid=True`` (``invalid_rewards="drop_groups"``): None, NaN and inf become NaN in
    the result instead of raising; the caller drops their groups. ``per_step=True``: an (n, T)
    array of per-step rewards (T > 1) is accepted too and returned as (n, T).
    """
    t = (
        values.detach()
        if isinstance(values, Tensor)
        else _rewards_from_numbers(values, n, where, allow_invalid)
    )
    if t.dim() == 2 and t.shape[-1] == 1:
        t = t.squeeze(-1)
    if t.shape != (n,) and not (per_step and t.dim() == 2 and t.shape[0] == n and t.shape[1] > 0):
        per = f" or ({n}, T): one reward per step of each action" if per_step else ""
        raise ValueError(
            f"{where} returned rewards of shape {tuple(t.shape)}; expected ({n},): one reward per "
            f"(state, action) pair, in the flat group-major order it was given{per}."
        )
    if t.is_complex():
        raise TypeError(f"{where} returned complex rewards ({t.dtype}); expected real numbers.")
    t = t.to(device=device, dtype=torch.float32)
    if allow_invalid:
        return torch.where(torch.isfinite(t), t, torch.nan)
    if math.isfinite(float(t.sum())):  # one reduction in the common case (an overflow of the sum
        return t  # of finite values falls through to the exact check below, which passes)
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        bad_idx = (~finite).nonzero().flatten()[:10].tolist()
        raise ValueError(
            f"{where} returned non-finite rewards (NaN or inf) at flat positions {bad_idx} "
            f"(group = position // group_size). Fix the reward, clip it to a finite range, or set "
            f"GRPOConfig(invalid_rewards='drop_groups') to leave such groups out of the step."
        )
    return t


def _rewards_from_numbers(values: Any, n: int, where: str, allow_invalid: bool) -> Tensor:
    """A NumPy array or a sequence of numbers as a CPU tensor (None -> NaN when ``allow_invalid``)."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if not isinstance(values, Sequence):
            raise TypeError(
                f"{where} returned {type(values).__name__}; expected a Tensor, NumPy array or "
                f"list of {n} numbers."
            )
        if allow_invalid:
            values = [float("nan") if v is None else v for v in values]
        bad = [i for i, v in enumerate(values) if v is None or isinstance(v, (str, bytes))]
        if bad:
            raise TypeError(
                f"{where} returned non-numeric rewards at positions {bad[:10]} "
                f"(e.g. {values[bad[0]]!r}); every sample needs a number. Return 0.0 (or a "
                f"penalty) for samples the reward does not apply to, or (for None) set "
                f"GRPOConfig(invalid_rewards='drop_groups') to leave their groups out."
            )
        try:
            arr = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where} returned rewards that are not numbers: {e}") from e
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{where} returned rewards of dtype {arr.dtype}; expected numbers.")
    return torch.from_numpy(np.ascontiguousarray(arr))


def checked_step_rewards(step: Tensor, mask: Tensor | None, reward_model: Any) -> Tensor:
    """Per-step rewards (N, T) zeroed on invalid steps, or an error when their T is not the
    policy's: step t's reward must belong to the log-prob of step t."""
    if mask is None or mask.shape != step.shape:
        got = "one log-prob per action" if mask is None else f"log-probs of shape {tuple(mask.shape)}"
        raise ValueError(
            f"{method_name(reward_model, 'compute_rewards')} returned per-step rewards of shape "
            f"{tuple(step.shape)}, but the policy gives {got}. Per-step rewards need per-step "
            f"log-probs of the same (N, T) (PolicyOutput(log_probs, mask)); return one reward "
            f"per action, shape ({step.shape[0]},), otherwise."
        )
    return step.masked_fill(~mask, 0.0)


def states_type_error(states: Any) -> str:
    """Why ``states`` (not a Tensor, not a sequence) is refused, and what to pass instead."""
    kind = type(states).__name__
    if isinstance(states, np.ndarray):
        return (
            f"states is a NumPy array of shape {states.shape}; pass a Tensor (B, ...): "
            f"torch.from_numpy(states), or a list of states: list(states)."
        )
    if isinstance(states, (str, bytes)):
        return f"states is a single {kind}; pass a list of states, e.g. step([state])."
    if hasattr(states, "__iter__"):  # a generator, iterator, set...: not indexable
        return (
            f"states is a {kind}, not a sequence the trainer can index and count; pass a list or "
            f"a Tensor (B, ...), e.g. step(list(states))."
        )
    return (
        f"states must be a sequence of states or a Tensor (B, ...), got {kind}. Wrap a single "
        f"state in a list: step([state])."
    )


def stack_hint(states: Any, error: BaseException) -> str | None:
    """The message for a policy that failed on ``states`` given as a list of same-shape Tensors
    because it takes one Tensor (B, ...) (the error names the list type); None otherwise."""
    if isinstance(states, Tensor) or not isinstance(states, Sequence) or not states:
        return None
    if type(states).__name__ not in str(error) or not all(isinstance(s, Tensor) for s in states):
        return None
    shapes = {tuple(s.shape) for s in states}
    if len(shapes) != 1:
        return None
    shape = next(iter(shapes))
    return (
        f"{type(error).__name__}: {error}, with states given as a {type(states).__name__} of "
        f"{len(states)} Tensors of shape {shape}. If the policy takes a Tensor (B, ...), pass "
        f"torch.stack(states) (shape {(len(states), *shape)})."
    )
