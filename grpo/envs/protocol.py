"""The `Environment` protocol: what `grpo.gym.episodes.run_episodes` (and the branching of
`grpo.gym.branching`) need of anything the policy plays against.

An environment holds ``num_envs`` sub-environments stepped together (1 for a plain env; hundreds
for a batched tensor simulator on a GPU). Everything crossing the protocol is a torch tensor on
the environment's device, batched over the sub-environments::

    obs = env.reset(starts)            # starts: num_envs start states -> (num_envs, *obs_shape)
    t = env.step(actions)              # actions (num_envs,) ints or (num_envs, act_dim) floats
    t.observations (num_envs, *obs_shape), t.rewards (num_envs,) float32,
    t.terminated (num_envs,) bool, t.truncated (num_envs,) bool
    env.close()

A start state is whatever the environment resets to: an int seed (gymnasium:
``env.reset(seed=s)``), a snapshot of the simulator (`grpo.gym.snapshots.Snapshot`), or a task
object of the environment's own. After a sub-environment's episode ends (terminated or truncated)
its later steps are ignored by the caller; what the environment returns for them does not
matter. Rewards are the reward of the transition just taken.

`SupportsSnapshots` is the optional capability of saving and restoring one sub-environment's
state: branching and exact replay need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Environment", "SupportsSnapshots", "Transition"]


class Transition(NamedTuple):
    """One step of every sub-environment (shapes in the module docstring)."""

    observations: Tensor
    rewards: Tensor
    terminated: Tensor
    truncated: Tensor


@runtime_checkable
class Environment(Protocol):
    """``num_envs`` sub-environments, reset to given start states and stepped together."""

    num_envs: int

    def reset(self, starts: Sequence[Any]) -> Tensor:
        """Reset sub-environment i to ``starts[i]``; returns the observations (num_envs, ...)."""

    def step(self, actions: Tensor) -> Transition:
        """Take ``actions[i]`` in sub-environment i."""

    def close(self) -> None:
        """Release what the environment holds (processes, simulators)."""


@runtime_checkable
class SupportsSnapshots(Protocol):
    """An `Environment` that saves and restores one sub-environment's full state."""

    def snapshot(self, index: int, observation: Tensor | None = None) -> Any:
        """The state of sub-environment ``index`` (a start state `Environment.reset` accepts)."""
