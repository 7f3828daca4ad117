"""The small_policy preset with per-step credit learns classic control on tiny budgets (the same
trainer as examples/classic_control.py; the full-budget comparison with PPO is
benchmarks/learning.py). Deterministic returns on 5 held-out seeds, 3 training seeds each."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gymnasium")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import classic_control

from grpo.gym.episodes import EpisodeRewards, evaluate_episodes
from grpo.gym.exploration import EpisodeSpread

EVAL = classic_control.EVAL_SEEDS[:5]
pytestmark = pytest.mark.usefixtures("one_thread")


def returns_after(env_id: str, seed: int, env_steps: int) -> tuple[float, float]:
    """Greedy mean return before training and after ``env_steps`` training env steps."""
    trainer, policy = classic_control.make_trainer(env_id, seed)
    before = float(evaluate_episodes(policy, env_id, EVAL).mean())
    rng = np.random.default_rng(seed)
    while policy.env_steps < env_steps:
        trainer.step(rng.integers(0, 2**20, size=4).tolist())
    after = float(evaluate_episodes(policy, env_id, EVAL).mean())
    policy.close()
    return before, after


def test_cartpole_balances_after_10k_env_steps() -> None:
    runs = [returns_after("CartPole-v1", s, 10_000) for s in range(3)]
    assert max(b for b, _ in runs) < 60  # the untrained policies fall at once
    assert np.mean([a for _, a in runs]) >= 300, runs  # measured: 450, 263, 466


@pytest.mark.slow
def test_acrobot_leaves_the_all_fail_start_with_the_tie_breaker() -> None:
    runs = [returns_after("Acrobot-v1", s, 40_000) for s in range(3)]
    assert min(b for b, _ in runs) < -450  # every early episode fails alike
    assert all(a > -400 for _, a in runs), runs  # measured: -252, -77, -80
    assert np.mean([a for _, a in runs]) >= -250, runs


@pytest.mark.slow  # 3 x 40k env steps: ~15 s of CPU (CartPole's learning run stays in the default run)
def test_pendulum_improves_within_40k_env_steps() -> None:
    runs = [returns_after("Pendulum-v1", s, 40_000) for s in range(3)]
    assert all(a - b > 150 for b, a in runs), runs  # measured: +273, +308, +569
    assert np.mean([a for _, a in runs]) >= -950, runs  # measured: -829


def test_the_tie_breaker_goes_to_the_last_real_step_with_its_weight() -> None:
    from grpo.gym.episodes import EpisodePolicy
    from grpo.policies import categorical_mlp

    torch.manual_seed(0)
    policy = EpisodePolicy("Acrobot-v1", categorical_mlp(6, 3), max_steps=20)
    episodes = [e for group in policy.generate_actions([1, 2], 2) for e in group]
    plain = EpisodeRewards().compute_rewards(None, episodes)
    spread = EpisodeSpread().compute_rewards(None, episodes)
    with_bonus = EpisodeRewards(bonus=EpisodeSpread(), bonus_weight=0.25).compute_rewards(None, episodes)
    last = torch.tensor([e.length - 1 for e in episodes])
    expected = plain.clone()
    expected[torch.arange(4), last] += 0.25 * spread
    torch.testing.assert_close(with_bonus, expected)
    policy.close()
    with pytest.raises(TypeError, match="needs a RewardModel with compute_rewards"):
        EpisodeRewards(bonus=3)
    with pytest.raises(ValueError, match=r"EpisodeRewards\(bonus_weight=0\): expected a finite number > 0"):
        EpisodeRewards(bonus=EpisodeSpread(), bonus_weight=0)
