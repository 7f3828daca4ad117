"""The replay check: a snapshot method is trusted for an env type only after it replays exactly.

`grpo.gym.snapshots.snapshot` runs it on the first capture of each (method, env class) in a process
(``check="once"``, the default; the verdict is cached, a failure too) or on every capture
(``check="always"``)::

    S = the snapshot just taken
    play K = 8 actions from S in the unwrapped env, recording (obs, reward, terminated, truncated,
        info["success"]) after each           # the original continuation
    restore(env, S); play the same K actions   # the replayed continuation
    compare the two bitwise; restore(env, S) again

The actions are drawn from a copy of the action space seeded with 0 (the env's own spaces and
generators are not touched). The steps go to the unwrapped env, so the wrappers (their step
counters, episode statistics) do not see them. Cost: 2 x K env steps and 2 restores, once per env
class. When the two continuations differ the method is refused with a `SnapshotError` that says
where they first differ and which attributes the snapshot did not hold. A passed check is evidence,
not proof: an attribute that shapes the future only after K steps, or only in states the check did
not visit, escapes it; ``check="always"`` checks every captured state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from grpo.gym.mujoco_state import same_value

__all__ = ["REPLAY_STEPS", "clear_replay_checks", "first_difference", "play_unwrapped"]

REPLAY_STEPS = 8
"""K, the steps the replay check plays from the snapshot twice."""

_VERDICTS: dict[tuple[str, str], str | None] = {}  # (method, env class) -> None (passed) or the error


def clear_replay_checks() -> None:
    """Forget the cached verdicts: the next capture of each env class is checked again."""
    _VERDICTS.clear()


def _outcome(obs: Any, reward: Any, terminated: Any, truncated: Any, info: Any) -> tuple[Any, ...]:
    success = info.get("success", info.get("is_success")) if isinstance(info, dict) else None
    return (np.array(obs, copy=True), np.float64(reward), bool(terminated), bool(truncated), success)


def play_unwrapped(unwrapped: Any, actions: list[Any]) -> list[tuple[Any, ...]]:
    """Step ``unwrapped`` with ``actions`` until its episode ends; an exception ends the list with its
    type and message (the replay must raise it too)."""
    out: list[tuple[Any, ...]] = []
    for a in actions:
        try:
            obs, reward, terminated, truncated, info = unwrapped.step(a)
        except Exception as e:
            out.append(("raised", f"{type(e).__name__}: {e}"))
            break
        out.append(_outcome(obs, reward, terminated, truncated, info))
        if out[-1][2] or out[-1][3]:
            break
    return out


def _describe(outcome: tuple[Any, ...]) -> str:
    return f"raised {outcome[1]}" if _raised(outcome) else "stepped"


def _raised(outcome: tuple[Any, ...]) -> bool:
    return isinstance(outcome[0], str) and outcome[0] == "raised"


def first_difference(original: list[tuple[Any, ...]], replay: list[tuple[Any, ...]]) -> str | None:
    """Where two continuations first differ, in words; None when they are bitwise equal."""
    names = ("observation", "reward", "terminated", "truncated", 'info["success"]')
    for t, (a, b) in enumerate(zip(original, replay, strict=False)):
        if _raised(a) or _raised(b):
            if not (_raised(a) and _raised(b) and a[1] == b[1]):
                return f"step {t}: the original {_describe(a)}, the replay {_describe(b)}"
            continue
        for name, x, y in zip(names, a, b, strict=True):
            if same_value(x, y):
                continue
            if name == "observation" and np.shape(x) == np.shape(y):
                xs, ys = np.asarray(x).ravel(), np.asarray(y).ravel()
                idx = np.flatnonzero([not same_value(u, v) for u, v in zip(xs, ys, strict=True)])[:3]
                return (
                    f"step {t}: the observation differs at entries {idx.tolist()} "
                    f"({xs[idx].tolist()} vs {ys[idx].tolist()})"
                )
            return f"step {t}: the {name} differs ({x!r} vs {y!r})"
    if len(original) != len(replay):
        return f"the original lasted {len(original)} steps, the replay {len(replay)}"
    return None


def replay_check(
    env: Any,
    unwrapped: Any,
    snap: Any,
    restore: Callable[[Any, Any], Any],
    *,
    always: bool,
    skipped: tuple[str, ...] = (),
) -> str | None:
    """The verdict for ``snap``'s method on this env class: None (trusted) or what differed.

    ``restore(env, snap)`` puts the env back; it is called twice (the replay, then the end state).
    """
    key = (snap.method, snap.env_type)
    if not always and key in _VERDICTS:
        return _VERDICTS[key]
    space = copy.deepcopy(unwrapped.action_space)
    space.seed(0)
    actions = [space.sample() for _ in range(REPLAY_STEPS)]
    original = play_unwrapped(unwrapped, actions)
    try:
        restore(env, snap)
        replay = play_unwrapped(unwrapped, actions)
        restore(env, snap)
        diff = first_difference(original, replay)
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:
        diff = f"restore() into the env it was taken from raised {type(e).__name__}: {e}"
    verdict = None
    if diff is not None and diff.startswith("restore()"):
        verdict = diff
    elif diff is not None:
        verdict = (
            f"replaying the same {len(actions)} actions after restore() did not give the original "
            f"continuation: {diff}"
        )
        if skipped:
            verdict += f". Attributes of the env the snapshot does not hold: {list(skipped)}"
    _VERDICTS[key] = verdict
    return verdict
