"""Gymnasium episodes as GRPO actions (the ``gym`` extra; gymnasium is imported lazily).

GRPO scores each action against the other actions of its *group*: the G actions sampled for one
state. For control, the "state" here is an **environment seed** and the "action" is a **whole
episode** played by the policy from the initial state that seed produces::

    states  = [seed_0, ..., seed_{B-1}]                     # B ints (or a Tensor (B,))
    actions = B groups of G `Episode`s, each started with env.reset(seed=seed_b)
    reward  = the episode return R_i = sum_t gamma^t r_t    (`EpisodeReturn`)
    A_i     = (R_i - mean_group(R)) / (std_group(R) + eps) # the trainer's group advantage

Every step t of episode i then gets the advantage A_i. With `EpisodeRewards` instead (per-step
rewards (N, T)), step t gets its own advantage from its discounted return-to-go, compared with the
group's other episodes at the same t (docs/gym_episodes.md, "Credit"). The loss is the clipped
surrogate over the per-step log-probs ``log pi(a_t | o_t)``: shape ``(N, T)`` with a bool mask
``(N, T)`` that is False after the episode ended (episodes of one batch have different lengths;
T is the longest).

Why the G episodes of a group must start from the same state
------------------------------------------------------------
The group mean is GRPO's baseline: it replaces PPO's learned value function. It is an unbiased
baseline for action i only if the other episodes of the group faced the same situation. With G
episodes from G different random starts, ``R_i - mean(R)`` mixes "this episode acted well" with
"this episode started in an easy state", and the start-state luck is pure noise in the gradient.
Starting all G from ``reset(seed=s)`` removes that noise: the only difference between the G
returns is the policy's own sampling (and the environment's transition noise, which the same seed
also aligns at the start). `EpisodePolicy` checks this: with ``check_group_reset=True`` (the
default) it raises if the G initial observations of a group differ.

When an environment cannot reset to the same state (a real robot, an external simulator, an env
whose ``reset`` ignores its seed), in order of preference:

1. make ``reset(seed=s)`` give start s with a start function (`grpo.gym.seeded_starts.SeededStarts`;
   MetaWorld: `grpo.gym.seeded_starts.make_metaworld`), or reset to a fixed set of start
   configurations and use their index as the seed;
2. snapshot and restore the simulator state (`grpo.gym.snapshots`: exact for classic control and
   MuJoCo envs, replay-checked, refused where no exact method exists), with ``SnapshotReset``
   whose ``reset(seed=i)`` restores snapshot ``i``;
3. otherwise GRPO's group baseline is the wrong tool: use a learned value baseline (PPO/A2C), or
   at least a large G so the start-state noise averages out, and pass ``check_group_reset=False``.

Vectorisation: all ``N = B*G`` episodes run together in one gymnasium vector env
(``gymnasium.make_vec(..., vectorization_mode="sync"|"async")``); each env step is one batched
policy forward over the N observations. A sync vector env steps only the sub-envs still playing
(`grpo.gym.vector_env.GymVectorEnvironment.step_active`); an async one steps them all (autoreset)
until the last episode ends, and their extra steps are discarded (mask False). Only real steps
count in `EpisodePolicy.env_steps`.

Log-probs during the update are recomputed from the policy on the stored observations in one
batched forward over the valid steps (``obs[mask]``, shape ``(sum(mask), obs_dim)``), scattered
back to ``(N, T)``, so they carry gradient.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from grpo.envs.protocol import Environment
from grpo.gym.gymnasium_lib import import_gymnasium
from grpo.gym.success import info_success, warn_length_bias
from grpo.gym.vector_env import GymVectorEnvironment, as_environment
from grpo.policies import DistributionPolicy
from grpo.policy_base import EntropyRequest, PolicyOutput, entropy_grad_mode
from grpo.reward_model_base import StatelessReward

__all__ = [
    "Episode",
    "EpisodeEvaluation",
    "EpisodePolicy",
    "EpisodeReturn",
    "EpisodeRewards",
    "episode_returns",
    "evaluate_episodes",
    "evaluate_policy",
    "run_episodes",
]


@dataclass(frozen=True)
class Episode:
    """One episode played from ``env.reset(seed=seed)``: the action GRPO scores.

    All tensors are padded to the longest episode of the batch it was collected in (T steps).

    Attributes:
        seed: the reset seed (the GRPO state this episode belongs to).
        observations: ``(T, obs_dim)`` float32, ``o_t`` seen before action t; zeros after the end.
        actions: ``(T,)`` int64 for discrete spaces, ``(T, act_dim)`` float32 for Box spaces
            (the sampled, unclipped action whose log-prob is trained; the env saw it clipped).
        rewards: ``(T,)`` float32, ``r_t`` received after action t; zeros after the end.
        mask: ``(T,)`` bool, True for the ``length`` real steps.
        terminated: the env reported termination (not a time limit).
        success: True when a step's info reported success (``info["success"]`` or
            ``info["is_success"]``, `grpo.gym.success`), False when steps reported it and none
            succeeded, None when the env reports no success.
    """

    seed: int
    observations: Tensor
    actions: Tensor
    rewards: Tensor
    mask: Tensor
    terminated: bool
    success: bool | None = None

    @property
    def length(self) -> int:
        """Number of real steps."""
        return int(self.mask.sum())

    @property
    def episode_return(self) -> float:
        """Undiscounted return ``sum_t r_t``."""
        return float(self.rewards.sum())


def episode_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """The discounted return of each episode: R_i = sum_t gamma^t r_{i,t} over the real steps (mask True).

    Shapes: rewards (N, T), mask (N, T) bool -> (N,) float32. gamma = 1 is the plain return. The
    per-step returns-to-go (N, T) are `grpo.algorithms.advantages.discounted_returns`.
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma={gamma!r} is not allowed: expected 0 < gamma <= 1 (1 = undiscounted).")
    r = rewards.to(torch.float64) * mask
    if gamma == 1.0:
        return r.sum(-1).float()
    disc = torch.full((r.shape[-1],), gamma, dtype=torch.float64).cumprod(0) / gamma  # gamma^t
    return (r * disc).sum(-1).float()


def stack_episodes(episodes: Sequence[Episode], where: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Episodes -> obs (N, T, obs_dim), actions (N, T, ...), rewards (N, T), mask (N, T).

    Episodes of different padded lengths are zero-padded to the longest; ``where`` names the
    caller in the errors (no episodes, or an item that is not an `Episode`).
    """
    if not episodes:
        raise ValueError(f"{where} got no episodes.")
    bad = [i for i, e in enumerate(episodes) if not isinstance(e, Episode)]
    if bad:
        raise TypeError(
            f"{where} expects grpo.gym.episodes.Episode actions (made by EpisodePolicy."
            f"generate_actions); item {bad[0]} is {type(episodes[bad[0]]).__name__}."
        )
    lengths = {e.mask.shape[0] for e in episodes}
    if len(lengths) == 1:
        obs = torch.stack([e.observations for e in episodes])
        act = torch.stack([e.actions for e in episodes])
        rew = torch.stack([e.rewards for e in episodes])
        mask = torch.stack([e.mask for e in episodes])
        return obs, act, rew, mask
    # Episodes from different collections (different padded T): pad to the longest.
    t_max = max(lengths)

    def pad(x: Tensor) -> Tensor:
        out = x.new_zeros((t_max, *x.shape[1:]))
        out[: x.shape[0]] = x
        return out

    return (
        torch.stack([pad(e.observations) for e in episodes]),
        torch.stack([pad(e.actions) for e in episodes]),
        torch.stack([pad(e.rewards) for e in episodes]),
        torch.stack([pad(e.mask) for e in episodes]),
    )


class EpisodeReturn(StatelessReward):
    """`RewardModel`: the reward of an `Episode` is its (optionally discounted) return.

    ``compute_rewards(states, episodes) -> (N,)`` with ``R_i = sum_t gamma^t r_{i,t}``.
    """

    def __init__(self, gamma: float = 1.0) -> None:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"EpisodeReturn(gamma={gamma!r}): expected 0 < gamma <= 1 (1 = undiscounted).")
        self.gamma = gamma

    def compute_rewards(self, states: Any, actions: Sequence[Episode]) -> Tensor:
        _, _, rew, mask = stack_episodes(actions, "EpisodeReturn.compute_rewards")
        returns = episode_returns(rew, mask, self.gamma)
        warn_length_bias(self, actions, returns)
        return returns

    def check_config(self, config: Any) -> None:
        """Called by the trainer: records ``config.loss_aggregation`` for the length-bias warning
        (`grpo.gym.success.LengthBiasWarning`)."""
        self.loss_aggregation = config.loss_aggregation


class EpisodeRewards(StatelessReward):
    """`RewardModel`: the per-step rewards of each `Episode`, for per-step credit.

    ``compute_rewards(states, episodes) -> (N, T)``: ``r_it`` on real steps, 0 after the end. The
    trainer then credits step t with its return-to-go ``G_it = sum_{t' >= t} gamma^(t'-t) r_it'``
    (``GRPOConfig.gamma``) compared with the other episodes of the group at the same t::

        A_it = (G_it - mean_{j alive at t} G_jt) / (std_{j alive at t} G_jt + eps)

    instead of giving every step the episode's advantage (`EpisodeReturn`). ``reward/mean`` is
    still the mean undiscounted episode return (plus the bonus, if any).

    Args:
        bonus: optional `RewardModel` scoring whole episodes, ``(N,)``, e.g.
            ``grpo.gym.exploration.EpisodeSpread()``: ``bonus_weight * bonus_i`` is added to the last
            real step of episode i. With a small weight it only breaks ties: where a group's task
            rewards are all equal (every episode failed alike, as every early Acrobot or
            MountainCar episode does) the group-normalised advantages become the standardised
            bonuses, while elsewhere they barely move (docs/gym_episodes.md, "All-fail tasks").
        bonus_weight: the weight of the bonus (> 0).
    """

    def __init__(self, bonus: Any = None, bonus_weight: float = 0.01) -> None:
        if bonus is not None and not callable(getattr(bonus, "compute_rewards", None)):
            raise TypeError(
                f"EpisodeRewards(bonus=...) needs a RewardModel with compute_rewards(states, episodes) "
                f"-> (N,), e.g. grpo.gym.exploration.EpisodeSpread(); got {type(bonus).__name__}."
            )
        if not (isinstance(bonus_weight, (int, float)) and math.isfinite(bonus_weight) and bonus_weight > 0):
            raise ValueError(f"EpisodeRewards(bonus_weight={bonus_weight!r}): expected a finite number > 0.")
        self.bonus = bonus
        self.bonus_weight = float(bonus_weight)

    def compute_rewards(self, states: Any, actions: Sequence[Episode]) -> Tensor:
        _, _, rew, mask = stack_episodes(actions, "EpisodeRewards.compute_rewards")
        rew = rew * mask
        if self.bonus is not None:
            extra = torch.as_tensor(self.bonus.compute_rewards(states, actions), dtype=rew.dtype)
            if extra.shape != (rew.shape[0],):
                raise ValueError(
                    f"EpisodeRewards: {type(self.bonus).__name__}.compute_rewards returned shape "
                    f"{tuple(extra.shape)}; expected ({rew.shape[0]},), one number per episode."
                )
            last = (mask.sum(-1) - 1).clamp(min=0)
            rew[torch.arange(rew.shape[0]), last] += self.bonus_weight * extra * mask.any(-1)
        return rew


class _EnvPool:
    """Lazily built vector envs keyed by their number of sub-envs. Never copied (see __deepcopy__)."""

    def __init__(
        self, env: str | Callable[[], Any] | Environment, vectorization_mode: str, env_kwargs: dict[str, Any]
    ):
        self.env = env
        self.vectorization_mode = vectorization_mode
        self.env_kwargs = env_kwargs
        self._envs: dict[int, Any] = {}

    def get(self, num_envs: int) -> Any:
        if isinstance(self.env, Environment):  # one given environment: its size is fixed
            if self.env.num_envs != num_envs:
                raise ValueError(
                    f"{type(self.env).__name__} has num_envs={self.env.num_envs}, but this step plays "
                    f"{num_envs} episodes (batch_size x group_size); build it with num_envs={num_envs}."
                )
            return self.env
        envs = self._envs.get(num_envs)
        if envs is None:
            gym = import_gymnasium()
            if isinstance(self.env, str):
                envs = gym.make_vec(
                    self.env,
                    num_envs=num_envs,
                    vectorization_mode=self.vectorization_mode,
                    **self.env_kwargs,
                )
            elif self.vectorization_mode == "async":
                envs = gym.vector.AsyncVectorEnv([self.env] * num_envs)
            else:
                envs = gym.vector.SyncVectorEnv([self.env] * num_envs)
            self._envs[num_envs] = envs
        return envs

    def close(self) -> None:
        if isinstance(self.env, Environment):
            self.env.close()
        for envs in self._envs.values():
            envs.close()
        self._envs.clear()

    def __deepcopy__(self, memo: dict[int, Any]) -> _EnvPool:
        # A frozen reference policy copies the network, not the simulators: it never plays.
        return _EnvPool(self.env, self.vectorization_mode, dict(self.env_kwargs))


def _as_distribution_policy(policy: nn.Module) -> DistributionPolicy:
    if isinstance(policy, DistributionPolicy):
        return policy
    if isinstance(policy, nn.Module):
        return DistributionPolicy(policy)
    raise TypeError(
        f"EpisodePolicy needs a torch.nn.Module mapping observations (n, obs_dim) to a "
        f"torch.distributions.Distribution (e.g. grpo.policies.categorical_mlp(obs_dim, n_actions) or "
        f"grpo.policies.gaussian_mlp(obs_dim, act_dim)); got {type(policy).__name__}."
    )


def env_seeds(states: Any) -> list[int]:
    """The GRPO states of an `EpisodePolicy` as env seeds: B non-negative ints (a list or an int Tensor)."""
    if isinstance(states, Tensor):
        if states.dim() != 1 or states.dtype.is_floating_point:
            raise ValueError(
                f"EpisodePolicy states must be integer env seeds, a list or an int Tensor (B,); "
                f"got a Tensor of shape {tuple(states.shape)} and dtype {states.dtype}."
            )
        return [int(s) for s in states.tolist()]
    out = []
    for s in states:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(
                f"EpisodePolicy states must be non-negative integer env seeds (one per group); got "
                f"{s!r}. Draw them e.g. as rng.integers(0, 2**31, size=B).tolist()."
            )
        out.append(int(s))
    return out


@torch.no_grad()
def run_episodes(
    policy: DistributionPolicy,
    envs: Any,
    seeds: Sequence[Any],
    *,
    max_steps: int | None = None,
    deterministic: bool = False,
) -> list[Episode]:
    """Play ``len(seeds)`` episodes at once in ``envs``: an `grpo.envs.Environment` with that
    many sub-environments, or a gymnasium vector env (wrapped in
    `grpo.gym.vector_env.GymVectorEnvironment`).

    Sub-env i starts from ``seeds[i]`` (an int seed, or any start state the environment takes).
    At each step one forward of ``policy`` on the (n, obs_dim) observations gives the actions
    (sampled, or the distribution's mode if ``deterministic``). Steps after an episode's end are
    discarded. Returns the episodes padded to the longest; ``Episode.success`` from the steps'
    infos (`grpo.gym.success.info_success`).
    """
    env = as_environment(envs)
    n = len(seeds)
    if env.num_envs != n:
        raise ValueError(f"run_episodes got {n} seeds for a vector env of {env.num_envs} sub-envs.")
    device = policy.device
    obs = env.reset(list(seeds))
    alive = torch.ones(n, dtype=torch.bool)
    terminated_any = torch.zeros(n, dtype=torch.bool)
    reported, succeeded = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
    obs_list: list[Tensor] = []
    act_list: list[Tensor] = []
    rew_list: list[Tensor] = []
    mask_list: list[Tensor] = []
    limit = max_steps if max_steps is not None else math.inf
    t = 0
    while bool(alive.any()) and t < limit:
        dist: Distribution = policy.distribution(obs.to(device))
        a = dist.mode if deterministic else dist.sample()
        # A gymnasium SyncVectorEnv steps only the sub-envs still playing (the others' steps would
        # be discarded); other environments step them all.
        step = env.step(a, active=alive) if isinstance(env, GymVectorEnvironment) else env.step(a)
        obs_list.append(obs.cpu())
        act_list.append(a.cpu())
        rew_list.append(torch.where(alive, step.rewards.cpu(), 0.0))
        mask_list.append(alive)
        ended = step.terminated.cpu()
        terminated_any |= alive & ended
        if step.infos is not None:
            flags = [info_success(info) for info in step.infos]
            reported |= alive & torch.tensor([f is not None for f in flags])
            succeeded |= alive & torch.tensor([bool(f) for f in flags])
        alive = alive & ~(ended | step.truncated.cpu())
        obs = step.observations
        t += 1
    success = [bool(succeeded[i]) if reported[i] else None for i in range(n)]
    return _padded_episodes(seeds, obs_list, act_list, rew_list, mask_list, terminated_any, success)


def _padded_episodes(
    seeds: Sequence[Any],
    obs_list: list[Tensor],
    act_list: list[Tensor],
    rew_list: list[Tensor],
    mask_list: list[Tensor],
    terminated: Tensor,
    success: list[bool | None],
) -> list[Episode]:
    """The steps stacked into `Episode`s padded to the longest; zeros after each episode's end."""
    mask = torch.stack(mask_list, 1)  # (n, T)
    obs = torch.stack(obs_list, 1) * mask.unsqueeze(-1)  # (n, T, obs_dim)
    act = torch.stack(act_list, 1)  # (n, T) or (n, T, act_dim)
    act = act * (mask if act.dim() == 2 else mask.unsqueeze(-1)).to(act.dtype)
    rew = torch.stack(rew_list, 1)  # (n, T)
    starts = [int(s) if isinstance(s, (int, np.integer)) else -1 for s in seeds]
    return [
        Episode(starts[i], obs[i], act[i], rew[i], mask[i], bool(terminated[i]), success[i])
        for i in range(len(seeds))
    ]


class EpisodePolicy(nn.Module):
    """`PolicyModel` whose state is an env seed and whose action is a whole `Episode`.

    Wraps a ready policy of `grpo.policies` (``categorical_mlp`` for Discrete action spaces,
    ``gaussian_mlp`` for Box) or any module ``obs (n, obs_dim) -> Distribution``.

    * ``generate_actions(seeds (B), G) -> B lists of G Episodes``: the N = B*G episodes run
      together in one vector env; sub-envs ``b*G .. b*G+G-1`` are reset with ``seeds[b]``.
    * ``get_log_probabilities(states, episodes) -> PolicyOutput(log_probs (N, T), mask (N, T))``:
      ``log pi(a_t | o_t)`` from one forward over the valid steps, with gradient.
    * ``evaluate_actions(...)``: the same plus the exact per-step entropy.

    Args:
        env: a registered env id (``"CartPole-v1"``), a zero-argument factory returning a gymnasium
            env, or an `grpo.envs.Environment` with ``num_envs = batch_size x group_size``
            sub-environments (a batched tensor environment such as `grpo.envs.pendulum.TensorPendulum`).
        policy: the network (see above). Its parameters are this module's parameters.
        max_steps: cap on the steps of one episode (None = the env's own time limit).
        vectorization_mode: ``"sync"`` (one process; best for cheap envs) or ``"async"``
            (one process per sub-env; for expensive envs).
        check_group_reset: raise if the G initial observations of a group differ (see the
            module docstring for why GRPO needs them equal).
        env_kwargs: passed to ``gymnasium.make_vec`` when ``env`` is an id.

    Attributes:
        env_steps: real env steps collected by ``generate_actions`` so far (masked steps only).
    """

    def __init__(
        self,
        env: str | Callable[[], Any] | Environment,
        policy: nn.Module,
        *,
        max_steps: int | None = None,
        vectorization_mode: str = "sync",
        check_group_reset: bool = True,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if vectorization_mode not in ("sync", "async"):
            raise ValueError(f"vectorization_mode={vectorization_mode!r}: choose 'sync' or 'async'.")
        if max_steps is not None and (isinstance(max_steps, bool) or max_steps < 1):
            raise ValueError(f"max_steps={max_steps!r}: expected an integer >= 1 or None.")
        self.policy = _as_distribution_policy(policy)
        self.max_steps = max_steps
        self.check_group_reset = check_group_reset
        self.env_steps = 0
        self._pool = _EnvPool(env, vectorization_mode, dict(env_kwargs or {}))

    def close(self) -> None:
        """Close the vector envs (they are rebuilt on the next ``generate_actions``)."""
        self._pool.close()

    def vector_envs(self, n: int) -> Any:
        """The policy's vector env of ``n`` sub-envs (built on first use, kept for the next call of
        the same size; `close` closes it)."""
        return self._pool.get(n)

    # ---- PolicyModel ---------------------------------------------------------------------
    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> list[list[Episode]]:
        """Play G episodes from each seed. Returns B lists of G `Episode`s (group-major).

        ``kwargs`` go to `run_episodes` (e.g. ``deterministic=True``; the trainer passes its
        ``step(states, **generate_kwargs)`` here).
        """
        seeds = env_seeds(states)
        g = num_actions_per_state
        flat_seeds = [s for s in seeds for _ in range(g)]
        envs = self.vector_envs(len(flat_seeds))
        episodes = run_episodes(self.policy, envs, flat_seeds, max_steps=self.max_steps, **kwargs)
        if self.check_group_reset and g > 1:
            first = torch.stack([e.observations[0] for e in episodes]).view(len(seeds), g, -1)
            differs = (first != first[:, :1]).flatten(1).any(1)
            if bool(differs.any()):
                b = int(differs.nonzero()[0, 0])
                raise ValueError(
                    f"the {g} episodes of group {b} (seed {seeds[b]}) did not start from the same "
                    f"observation after env.reset(seed={seeds[b]}): {first[b, 0].tolist()} vs "
                    f"{first[b, 1:].tolist()[:2]}... GRPO's group baseline needs equal starts. Make "
                    f"reset(seed=...) deterministic (seed the env's np_random), restore a saved "
                    f"simulator state, or pass check_group_reset=False and use a large group_size "
                    f"(see grpo.gym.episodes' docstring)."
                )
        self.env_steps += int(sum(e.length for e in episodes))
        return [episodes[b * g : (b + 1) * g] for b in range(len(seeds))]

    def get_log_probabilities(self, states: Any, actions: Sequence[Episode]) -> PolicyOutput:
        """Per-step ``log pi(a_t | o_t)``: PolicyOutput(log_probs (N, T), mask (N, T))."""
        return self.evaluate_actions(states, actions)

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Episode],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput:
        """Log-probs (N, T), mask (N, T) and optionally the exact entropy (N, T), one forward.

        ``states`` is not needed (the episodes hold their observations), so the grouped and the
        flat layouts are handled alike.
        """
        obs, act, _, mask = stack_episodes(actions, f"{type(self).__name__}.get_log_probabilities")
        device = self.policy.device
        obs, act, mask = obs.to(device), act.to(device), mask.to(device)
        dist = self.policy.distribution(obs[mask])  # one forward over the sum(mask) valid steps
        logp = obs.new_zeros(mask.shape).masked_scatter(mask, dist.log_prob(act[mask]))
        ent = None
        if with_entropy:
            with entropy_grad_mode(with_entropy):
                ent = obs.new_zeros(mask.shape).masked_scatter(mask, dist.entropy())
        return PolicyOutput(logp, mask=mask, entropy=ent)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.policy.named_parameters())

    def __deepcopy__(self, memo: dict[int, Any]) -> EpisodePolicy:
        new = EpisodePolicy.__new__(EpisodePolicy)
        nn.Module.__init__(new)
        new.policy = copy.deepcopy(self.policy, memo)
        new.max_steps = self.max_steps
        new.check_group_reset = self.check_group_reset
        new.env_steps = self.env_steps
        new._pool = copy.deepcopy(self._pool, memo)
        new.train(self.training)
        return new


@dataclass(frozen=True)
class EpisodeEvaluation:
    """One evaluation episode per seed (`evaluate_policy`), in seed order.

    Attributes:
        returns: ``(n,)`` float64, the undiscounted returns.
        lengths: ``(n,)`` int64, the steps of each episode.
        successes: ``(n,)`` bool, ``Episode.success`` of each episode; None when the env reports
            no success (an episode without a flag makes the whole array None).
    """

    returns: np.ndarray
    lengths: np.ndarray
    successes: np.ndarray | None

    @property
    def success_rate(self) -> float | None:
        """p = (1/n) sum_i 1[success_i]; None without success flags."""
        return None if self.successes is None else float(self.successes.mean())

    @property
    def success_stderr(self) -> float | None:
        """The standard error of ``success_rate``: sqrt(p (1 - p) / (n - 1)) (the sample standard
        deviation of the n flags over sqrt(n)); NaN for n = 1, None without success flags."""
        if self.successes is None:
            return None
        n, p = self.successes.size, self.success_rate
        assert p is not None
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else math.nan


def evaluate_policy(
    policy: DistributionPolicy | EpisodePolicy | nn.Module,
    env: str | Callable[[], Any],
    seeds: Sequence[int],
    *,
    deterministic: bool = True,
    max_steps: int | None = None,
    env_kwargs: dict[str, Any] | None = None,
    num_envs: int = 16,
) -> EpisodeEvaluation:
    """One episode per seed, played by a pool of at most ``num_envs`` envs reused across the seeds.

    The n seeds are played in ``c = ceil(n / num_envs)`` rounds of ``k = ceil(n / c)`` episodes in
    one vector env of k sub-envs (each round resets them with its seeds; the last round repeats its
    last seed to fill the k sub-envs and drops the extra episodes), so k envs are built, not n.
    ``deterministic=True`` plays the distribution's mode (argmax / mean), as is usual for reporting.
    Returns an `EpisodeEvaluation` (returns, lengths, success flags and rate with standard error).
    """
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"evaluate_policy(num_envs={num_envs!r}): expected an integer >= 1 (envs reused).")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("evaluate_policy got no seeds: pass one seed per evaluation episode.")
    net = policy.policy if isinstance(policy, EpisodePolicy) else _as_distribution_policy(policy)
    rounds = -(-len(seeds) // num_envs)
    k = -(-len(seeds) // rounds)
    pool = _EnvPool(env, "sync", dict(env_kwargs or {}))
    was_training = net.training
    net.eval()
    episodes: list[Episode] = []
    try:
        envs = pool.get(k)
        for r in range(rounds):
            part = seeds[r * k : (r + 1) * k]
            played = run_episodes(
                net,
                envs,
                part + part[-1:] * (k - len(part)),
                max_steps=max_steps,
                deterministic=deterministic,
            )
            episodes += played[: len(part)]
    finally:
        net.train(was_training)
        pool.close()
    flags = [e.success for e in episodes]
    return EpisodeEvaluation(
        returns=np.array([e.episode_return for e in episodes], dtype=np.float64),
        lengths=np.array([e.length for e in episodes], dtype=np.int64),
        successes=None if None in flags else np.array(flags, dtype=bool),
    )


def evaluate_episodes(
    policy: DistributionPolicy | EpisodePolicy,
    env: str | Callable[[], Any],
    seeds: Sequence[int],
    *,
    deterministic: bool = True,
    max_steps: int | None = None,
    env_kwargs: dict[str, Any] | None = None,
    num_envs: int = 16,
) -> np.ndarray:
    """Returns of one episode per seed (float64 array (len(seeds),)): ``evaluate_policy(...).returns``
    (a pool of at most ``num_envs`` envs, reused across the seeds)."""
    return evaluate_policy(
        policy,
        env,
        seeds,
        deterministic=deterministic,
        max_steps=max_steps,
        env_kwargs=env_kwargs,
        num_envs=num_envs,
    ).returns


def __getattr__(name: str) -> Callable[[Tensor, Tensor, float], Tensor]:
    """``discounted_returns``, the grpo 0.1 name of `episode_returns`, with a DeprecationWarning."""
    if name == "discounted_returns":
        warnings.warn(
            "grpo.gym.episodes.discounted_returns was renamed episode_returns in grpo 0.2 (one "
            "discounted return per episode, (N,)); grpo.algorithms.advantages.discounted_returns is "
            "the per-step returns-to-go (N, T). The old name goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return episode_returns
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
