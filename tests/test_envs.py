"""The Environment protocol (grpo.envs): the gymnasium adapter, the batched tensor Pendulum, and
EpisodePolicy / run_episodes on any Environment."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.envs import Environment, SupportsSnapshots  # noqa: E402
from grpo.envs.pendulum import TensorPendulum  # noqa: E402
from grpo.gym.episodes import EpisodePolicy, EpisodeRewards, run_episodes  # noqa: E402
from grpo.gym.vector_env import GymVectorEnvironment  # noqa: E402
from grpo.policies import categorical_mlp, gaussian_mlp  # noqa: E402


def test_both_environments_satisfy_the_protocol() -> None:
    vec = GymVectorEnvironment(gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync"))
    for env in (vec, TensorPendulum(3)):
        assert isinstance(env, Environment)
        assert isinstance(env, SupportsSnapshots)
    vec.close()


def test_tensor_pendulum_follows_gymnasium_pendulum() -> None:
    """Same start, same torques: the same trajectory to float32 rounding, 200 steps, then truncated."""
    env = TensorPendulum(1)
    ref = gym.make("Pendulum-v1")
    ref.reset(seed=0)
    obs = env.reset([7])
    theta, theta_dot = float(env.theta[0]), float(env.theta_dot[0])
    ref.unwrapped.state = np.array([theta, theta_dot])
    rng = np.random.default_rng(0)
    for t in range(200):
        assert obs[0].numpy() == pytest.approx(ref.unwrapped._get_obs(), abs=5e-3), t
        u = rng.uniform(-3, 3, size=1)  # beyond the bounds too: both clip to |u| <= 2
        step = env.step(torch.tensor(u, dtype=torch.float32).view(1, 1))
        _, r, term, trunc, _ = ref.step(u.astype(np.float32))
        assert float(step.rewards[0]) == pytest.approx(r, rel=2e-3, abs=2e-3), t
        assert not bool(step.terminated[0])
        assert not term
        assert bool(step.truncated[0]) == trunc == (t == 199)
        obs = step.observations


def test_a_tensor_pendulum_snapshot_restarts_exactly() -> None:
    env = TensorPendulum(2)
    env.reset([1, 2])
    for _ in range(5):
        env.step(torch.ones(2, 1))
    snap = env.snapshot(1)
    later = [env.step(torch.full((2, 1), 0.5)).observations[1].clone() for _ in range(4)]
    env.reset([snap, 3])
    again = [env.step(torch.full((2, 1), 0.5)).observations[0].clone() for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(later, again, strict=True))


def test_a_snapshot_start_of_the_gym_adapter_replays_exactly() -> None:
    vec = GymVectorEnvironment(gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync"))
    vec.reset([5, 6])
    for _ in range(3):
        vec.step(torch.tensor([1, 0]))
    obs = vec.step(torch.tensor([0, 1])).observations
    snap = vec.snapshot(0, obs[0])
    actions = [torch.tensor([1, 1]), torch.tensor([0, 0]), torch.tensor([1, 0])]
    first = [vec.step(a) for a in actions]
    restarted = vec.reset([6, snap])
    assert torch.equal(restarted[1], obs[0])
    second = [vec.step(a.flip(0)) for a in actions]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.observations[0], b.observations[1])
        assert a.rewards[0] == b.rewards[1]
    vec.close()


def test_episode_policy_trains_on_a_batched_tensor_environment() -> None:
    """B x G episodes in one TensorPendulum: groups start equal, every env step is counted, the
    trainer steps (and a wrong num_envs is refused with the size to build)."""
    torch.manual_seed(0)
    policy = EpisodePolicy(TensorPendulum(8), gaussian_mlp(3, 1), max_steps=50)
    trainer = GRPOTrainer(
        GRPOConfig.recipe("small_policy", group_size=4, batch_size=2), policy, EpisodeRewards()
    )
    metrics = trainer.step([11, 12])
    assert policy.env_steps == 8 * 50
    assert math.isfinite(metrics["loss/total"])
    groups = policy.generate_actions([3, 4], 4)
    assert all(torch.equal(e.observations[0], g[0].observations[0]) for g in groups for e in g)
    with pytest.raises(ValueError, match=r"TensorPendulum has num_envs=8, but this step plays 12 episodes"):
        trainer.step([1, 2, 3])


def test_run_episodes_takes_a_gym_vector_env_or_an_environment_alike() -> None:
    torch.manual_seed(0)
    net = categorical_mlp(4, 2)
    torch.manual_seed(1)
    a = run_episodes(net, gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync"), [1, 2, 3])
    torch.manual_seed(1)
    env = GymVectorEnvironment(gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync"))
    b = run_episodes(net, env, [1, 2, 3])
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.observations, y.observations)
        assert torch.equal(x.rewards, y.rewards)
        assert x.seed == y.seed


def test_bad_environment_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_envs=0\): expected an integer >= 1"):
        TensorPendulum(0)
    env = TensorPendulum(2)
    with pytest.raises(ValueError, match=r"got 1 starts for 2 envs"):
        env.reset([1])
    with pytest.raises(ValueError, match=r"non-negative int seeds or snapshots; got -1"):
        env.reset([1, -1])

    class Switches(gym.Env):  # an action space the adapter cannot sample for
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
        action_space = gym.spaces.MultiBinary(3)

    with pytest.raises(TypeError, match=r"supports Discrete and Box action spaces; the env has MultiBinary"):
        GymVectorEnvironment(gym.vector.SyncVectorEnv([Switches]))
