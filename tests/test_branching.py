"""Branching (grpo.gym.branching): snapshot branches are exact, every env step is counted, and
the estimator on branched groups is the per-step group baseline computed by a plain loop."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.gym.branching import BranchPoints, branching_policy  # noqa: E402
from grpo.gym.episodes import EpisodeRewards  # noqa: E402
from grpo.gym.snapshots import SnapshotStore, restore  # noqa: E402
from grpo.policies import categorical_mlp, gaussian_mlp  # noqa: E402

HAS_MUJOCO = importlib.util.find_spec("mujoco") is not None
ENVS = [
    ("CartPole-v1", lambda: categorical_mlp(4, 2, hidden=(16,))),
    ("Pendulum-v1", lambda: gaussian_mlp(3, 1, hidden=(16,))),
    pytest.param(
        "Hopper-v5",
        lambda: gaussian_mlp(11, 3, hidden=(16,)),
        marks=pytest.mark.skipif(not HAS_MUJOCO, reason="needs mujoco (pip install 'gymnasium[mujoco]')"),
    ),
]


def branched(env_id: str, make_net, *, every: int = 7, horizon: int = 12, b: int = 2, g: int = 3):
    torch.manual_seed(0)
    store = SnapshotStore()
    policy = branching_policy(env_id, make_net(), store, horizon=horizon)
    trunk = BranchPoints(env_id, policy, store, every=every, seed=0)
    states = trunk.sample(b)
    groups = policy.generate_actions(states, g)
    return store, policy, trunk, states, groups


@pytest.mark.parametrize(("env_id", "make_net"), ENVS)
def test_a_branch_replayed_from_its_snapshot_gives_the_same_rewards(env_id: str, make_net) -> None:
    store, policy, trunk, states, groups = branched(env_id, make_net)
    env = gym.make(env_id)
    env.reset(seed=123)
    for index, group in zip(states, groups, strict=True):
        for ep in group:
            obs = restore(env, store[index])
            assert np.array_equal(np.asarray(obs, dtype=np.float32), ep.observations[0].numpy())
            for t in range(ep.length):
                assert np.array_equal(np.asarray(obs, dtype=np.float32), ep.observations[t].numpy()), t
                a = ep.actions[t].numpy()  # as sampled; the env got it clipped to its bounds
                space = env.action_space
                obs, r, *_ = env.step(int(a) if a.ndim == 0 else np.clip(a, space.low, space.high))
                assert np.float32(r) == ep.rewards[t].item(), (t, r, ep.rewards[t])
    policy.close()
    trunk.close()


@pytest.mark.parametrize(("env_id", "make_net"), ENVS[:2])
def test_every_env_step_is_counted_and_branches_stop_at_the_horizon(env_id: str, make_net) -> None:
    store, policy, trunk, _, groups = branched(env_id, make_net, every=5, horizon=9, b=3, g=2)
    lengths = [ep.length for group in groups for ep in group]
    assert max(lengths) <= 9
    assert policy.env_steps == sum(lengths)
    assert 3 <= trunk.env_steps <= 3 * 5  # `every` steps after each snapshot, fewer when an episode ends
    assert len(store) == 3
    first = [group[0].observations[0] for group in groups]
    assert all(torch.equal(ep.observations[0], first[i]) for i, group in enumerate(groups) for ep in group)


def test_the_advantages_of_branched_groups_are_the_per_step_group_baseline() -> None:
    """A plain loop: returns-to-go G_it (gamma) within each branch, then at each t the group's
    mean and std over the branches still alive at t."""
    _, policy, trunk, states, _ = branched("CartPole-v1", ENVS[0][1], every=3, horizon=15, b=2, g=4)
    cfg = GRPOConfig(group_size=4, batch_size=2, gamma=0.9, seed=0)
    trainer = GRPOTrainer(cfg, policy, EpisodeRewards())
    batch = trainer.collect(states)
    adv = trainer.advantages(batch).values
    eps = cfg.advantage_eps
    for gi in range(2):
        eps_ = [batch.actions[gi * 4 + k] for k in range(4)]
        T = max(e.length for e in eps_)
        rtg = [[0.0] * T for _ in eps_]
        for k, e in enumerate(eps_):
            acc = 0.0
            for t in reversed(range(e.length)):
                acc = float(e.rewards[t]) + 0.9 * acc
                rtg[k][t] = acc
        for t in range(T):
            alive = [k for k, e in enumerate(eps_) if t < e.length]
            vals = [rtg[k][t] for k in alive]
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            for k in alive:
                want = 0.0 if len(vals) < 2 or std == 0 else (rtg[k][t] - mean) / (std + eps)
                assert adv[gi * 4 + k, t].item() == pytest.approx(want, abs=1e-5), (gi, k, t)
    policy.close()
    trunk.close()


def test_bad_branching_settings_are_refused() -> None:
    store = SnapshotStore()
    with pytest.raises(ValueError, match=r"horizon=0\): expected an integer >= 1"):
        branching_policy("CartPole-v1", categorical_mlp(4, 2), store, horizon=0)
    policy = branching_policy("CartPole-v1", categorical_mlp(4, 2), store, horizon=5)
    with pytest.raises(ValueError, match=r"every=0\): expected an integer >= 1"):
        BranchPoints("CartPole-v1", policy, store, every=0)
    with pytest.raises(TypeError, match=r"needs a grpo\.gym\.snapshots\.SnapshotStore"):
        BranchPoints("CartPole-v1", policy, {}, every=5)  # type: ignore[arg-type]
