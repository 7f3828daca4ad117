"""Groups without resets: snapshot/restore, and grouping by nearest start states.

GRPO's group baseline needs the G episodes of a group to start from one state (see
`grpo.gym_episodes`). `EpisodePolicy` gets that from ``env.reset(seed=s)``. This module covers the
environments where that is not possible (gymnasium is imported lazily, as in `grpo.gym_episodes`).

**1. The env can save and restore its state** (any simulator): `snapshot` / `restore` capture and
set the full simulator state, and the `SnapshotReset` wrapper's ``reset(seed=i)`` restores snapshot
i of a `SnapshotStore`. States reached any way (playing a long-running simulation, a scripted
curriculum, a recorded demonstration) become GRPO states: the seed indexes a snapshot::

    store = SnapshotStore()
    ...; store.capture(env, observation=obs)                 # -> index i, any number of times
    policy = EpisodePolicy(lambda: SnapshotReset(gym.make("CartPole-v1"), store), net)
    trainer.step([i, j, k])                                  # G episodes from each snapshot

What a snapshot holds (``Snapshot.method``):

* ``"classic_control"``: gymnasium's CartPole, Acrobot, Pendulum, MountainCar and
  MountainCarContinuous: ``env.unwrapped.state`` plus the attributes that shape the future
  (CartPole's ``steps_beyond_terminated``, Pendulum's ``last_u``) and the env's ``np_random``
  generator (Acrobot's optional torque noise then repeats exactly).
* ``"mujoco"``: any env with ``data.qpos`` / ``data.qvel`` and ``set_state(qpos, qvel)`` (the
  gymnasium MuJoCo envs): qpos, qvel and, where the data has them, ``time``, ``act``, ``ctrl``,
  ``qacc_warmstart`` (the constraint solver's warm start), ``mocap_pos`` / ``mocap_quat``,
  ``userdata``, ``plugin_state`` (MuJoCo's full integration state, ``mjSTATE_INTEGRATION``); plus
  ``np_random``.
* ``"deepcopy"``: ``copy.deepcopy`` of the whole wrapper chain, restored in place layer by layer.
  The fallback for pure-Python envs; also the method for stateful wrappers (observation
  normalisers, frame stacks), whose state the other two methods do not hold.

The other two methods also carry the ``TimeLimit`` step counter, so a restored episode is truncated
where the original would have been (``reset_time_limit=True`` starts a fresh time budget instead).

**2. The env cannot restore** (a real robot, an external simulator): `NearestStartPolicy` plays
B·G episodes from B·G independent random starts and partitions them into B groups of G episodes
whose *start observations* are close (`group_by_nearest_start`), and measures after every batch how
much of the within-group return spread the remaining start differences explain
(`grouping_stats`, ``policy.last_grouping_stats``). See docs/gym_episodes.md, "Groups without
resets", for the algorithm, its cost and the math of the diagnostic.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from grpo.gym_episodes import Episode, EpisodePolicy, _gym, _seeds, discounted_returns, run_episodes

__all__ = [
    "NearestStartPolicy",
    "Snapshot",
    "SnapshotError",
    "SnapshotReset",
    "SnapshotStore",
    "StartStateBiasWarning",
    "group_by_nearest_start",
    "grouping_stats",
    "restore",
    "snapshot",
]

logger = logging.getLogger(__name__)

SnapshotMethod = Literal["auto", "classic_control", "mujoco", "deepcopy"]

# MuJoCo ``data`` fields restored before ``set_state(qpos, qvel)`` (which runs mj_forward).
_MUJOCO_FIELDS = ("act", "ctrl", "qacc_warmstart", "mocap_pos", "mocap_quat", "userdata", "plugin_state")


class SnapshotError(TypeError):
    """The env cannot be snapshotted: no known state and ``copy.deepcopy`` fails (or, for a store
    with a directory, pickling fails)."""


class StartStateBiasWarning(UserWarning):
    """`NearestStartPolicy`: start-state differences explain too much of the within-group returns."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The full state of an env at one moment, made by `snapshot`; restore it with `restore`.

    Picklable (it holds numpy arrays, a numpy Generator and gymnasium spaces; ``"deepcopy"``
    snapshots hold a copy of the env, picklable when the env is), so a `SnapshotStore` with a
    directory can share it with other processes.

    Attributes:
        method: ``"classic_control"``, ``"mujoco"`` or ``"deepcopy"`` (see the module docstring).
        observation: what the env observes in this state, as the wrapped env returns it (the
            observation ``reset`` of a `SnapshotReset` returns for this snapshot).
        observation_space: the env's observation space (a restore into another space is refused).
        action_space: the env's action space (likewise).
        env_type: qualified class name of ``env.unwrapped``.
        wrappers: qualified class names of the wrapper chain, outermost first, ending with
            ``env_type``.
        elapsed_steps: the ``TimeLimit`` step counter (None without a TimeLimit or for
            ``"deepcopy"``, which holds it in its copy).
        state: the method's payload (attribute values, MuJoCo arrays, or the env copy).
    """

    method: str
    observation: np.ndarray
    observation_space: Any
    action_space: Any
    env_type: str
    wrappers: tuple[str, ...]
    elapsed_steps: int | None
    state: dict[str, Any] = field(repr=False)


# ---- the wrapper chain --------------------------------------------------------------------------
def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _chain(env: Any) -> list[Any]:
    """[env, env.env, ..., env.unwrapped]: the gymnasium wrapper layers, outermost first."""
    gym = _gym()
    if not isinstance(env, gym.Env):
        raise TypeError(
            f"expected a gymnasium.Env (e.g. gymnasium.make('CartPole-v1')); got {type(env).__name__}. "
            f"A SnapshotReset wraps an env instance, not a factory: "
            f"EpisodePolicy(lambda: SnapshotReset(make_env(), store), ...)."
        )
    layers = [env]
    while isinstance(layers[-1], gym.Wrapper):
        layers.append(layers[-1].env)
    return layers


def _classic_control_spec(unwrapped: Any) -> tuple[tuple[str, ...], Callable[[Any], np.ndarray]] | None:
    """(attributes that define the future, observation getter) of a known classic-control env."""
    from gymnasium.envs import classic_control as cc

    def from_state(u: Any) -> np.ndarray:
        return np.array(u.state, dtype=np.float32)

    known: list[tuple[type, tuple[str, ...], Callable[[Any], np.ndarray]]] = [
        (cc.CartPoleEnv, ("state", "steps_beyond_terminated"), from_state),
        (cc.AcrobotEnv, ("state",), lambda u: np.asarray(u._get_ob())),
        (cc.PendulumEnv, ("state", "last_u"), lambda u: np.asarray(u._get_obs())),
        (cc.MountainCarEnv, ("state",), from_state),
        (cc.Continuous_MountainCarEnv, ("state",), from_state),
    ]
    for cls, attrs, observe in known:
        if type(unwrapped) is cls:
            return attrs, observe
    return None


def _is_mujoco_style(unwrapped: Any) -> bool:
    data = getattr(unwrapped, "data", None)
    return callable(getattr(unwrapped, "set_state", None)) and hasattr(data, "qpos") and hasattr(data, "qvel")


def _derive_observation(layers: list[Any], method: str) -> np.ndarray:
    """The observation of the current state, computed from the unwrapped env."""
    gym = _gym()
    unwrapped = layers[-1]
    transforming = [
        _qualname(layer)
        for layer in layers[:-1]
        if isinstance(layer, gym.ObservationWrapper) or layer.observation_space != unwrapped.observation_space
    ]
    if transforming:
        raise ValueError(
            f"snapshot() cannot compute the observation: the wrapper(s) {transforming} change what the "
            f"env observes. Pass observation= (the last observation the wrapped env returned)."
        )
    spec = _classic_control_spec(unwrapped) if method == "classic_control" else None
    if spec is not None:
        return spec[1](unwrapped)
    for getter in ("_get_obs", "_get_ob"):
        fn = getattr(unwrapped, getter, None)
        if callable(fn):
            return np.asarray(fn())
    raise ValueError(
        f"snapshot() cannot compute the observation of {_qualname(unwrapped)} (it has no _get_obs()): "
        f"pass observation= (the last observation the env returned)."
    )


def _check_observation(observation: Any, space: Any, where: str) -> np.ndarray:
    obs = np.array(observation, dtype=getattr(space, "dtype", None), copy=True)
    shape = getattr(space, "shape", None)
    if shape is not None and obs.shape != tuple(shape):
        raise ValueError(
            f"{where}: the observation has shape {obs.shape}, the env's observation space {space} has "
            f"shape {tuple(shape)}."
        )
    return obs


def _time_limits(layers: list[Any]) -> list[Any]:
    from gymnasium.wrappers import TimeLimit

    return [layer for layer in layers if isinstance(layer, TimeLimit)]


def _never_reset(layers: list[Any]) -> bool:
    return any(
        getattr(layer, "_has_reset", True) is False or getattr(layer, "checked_reset", True) is False
        for layer in layers
    ) or (hasattr(layers[-1], "state") and layers[-1].state is None)


# ---- snapshot / restore -------------------------------------------------------------------------
def snapshot(env: Any, *, observation: Any = None, method: SnapshotMethod = "auto") -> Snapshot:
    """Capture the full state of ``env`` (a gymnasium env, wrapped or not) after reset or a step.

    Args:
        env: the env whose current state to save. It must have been reset.
        observation: the last observation ``env`` returned. Needed when a wrapper transforms
            observations or the env has no ``_get_obs()``; otherwise computed from the state.
        method: ``"auto"`` picks ``"classic_control"`` for gymnasium's classic-control envs,
            ``"mujoco"`` for envs with ``data.qpos/qvel`` and ``set_state``, else ``"deepcopy"``.

    Returns:
        A `Snapshot`; ``restore(other_env, snap)`` puts any env of the same kind into this state.

    Raises:
        SnapshotError: the method does not apply, or ``copy.deepcopy`` of the env fails.
        ValueError: the env was never reset, or the observation is missing or of the wrong shape.
    """
    if method not in ("auto", "classic_control", "mujoco", "deepcopy"):
        raise ValueError(f"method={method!r}: choose 'auto', 'classic_control', 'mujoco' or 'deepcopy'.")
    layers = _chain(env)
    unwrapped = layers[-1]
    classic = _classic_control_spec(unwrapped)
    if method == "auto":
        method = "classic_control" if classic else "mujoco" if _is_mujoco_style(unwrapped) else "deepcopy"
    elif method == "classic_control" and classic is None:
        raise SnapshotError(
            f"method='classic_control' needs gymnasium's CartPole, Acrobot, Pendulum, MountainCar or "
            f"MountainCarContinuous; the env is {_qualname(unwrapped)}. Use method='auto'."
        )
    elif method == "mujoco" and not _is_mujoco_style(unwrapped):
        raise SnapshotError(
            f"method='mujoco' needs an env with data.qpos, data.qvel and set_state(qpos, qvel); "
            f"{_qualname(unwrapped)} has not. Use method='auto'."
        )
    state: dict[str, Any] = {}
    if method == "classic_control":
        assert classic is not None
        if getattr(unwrapped, "state", None) is None:
            raise ValueError(f"snapshot(): {_qualname(unwrapped)} has no state yet; call env.reset() first.")
        state = {name: copy.deepcopy(getattr(unwrapped, name)) for name in classic[0]}
        state["_np_random"] = copy.deepcopy(getattr(unwrapped, "_np_random", None))
    elif method == "mujoco":
        data = unwrapped.data
        state = {"qpos": np.array(data.qpos, copy=True), "qvel": np.array(data.qvel, copy=True)}
        for name in _MUJOCO_FIELDS:
            if hasattr(data, name):
                state[name] = np.array(getattr(data, name), copy=True)
        if hasattr(data, "time"):
            state["time"] = float(data.time)
        state["_np_random"] = copy.deepcopy(getattr(unwrapped, "_np_random", None))
    else:
        try:
            state = {"env": copy.deepcopy(env)}
        except Exception as e:
            raise SnapshotError(
                f"cannot snapshot {_qualname(unwrapped)}: it is not a gymnasium classic-control env, has "
                f"no MuJoCo-style data.qpos/qvel + set_state(qpos, qvel), and copy.deepcopy(env) failed "
                f"({type(e).__name__}: {e}). Give the env a set_state(qpos, qvel) and data.qpos/qvel, "
                f"make it deep-copyable, or group by nearest start states (NearestStartPolicy)."
            ) from e
    obs = _derive_observation(layers, method) if observation is None else observation
    obs = _check_observation(obs, env.observation_space, "snapshot()")
    limits = _time_limits(layers)
    elapsed = limits[0]._elapsed_steps if limits and method != "deepcopy" else None
    return Snapshot(
        method=method,
        observation=obs,
        observation_space=copy.deepcopy(env.observation_space),
        action_space=copy.deepcopy(env.action_space),
        env_type=_qualname(unwrapped),
        wrappers=tuple(_qualname(layer) for layer in layers),
        elapsed_steps=elapsed,
        state=state,
    )


def restore(env: Any, snap: Snapshot, *, reset_time_limit: bool = False) -> np.ndarray:
    """Put ``env`` into the state saved in ``snap`` (made by `snapshot` from this or another env).

    After ``restore(env, snap)``, stepping ``env`` with the actions the original env took after
    the snapshot gives the original observations, rewards, terminations and truncations exactly.
    An env that was never reset is reset once first (gymnasium's ``OrderEnforcing`` and
    ``PassiveEnvChecker`` wrappers refuse a step before the first reset); the restore then
    overwrites everything that reset set.

    Args:
        env: an env of the same kind (same unwrapped class, same spaces; for ``"deepcopy"``
            snapshots also the same wrapper classes).
        snap: the `Snapshot`.
        reset_time_limit: start the ``TimeLimit`` counter at 0 (a fresh time budget) instead of
            where the snapshot was taken.

    Returns:
        A copy of ``snap.observation``: what the env observes now.

    Raises:
        TypeError: ``snap`` is not a `Snapshot`.
        ValueError: the spaces, the env class, the wrappers or MuJoCo array shapes differ.
    """
    if not isinstance(snap, Snapshot):
        raise TypeError(f"restore() expects a grpo.gym_resets.Snapshot; got {type(snap).__name__}.")
    layers = _chain(env)
    unwrapped = layers[-1]
    for what, have, want in (
        ("observation", env.observation_space, snap.observation_space),
        ("action", env.action_space, snap.action_space),
    ):
        if have != want:
            raise ValueError(
                f"restore(): mismatched {what} spaces: the snapshot was taken in {want}, the env has "
                f"{have} (snapshot of {snap.env_type}, env {_qualname(unwrapped)})."
            )
    if snap.method != "deepcopy" and _qualname(unwrapped) != snap.env_type:
        raise ValueError(
            f"restore(): the snapshot is of a {snap.env_type}, the env is a {_qualname(unwrapped)}."
        )
    st = snap.state
    if snap.method != "deepcopy" and _never_reset(layers):
        # OrderEnforcing / PassiveEnvChecker refuse a step before the first reset. Reset below any
        # SnapshotReset layer (whose own reset would restore a snapshot of its store).
        inner = max((k for k, layer in enumerate(layers) if isinstance(layer, SnapshotReset)), default=-1)
        layers[inner + 1].reset()
    if snap.method == "classic_control":
        for name, value in st.items():
            if name != "_np_random":
                setattr(unwrapped, name, copy.deepcopy(value))
    elif snap.method == "mujoco":
        data = unwrapped.data
        for name in ("qpos", "qvel", *_MUJOCO_FIELDS):
            if name in st and np.shape(getattr(data, name)) != st[name].shape:
                raise ValueError(
                    f"restore(): mismatched MuJoCo models: data.{name} has shape "
                    f"{np.shape(getattr(data, name))}, the snapshot's {st[name].shape}."
                )
        for name in _MUJOCO_FIELDS:
            if name in st and st[name].size:
                getattr(data, name)[...] = st[name]
        if "time" in st:
            data.time = st["time"]
        unwrapped.set_state(st["qpos"].copy(), st["qvel"].copy())
    elif snap.method == "deepcopy":
        saved = [_qualname(layer) for layer in layers]
        if tuple(saved) != snap.wrappers:
            raise ValueError(
                f"restore(): a 'deepcopy' snapshot restores into the same wrapper chain; the snapshot "
                f"has {list(snap.wrappers)}, the env {saved}."
            )
        fresh = _chain(copy.deepcopy(st["env"]))
        for k, (target, source) in enumerate(zip(layers, fresh, strict=True)):
            inner = target.__dict__.get("env")
            target.__dict__.clear()
            target.__dict__.update(source.__dict__)
            if k < len(layers) - 1:  # a wrapper keeps pointing at its own inner env
                target.__dict__["env"] = inner
    else:
        raise ValueError(f"restore(): unknown snapshot method {snap.method!r}.")
    if snap.method != "deepcopy":
        if st.get("_np_random") is not None:
            unwrapped.np_random = copy.deepcopy(st["_np_random"])
        for limit in _time_limits(layers):
            limit._elapsed_steps = snap.elapsed_steps if snap.elapsed_steps is not None else 0
    if reset_time_limit:
        for limit in _time_limits(layers):
            limit._elapsed_steps = 0
    for layer in layers:  # OrderEnforcing: stepping a restored env is allowed
        if hasattr(layer, "_has_reset"):
            layer._has_reset = True
    return np.array(snap.observation, copy=True)


# ---- the store ----------------------------------------------------------------------------------
def _index(i: Any, where: str) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
        raise TypeError(f"{where}: a snapshot index is a non-negative int; got {i!r}.")
    return int(i)


class SnapshotStore:
    """Numbered snapshots; the index of a snapshot is the GRPO state (the seed) that replays it.

    One store is shared by every env a factory makes: ``lambda: SnapshotReset(make_env(), store)``
    closes over it, so the sub-envs of a ``SyncVectorEnv`` (one process) all see every snapshot,
    including those added later.

    With ``directory=None`` the snapshots live in memory. Other processes (``AsyncVectorEnv``
    workers, ``EpisodePolicy(..., vectorization_mode="async")``) get a copy of the store made when
    they start, so snapshots added afterwards are missing there (a lookup names this). With a
    ``directory``, each snapshot is also pickled to ``directory/snapshot-<index>.pkl`` (written to a
    temporary file, then linked into place, so readers never see half a file and two writers never
    take the same index) and every process reads missing ones from there: snapshots must then be
    picklable. The directory persists: a new store on it sees the snapshots written before. Load only
    directories you wrote (pickle runs code on load).

    Args:
        directory: where to keep the snapshots on disk (created if missing); None = memory only.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = None if directory is None else Path(directory)
        self._snapshots: dict[int, Snapshot] = {}
        self._pid = os.getpid()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, index: int) -> Path:
        assert self.directory is not None
        return self.directory / f"snapshot-{index:09d}.pkl"

    def __len__(self) -> int:
        if self.directory is None:
            return len(self._snapshots)
        return sum(1 for _ in self.directory.glob("snapshot-*.pkl"))

    def add(self, snap: Snapshot) -> int:
        """Append a snapshot; returns its index (0, 1, 2, ...)."""
        if not isinstance(snap, Snapshot):
            raise TypeError(
                f"SnapshotStore.add expects a Snapshot (made by snapshot(env)); got {type(snap).__name__}."
            )
        if self.directory is None:
            index = len(self._snapshots)
        else:
            tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
            try:
                tmp.write_bytes(pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL))
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                tmp.unlink(missing_ok=True)
                raise SnapshotError(
                    f"SnapshotStore(directory=...) pickles its snapshots and this one cannot be pickled "
                    f"({type(e).__name__}: {e}); use a memory store (directory=None)."
                ) from e
            index = len(self)
            while True:
                try:
                    os.link(tmp, self._path(index))
                    break
                except FileExistsError:
                    index += 1
            tmp.unlink()
        self._snapshots[index] = snap
        return index

    def capture(self, env: Any, *, observation: Any = None, method: SnapshotMethod = "auto") -> int:
        """``add(snapshot(env, observation=..., method=...))``: save the env's current state."""
        return self.add(snapshot(env, observation=observation, method=method))

    def __getitem__(self, index: int) -> Snapshot:
        i = _index(index, "SnapshotStore")
        snap = self._snapshots.get(i)
        if snap is not None:
            return snap
        if self.directory is not None and self._path(i).exists():
            loaded = pickle.loads(self._path(i).read_bytes())
            if not isinstance(loaded, Snapshot):
                raise TypeError(f"{self._path(i)} holds a {type(loaded).__name__}, not a Snapshot.")
            self._snapshots[i] = loaded
            return loaded
        n = len(self)
        msg = f"snapshot {i} is not in the store ({n} snapshot(s): indices 0..{n - 1})."
        if n == 0:
            msg = f"snapshot {i} is not in the store: it is empty (add snapshots with store.capture(env))."
        if self.directory is None and os.getpid() != self._pid:
            msg += (
                f" This process (pid {os.getpid()}) holds a copy of the store made when it started (e.g. "
                f"an AsyncVectorEnv worker): snapshots added afterwards in process {self._pid} are not "
                f"in it. Use SnapshotStore(directory=...) to share snapshots between processes."
            )
        raise IndexError(msg)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.directory is not None:
            state["_snapshots"] = {}  # the other process reads them from the directory
        return state


# ---- the wrapper --------------------------------------------------------------------------------
class SnapshotReset:
    """gymnasium Wrapper whose ``reset(seed=i)`` restores snapshot i of a `SnapshotStore`.

    It is a real ``gymnasium.Wrapper`` (``isinstance(w, gymnasium.Wrapper)``; other wrappers can
    wrap it); the class is completed on first use so that importing this module does not import
    gymnasium. The seed of `EpisodePolicy`'s groups indexes the store::

        store = SnapshotStore()
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=0)
        for _ in range(20):
            obs, *_ = env.step(env.action_space.sample())
        i = store.capture(env, observation=obs)           # index 0
        policy = EpisodePolicy(lambda: SnapshotReset(gym.make("CartPole-v1"), store), net)
        groups = policy.generate_actions([i], 8)          # 8 episodes from exactly that state

    ``reset(seed=i)`` first resets the inner env (so wrappers of unknown state start a new episode;
    ``reset_inner=False`` skips that, for envs whose reset is expensive), then restores snapshot i
    (`restore`) and returns ``(snapshot.observation, {"snapshot": i})``. ``reset()`` without a seed (a vector
    env's autoreset) restores the last snapshot again.

    Args:
        env: the env to restore into (an instance, not a factory).
        store: the shared `SnapshotStore`.
        reset_time_limit: give each restored episode a fresh ``TimeLimit`` budget instead of the
            steps left when the snapshot was taken.
        reset_inner: call the inner env's ``reset`` before restoring.

    Attributes:
        last_index: the snapshot restored by the last reset (None before the first).
    """

    env: Any
    store: SnapshotStore
    reset_time_limit: bool
    reset_inner: bool
    last_index: int | None

    def __new__(cls, *args: Any, **kwargs: Any) -> SnapshotReset:
        impl = _snapshot_reset_class() if cls is SnapshotReset else cls
        return object.__new__(impl)

    def __init__(
        self, env: Any, store: SnapshotStore, *, reset_time_limit: bool = False, reset_inner: bool = True
    ) -> None:
        _chain(env)  # a gymnasium.Env, or a TypeError that says so
        if not isinstance(store, SnapshotStore):
            raise TypeError(
                f"SnapshotReset needs a grpo.gym_resets.SnapshotStore; got {type(store).__name__}."
            )
        _gym().Wrapper.__init__(self, env)
        self.store = store
        self.reset_time_limit = reset_time_limit
        self.reset_inner = reset_inner
        self.last_index = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Restore snapshot ``seed`` (or the last one when ``seed`` is None); see the class docs."""
        if seed is None:
            if self.last_index is None:
                raise ValueError(
                    "SnapshotReset.reset() needs seed=<snapshot index> (the GRPO state); reset() without a "
                    "seed restores the last snapshot, and none was restored yet."
                )
            index = self.last_index
        else:
            index = _index(seed, "SnapshotReset.reset(seed=...)")
        snap = self.store[index]
        if self.reset_inner:
            self.env.reset(seed=index, options=options)
        obs = restore(self.env, snap, reset_time_limit=self.reset_time_limit)
        self.last_index = index
        return obs, {"snapshot": index}

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (_new_snapshot_reset, (), dict(self.__dict__))


@functools.cache
def _snapshot_reset_class() -> type[SnapshotReset]:
    gym = _gym()
    impl = type(
        "SnapshotReset",
        (SnapshotReset, gym.Wrapper),
        {"__module__": __name__, "__qualname__": "SnapshotReset", "__doc__": SnapshotReset.__doc__},
    )
    return impl


def _new_snapshot_reset() -> SnapshotReset:
    return object.__new__(_snapshot_reset_class())


# ---- nearest-start grouping ---------------------------------------------------------------------
def _as_matrix(x: Tensor | np.ndarray | Sequence[Any], where: str) -> np.ndarray:
    a = x.detach().cpu().double().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{where}: start observations must be (N, d); got shape {a.shape}.")
    if not np.isfinite(a).all():
        raise ValueError(f"{where}: start observations contain NaN or inf.")
    return a


def _standardize(x: np.ndarray) -> np.ndarray:
    """z = (x - mean) / std per column over the batch; constant columns become 0."""
    mean = x.mean(0)
    std = x.std(0)
    keep = std > 1e-12 * (1.0 + np.abs(mean))
    z = np.zeros_like(x)
    z[:, keep] = (x[:, keep] - mean[keep]) / std[keep]
    return z


def _sq_dists(z: np.ndarray) -> np.ndarray:
    sq = (z * z).sum(1)
    d2: np.ndarray = sq[:, None] + sq[None, :] - 2.0 * (z @ z.T)
    np.maximum(d2, 0.0, out=d2)
    np.fill_diagonal(d2, 0.0)
    return d2


def group_by_nearest_start(starts: Tensor | np.ndarray, group_size: int) -> np.ndarray:
    """Partition N episodes into N/G groups of G whose start observations are close.

    Algorithm (greedy, deterministic): standardise each column of ``starts`` over the batch
    (``z = (x - mean) / std``; constant columns are dropped), then repeat until every episode is
    grouped: among the ungrouped episodes take the one farthest from their centroid (an outlier
    picks its neighbours first, before they are taken), and group it with its G-1 nearest ungrouped
    episodes (Euclidean distance in z; ties go to the lower index).

    Cost: ``O(N^2 d)`` time and ``O(N^2)`` memory for the distance matrix, plus ``O(N log N)`` per
    group, i.e. ``O(N^2 (d + log N / G))``: measured 4 ms for N = 256 and 0.4 s for N = 2048
    (d = 4, one CPU core).

    Args:
        starts: ``(N, d)`` start observations (or features of them); N must be a multiple of G.
        group_size: G.

    Returns:
        ``(N // G, G)`` int64 episode indices; row b is group b, its first entry the outlier that
        opened it.
    """
    x = _as_matrix(starts, "group_by_nearest_start")
    n = x.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_by_nearest_start: group_size={group_size!r}, expected an int >= 1.")
    if n == 0 or n % group_size:
        raise ValueError(f"group_by_nearest_start: {n} episodes do not split into groups of {group_size}.")
    z = _standardize(x)
    d2 = _sq_dists(z)
    ungrouped = np.arange(n)
    groups = []
    while ungrouped.size:
        zu = z[ungrouped]
        far = int(ungrouped[np.argmax(((zu - zu.mean(0)) ** 2).sum(1))])
        others = ungrouped[ungrouped != far]
        nearest = others[np.lexsort((others, d2[far, others]))[: group_size - 1]]
        members = np.concatenate(([far], nearest))
        groups.append(members)
        ungrouped = np.setdiff1d(ungrouped, members, assume_unique=True)
    out: np.ndarray = np.stack(groups).astype(np.int64)
    return out


def _check_groups(groups: Any, n: int) -> np.ndarray:
    g = np.asarray(groups)
    if g.ndim != 2 or g.size != n or not np.array_equal(np.sort(g.ravel()), np.arange(n)):
        raise ValueError(
            f"grouping_stats: groups must be a (B, G) array holding every episode index 0..{n - 1} once; "
            f"got shape {g.shape}."
        )
    return g.astype(np.int64)


def grouping_stats(
    starts: Tensor | np.ndarray,
    returns: Tensor | np.ndarray | Sequence[float],
    groups: Any,
    *,
    degree: int | None = None,
) -> dict[str, float]:
    """How far apart the starts of each group are, and how much of the returns that explains.

    Notation: N episodes in B groups of G; ``z_i`` the standardised start observation of episode
    i (as in `group_by_nearest_start`), ``R_i`` its return, ``g(i)`` its group, bars group means.

    * ``start_dist_within`` = mean over the pairs i < j of one group of ``||z_i - z_j||``.
    * ``start_dist_random`` = mean over all pairs i < j of the batch of ``||z_i - z_j||``: what a
      random partition gives in expectation.
    * ``start_dist_ratio`` = within / random: 0 = every group starts from one state (real resets),
      about 1 = groups no better than random.
    * ``start_share`` (the bias diagnostic): the share of the within-group return variance that
      the start observations explain. Features ``phi_i = [z_i, z_i^2]`` (elementwise square, so an
      even dependence like ``|angle|`` is caught; ``phi_i = z_i`` when ``degree=1``). With
      ``R~_i = R_i - Rbar_g(i)`` and ``phi~_i = phi_i - phibar_g(i)``, least squares
      ``beta = argmin sum_i (R~_i - phi~_i beta)^2``, ``SST = sum_i R~_i^2``,
      ``SSR = sum_i (R~_i - phi~_i beta)^2``, ``p = rank(phi~)``:
      ``start_share = clip(1 - (SSR / (N - B - p)) / (SST / (N - B)), 0, 1)``, the adjusted R^2 of
      the within-group (fixed-effects) regression. It estimates
      ``Var_within(f(x)) / Var_within(R)`` for ``f(x)`` = the expected return from start x: the
      share of GRPO's advantage numerator ``R_i - mean_g R`` that is due to where episode i
      started rather than how it acted. 0 when all starts of a group are equal (real resets),
      about 0 when the return does not depend on the start, NaN when ``N - B - p <= 0``.
    * ``start_share_raw``: the same without the degrees-of-freedom correction, ``1 - SSR / SST``.
    * ``start_share_degree``: the degree used, 1 or 2.
    * ``return_std_within`` = ``sqrt(SST / (N - B))``: the pooled within-group std of the returns.
    * ``start_bias_std`` = ``sqrt(start_share) * return_std_within``: the typical size, in return
      units, of the start-state part of ``R_i - mean_g R``.

    Args:
        starts: ``(N, d)`` start observations (or features of them).
        returns: ``(N,)`` episode returns.
        groups: ``(B, G)`` episode indices, a partition of ``range(N)`` (e.g. from
            `group_by_nearest_start`, or ``np.arange(N).reshape(B, G)``).
        degree: 1 (linear in z) or 2 (z and z^2). None: 2 when ``N - B >= 8 d`` (at least four
            within-group degrees of freedom per coefficient), else 1.

    Returns:
        dict of floats with the keys above.
    """
    x = _as_matrix(starts, "grouping_stats")
    n = x.shape[0]
    r = (
        returns.detach().cpu().double().numpy()
        if isinstance(returns, Tensor)
        else np.asarray(returns, dtype=np.float64)
    ).reshape(-1)
    if r.shape[0] != n:
        raise ValueError(f"grouping_stats: {n} start observations but {r.shape[0]} returns.")
    grp = _check_groups(groups, n)
    b, g = grp.shape
    z = _standardize(x)
    d = np.sqrt(_sq_dists(z))
    iu = np.triu_indices(n, 1)
    random = float(d[iu].mean()) if n > 1 else 0.0
    if g > 1:
        gi, gj = np.triu_indices(g, 1)
        within = float(np.linalg.norm(z[grp[:, gi]] - z[grp[:, gj]], axis=-1).mean())  # exact differences
    else:
        within = 0.0
    ratio = within / random if random > 0 else 0.0
    dims = z.shape[1]
    if degree is None:
        degree = 2 if n - b >= 8 * dims else 1
    if degree not in (1, 2):
        raise ValueError(f"grouping_stats: degree={degree!r}, expected 1, 2 or None.")
    phi = np.concatenate([z, z * z], 1) if degree == 2 else z  # (N, d * degree)
    zc = phi[grp] - phi[grp].mean(1, keepdims=True)  # (B, G, d * degree)
    rc = r[grp] - r[grp].mean(1, keepdims=True)  # (B, G)
    xw, yw = zc.reshape(n, -1), rc.reshape(n)
    sst = float(yw @ yw)
    dof = n - b
    if sst > 0 and dof > 0:
        beta, _, rank, _ = np.linalg.lstsq(xw, yw, rcond=None)
        resid = yw - xw @ beta
        ssr = float(resid @ resid)
        raw = 1.0 - ssr / sst
        share = (
            float(np.clip(1.0 - (ssr / (dof - rank)) / (sst / dof), 0.0, 1.0)) if dof > rank else float("nan")
        )
    else:
        raw, share = 0.0, 0.0
    std_within = float(np.sqrt(sst / dof)) if dof > 0 else 0.0
    return {
        "start_dist_within": within,
        "start_dist_random": random,
        "start_dist_ratio": ratio,
        "start_share": share,
        "start_share_raw": float(np.clip(raw, 0.0, 1.0)),
        "return_std_within": std_within,
        "start_bias_std": float(np.sqrt(share) * std_within) if np.isfinite(share) else float("nan"),
        "start_share_degree": float(degree),
    }


def _episode_seed(state: int, j: int) -> int:
    """Seed of member j of the group drawn for GRPO state ``state``: independent starts."""
    return int(np.random.SeedSequence([state, j]).generate_state(1, np.uint32)[0])


class NearestStartPolicy(EpisodePolicy):
    """`EpisodePolicy` for envs that cannot reset to one state: groups of nearby random starts.

    ``generate_actions(states (B), G)`` plays N = B·G episodes, each from its own random start
    (episode j of state s is reset with the seed ``SeedSequence([s, j])`` draws; ``Episode.seed``
    records it), then partitions them into B groups of G by nearest start observation
    (`group_by_nearest_start`; ``grouping="random"`` keeps the play order instead, i.e. groups of
    independent random starts: the ablation). The B groups are returned in place of the B states,
    so the group advantage compares episodes that started close together. The grouping looks only
    at start observations, never at actions or returns, so the baseline stays independent of each
    episode's own actions given its start.

    After every batch ``last_grouping_stats`` holds `grouping_stats` of the chosen grouping plus
    ``start_share_random`` (the same diagnostic for the play-order grouping of the same batch,
    i.e. what groups of random starts would have had) and ``num_episodes``; log it each step, e.g.
    ``metrics.update({f"grouping/{k}": v for k, v in policy.last_grouping_stats.items()})``. A
    `StartStateBiasWarning` is issued the first time ``start_share`` exceeds ``warn_start_share``
    (once per policy, not every step).

    Args:
        env, policy, max_steps, vectorization_mode, env_kwargs: as for `EpisodePolicy`
            (``check_group_reset`` is always False: the starts differ by design).
        grouping: ``"nearest"`` (default) or ``"random"``.
        start_features: optional map ``(N, obs_dim) -> (N, k)`` float Tensor from start
            observations to the features to group by and diagnose (e.g. an angle from its cos
            and sin, or only the dimensions that matter). Default: the observation itself.
        gamma: discount of the returns in the diagnostic (use the `EpisodeReturn`'s).
        warn_start_share: warn when ``start_share`` is above this (default 0.5: start states
            explain more of the within-group return variance than the actions do; None = never
            warn).
    """

    def __init__(
        self,
        env: str | Callable[[], Any],
        policy: nn.Module,
        *,
        grouping: Literal["nearest", "random"] = "nearest",
        start_features: Callable[[Tensor], Tensor] | None = None,
        gamma: float = 1.0,
        warn_start_share: float | None = 0.5,
        max_steps: int | None = None,
        vectorization_mode: str = "sync",
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if grouping not in ("nearest", "random"):
            raise ValueError(f"grouping={grouping!r}: choose 'nearest' or 'random'.")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma={gamma!r}: expected 0 < gamma <= 1.")
        super().__init__(
            env,
            policy,
            max_steps=max_steps,
            vectorization_mode=vectorization_mode,
            check_group_reset=False,
            env_kwargs=env_kwargs,
        )
        self.grouping = grouping
        self.start_features = start_features
        self.gamma = gamma
        self.warn_start_share = warn_start_share
        self.last_grouping_stats: dict[str, float] = {}
        self._warned = False

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> list[list[Episode]]:
        """Play B·G episodes from independent starts; return B groups of G nearby starts."""
        seeds = _seeds(states)
        g = num_actions_per_state
        flat_seeds = [_episode_seed(s, j) for s in seeds for j in range(g)]
        envs = self._pool.get(len(flat_seeds))
        episodes = run_episodes(self.policy, envs, flat_seeds, max_steps=self.max_steps, **kwargs)
        self.env_steps += int(sum(e.length for e in episodes))
        starts = torch.stack([e.observations[0] for e in episodes])
        if self.start_features is not None:
            starts = self.start_features(starts)
        rewards = torch.stack([e.rewards for e in episodes])
        mask = torch.stack([e.mask for e in episodes])
        returns = discounted_returns(rewards, mask, self.gamma)
        play_order = np.arange(len(episodes)).reshape(len(seeds), g)
        groups = group_by_nearest_start(starts, g) if self.grouping == "nearest" else play_order
        stats = grouping_stats(starts, returns, groups)
        stats["start_share_random"] = (
            stats["start_share"]
            if self.grouping == "random"
            else grouping_stats(starts, returns, play_order)["start_share"]
        )
        stats["num_episodes"] = float(len(episodes))
        self.last_grouping_stats = stats
        logger.debug("nearest-start grouping: %s", stats)
        share = stats["start_share"]
        exceeded = self.warn_start_share is not None and np.isfinite(share) and share > self.warn_start_share
        if exceeded and not self._warned:
            self._warned = True
            warnings.warn(
                f"start states explain {share:.0%} of the within-group return variance (> "
                f"warn_start_share={self.warn_start_share}; random groups: "
                f"{stats['start_share_random']:.0%}): GRPO's group baseline is mostly comparing start "
                f"states. Raise batch_size (denser starts), group by fewer/better start_features, or "
                f"restore snapshots (SnapshotReset) if the env allows it. (Warned once; "
                f"policy.last_grouping_stats has the value of every step.)",
                StartStateBiasWarning,
                stacklevel=2,
            )
        return [[episodes[int(i)] for i in row] for row in groups]

    def __deepcopy__(self, memo: dict[int, Any]) -> NearestStartPolicy:
        new = super().__deepcopy__(memo)
        new.__class__ = type(self)  # EpisodePolicy.__deepcopy__ builds an EpisodePolicy
        assert isinstance(new, NearestStartPolicy)
        new.grouping = self.grouping
        new.start_features = self.start_features
        new.gamma = self.gamma
        new.warn_start_share = self.warn_start_share
        new.last_grouping_stats = dict(self.last_grouping_stats)
        new._warned = self._warned
        return new
