"""Success as a first-class signal: the env's ``info["success"]`` (or ``info["is_success"]``).

Robot tasks (MetaWorld, robosuite, LIBERO) report whether the task is solved in the step's info.
Fine-tuning on success (SimpleVLA-RL: a binary reward, the episode ends when the task is solved)
needs three things, each here or in `grpo.gym.episodes`:

* `EndOnSuccess`, a gymnasium wrapper: the episode terminates at the first step whose info reports
  success, and with ``binary_reward=True`` the reward becomes ``r_t = 1[success at t]`` (so the
  return is 1 for a solved episode, 0 otherwise: ``EpisodeReturn`` is then the success);
* `grpo.gym.episodes.Episode.success`: True when some step of the episode reported success, False
  when steps reported it and none succeeded, None when the env reports nothing;
  ``episode/success_rate`` (the step metric) is the mean over the N episodes of a step;
* `EpisodeSuccess`, a reward model: ``R_i = 1.0`` if episode i succeeded else 0.0, from the flag
  (for an env whose own reward you keep for something else).

`evaluate_policy` (`grpo.gym.episodes`) reports the success rate of an evaluation and its standard
error.

The length bias (`LengthBiasWarning`): episodes that end on success are short (MetaWorld push: ~70
steps), failures run to the time limit (150). With one advantage per episode (a whole-episode
reward: `EpisodeSuccess`, `grpo.gym.episodes.EpisodeReturn`) and a loss that weighs every step the
same (``loss_aggregation`` other than ``"seq-mean-token-mean"``), episode i weighs ``L_i``, and the
net push of a group on the policy is ``sum_i A_i L_i / sum_i L_i``: with success probability p and
group-normalised advantages it is proportional to ``p (1 - p) (L_success - L_fail) < 0``, so the
update on average *lowers* the log-probability of what the policy does, successes included. Per-step
credit (`grpo.gym.episodes.EpisodeRewards`, the ``finetune_success`` recipe) or
``"seq-mean-token-mean"`` removes it; the whole-episode rewards of this package warn when a batch
shows it (`length_bias`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.gym.gymnasium_lib import import_gymnasium
from grpo.reward_model_base import StatelessReward

__all__ = [
    "LENGTH_WEIGHTED",
    "SUCCESS_KEYS",
    "EndOnSuccess",
    "EpisodeSuccess",
    "LengthBiasWarning",
    "info_success",
    "length_bias",
    "warn_length_bias",
]

LENGTH_WEIGHTED = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""The ``loss_aggregation`` values under which an episode weighs its length (all but
``"seq-mean-token-mean"``, which weighs each episode 1/G)."""


class LengthBiasWarning(UserWarning):
    """A whole-episode reward with a length-weighted loss where successes end sooner than failures
    (module docstring): the update pushes against success."""


SUCCESS_KEYS = ("success", "is_success")
"""The info keys read as success, in order (MetaWorld, robosuite: ``success``; gymnasium-robotics,
stable-baselines3: ``is_success``)."""


def info_success(info: Any) -> bool | None:
    """``bool(info[k])`` for the first key of `SUCCESS_KEYS` in ``info``; None when there is none."""
    if not isinstance(info, dict):
        return None
    for key in SUCCESS_KEYS:
        if key in info:
            return bool(np.asarray(info[key]).item())
    return None


class EndOnSuccess:
    """gymnasium Wrapper: terminate the episode at its first successful step (SimpleVLA-RL's setting).

    Args:
        env: the env; its step info must hold ``"success"`` or ``"is_success"`` (a step without it
            raises ValueError: a silent 0 would train on nothing).
        binary_reward: replace the env's reward with ``1.0`` at the successful step and ``0.0``
            otherwise (the env's reward goes to ``info["env_reward"]``).
    """

    env: Any
    binary_reward: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> EndOnSuccess:
        impl = _end_on_success_class() if cls is EndOnSuccess else cls
        return object.__new__(impl)

    def __init__(self, env: Any, *, binary_reward: bool = True) -> None:
        gym = import_gymnasium()
        if not isinstance(env, gym.Env):
            raise TypeError(f"EndOnSuccess wraps a gymnasium.Env instance; got {type(env).__name__}.")
        gym.Wrapper.__init__(self, env)
        self.binary_reward = bool(binary_reward)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The inner env's reset."""
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """The inner step; terminated on success, the reward ``1[success]`` with ``binary_reward``."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        success = info_success(info)
        if success is None:
            raise ValueError(
                f"EndOnSuccess: the step info of {type(self.env.unwrapped).__name__} holds none of "
                f"{list(SUCCESS_KEYS)} (keys: {sorted(info)[:8]}); it needs an env that reports success."
            )
        if self.binary_reward:
            info = {**info, "env_reward": reward}
            reward = 1.0 if success else 0.0
        return obs, reward, bool(terminated) or success, bool(truncated), info


@functools.cache
def _end_on_success_class() -> type[EndOnSuccess]:
    gym = import_gymnasium()
    return type(
        "EndOnSuccess",
        (EndOnSuccess, gym.Wrapper),
        {"__module__": __name__, "__qualname__": "EndOnSuccess", "__doc__": EndOnSuccess.__doc__},
    )


def length_bias(rewards: Tensor, lengths: Tensor, groups: Tensor) -> float:
    """The net weight a length-weighted loss gives the whole-episode advantages of a batch.

    Shapes: rewards, lengths, groups ``(N,)`` (``groups[i]``: the group of episode i). With
    ``A_i = R_i - mean_{j in group(i)} R_j`` (the sign of the group advantage; its scale does not
    change the sign), returns ``sum_i A_i L_i / sum_i L_i``: negative when the better episodes of
    the groups are the shorter ones, 0 when lengths and rewards are unrelated.
    """
    r, lengths = rewards.double(), lengths.double()
    _, idx = torch.unique(groups, return_inverse=True)
    count = torch.zeros(int(idx.max()) + 1, dtype=torch.float64).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, idx, r) / count
    return float(((r - mean[idx]) * lengths).sum() / lengths.sum().clamp(min=1.0))


def warn_length_bias(owner: Any, episodes: Sequence[Any], rewards: Tensor) -> None:
    """Issue `LengthBiasWarning` once per ``owner`` (a whole-episode reward whose trainer set
    ``owner.loss_aggregation``) when the aggregation weighs lengths, some episode ended on success
    (terminated with ``success``) and `length_bias` of the batch is negative."""
    if getattr(owner, "loss_aggregation", None) not in LENGTH_WEIGHTED or getattr(owner, "_warned", False):
        return
    if not any(getattr(e, "success", None) and getattr(e, "terminated", False) for e in episodes):
        return
    lengths = torch.tensor([float(e.length) for e in episodes])
    groups = torch.tensor([int(e.seed) for e in episodes])
    bias = length_bias(rewards.reshape(-1), lengths, groups)
    if bias < 0:
        import warnings

        owner._warned = True
        warnings.warn(
            f"{type(owner).__name__} gives each episode one advantage, loss_aggregation="
            f"{owner.loss_aggregation!r} weighs an episode by its length, and the episodes that ended on "
            f"success are shorter than the failures: the net weight sum_i A_i L_i / sum_i L_i is "
            f"{bias:.3g} < 0, so the update pushes against what the policy does, successes included. "
            f"Use per-step credit (grpo.gym.EpisodeRewards(), GRPOConfig.recipe('finetune_success')) or "
            f"loss_aggregation='seq-mean-token-mean' (grpo.gym.success's docstring).",
            LengthBiasWarning,
            stacklevel=3,
        )


class EpisodeSuccess(StatelessReward):
    """`RewardModel`: ``R_i = 1.0`` if `Episode` i succeeded (``episode.success``), else ``0.0``.

    ``compute_rewards(states, episodes) -> (N,)`` float32. An episode whose env reported no success
    (``success is None``) is refused: wrap the env in one that reports it.
    """

    def compute_rewards(self, states: Any, actions: Sequence[Any]) -> Tensor:
        flags = [getattr(e, "success", None) for e in actions]
        missing = [i for i, f in enumerate(flags) if f is None]
        if missing:
            raise ValueError(
                f"EpisodeSuccess: episode {missing[0]} (of {len(flags)}) has no success flag: its env's "
                f"step info holds none of {list(SUCCESS_KEYS)}. Use an env that reports success "
                f"(MetaWorld, or a wrapper that adds info['success'])."
            )
        rewards = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32)
        warn_length_bias(self, actions, rewards)
        return rewards

    def check_config(self, config: Any) -> None:
        """Called by the trainer: records ``config.loss_aggregation`` for `warn_length_bias`."""
        self.loss_aggregation = config.loss_aggregation
