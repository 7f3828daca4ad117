"""Truncated importance sampling for a sampler/trainer mismatch (GRPOConfig.sampler_is_cap)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput
from grpo.policies import CategoricalMLP, DistributionPolicy
from tests.conftest import WordPolicy


class HotSampler(DistributionPolicy):
    """A categorical policy whose sampler runs at temperature ``tau`` (a stand-in for vLLM or a
    quantised generator: same weights, other numbers) and reports its own log-probs."""

    def __init__(self, tau: float) -> None:
        torch.manual_seed(0)
        super().__init__(CategoricalMLP(3, 4, (8,)))
        self.tau = tau

    def sampler_log_probs(self, states: Tensor) -> Tensor:
        return torch.log_softmax(self.net.net(states) / self.tau, -1)  # (B, K)

    def generate_actions_with_log_probs(
        self, states: Any, num_actions_per_state: int, **kwargs: Any
    ) -> tuple[Tensor, PolicyOutput]:
        table = self.sampler_log_probs(states)
        actions = torch.multinomial(table.exp(), num_actions_per_state, replacement=True)  # (B, G)
        return actions, PolicyOutput(table.gather(1, actions).reshape(-1))


def reward(states: Tensor, actions: Tensor) -> Tensor:
    return actions.float() + states[:, 0]


CFG = dict(group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=0.05, seed=0)


def test_weights_and_metrics_match_an_independent_computation() -> None:
    policy = HotSampler(tau=3.0)
    cap = 1.05  # the weights of this small net are within ~10 % of 1: a cap they cross
    trainer = GRPOTrainer(GRPOConfig(**CFG, num_epochs_per_update=2, sampler_is_cap=cap), policy, reward)
    states = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    batch = trainer.collect(states)
    assert batch.sampler_log_probs is not None
    assert batch.old_log_probs is not None
    with torch.no_grad():  # independent: the trainer's log-probs and the sampler's, same weights
        flat = states.repeat_interleave(4, 0)
        actions = batch.actions.reshape(-1, 1)
        mine = torch.log_softmax(policy.net.net(flat), -1).gather(1, actions).squeeze(1)
        theirs = policy.sampler_log_probs(flat).gather(1, actions).squeeze(1)
    torch.testing.assert_close(batch.old_log_probs[:, 0], mine)  # old: the trainer's own forward
    torch.testing.assert_close(batch.sampler_log_probs[:, 0], theirs)
    raw = torch.exp(mine - theirs)
    assert float(raw.max()) > cap  # the cap is active in this example
    stats = trainer.update(batch, trainer.advantages(batch))
    # two epochs: the first sees exactly these weights; the second the same old log-probs
    expected_mean = float(raw.clamp(max=cap).mean())
    assert float(stats["sampler/is_weight_mean"]) == pytest.approx(expected_mean, rel=1e-6)
    assert float(stats["sampler/is_frac_capped"]) == pytest.approx(float((raw > cap).float().mean()))


def test_the_policy_term_is_weighted_in_the_update() -> None:
    """One optimizer step from the same state: the corrected update equals the uncorrected one
    whose advantages were multiplied by the (clamped) weights, as pg is linear in A at ratio 1."""
    cap = 1.05
    states = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    corrected = HotSampler(tau=3.0)
    trainer = GRPOTrainer(GRPOConfig(**CFG, sampler_is_cap=cap), corrected, reward)
    batch = trainer.collect(states)
    adv = trainer.advantages(batch)
    assert batch.sampler_log_probs is not None
    with torch.no_grad():
        old = corrected.evaluate_actions(batch.states, batch.actions, group_size=4).log_probs
        weights = torch.exp(old - batch.sampler_log_probs[:, 0]).clamp(max=cap)
    scaled = adv.values * weights
    trainer.update(batch, adv)

    plain = HotSampler(tau=3.0)  # same initial weights
    plain_batch = dataclasses.replace(batch, old_log_probs=None, sampler_log_probs=None)
    GRPOTrainer(GRPOConfig(**CFG), plain, reward).update(plain_batch, adv._replace(values=scaled))
    for a, b in zip(corrected.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_no_mismatch_gives_weights_of_one_and_the_plain_update() -> None:
    runs = []
    for cap in (2.0, None):
        policy = HotSampler(tau=1.0)  # the sampler is the trainer: weights exactly 1
        trainer = GRPOTrainer(GRPOConfig(**CFG, num_epochs_per_update=2, sampler_is_cap=cap), policy, reward)
        m = trainer.step(torch.randn(4, 3, generator=torch.Generator().manual_seed(3)))
        runs.append(([p.detach().clone() for p in policy.parameters()], m))
    (p_cap, m_cap), (p_plain, m_plain) = runs
    assert m_cap["sampler/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m_cap["sampler/is_frac_capped"] == 0.0
    assert "sampler/is_weight_mean" not in m_plain
    for a, b in zip(p_cap, p_plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_policy_without_sampler_log_probs_is_refused_at_construction() -> None:
    with pytest.raises(
        TypeError, match=r"WordPolicy has no generate_actions_with_log_probs.*sampler_is_cap=None"
    ):
        GRPOTrainer(GRPOConfig(**CFG, sampler_is_cap=2.0), WordPolicy(), reward)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), "2"])
def test_cap_must_be_positive(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"sampler_is_cap.*expected a number > 0"):
        GRPOConfig(**CFG, sampler_is_cap=bad)
