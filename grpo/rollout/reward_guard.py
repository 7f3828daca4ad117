"""Calling a user's reward: which reward failed, on which sample, and an optional time limit.

`call_reward(fn, where, states, actions, ...)` runs one reward call. If it raises, the reward is
run again on one sample at a time (at most N calls, stopping at the first that raises) to find
the sample that breaks it, and a `RewardError` names the reward (``where``, e.g.
``CombinedReward['format']``), the flat index, its group and position in the group, and the
state and action (shortened). If it does not raise on any single sample (a reward that fails only
on the batch), the error says so. A reward that cannot be called as ``reward(states, actions)`` at
all (``def reward(x)``, or a third required argument) raises `TypeError` saying what the signature
must be, instead of being re-run per sample. With ``timeout`` the call runs in a daemon thread; after
``timeout`` seconds `RewardTimeoutError` is raised (the thread cannot be stopped and finishes in
the background; its result is discarded).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from grpo.reward_model_base import FunctionReward

__all__ = ["RewardError", "RewardTimeoutError", "call_reward"]


class RewardError(RuntimeError):
    """A reward raised; the message names the reward and the first sample that fails."""


class RewardTimeoutError(TimeoutError):
    """A reward call took longer than ``GRPOConfig.reward_timeout``."""


def _short(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _with_timeout(
    fn: Callable[[Any, Any], Any], states: Any, actions: Any, timeout: float, where: str
) -> Any:
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(states, actions))
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    worker = threading.Thread(target=run, name=f"grpo-reward {where}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeoutError(
            f"{where} did not return within GRPOConfig.reward_timeout={timeout} s for {len(states)} "
            f"samples. Make the reward faster, raise reward_timeout, or set it to None."
        )
    if error:
        raise error[0]
    return result[0]


def _locate(fn: Callable[[Any, Any], Any], states: Any, actions: Any) -> tuple[int, BaseException] | None:
    """The first flat index whose single-sample call raises, with its exception."""
    for i in range(len(states)):
        try:
            fn(states[i : i + 1], actions[i : i + 1])
        except Exception as e:
            return i, e
    return None


def _signature_mismatch(fn: Callable[[Any, Any], Any], where: str) -> TypeError | None:
    """A `TypeError` saying what a reward's signature must be when ``fn`` (or the function a
    `FunctionReward` wraps) cannot take ``(states, actions)``; None when it can (or has no
    inspectable signature): then the call's `TypeError` came from inside the reward."""
    owner = getattr(fn, "__self__", None)
    target: Any = owner.fn if isinstance(owner, FunctionReward) and fn == owner.compute_rewards else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # builtins and other objects without a signature
        return None
    try:
        sig.bind(None, None)
    except TypeError as why:
        name = getattr(target, "__qualname__", None) or type(target).__name__
        call = name if name.isidentifier() else "my_reward"  # e.g. not "<lambda>"
        return TypeError(
            f"{where} cannot be called as reward(states, actions): {name}{sig} ({why}). A reward is "
            f"called once per step with two arguments, the N flat states and the N flat actions, "
            f"and returns N numbers: def reward(states, actions) -> list[float] | Tensor (N,) (a "
            f"RewardModel: compute_rewards(self, states, actions)). Give it that signature, or "
            f"adapt it, e.g. lambda states, actions: {call}(actions)."
        )
    return None


def call_reward(
    fn: Callable[[Any, Any], Any],
    where: str,
    states: Any,
    actions: Any,
    *,
    group_size: int | None = None,
    timeout: float | None = None,
) -> Any:
    """``fn(states, actions)``; on an exception, a `RewardError` saying which reward and sample."""
    try:
        if timeout is None:
            return fn(states, actions)
        return _with_timeout(fn, states, actions, timeout, where)
    except RewardTimeoutError:
        raise
    except Exception as e:
        mismatch = _signature_mismatch(fn, where) if isinstance(e, TypeError) else None
        if mismatch is not None:
            raise mismatch from e
        found = _locate(fn, states, actions)
        if found is None:
            raise RewardError(
                f"{where} raised {type(e).__name__}: {e} on the batch of {len(states)} samples, but not on "
                f"any single sample when re-run one at a time."
            ) from e
        i, sample_error = found
        group = "" if group_size is None else f" (group {i // group_size}, action {i % group_size})"
        raise RewardError(
            f"{where} raised {type(e).__name__}: {e}. First failing sample: flat index {i}{group}, "
            f"state={_short(states[i])}, action={_short(actions[i])} (alone it raises "
            f"{type(sample_error).__name__}: {sample_error}). Make the reward handle this input, e.g. "
            f"return a penalty for malformed actions."
        ) from e
