"""Per-step rewards (N, T): returns-to-go with a discount, normalised across the group at each
time step. Checked against plain Python loops, through the trainer, and on a real gymnasium env."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.algorithms.advantages import AdvantageNormalisation, normalise_step_scores

# ---- plain-loop references -------------------------------------------------------------------


def loop_returns(rewards: list[list[float]], lengths: list[int], gamma: float) -> list[list[float]]:
    out = []
    for r, n in zip(rewards, lengths, strict=True):
        g, row = 0.0, [0.0] * len(r)
        for t in reversed(range(n)):
            g = r[t] + gamma * g
            row[t] = g
        out.append(row)
    return out


def loop_advantages(
    returns: list[list[float]], lengths: list[int], groups: list[int], *, scale: str, eps: float = 1e-6
) -> list[list[float]]:
    """A_it = (G_it - mean) / (std + eps) over the members of i's group alive at t."""
    n, t_max = len(returns), len(returns[0])
    dev = [[0.0] * t_max for _ in range(n)]
    for i in range(n):
        for t in range(lengths[i]):
            alive = [j for j in range(n) if groups[j] == groups[i] and lengths[j] > t]
            vals = [returns[j][t] for j in alive]
            if len(vals) < 2 or max(vals) == min(vals):
                continue
            mean = sum(vals) / len(vals)
            d = returns[i][t] - mean
            if scale == "group":
                std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
                d = d / (std + eps)
            dev[i][t] = d
    if scale == "batch":
        valid = [dev[i][t] for i in range(n) for t in range(lengths[i])]
        m = sum(valid) / len(valid)
        std = math.sqrt(sum((v - m) ** 2 for v in valid) / (len(valid) - 1))
        dev = [
            [v / (std + eps) if t < lengths[i] else 0.0 for t, v in enumerate(row)]
            for i, row in enumerate(dev)
        ]
    return dev


def random_case(seed: int, n_groups: int = 3, g: int = 4, t_max: int = 7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t_max + 1, size=n_groups * g).tolist()
    lengths[0] = t_max
    rewards = rng.normal(size=(n_groups * g, t_max)).round(2)
    if seed % 2:  # ties: integer rewards, and one group whose members are all equal
        rewards = rng.integers(0, 2, size=rewards.shape).astype(float)
        rewards[g : 2 * g] = 1.0
        lengths[g : 2 * g] = [t_max] * g
    for i, n in enumerate(lengths):
        rewards[i, n:] = 0.0
    groups = [i // g for i in range(n_groups * g)]
    return rewards.tolist(), lengths, groups, n_groups


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize(("baseline", "scale"), [("group", "group"), ("group", "none"), ("group", "batch")])
def test_step_advantages_equal_a_plain_loop(seed: int, gamma: float, baseline: str, scale: str) -> None:
    rewards, lengths, groups, k = random_case(seed)
    mask = torch.tensor([[t < n for t in range(len(rewards[0]))] for n in lengths])
    from grpo.algorithms.advantages import discounted_returns

    rtg = discounted_returns(torch.tensor(rewards, dtype=torch.float64), mask, gamma)
    want_rtg = loop_returns(rewards, lengths, gamma)
    torch.testing.assert_close(rtg, torch.tensor(want_rtg, dtype=torch.float64))
    got = normalise_step_scores(rtg, mask, torch.tensor(groups), k, AdvantageNormalisation(baseline, scale))  # type: ignore[arg-type]
    want = loop_advantages(want_rtg, lengths, groups, scale=scale)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-9, rtol=1e-9)


def test_unsupported_sources_are_refused_with_the_supported_ones() -> None:
    x, mask = torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"per-step rewards support advantage_baseline in .*'leave_one_out'"):
        normalise_step_scores(x, mask, torch.tensor([0, 0, 1, 1]), 2, AdvantageNormalisation("leave_one_out"))


# ---- through the trainer ------------------------------------------------------------------------


class StepPolicy(nn.Module):
    """Sample k has per-step log-probs theta[k, t] - 1 over its first lengths[k] steps: the
    gradient of the loss w.r.t. theta[k, t] is the weight of step t of sample k, readable by hand."""

    def __init__(self, lengths: list[int], t_max: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(len(lengths), t_max))
        self.lengths = torch.tensor(lengths)

    def generate_actions(self, states: Tensor, g: int, **kw: Any) -> Tensor:
        return torch.arange(states.shape[0] * g).view(-1, g)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> PolicyOutput:
        t = torch.arange(self.theta.shape[1])
        mask = t[None, :] < self.lengths[actions][:, None]
        return PolicyOutput(self.theta[actions] - 1.0, mask=mask)

    def get_parameters(self) -> dict[str, Tensor]:
        return {"theta": self.theta}


def step_reward(table: list[list[float]]):
    def reward(states: Tensor, actions: Tensor) -> Tensor:
        return torch.tensor(table, dtype=torch.float32)[actions]

    return reward


@pytest.mark.parametrize("seed", [0, 1])
def test_the_trainer_credits_each_step_with_its_return_to_go(seed: int) -> None:
    rewards, lengths, groups, k = random_case(seed)
    g = len(rewards) // k
    policy = StepPolicy(lengths, len(rewards[0]))
    config = GRPOConfig(
        group_size=g, batch_size=k, gamma=0.9, kl_coeff=0.0, max_grad_norm=None,
        loss_aggregation="token-mean", learning_rate=1.0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        config, policy, step_reward(rewards), optimizer=torch.optim.SGD(policy.parameters(), lr=1.0)
    )
    batch = trainer.collect(torch.zeros(k, 1))
    want = torch.tensor(
        loop_advantages(loop_returns(rewards, lengths, 0.9), lengths, groups, scale="group"),
        dtype=torch.float64,
    )
    adv = trainer.advantages(batch)
    assert adv.values.shape == (len(rewards), len(rewards[0]))
    torch.testing.assert_close(adv.values.double(), want, atol=1e-5, rtol=1e-5)
    # reward/mean is the mean undiscounted sum over each sample's real steps
    assert adv.metrics()["reward/mean"] == pytest.approx(float(np.mean([sum(r) for r in rewards])), abs=1e-5)
    # one SGD step (lr 1) at ratio 1 with token-mean: d loss / d theta[k, t] = -A_kt / sum(lengths)
    trainer.update(batch, adv)
    torch.testing.assert_close(policy.theta.detach().double(), want / sum(lengths), atol=1e-6, rtol=1e-5)


def test_a_final_reward_alone_gives_every_step_the_episode_advantage() -> None:
    """gamma = 1, equal lengths, reward only at the last step: G_t = R for every t, so per-step
    credit reduces to the episode-level form."""
    final = [3.0, 1.0, 0.0, 2.0, 5.0, 5.0, 1.0, 4.0]
    table = [[0.0, 0.0, 0.0, r] for r in final]
    policy = StepPolicy([4] * 8, 4)
    trainer = GRPOTrainer(GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0), policy, step_reward(table))
    per_step = trainer.advantages(trainer.collect(torch.zeros(2, 1))).values
    episode = GRPOTrainer(
        GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0),
        StepPolicy([4] * 8, 4),
        step_reward([[r] for r in final]),
    )
    per_sample = episode.advantages(episode.collect(torch.zeros(2, 1))).values
    assert per_sample.shape == (8,)
    torch.testing.assert_close(per_step, per_sample[:, None].expand(8, 4))


def test_step_advantages_ignore_a_positive_scale_and_a_shift_of_equal_length_episodes() -> None:
    rewards, _lengths, _, k = random_case(0)
    r = torch.tensor(rewards, dtype=torch.float64)
    mask = torch.ones_like(r, dtype=torch.bool)
    ids = torch.arange(len(rewards)) // (len(rewards) // k)
    from grpo.algorithms.advantages import discounted_returns

    base = normalise_step_scores(
        discounted_returns(r, mask, 0.95), mask, ids, k, AdvantageNormalisation(eps=1e-12)
    )
    moved = normalise_step_scores(
        discounted_returns(2.5 * r - 7.0, mask, 0.95), mask, ids, k, AdvantageNormalisation(eps=1e-12)
    )
    torch.testing.assert_close(base, moved, atol=1e-9, rtol=1e-9)


def test_per_step_rewards_need_per_step_log_probs_of_the_same_shape() -> None:
    policy = StepPolicy([3, 3, 3, 3], 3)
    wrong_t = GRPOTrainer(GRPOConfig(group_size=2, batch_size=2), policy, step_reward([[1.0] * 5] * 4))
    with pytest.raises(
        ValueError,
        match=r"per-step rewards of shape \(4, 5\), but the policy gives log-probs of shape \(4, 3\)",
    ):
        wrong_t.step(torch.zeros(2, 1))
    assert torch.equal(policy.theta, torch.zeros(4, 3))


def test_a_group_with_an_invalid_step_reward_is_dropped() -> None:
    table = [[1.0, 0.0], [0.0, 1.0], [1.0, float("nan")], [0.0, 0.0]]
    trainer = GRPOTrainer(
        GRPOConfig(group_size=2, batch_size=2, invalid_rewards="drop_groups"),
        StepPolicy([2] * 4, 2),
        step_reward(table),
    )
    batch = trainer.collect(torch.zeros(2, 1))
    assert batch.dropped_groups == 1
    assert batch.step_rewards is not None
    assert batch.step_rewards.tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_gamma_is_validated() -> None:
    with pytest.raises(
        ValueError, match=r"GRPOConfig.gamma=1.5 is not allowed: expected a number in \[0, 1\]"
    ):
        GRPOConfig(gamma=1.5)


# ---- gymnasium episodes --------------------------------------------------------------------------


def test_episode_rewards_are_the_masked_per_step_rewards_of_cartpole() -> None:
    pytest.importorskip("gymnasium")
    from grpo.gym.episodes import EpisodePolicy, EpisodeRewards
    from grpo.policies import categorical_mlp

    torch.manual_seed(0)
    policy = EpisodePolicy("CartPole-v1", categorical_mlp(4, 2))
    trainer = GRPOTrainer(GRPOConfig(group_size=4, batch_size=2, gamma=0.99), policy, EpisodeRewards())
    batch = trainer.collect([3, 4])
    assert batch.step_rewards is not None
    assert batch.mask is not None
    assert torch.equal(batch.step_rewards, batch.mask.float())  # CartPole pays 1 per step
    assert batch.rewards.tolist() == batch.mask.sum(-1).float().tolist()
    adv = trainer.advantages(batch).values
    assert adv.shape == batch.mask.shape
    assert bool((adv[~batch.mask] == 0).all())
    policy.close()
