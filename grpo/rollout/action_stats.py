"""Length statistics of a step's actions, for any policy whose actions report their length.

The hook is two members of each action (`LengthReporting`):

* ``len(action)``: its length L_i (tokens of a completion, steps of an episode);
* ``action.truncated``: True when it was cut at the length limit (``max_new_tokens``, a time
  limit) without ending, False when it ended on its own (an EOS token, a terminal state). An
  action may offer ``action.finished`` (its negation) instead; ``truncated`` wins when it has
  both (`truncated_flag`; the same flag ``GRPOConfig.mask_truncated_completions`` reads).

`grpo.llm.Completion` has all three. Actions without them (a Tensor of actions, ints, ...) report
nothing: `action_metrics` returns no key, so a bandit's or a gym policy's metrics hold no bogus
lengths. The keys keep the ``completion/*`` names of ``grpo-train`` (declared in `grpo.metrics`).

`success_metrics` is the same for success: actions with a bool ``success`` attribute (the
`grpo.gym.episodes.Episode` of an env whose step info reports ``success``) give
``episode/success_rate``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "LENGTH_KEYS",
    "LengthReporting",
    "action_metrics",
    "reports_lengths",
    "success_metrics",
    "truncated_flag",
]

LENGTH_KEYS: tuple[str, ...] = (
    "completion/tokens",
    "completion/mean_length",
    "completion/min_length",
    "completion/max_length",
    "completion/frac_truncated",
    "completion/mean_terminated_length",
)
"""The keys `action_metrics` returns for actions that report their lengths (`grpo.metrics`)."""


@runtime_checkable
class LengthReporting(Protocol):
    """An action that reports its length and whether it was cut at the length limit (the hook
    of this module; ``finished``, the negation, may stand in for ``truncated``)."""

    def __len__(self) -> int:
        """L_i: tokens of a completion, steps of an episode."""
        ...

    @property
    def truncated(self) -> bool:
        """True: cut at the length limit without ending; False: ended (EOS, terminal state)."""
        ...


def reports_lengths(actions: Any) -> bool:
    """Whether ``actions`` (a step's N flat actions) use the hook: a non-empty list or tuple whose
    first item has ``__len__`` and ``truncated`` or ``finished``. A Tensor of actions never does."""
    if not isinstance(actions, (list, tuple)) or not actions:
        return False
    return _has_hook(actions[0])


def truncated_flag(action: Any) -> bool | None:
    """``action.truncated``, else ``not action.finished``; None when it has neither."""
    if hasattr(action, "truncated"):
        return bool(action.truncated)
    return None if not hasattr(action, "finished") else not bool(action.finished)


def _has_hook(action: Any) -> bool:
    return hasattr(type(action), "__len__") and (hasattr(action, "truncated") or hasattr(action, "finished"))


def action_metrics(actions: Any) -> dict[str, float]:
    """The length metrics of N actions that report their lengths, or ``{}`` for actions that do not.

    With L_i = ``len(a_i)`` and E = {i : a_i ended} (``truncated_flag(a_i)`` False)::

        completion/tokens                  = sum_i L_i
        completion/mean_length             = sum_i L_i / N
        completion/min_length              = min_i L_i
        completion/max_length              = max_i L_i
        completion/frac_truncated          = (N - |E|) / N       (cut at the limit without ending)
        completion/mean_terminated_length  = sum_{i in E} L_i / |E|   (NaN when |E| = 0)

    The trainer calls it after the update (step 5), so a list that mixes actions with and without
    the hook gets a warning naming the first without it and no length metric, never an error.
    """
    if not reports_lengths(actions):
        return {}
    items: Sequence[Any] = actions
    bad = next((i for i, a in enumerate(items) if not _has_hook(a)), None)
    if bad is not None:
        warnings.warn(
            f"action {bad} of the step is a {type(items[bad]).__name__} without len() and "
            f".truncated, while action 0 ({type(items[0]).__name__}) has both, so the step reports "
            f"no completion/* length metric (grpo.rollout.action_stats). Return actions of one "
            f"kind from generate_actions.",
            UserWarning,
            stacklevel=2,
        )
        return {}
    lengths = [len(a) for a in items]
    done = [length for length, a in zip(lengths, items, strict=True) if not truncated_flag(a)]
    n = len(lengths)
    return {
        "completion/tokens": float(sum(lengths)),
        "completion/mean_length": sum(lengths) / n,
        "completion/min_length": float(min(lengths)),
        "completion/max_length": float(max(lengths)),
        "completion/frac_truncated": (n - len(done)) / n,
        "completion/mean_terminated_length": sum(done) / len(done) if done else math.nan,
    }


def success_metrics(actions: Any) -> dict[str, float]:
    """``{"episode/success_rate": (1/N) sum_i 1[a_i.success]}`` when each of the N actions has a bool
    ``success`` attribute; ``{}`` otherwise (actions that do not report success, or an env that
    reported it for some episodes only)."""
    if not isinstance(actions, Sequence) or not actions:  # a Tensor of actions reports nothing
        return {}
    if not isinstance(getattr(actions[0], "success", None), bool):  # O(1) for other actions
        return {}
    flags = [getattr(a, "success", None) for a in actions]
    if not all(isinstance(f, bool) for f in flags):
        return {}
    return {"episode/success_rate": sum(1 for f in flags if f) / len(flags)}
