"""`GymVectorEnvironment`: a gymnasium vector env as an `grpo.envs.Environment`.

Observations come back as float32 tensors ``(num_envs, obs_dim)`` (flattened), rewards as float32
``(num_envs,)``. Actions go in as the policy sampled them: ints for a ``Discrete`` space, floats
clipped to a ``Box`` space's bounds (the env sees the clipped action; the policy trains the
sampled one). A start is an int seed (``reset(seed=...)``) or, for a ``SyncVectorEnv`` (whose
sub-envs live in this process), a `grpo.gym.snapshots.Snapshot`: the sub-env is reset, then the
snapshot restored. gymnasium is imported lazily (the ``gym`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.envs.protocol import Transition
from grpo.gym.gymnasium_lib import import_gymnasium
from grpo.gym.snapshots import Snapshot, restore
from grpo.gym.snapshots import snapshot as take_snapshot
from grpo.gym.success import info_success

__all__ = ["GymVectorEnvironment", "as_environment"]


class GymVectorEnvironment:
    """An `Environment` (and `SupportsSnapshots`) over a gymnasium ``VectorEnv``.

    Args:
        envs: the vector env (``gymnasium.make_vec``, ``SyncVectorEnv``, ``AsyncVectorEnv``);
            its action space must be ``Discrete`` or ``Box``.
    """

    def __init__(self, envs: Any) -> None:
        gymnasium = import_gymnasium()
        space = envs.single_action_space
        self.discrete = isinstance(space, gymnasium.spaces.Discrete)
        if not self.discrete and not isinstance(space, gymnasium.spaces.Box):
            raise TypeError(
                f"EpisodePolicy supports Discrete and Box action spaces; the env has {space}. "
                f"Wrap the env (e.g. gymnasium.wrappers.FlattenObservation / a custom ActionWrapper)."
            )
        self.envs = envs
        self.num_envs = int(envs.num_envs)
        self._space = space
        self._local = isinstance(envs, gymnasium.vector.SyncVectorEnv)

    def reset(self, starts: Sequence[Any]) -> Tensor:
        """Sub-env i from ``starts[i]``: an int seed, or a `Snapshot` (``SyncVectorEnv`` only)."""
        if len(starts) != self.num_envs:
            raise ValueError(f"reset got {len(starts)} starts for a vector env of {self.num_envs} sub-envs.")
        snaps = {i: s for i, s in enumerate(starts) if isinstance(s, Snapshot)}
        if snaps and not self._local:
            raise TypeError(
                f"{type(self.envs).__name__}: a snapshot start restores the sub-env in this process, so it "
                f"needs a gymnasium.vector.SyncVectorEnv (vectorization_mode='sync')."
            )
        seeds = [0 if i in snaps else int(s) for i, s in enumerate(starts)]
        obs, _ = self.envs.reset(seed=seeds)
        obs = np.asarray(obs, dtype=np.float32).reshape(self.num_envs, -1)
        for i, snap in snaps.items():
            obs[i] = np.asarray(restore(self.envs.envs[i], snap), dtype=np.float32).reshape(-1)
        return torch.from_numpy(obs)

    def step(self, actions: Tensor, active: Tensor | None = None) -> Transition:
        """One step of every sub-env; with ``active`` ``(num_envs,)`` bool, a ``SyncVectorEnv``
        steps only the active sub-envs (`step_active`)."""
        a = actions.cpu().numpy()
        env_a = a.astype(np.int64) if self.discrete else np.clip(a, self._space.low, self._space.high)
        if active is not None and self._local:
            return self.step_active(env_a, active.cpu().numpy().astype(bool))
        obs, rew, term, trunc, info = self.envs.step(env_a)
        return Transition(
            torch.from_numpy(np.asarray(obs, dtype=np.float32).reshape(self.num_envs, -1)),
            torch.from_numpy(np.asarray(rew, dtype=np.float32)),
            torch.from_numpy(np.asarray(term, dtype=bool)),
            torch.from_numpy(np.asarray(trunc, dtype=bool)),
            _success_infos(info, self.num_envs),
        )

    def step_active(self, env_actions: np.ndarray, active: np.ndarray) -> Transition:
        """Step the active sub-envs of a ``SyncVectorEnv`` one by one, the others not at all.

        A sub-env whose episode ended costs nothing more (the vector env's own step would step it
        on, or autoreset it, until the batch's last episode ends: MetaWorld spends most of a step
        in its own Python). Inactive entries come back as a zero observation and reward,
        ``terminated`` True and an empty info; the next ``reset`` resets every sub-env, so the
        vector env's autoreset bookkeeping, bypassed here, is never read.
        """
        n = self.num_envs
        obs = np.zeros((n, int(np.prod(self.envs.single_observation_space.shape))), np.float32)
        rew, term, trunc = np.zeros(n, np.float32), np.ones(n, bool), np.zeros(n, bool)
        infos: list[dict[str, Any]] = [{} for _ in range(n)]
        for i in np.flatnonzero(active):
            o, r, te, tr, info = self.envs.envs[i].step(env_actions[i])
            obs[i], rew[i], term[i], trunc[i] = np.asarray(o, np.float32).reshape(-1), r, te, tr
            flag = info_success(info)
            infos[i] = {} if flag is None else {"success": flag}
        reported = any(infos)
        return Transition(
            torch.from_numpy(obs),
            torch.from_numpy(rew),
            torch.from_numpy(term),
            torch.from_numpy(trunc),
            infos if reported else None,
        )

    def snapshot(self, index: int, observation: Tensor | None = None) -> Any:
        """A `grpo.gym.snapshots.Snapshot` of sub-env ``index`` (``SyncVectorEnv`` only)."""
        if not self._local:
            raise TypeError(f"{type(self.envs).__name__}: snapshots need a gymnasium.vector.SyncVectorEnv.")
        obs = None if observation is None else observation.cpu().numpy()
        return take_snapshot(self.envs.envs[index], observation=obs)

    def close(self) -> None:
        self.envs.close()


def _success_infos(info: Any, n: int) -> list[dict[str, Any]] | None:
    """The success flags of a vector env's step info as n dicts (``{"success": bool}``, or ``{}``
    for a sub-env that did not report it); None when no sub-env reports success."""
    for key in ("success", "is_success"):  # grpo.gym.success.SUCCESS_KEYS
        if isinstance(info, dict) and key in info:
            values = np.asarray(info[key]).reshape(n)
            present = np.asarray(info.get(f"_{key}", np.ones(n, dtype=bool))).reshape(n)
            return [{"success": bool(v)} if p else {} for v, p in zip(values, present, strict=True)]
    return None


def as_environment(envs: Any) -> Any:
    """``envs`` as an `Environment`: a gymnasium ``VectorEnv`` is wrapped in `GymVectorEnvironment`,
    anything else is taken as an `Environment` already."""
    return GymVectorEnvironment(envs) if isinstance(envs, import_gymnasium().vector.VectorEnv) else envs
