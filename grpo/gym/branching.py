"""Branching: groups of short continuations from states along the policy's own trajectories.

On long horizons (MuJoCo locomotion: 1,000 steps an episode) a group of G whole episodes from one
start state is costly (B x G x 1,000 env steps per update) and its comparison is mostly noise: the
episodes part ways early and everything after is compared at once. Branching is TRPO's "vine"
estimator (Schulman et al., 2015, section 5.2) in GRPO's form, with the group as the baseline and
no critic:

1. **trunk**: the current policy plays on; every ``every`` steps a snapshot of the simulator is
   taken (`grpo.gym.snapshots`); each snapshot is a GRPO *state*;
2. **branches**: from each of B snapshots, G continuations of at most H steps
   (``EpisodePolicy(..., max_steps=H)`` over ``SnapshotReset``); they start from one state
   exactly, so their per-step returns-to-go compare like-for-like (`EpisodeRewards`, the group's
   time-dependent baseline of `grpo.gym.episodes`);
3. the update is GRPO's, on the B x G branches.

Cost per update: ``B x every`` trunk steps plus at most ``B x G x H`` branch steps, all counted
(`BranchPoints.env_steps` + ``EpisodePolicy.env_steps``). A branch's return-to-go stops at H: what
an action does after H steps is not credited (the truncation bias of an H-step return without a
bootstrap); a larger H credits further and costs more. docs/gym_episodes.md, "Branching", says
when to branch and what H and G cost.

Exactness: a branch restored from its snapshot and replayed with the same actions gives the same
observations and rewards (tested for classic control and MuJoCo), because `restore` sets the full
simulator state and the env's random generator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from grpo.gym.episodes import EpisodePolicy
from grpo.gym.gymnasium_lib import import_gymnasium
from grpo.gym.snapshots import SnapshotMethod, SnapshotReset, SnapshotStore

__all__ = ["BranchPoints", "branching_policy"]


class BranchPoints:
    """Snapshots along trunk trajectories of the current policy: the states of branched groups.

    ``sample(n)`` plays the trunk on with the policy (sampling its actions) and returns the
    indices of ``n`` new snapshots in ``store``, one every ``every`` steps; an episode that ends
    starts the next one from a fresh seed. The indices are the GRPO states to pass to
    ``trainer.step`` with a `branching_policy` on the same store.

    Args:
        env: a registered env id or a zero-argument factory (the same as the branches').
        policy: the `EpisodePolicy` being trained (its network plays the trunk).
        store: where the snapshots go (shared with the branches' `SnapshotReset`).
        every: trunk steps between two snapshots (>= 1).
        seed: seeds the trunk's episode seeds.
        method: the snapshot method (`grpo.gym.snapshots.snapshot`).

    Attributes:
        env_steps: trunk env steps so far.
    """

    def __init__(
        self,
        env: str | Callable[[], Any],
        policy: EpisodePolicy,
        store: SnapshotStore,
        *,
        every: int = 50,
        seed: int = 0,
        method: SnapshotMethod = "auto",
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"BranchPoints(every={every!r}): expected an integer >= 1 (trunk steps per snapshot)."
            )
        if not isinstance(store, SnapshotStore):
            raise TypeError(
                f"BranchPoints needs a grpo.gym.snapshots.SnapshotStore; got {type(store).__name__}."
            )
        self.env = import_gymnasium().make(env) if isinstance(env, str) else env()
        self.policy, self.store, self.every, self.method = policy, store, every, method
        self.rng = np.random.default_rng(seed)
        self.env_steps = 0
        self._obs: np.ndarray | None = None

    def sample(self, n: int) -> list[int]:
        """Play the trunk on and return the store indices of ``n`` new snapshots."""
        indices = []
        for _ in range(n):
            if self._obs is None:
                self._obs, _ = self.env.reset(seed=int(self.rng.integers(0, 2**31)))
            indices.append(self.store.capture(self.env, observation=self._obs, method=self.method))
            self._advance()
        return indices

    @torch.no_grad()
    def _advance(self) -> None:
        """``every`` trunk steps with the policy's sampled actions (fewer when the episode ends)."""
        net = self.policy.policy
        space = self.env.action_space
        discrete = isinstance(space, import_gymnasium().spaces.Discrete)
        for _ in range(self.every):
            assert self._obs is not None
            obs = np.asarray(self._obs, dtype=np.float32).reshape(1, -1)  # moved to the net's device
            a = net.distribution(obs).sample()[0].cpu().numpy()
            action = int(a) if discrete else np.clip(a, space.low, space.high)
            self._obs, _, terminated, truncated, _ = self.env.step(action)
            self.env_steps += 1
            if terminated or truncated:
                self._obs = None
                return

    def close(self) -> None:
        self.env.close()


def branching_policy(
    env: str | Callable[[], Any],
    net: torch.nn.Module,
    store: SnapshotStore,
    *,
    horizon: int,
    reset_inner: bool = False,
    env_kwargs: dict[str, Any] | None = None,
) -> EpisodePolicy:
    """The `EpisodePolicy` of the branches: each group's G episodes restore one snapshot of
    ``store`` (the state is its index) and run at most ``horizon`` (H) steps.

    ``reset_inner=False`` restores without resetting the inner env first (MuJoCo's reset is
    costly and the restore sets the whole state).
    """
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise ValueError(
            f"branching_policy(horizon={horizon!r}): expected an integer >= 1 (steps per branch)."
        )
    gym = import_gymnasium()
    kwargs = dict(env_kwargs or {})

    def make() -> Any:
        inner = gym.make(env, **kwargs) if isinstance(env, str) else env()
        return SnapshotReset(inner, store, reset_inner=reset_inner)

    return EpisodePolicy(make, net, max_steps=horizon)
