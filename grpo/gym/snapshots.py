"""Groups without resets, when the env can save and restore its state: snapshot / restore.

GRPO's group baseline needs the G episodes of a group to start from one state (see
`grpo.gym.episodes`). `EpisodePolicy` gets that from ``env.reset(seed=s)``. This module covers the
environments that cannot reset to a chosen state but whose simulator state can be captured and set
(gymnasium is imported lazily, as in `grpo.gym.episodes`); for envs that cannot restore either, see
`grpo.gym.grouping`. `grpo.gym.resets` re-exports both.

`snapshot` / `restore` capture and set the full simulator state, and the `SnapshotReset` wrapper's
``reset(seed=i)`` restores snapshot i of a `SnapshotStore`. States reached any way (playing a
long-running simulation, a scripted curriculum, a recorded demonstration) become GRPO states: the
seed indexes a snapshot::

    store = SnapshotStore()
    ...; store.capture(env, observation=obs)                 # -> index i, any number of times
    policy = EpisodePolicy(lambda: SnapshotReset(gym.make("CartPole-v1"), store), net)
    trainer.step([i, j, k])                                  # G episodes from each snapshot

What a snapshot holds (``Snapshot.method``):

* ``"classic_control"``: gymnasium's CartPole, Acrobot, Pendulum, MountainCar and
  MountainCarContinuous: ``env.unwrapped.state`` plus the attributes that shape the future
  (CartPole's ``steps_beyond_terminated``, Pendulum's ``last_u``) and the env's ``np_random``
  generator (Acrobot's optional torque noise then repeats exactly).
* ``"mujoco"``: any env holding a ``mujoco.MjModel`` ``model`` and a ``mujoco.MjData`` ``data``
  (gymnasium's MuJoCo envs, MetaWorld): MuJoCo's full integration state (``mj_getState`` with
  ``mjSTATE_INTEGRATION``), the model arrays envs move at reset, and the env's Python attributes
  that are plain data (its frame stack, targets, step counter, ``np_random``; see
  `grpo.gym.mujoco_state`).
* ``"deepcopy"``: ``copy.deepcopy`` of the whole wrapper chain, restored in place layer by layer.
  Only when asked for (``method="deepcopy"``): for pure-Python envs and stateful wrappers
  (observation normalisers, frame stacks), whose state the other two methods do not hold.

Exact or refused: before a method is trusted for an env class, the replay check of
`grpo.gym.snapshot_check` plays 8 actions from the snapshot, restores, plays them again and
compares the two continuations bitwise; a difference refuses the method with a `SnapshotError`
naming it (once per method and env class per process; ``check="always"`` checks every capture).
``method="auto"`` never falls back to ``deepcopy``: an env with no exact method is refused with a
`SnapshotError` that says what to do. (A deep copy of a MetaWorld env, for one, rebuilds its
simulator from the model file and loses the mocap and placement state.)

The other two methods also carry the ``TimeLimit`` step counter, so a restored episode is truncated
where the original would have been (``reset_time_limit=True`` starts a fresh time budget instead).
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from grpo.gym.gymnasium_lib import import_gymnasium
from grpo.gym.mujoco_state import capture_mujoco, is_mujoco_env, restore_mujoco, same_value
from grpo.gym.snapshot_check import replay_check

__all__ = [
    "Snapshot",
    "SnapshotError",
    "SnapshotReset",
    "SnapshotStore",
    "restore",
    "snapshot",
]

SnapshotMethod = Literal["auto", "classic_control", "mujoco", "deepcopy"]
ReplayCheck = Literal["once", "always"]


class SnapshotError(TypeError):
    """The env cannot be snapshotted exactly: no exact method applies, the method failed the replay
    check, ``copy.deepcopy`` fails, or (for a store with a directory) pickling fails."""


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
    gym = import_gymnasium()
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


def _derive_observation(layers: list[Any], method: str, state: dict[str, Any]) -> np.ndarray:
    """The observation of the current state, computed from the unwrapped env (``state``: the
    captured state; a ``"mujoco"`` env whose ``_get_obs()`` changes its own attributes is put back
    and refused)."""
    gym = import_gymnasium()
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
            obs = np.array(fn(), copy=True)
            _refuse_changing_getter(unwrapped, getter, state)
            return obs
    raise ValueError(
        f"snapshot() cannot compute the observation of {_qualname(unwrapped)} (it has no _get_obs()): "
        f"pass observation= (the last observation the env returned)."
    )


def _refuse_changing_getter(unwrapped: Any, getter: str, state: dict[str, Any]) -> None:
    """After ``unwrapped.<getter>()``: put back and refuse the attributes it changed (``"mujoco"``)."""
    saved = state.get("python")
    if saved is None:
        return
    changed = [k for k, v in saved.items() if not same_value(getattr(unwrapped, k, None), v)]
    if changed:
        for k in changed:
            setattr(unwrapped, k, copy.deepcopy(saved[k]))
        raise ValueError(
            f"snapshot() cannot compute the observation of {_qualname(unwrapped)}: its {getter}() changes "
            f"the env ({changed}; e.g. a frame stack). Pass observation= (the last observation the env "
            f"returned)."
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
def snapshot(
    env: Any, *, observation: Any = None, method: SnapshotMethod = "auto", check: ReplayCheck = "once"
) -> Snapshot:
    """Capture the full state of ``env`` (a gymnasium env, wrapped or not) after reset or a step.

    Args:
        env: the env whose current state to save. It must have been reset.
        observation: the last observation ``env`` returned. Needed when a wrapper transforms
            observations or the env cannot compute it without changing itself (MetaWorld's
            ``_get_obs()`` shifts its frame stack); otherwise computed from the state.
        method: ``"auto"`` picks ``"classic_control"`` for gymnasium's classic-control envs,
            ``"mujoco"`` for envs with a MuJoCo ``model`` and ``data``, and refuses any other env;
            ``"deepcopy"`` only when named.
        check: run the replay check (`grpo.gym.snapshot_check`) on the first capture of each
            method and env class (``"once"``) or on every capture (``"always"``). It steps the
            unwrapped env and leaves it restored to the snapshot.

    Returns:
        A `Snapshot`; ``restore(other_env, snap)`` puts any env of the same kind into this state.

    Raises:
        SnapshotError: no exact method applies, the method does not apply, the replay check
            failed, or ``copy.deepcopy`` of the env fails.
        ValueError: the env was never reset, or the observation is missing or of the wrong shape.
    """
    if method not in ("auto", "classic_control", "mujoco", "deepcopy"):
        raise ValueError(f"method={method!r}: choose 'auto', 'classic_control', 'mujoco' or 'deepcopy'.")
    if check not in ("once", "always"):
        raise ValueError(f"check={check!r}: choose 'once' (first capture of each env class) or 'always'.")
    layers = _chain(env)
    unwrapped = layers[-1]
    method = _snapshot_method(method, unwrapped)
    state = _capture_state(env, unwrapped, method)
    obs = _derive_observation(layers, method, state) if observation is None else observation
    obs = _check_observation(obs, env.observation_space, "snapshot()")
    limits = _time_limits(layers)
    elapsed = limits[0]._elapsed_steps if limits and method != "deepcopy" else None
    snap = Snapshot(
        method=method,
        observation=obs,
        observation_space=copy.deepcopy(env.observation_space),
        action_space=copy.deepcopy(env.action_space),
        env_type=_qualname(unwrapped),
        wrappers=tuple(_qualname(layer) for layer in layers),
        elapsed_steps=elapsed,
        state=state,
    )
    skipped = state.get("skipped", ())
    verdict = replay_check(env, unwrapped, snap, restore, always=check == "always", skipped=skipped)
    if verdict is not None:
        raise SnapshotError(
            f"snapshot(method={method!r}) is not exact for {snap.env_type}: {verdict}. Make the state "
            f"that shapes the env's future plain attributes of the env (numbers, arrays, numpy "
            f"generators) or MuJoCo state, seed its starts instead (grpo.gym.seeded_starts."
            f"SeededStarts) or group by nearest start states (NearestStartPolicy)."
        )
    return snap


def _snapshot_method(method: SnapshotMethod, unwrapped: Any) -> SnapshotMethod:
    """The method `snapshot` uses: ``"auto"`` resolved, an explicit one checked against the env."""
    classic = _classic_control_spec(unwrapped)
    if method == "auto":
        if classic:
            return "classic_control"
        if is_mujoco_env(unwrapped):
            return "mujoco"
        raise SnapshotError(
            f"snapshot(): no exact snapshot method for {_qualname(unwrapped)}: it is not one of "
            f"gymnasium's classic-control envs and holds no MuJoCo model and data (env.model, env.data). "
            f"Make reset(seed=s) give start s (grpo.gym.seeded_starts.SeededStarts), pass "
            f"method='deepcopy' if copy.deepcopy(env) copies its whole state (it is replay-checked too), "
            f"or group by nearest start states (NearestStartPolicy)."
        )
    if method == "classic_control" and classic is None:
        raise SnapshotError(
            f"method='classic_control' needs gymnasium's CartPole, Acrobot, Pendulum, MountainCar or "
            f"MountainCarContinuous; the env is {_qualname(unwrapped)}. Use method='auto'."
        )
    if method == "mujoco" and not is_mujoco_env(unwrapped):
        raise SnapshotError(
            f"method='mujoco' needs an env holding a mujoco.MjModel as env.model and a mujoco.MjData as "
            f"env.data (gymnasium's MuJoCo envs, MetaWorld; mujoco >= 3.1); {_qualname(unwrapped)} "
            f"has not. Use method='auto'."
        )
    return method


def _capture_state(env: Any, unwrapped: Any, method: SnapshotMethod) -> dict[str, Any]:
    """`Snapshot.state`: what ``method`` saves of ``env`` (see the module docstring)."""
    if method == "classic_control":
        return _classic_control_state(unwrapped)
    if method == "mujoco":
        return capture_mujoco(unwrapped)
    try:
        return {"env": copy.deepcopy(env)}
    except Exception as e:
        raise SnapshotError(
            f"cannot snapshot {_qualname(unwrapped)} with method='deepcopy': copy.deepcopy(env) failed "
            f"({type(e).__name__}: {e}). Make it deep-copyable, seed its starts "
            f"(grpo.gym.seeded_starts.SeededStarts), or group by nearest start states (NearestStartPolicy)."
        ) from e


def _classic_control_state(unwrapped: Any) -> dict[str, Any]:
    """The attributes that define a classic-control env's future, and its ``np_random``."""
    spec = _classic_control_spec(unwrapped)
    assert spec is not None
    if getattr(unwrapped, "state", None) is None:
        raise ValueError(f"snapshot(): {_qualname(unwrapped)} has no state yet; call env.reset() first.")
    state = {name: copy.deepcopy(getattr(unwrapped, name)) for name in spec[0]}
    state["_np_random"] = copy.deepcopy(getattr(unwrapped, "_np_random", None))
    return state


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
        raise TypeError(f"restore() expects a grpo.gym.resets.Snapshot; got {type(snap).__name__}.")
    layers = _chain(env)
    _check_same_kind(env, snap, _qualname(layers[-1]))
    if snap.method != "deepcopy" and _never_reset(layers):
        # OrderEnforcing / PassiveEnvChecker refuse a step before the first reset. Reset below any
        # SnapshotReset layer (whose own reset would restore a snapshot of its store).
        inner = max((k for k, layer in enumerate(layers) if isinstance(layer, SnapshotReset)), default=-1)
        layers[inner + 1].reset()
    if snap.method == "classic_control":
        _restore_classic_control(layers[-1], snap.state)
    elif snap.method == "mujoco":
        restore_mujoco(layers[-1], snap.state)
    elif snap.method == "deepcopy":
        _restore_deepcopy(layers, snap)
    else:
        raise ValueError(f"restore(): unknown snapshot method {snap.method!r}.")
    _restore_counters(layers, snap, reset_time_limit)
    return np.array(snap.observation, copy=True)


def _check_same_kind(env: Any, snap: Snapshot, env_type: str) -> None:
    """`restore`: the env has the snapshot's spaces and (except for "deepcopy") its class."""
    for what, have, want in (
        ("observation", env.observation_space, snap.observation_space),
        ("action", env.action_space, snap.action_space),
    ):
        if have != want:
            raise ValueError(
                f"restore(): mismatched {what} spaces: the snapshot was taken in {want}, the env has "
                f"{have} (snapshot of {snap.env_type}, env {env_type})."
            )
    if snap.method != "deepcopy" and env_type != snap.env_type:
        raise ValueError(f"restore(): the snapshot is of a {snap.env_type}, the env is a {env_type}.")


def _restore_classic_control(unwrapped: Any, st: dict[str, Any]) -> None:
    for name, value in st.items():
        if name != "_np_random":
            setattr(unwrapped, name, copy.deepcopy(value))


def _restore_deepcopy(layers: list[Any], snap: Snapshot) -> None:
    """Copy each layer of a fresh copy of the saved chain into ``layers``, in place."""
    saved = [_qualname(layer) for layer in layers]
    if tuple(saved) != snap.wrappers:
        raise ValueError(
            f"restore(): a 'deepcopy' snapshot restores into the same wrapper chain; the snapshot "
            f"has {list(snap.wrappers)}, the env {saved}."
        )
    fresh = _chain(copy.deepcopy(snap.state["env"]))
    for k, (target, source) in enumerate(zip(layers, fresh, strict=True)):
        inner = target.__dict__.get("env")
        target.__dict__.clear()
        target.__dict__.update(source.__dict__)
        if k < len(layers) - 1:  # a wrapper keeps pointing at its own inner env
            target.__dict__["env"] = inner


def _restore_counters(layers: list[Any], snap: Snapshot, reset_time_limit: bool) -> None:
    """The env's ``np_random``, the ``TimeLimit`` step counters and OrderEnforcing's reset flag."""
    st = snap.state
    if snap.method != "deepcopy":
        if st.get("_np_random") is not None:
            layers[-1].np_random = copy.deepcopy(st["_np_random"])
        for limit in _time_limits(layers):
            limit._elapsed_steps = snap.elapsed_steps if snap.elapsed_steps is not None else 0
    if reset_time_limit:
        for limit in _time_limits(layers):
            limit._elapsed_steps = 0
    for layer in layers:  # OrderEnforcing: stepping a restored env is allowed
        if hasattr(layer, "_has_reset"):
            layer._has_reset = True


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
                f"SnapshotReset needs a grpo.gym.resets.SnapshotStore; got {type(store).__name__}."
            )
        import_gymnasium().Wrapper.__init__(self, env)
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
    gym = import_gymnasium()
    impl = type(
        "SnapshotReset",
        (SnapshotReset, gym.Wrapper),
        {"__module__": __name__, "__qualname__": "SnapshotReset", "__doc__": SnapshotReset.__doc__},
    )
    return impl


def _new_snapshot_reset() -> SnapshotReset:
    return object.__new__(_snapshot_reset_class())
