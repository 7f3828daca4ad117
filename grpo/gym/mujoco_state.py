"""The full state of a MuJoCo env, for `grpo.gym.snapshots`' ``"mujoco"`` method.

Three parts, each captured by `capture_mujoco` and set back by `restore_mujoco`:

* **physics**: MuJoCo's own full integration state, ``mj_getState(model, data, mjSTATE_INTEGRATION)``:
  time, qpos, qvel, act, the plugin and history state (``mjSTATE_FULLPHYSICS``), the controls and
  applied forces, mocap poses, userdata and equality activations (``mjSTATE_USER``) and the
  constraint solver's warm start (``mjSTATE_WARMSTART``). ``mj_setState``, ``mj_forward`` (which
  recomputes the derived quantities, ``xpos`` and the like, but also overwrites
  ``qacc_warmstart``) and ``mj_setState`` again restore it.
* **model placement**: the model arrays that envs move at reset (`MODEL_FIELDS`: MetaWorld places its
  drawer with ``model.body("drawer").pos`` and its goal with ``model.site("goal").pos``). The
  integration state does not hold them, so a restore into another env of the same class would
  otherwise keep that env's placement.
* **Python attributes**: every attribute of the unwrapped env whose value is plain data
  (`is_plain`: None, numbers, strings, numpy arrays and scalars, numpy generators, gymnasium spaces,
  and lists, tuples and dicts of those): MetaWorld's ``_target_pos``, ``obj_init_pos``,
  ``_prev_obs`` (its frame stack), ``curr_path_length``, ``_last_rand_vec``, ``np_random``, ...
  Attributes holding other objects are not captured; their names are kept (``skipped``) so that a
  failed replay check (`grpo.gym.snapshot_check`) can name them.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

__all__ = ["MODEL_FIELDS", "capture_mujoco", "is_mujoco_env", "is_plain", "restore_mujoco", "same_value"]

MODEL_FIELDS = (
    "body_pos",
    "body_quat",
    "site_pos",
    "site_quat",
    "geom_pos",
    "geom_quat",
    "geom_size",
    "eq_data",
)
"""Model arrays a snapshot carries: the ones envs move at reset (bodies, sites, geoms, weld targets)."""

_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic, np.random.Generator)


def _mujoco() -> Any:
    try:
        import mujoco  # type: ignore[import-untyped]
    except ImportError:
        return None
    return mujoco if hasattr(mujoco, "mj_getState") else None


def is_mujoco_env(unwrapped: Any) -> bool:
    """The env holds a ``mujoco.MjModel`` as ``model`` and a ``mujoco.MjData`` as ``data``."""
    mj = _mujoco()
    return (
        mj is not None
        and isinstance(getattr(unwrapped, "model", None), mj.MjModel)
        and isinstance(getattr(unwrapped, "data", None), mj.MjData)
    )


def is_plain(value: Any, depth: int = 0) -> bool:
    """Plain data, safe and cheap to deep-copy: see the module docstring (containers up to 4 deep)."""
    if isinstance(value, (*_PLAIN, np.random.RandomState, np.random.BitGenerator)):
        return not (isinstance(value, np.ndarray) and value.dtype == object)
    from gymnasium import spaces

    if isinstance(value, spaces.Space):
        return True
    if depth < 4 and isinstance(value, (list, tuple)):
        return all(is_plain(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return all(isinstance(k, (str, int)) and is_plain(v, depth + 1) for k, v in value.items())
    return False


def same_value(a: Any, b: Any) -> bool:
    """Two plain values (`is_plain`) are equal: arrays and floats bitwise, generators by their state."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, (float, np.floating)):
        return bool(np.float64(a).tobytes() == np.float64(b).tobytes())
    if isinstance(a, np.random.Generator):
        return same_value(a.bit_generator.state, b.bit_generator.state)
    if isinstance(a, np.random.RandomState):
        return same_value(a.get_state(legacy=False), b.get_state(legacy=False))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def capture_mujoco(unwrapped: Any) -> dict[str, Any]:
    """``{"physics", "physics_spec", "model", "python", "skipped"}`` of the env (module docstring)."""
    mj = _mujoco()
    model, data = unwrapped.model, unwrapped.data
    spec = int(mj.mjtState.mjSTATE_INTEGRATION)
    physics = np.empty(mj.mj_stateSize(model, spec), dtype=np.float64)
    mj.mj_getState(model, data, physics, spec)
    attrs = vars(unwrapped)
    python = {k: v for k, v in attrs.items() if k not in ("model", "data") and is_plain(v)}
    return {
        "physics": physics,
        "physics_spec": spec,
        "model": {name: np.array(getattr(model, name), copy=True) for name in MODEL_FIELDS},
        "python": copy.deepcopy(python),
        "skipped": tuple(sorted(k for k in attrs if k not in python and k not in ("model", "data"))),
    }


def restore_mujoco(unwrapped: Any, state: dict[str, Any]) -> None:
    """Set the Python attributes, the model placement and the physics of ``state``, then ``mj_forward``.

    Raises:
        ValueError: the env's model has other dimensions than the snapshot's (another model).
    """
    mj = _mujoco()
    model, data = unwrapped.model, unwrapped.data
    size = mj.mj_stateSize(model, state["physics_spec"])
    mismatched = [
        f"model.{name} {np.shape(getattr(model, name))} vs {value.shape}"
        for name, value in state["model"].items()
        if np.shape(getattr(model, name)) != value.shape
    ]
    if size != state["physics"].size:
        mismatched.insert(0, f"integration state of {size} numbers vs {state['physics'].size}")
    if mismatched:
        raise ValueError(
            f"restore(): mismatched MuJoCo models (env vs snapshot): {', '.join(mismatched)}. Restore into "
            f"an env built like the one the snapshot was taken from."
        )
    for name, value in state["python"].items():
        setattr(unwrapped, name, copy.deepcopy(value))
    for name, value in state["model"].items():
        getattr(model, name)[...] = value
    mj.mj_setState(model, data, state["physics"], state["physics_spec"])
    mj.mj_forward(model, data)  # the derived quantities (positions of bodies and sites, contacts) ...
    mj.mj_setState(model, data, state["physics"], state["physics_spec"])  # ... but not its warm start
