"""Gymnasium episodes as GRPO actions: collection, masks, log-probs, returns, learning."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput  # noqa: E402
from grpo.gym.episodes import (  # noqa: E402
    Episode,
    EpisodePolicy,
    EpisodeReturn,
    episode_returns,
    evaluate_episodes,
)
from grpo.policies import categorical_mlp, gaussian_mlp  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def cartpole_policy(seed: int = 0, **kwargs: Any) -> EpisodePolicy:
    torch.manual_seed(seed)
    return EpisodePolicy("CartPole-v1", categorical_mlp(4, 2, hidden=(16,)), **kwargs)


def pendulum_policy(seed: int = 0, **kwargs: Any) -> EpisodePolicy:
    torch.manual_seed(seed)
    return EpisodePolicy("Pendulum-v1", gaussian_mlp(3, 1, hidden=(16,), log_std_init=0.5), **kwargs)


def test_episode_returns_hand_computed() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 9.0], [1.0, 1.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    # gamma = 0.5: 1 + 0.5*2 + 0.25*3 = 2.75 ; 1 + 0.5*1 = 1.5 (padding ignored)
    assert episode_returns(rewards, mask, 0.5).tolist() == [2.75, 1.5]
    assert episode_returns(rewards, mask).tolist() == [6.0, 2.0]
    with pytest.raises(ValueError, match=r"gamma=1.5 is not allowed"):
        episode_returns(rewards, mask, 1.5)


def test_discounted_returns_is_the_old_name_of_episode_returns() -> None:
    import grpo.gym.episodes as episodes

    with pytest.warns(DeprecationWarning, match="renamed episode_returns"):
        assert episodes.discounted_returns is episode_returns


def test_groups_start_from_the_same_state_and_masks_are_prefixes() -> None:
    policy = cartpole_policy()
    groups = policy.generate_actions([11, 22], 3)
    assert len(groups) == 2
    assert all(len(g) == 3 for g in groups)
    episodes = [e for g in groups for e in g]
    t_max = max(e.length for e in episodes)
    for b, group in enumerate(groups):
        for e in group:
            assert e.seed == [11, 22][b]
            assert torch.equal(e.observations[0], group[0].observations[0])
            assert e.observations.shape == (t_max, 4)
            assert e.actions.shape == (t_max,)
            # mask: `length` Trues then Falses; CartPole pays 1 per step, so return == length
            assert e.mask.tolist() == [True] * e.length + [False] * (t_max - e.length)
            assert e.episode_return == e.length
            assert (e.observations[e.length :] == 0).all()
            assert (e.rewards[e.length :] == 0).all()
    assert policy.env_steps == sum(e.length for e in episodes)
    # different seeds, different starts
    assert not torch.equal(groups[0][0].observations[0], groups[1][0].observations[0])
    policy.close()


@pytest.mark.parametrize("make", [cartpole_policy, pendulum_policy])
def test_vectorised_collection_matches_a_plain_env_loop(make: Any) -> None:
    """Replaying each stored episode's actions in a fresh single env gives the stored obs and rewards."""
    policy = make(max_steps=60)
    episodes = [e for g in policy.generate_actions([5, 6], 2) for e in g]
    env_id = policy._pool.env
    for e in episodes:
        env = gym.make(env_id)
        obs, _ = env.reset(seed=e.seed)
        for t in range(e.length):
            np.testing.assert_allclose(e.observations[t].numpy(), obs, rtol=0, atol=1e-6)
            a = e.actions[t].numpy()
            a = int(a) if a.ndim == 0 else np.clip(a, -2.0, 2.0)
            obs, r, term, trunc, _ = env.step(a)
            assert e.rewards[t].item() == pytest.approx(float(r), abs=1e-5)
            assert (term or trunc) == (t == e.length - 1 and e.length < 60) or t < e.length - 1
        env.close()
    policy.close()


@pytest.mark.parametrize("make", [cartpole_policy, pendulum_policy])
def test_log_probs_and_entropy_match_a_per_step_loop_and_carry_gradient(make: Any) -> None:
    policy = make(max_steps=40)
    episodes = [e for g in policy.generate_actions([1, 2], 2) for e in g]
    out = policy.evaluate_actions([1, 1, 2, 2], episodes, with_entropy=True)
    assert isinstance(out, PolicyOutput)
    n, t_max = len(episodes), episodes[0].mask.shape[0]
    assert out.log_probs.shape == out.mask.shape == (n, t_max)
    assert out.entropy is not None
    assert out.entropy.shape == (n, t_max)
    for i, e in enumerate(episodes):
        assert torch.equal(out.mask[i], e.mask)
        for t in range(t_max):
            if e.mask[t]:
                d = policy.policy.distribution(e.observations[t : t + 1])
                exp_lp = d.log_prob(e.actions[t : t + 1])[0]
                exp_ent = d.entropy()[0]
                assert out.log_probs[i, t].item() == pytest.approx(exp_lp.item(), abs=1e-5)
                assert out.entropy[i, t].item() == pytest.approx(exp_ent.item(), abs=1e-5)
            else:
                assert out.log_probs[i, t].item() == 0.0
                assert out.entropy[i, t].item() == 0.0
    # get_log_probabilities is the same numbers, and the gradient reaches every parameter
    lp = policy.get_log_probabilities([1, 1, 2, 2], episodes)
    assert torch.equal(lp.log_probs, out.log_probs)
    assert lp.log_probs.requires_grad
    lp.log_probs.sum().backward()
    grads = [p.grad for p in policy.get_parameters().values()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    policy.close()


def test_episode_return_reward_model() -> None:
    policy = cartpole_policy(max_steps=30)
    episodes = [e for g in policy.generate_actions([3], 4) for e in g]
    got = EpisodeReturn(gamma=0.9).compute_rewards([3] * 4, episodes)
    expected = [sum(0.9**t for t in range(e.length)) for e in episodes]  # CartPole: r_t = 1
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    assert EpisodeReturn().compute_rewards([3] * 4, episodes).tolist() == [e.length for e in episodes]
    with pytest.raises(ValueError, match=r"expected 0 < gamma <= 1"):
        EpisodeReturn(gamma=0.0)
    policy.close()


class _UnseededStart(gym.Env[np.ndarray, int]):
    """An env whose reset ignores the seed: the G episodes of a group start apart."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)
    _counter = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        _UnseededStart._counter += 1
        return np.array([_UnseededStart._counter, 0.0], np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(2, np.float32), 1.0, True, False, {}


def test_group_whose_starts_differ_is_refused_with_a_fix() -> None:
    policy = EpisodePolicy(_UnseededStart, categorical_mlp(2, 2, hidden=(4,)))
    with pytest.raises(ValueError, match=r"did not start from the same observation.*check_group_reset=False"):
        policy.generate_actions([0], 2)
    policy.check_group_reset = False
    (group,) = policy.generate_actions([0], 2)
    assert [e.length for e in group] == [1, 1]
    policy.close()


def test_bad_states_and_policy_are_explained() -> None:
    policy = cartpole_policy()
    with pytest.raises(ValueError, match=r"non-negative integer env seeds.*got 0.5"):
        policy.generate_actions([0.5], 2)
    with pytest.raises(ValueError, match=r"integer env seeds.*dtype torch.float32"):
        policy.generate_actions(torch.zeros(2), 2)
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module.*got str"):
        EpisodePolicy("CartPole-v1", "not a net")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects grpo.gym.episodes.Episode actions"):
        policy.get_log_probabilities([0], [torch.zeros(3)])  # type: ignore[list-item]


def test_reference_copy_holds_no_envs_and_trains_with_kl() -> None:
    policy = cartpole_policy(max_steps=50)
    config = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.05, num_epochs_per_update=2, seed=0)
    trainer = GRPOTrainer(config, policy, EpisodeReturn())
    metrics = trainer.step(torch.tensor([7, 8]))  # a Tensor of seeds uses the grouped path
    ref = trainer.reference_policy
    assert isinstance(ref, EpisodePolicy)
    assert ref is not policy
    assert ref._pool._envs == {}
    assert metrics["kl/ref"] >= 0.0
    assert np.isfinite(metrics["loss/total"])
    assert copy.deepcopy(policy)._pool._envs == {}
    policy.close()


def _train_cartpole(seed: int, steps: int, max_steps: int) -> tuple[EpisodePolicy, list[float]]:
    policy = cartpole_policy(seed, max_steps=max_steps)
    config = GRPOConfig(
        group_size=8, batch_size=4, learning_rate=0.02, num_epochs_per_update=4, kl_coeff=0.0, seed=seed
    )
    trainer = GRPOTrainer(config, policy, EpisodeReturn())
    rng = np.random.default_rng(seed)
    rewards = [trainer.step(rng.integers(0, 2**20, size=4).tolist())["reward/mean"] for _ in range(steps)]
    policy.close()
    return policy, rewards


def test_cartpole_policy_learns() -> None:
    """Episodes capped at 100 steps keep this cheap; the greedy policy's return must rise a lot."""
    eval_seeds = list(range(10_000, 10_010))
    before = evaluate_episodes(cartpole_policy(0), "CartPole-v1", eval_seeds, max_steps=100).mean()
    policy, rewards = _train_cartpole(0, 6, max_steps=100)
    after = evaluate_episodes(policy, "CartPole-v1", eval_seeds, max_steps=100).mean()
    assert np.mean(rewards[-2:]) > 1.5 * np.mean(rewards[:2]), rewards
    assert after > before + 30, (before, after)


def test_seeded_runs_are_equal() -> None:
    a, rewards_a = _train_cartpole(3, 2, max_steps=30)
    b, rewards_b = _train_cartpole(3, 2, max_steps=30)
    assert rewards_a == rewards_b
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_pendulum_step_with_gaussian_policy() -> None:
    policy = pendulum_policy(max_steps=20)
    trainer = GRPOTrainer(GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0), policy, EpisodeReturn())
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = trainer.step([1, 2])
    assert metrics["reward/mean"] < 0
    assert np.isfinite(metrics["loss/total"])
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    (group,) = policy.generate_actions([3], 2)
    assert group[0].actions.shape == (20, 1)
    assert group[0].actions.dtype == torch.float32


def test_import_grpo_does_not_import_gymnasium() -> None:
    code = "import sys, grpo, grpo.gym.episodes; assert 'gymnasium' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_episode_is_frozen() -> None:
    e = Episode(0, torch.zeros(1, 1), torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool), False)
    with pytest.raises(AttributeError):
        e.seed = 1  # type: ignore[misc]
