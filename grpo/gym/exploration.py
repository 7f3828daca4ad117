"""An exploration bonus for tasks where every group fails: the remedy `grpo.training.stall_watch` names.

When every episode of every group fails alike (MountainCar-v0: -200 for all; Acrobot-v1: -500),
each group's rewards are equal, every GRPO advantage is exactly 0 and nothing is learned. An
entropy bonus, larger groups or a batch-level baseline do not change that (every reward is still
the same number; measured in benchmarks/RESULTS.md, "Stalls: all-fail and all-succeed groups").
What does is a second reward that *differs between the episodes of a group*. `EpisodeSpread`
is one that needs nothing from the task: how much of the observation space an episode covered.

Use it as a small extra component of the reward::

    reward = CombinedReward(
        {"task": EpisodeReturn(), "spread": EpisodeSpread()}, weights={"spread": 0.01}
    )

Why a *small* weight is enough, and why it needs no schedule: GRPO divides each group's centred
rewards by the group's own standard deviation,

    A_i = (r_i - mean_g r) / (std_g r + eps),      r_i = task_i + w * spread_i,

so the advantages do not depend on the scale of what varies in a group. In a group whose task
rewards are all equal, only ``w * spread_i`` varies and the advantages are the standardised
spreads, at full strength whatever ``w`` is (as long as ``w * std_g spread >> eps``). In a group
whose task rewards differ, the bonus moves each advantage by at most about
``w * (max - min spread) / std_g task``, negligible when ``w`` is well below the task reward's
resolution (MountainCar: 1 per step, w = 0.01). The bonus so acts as a tie-breaker that switches
itself off group by group as soon as the task reward varies; a decaying schedule is not needed
(a weight of 20, decayed or not, did no better in the benchmark). Keep the default
``reward_combination="sum"``: ``"per_component"`` normalises each component on its own, which
would give the bonus the same weight as the task everywhere.

``reward/task/mean`` and ``reward/spread/mean`` (and ``eval/reward/task/mean``) are logged, so the
task's own reward stays visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo.gym.episodes import Episode, stack_episodes
from grpo.reward_model_base import StatelessReward

__all__ = ["EpisodeSpread"]


class EpisodeSpread(StatelessReward):
    """`RewardModel`: the part of the observation space an episode swept, in [0, 1].

    For the N episodes of one call, observations ``o`` (N, T, d) and mask (N, T)::

        width_{i,k}  = max_t o_{i,t,k} - min_t o_{i,t,k}             (over episode i's real steps)
        range_k      = max_{i,t} o_{i,t,k} - min_{i,t} o_{i,t,k}      (over the whole call)
        spread_i     = mean_k width_{i,k} / range_k                   (dims with range_k = 0: 0)

    ``compute_rewards(states, episodes) -> (N,)`` float32. Each dimension is measured in units of
    its range in the batch, so no observation bounds are needed and no dimension dominates by its
    scale. No state is kept between calls: evaluation does not change it and checkpoints need
    nothing. It rewards swinging further, faster, wider: what reaching the goal of an all-fail
    control task (MountainCar, Acrobot) takes before the task reward can say so. It is a
    heuristic, not a task reward: use it with a small weight beside the task's (module docstring).
    """

    name = "spread"

    def compute_rewards(self, states: Any, actions: Sequence[Episode]) -> Tensor:
        obs, _, _, mask = stack_episodes(actions, "EpisodeSpread.compute_rewards")
        obs = obs.flatten(2).double()  # (N, T, d)
        valid = mask.unsqueeze(-1)  # (N, T, 1)
        hi = obs.masked_fill(~valid, -torch.inf).amax(1)  # (N, d)
        lo = obs.masked_fill(~valid, torch.inf).amin(1)
        width = (hi - lo).clamp(min=0)  # an episode without a real step: -inf - inf -> 0
        full = hi.amax(0) - lo.amin(0)  # (d,)
        full = torch.where(torch.isfinite(full) & (full > 0), full, torch.full_like(full, torch.inf))
        return (width / full).mean(-1).float()
