"""Seeded starts: ``reset(seed=s)`` gives start s, for envs whose own reset ignores its seed.

GRPO's groups need the G episodes of a group to start from one state (`grpo.gym.episodes`), and
`EpisodePolicy` gets it from ``env.reset(seed=s)``. Some envs ignore that seed: MetaWorld's
``reset(seed=...)`` draws its object and goal positions from its own generator (or a frozen task),
so G resets with one seed give G different starts, or all seeds the same one. The general
mechanism is a *start function* ``start(env, seed)`` that configures the unwrapped env so that its
next reset produces start ``seed``; the `SeededStarts` wrapper calls it before every reset::

    env = SeededStarts(make_env(), start)       # start(env.unwrapped, s) then env.reset(seed=s)
    obs_a, _ = env.reset(seed=7); obs_b, _ = env.reset(seed=7)   # equal, bitwise
    obs_c, _ = env.reset(seed=8)                                  # another start

A start function must make the whole reset a function of the seed (every generator the reset
draws from), not only the part it cares about: `check_seeded_starts` resets twice per seed and
compares.

MetaWorld (`metaworld_start`, `make_metaworld`): the start of seed s is MetaWorld's own seeded
draw, ``env.seed(s)`` (its ``np_random`` and spaces) with ``seeded_rand_vec=True`` and an unfrozen
random vector, so reset draws the object and goal positions ``rand_vec = np_random.uniform(low,
high)`` of the task's ``_random_reset_space``. Every seed is a start, so training and held-out
evaluation use disjoint seed ranges (e.g. training seeds below 10^6, evaluation seeds from 10^6).
MetaWorld's MT1 benchmark tasks (``metaworld.MT1(name, seed).train_tasks``: 50 fixed random vectors
drawn from the same distribution) are another source of starts: ``tasks_start(tasks)`` indexes
them by seed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grpo.gym.gymnasium_lib import import_gymnasium
from grpo.runtime.extras import install_hint

__all__ = ["SeededStarts", "check_seeded_starts", "make_metaworld", "metaworld_start", "tasks_start"]

StartFn = Callable[[Any, int], None]
"""``start(unwrapped_env, seed)``: configure the env so that its next reset gives start ``seed``."""


class SeededStarts:
    """gymnasium Wrapper: ``reset(seed=s)`` calls ``start(env.unwrapped, s)``, then the inner reset.

    A real ``gymnasium.Wrapper`` (completed on first use, so importing this module does not import
    gymnasium). ``reset()`` without a seed (a vector env's autoreset) repeats the last seed. The info
    of a reset holds ``"start_seed"``.

    Args:
        env: the env (an instance).
        start: the start function (module docstring), e.g. `metaworld_start`.

    Attributes:
        last_seed: the seed of the last reset (None before the first).
    """

    env: Any
    start: StartFn
    last_seed: int | None

    def __new__(cls, *args: Any, **kwargs: Any) -> SeededStarts:
        impl = _seeded_starts_class() if cls is SeededStarts else cls
        return object.__new__(impl)

    def __init__(self, env: Any, start: StartFn) -> None:
        gym = import_gymnasium()
        if not isinstance(env, gym.Env):
            raise TypeError(
                f"SeededStarts wraps a gymnasium.Env instance; got {type(env).__name__}. For a factory: "
                f"EpisodePolicy(lambda: SeededStarts(make_env(), start), ...)."
            )
        if not callable(start):
            raise TypeError(
                f"SeededStarts(start=...) needs a function start(env, seed) -> None; got "
                f"{type(start).__name__}."
            )
        gym.Wrapper.__init__(self, env)
        self.start = start
        self.last_seed = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Start ``seed`` (the last seed when None); see the class docs."""
        if seed is None:
            if self.last_seed is None:
                raise ValueError(
                    "SeededStarts.reset() needs seed=<start seed> the first time (the GRPO state); "
                    "reset() without a seed repeats the last start."
                )
            seed = self.last_seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"SeededStarts.reset(seed={seed!r}): a start seed is a non-negative int.")
        self.start(self.env.unwrapped, int(seed))
        obs, info = self.env.reset(seed=int(seed), options=options)
        self.last_seed = int(seed)
        return obs, {**info, "start_seed": int(seed)}

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """The inner env's step."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, info


@functools.cache
def _seeded_starts_class() -> type[SeededStarts]:
    gym = import_gymnasium()
    return type(
        "SeededStarts",
        (SeededStarts, gym.Wrapper),
        {"__module__": __name__, "__qualname__": "SeededStarts", "__doc__": SeededStarts.__doc__},
    )


def check_seeded_starts(env: Any, seeds: Sequence[int] = (0, 0, 1)) -> None:
    """Raise ValueError unless ``reset(seed=s)`` repeats its first observation bitwise for a repeated
    seed and gives different ones for different seeds (``seeds`` must hold both cases)."""
    first: dict[int, np.ndarray] = {}
    for s in seeds:
        obs = np.asarray(env.reset(seed=s)[0])
        if s in first and obs.tobytes() != first[s].tobytes():
            raise ValueError(
                f"reset(seed={s}) gave two different starts: {first[s].tolist()[:4]}... vs "
                f"{obs.tolist()[:4]}...; the start function leaves part of the reset unseeded."
            )
        same = [t for t, o in first.items() if t != s and o.tobytes() == obs.tobytes()]
        if same:
            raise ValueError(f"reset(seed={s}) and reset(seed={same[0]}) gave the same start.")
        first[s] = obs


# ---- MetaWorld ----------------------------------------------------------------------------------
def metaworld_start(env: Any, seed: int) -> None:
    """MetaWorld's seeded start ``seed`` (module docstring): ``env.seed(seed)``, ``seeded_rand_vec``.

    ``env`` is an unwrapped MetaWorld v3 env (``metaworld.sawyer_xyz_env.SawyerXYZEnv``) whose task
    is set (``make_metaworld`` builds one).
    """
    if not callable(getattr(env, "seed", None)) or not hasattr(env, "seeded_rand_vec"):
        raise TypeError(
            f"metaworld_start needs a MetaWorld v3 env (SawyerXYZEnv, with seed() and seeded_rand_vec); "
            f"got {type(env).__name__}. Build one with grpo.gym.seeded_starts.make_metaworld(name)."
        )
    env.seeded_rand_vec = True
    env._freeze_rand_vec = False
    env.seed(int(seed))


def tasks_start(tasks: Sequence[Any]) -> StartFn:
    """The start function of a fixed list of MetaWorld tasks (e.g. ``metaworld.MT1(name).train_tasks``):
    seed s sets task s (``env.set_task(tasks[s])``) and seeds the env with s."""
    tasks = list(tasks)
    if not tasks:
        raise ValueError("tasks_start(tasks): the list of tasks is empty.")

    def start(env: Any, seed: int) -> None:
        if seed >= len(tasks):
            raise ValueError(f"start seed {seed} indexes {len(tasks)} tasks (seeds 0..{len(tasks) - 1}).")
        env.set_task(tasks[seed])
        env.seed(int(seed))

    return start


def make_metaworld(
    name: str,
    *,
    goal_observable: bool = True,
    max_episode_steps: int | None = None,
    start: StartFn = metaworld_start,
) -> Any:
    """A MetaWorld v3 task (``"reach-v3"``, ``"push-v3"``, ``"drawer-open-v3"``, ...) whose
    ``reset(seed=s)`` gives start s: ``SeededStarts(TimeLimit(env, max_episode_steps), start)``.

    Args:
        name: a key of ``metaworld.env_dict.ALL_V3_ENVIRONMENTS``.
        goal_observable: the goal position is in the last 3 observation entries (MetaWorld's
            ``-goal-observable`` envs); False zeroes them, as MetaWorld's MT1 benchmark does.
        max_episode_steps: the time limit (None: MetaWorld's ``max_path_length``, 500).
        start: the start function (`metaworld_start`, or `tasks_start` of MT1 tasks).

    The info of each step holds MetaWorld's ``"success"`` (1.0 once the task is solved);
    `grpo.gym.success` turns it into the reward and the end of an episode.
    """
    gym = import_gymnasium()
    try:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError(
            f"make_metaworld needs MetaWorld v3: {install_hint('metaworld')} (metaworld 3.1 pins "
            f"mujoco==3.3.0; use a virtual environment of its own if another package needs another "
            f"mujoco)."
        ) from e
    if name not in ALL_V3_ENVIRONMENTS:
        raise ValueError(f"unknown MetaWorld v3 task {name!r}; e.g. {sorted(ALL_V3_ENVIRONMENTS)[:4]}.")
    env = ALL_V3_ENVIRONMENTS[name]()
    env._set_task_called = True  # the start function sets the task's random vector at each reset
    env._partially_observable = not goal_observable
    if "sawyer_observation_space" in vars(env):
        del env.sawyer_observation_space  # recomputed for the observability (MetaWorld's set_task does so)
    env.observation_space = env.sawyer_observation_space
    limit = max_episode_steps if max_episode_steps is not None else env.max_path_length
    return SeededStarts(gym.wrappers.TimeLimit(env, limit), start)
