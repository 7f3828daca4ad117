"""grpo.update.loop / grpo.update.plan: the update is invariant to micro-batching (the normaliser is
counted once per optimizer step), and groups collected elsewhere train through train_on_batch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer
from grpo.algorithms.aggregation import AGGREGATIONS
from grpo.experience_collector import ExperienceBatch
from grpo.policies import categorical_mlp


class FreeLogProbs(nn.Module):
    """Sample k of the batch has log-prob theta[k]: the gradient of the loss w.r.t. theta is the
    per-sample weight of the objective, readable by hand. Actions are the sample indices."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(n))

    def generate_actions(self, states: Tensor, g: int, **kw: Any) -> Tensor:
        return torch.arange(states.shape[0] * g).view(-1, g)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return self.theta[actions] - 1.0

    def get_parameters(self) -> dict[str, Tensor]:
        return {"theta": self.theta}


def fixed_rewards(values: list[float]):
    def reward(states: Tensor, actions: Tensor) -> Tensor:
        return torch.tensor(values)[actions]

    return reward


@pytest.mark.parametrize("micro", [None, 1])
def test_an_empty_micro_batch_does_not_change_the_update(micro: int | None) -> None:
    """Regression: with the mask unknown before the update (kl_coeff=0, one optimizer step) the
    deferred normaliser was clamped to >= 1 per micro-batch, so a micro-batch whose group was
    dropped added 1: the gradient was [0.236, -0.236, 0, 0] with micro_batch_size=1 instead of
    [0.354, -0.354, 0, 0]."""
    policy = FreeLogProbs(4)
    cfg = GRPOConfig(
        group_size=2, batch_size=2, micro_batch_size=micro, kl_coeff=0.0, drop_zero_variance_groups=True,
        max_grad_norm=None, seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        cfg,
        policy,
        fixed_rewards([0.0, 1.0, 0.5, 0.5]),
        optimizer=torch.optim.SGD(policy.parameters(), lr=1.0),
    )
    trainer.step(torch.zeros(2, 1))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # group 0: A = -a, +a; group 1 dropped (zero variance)
    expected = torch.tensor([-a / 2, a / 2, 0.0, 0.0])  # theta - grad, token-mean over 2 valid steps
    torch.testing.assert_close(policy.theta.detach(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("kl", [0.0, 0.1])
@pytest.mark.parametrize("epochs", [1, 2])
def test_micro_batching_does_not_change_the_update_with_dropped_groups(
    agg: str, kl: float, epochs: int
) -> None:
    """Random bandit batches where some groups have zero variance (dropped), every aggregation,
    mask known (KL on) or deferred (KL off): micro_batch_size 1, 2, 3 give the update of None."""
    results = []
    for micro in (None, 1, 2, 3):
        torch.manual_seed(0)
        policy = categorical_mlp(3, 2, hidden=(8,))
        init = torch.cat([p.detach().flatten() for p in policy.parameters()])
        cfg = GRPOConfig(
            group_size=3, batch_size=6, micro_batch_size=micro, kl_coeff=kl,
            drop_zero_variance_groups=True, loss_aggregation=agg, loss_normaliser=5.0,
            num_epochs_per_update=epochs, seed=1, learning_rate=0.05,
        )  # fmt: skip
        trainer = GRPOTrainer(cfg, policy, lambda s, a: (a == 1).float() * (s[:, 0] > 0).float())
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            trainer.step(torch.randn(6, 3, generator=gen))
        results.append(torch.cat([p.detach().flatten() for p in trainer.params]))
    assert float((results[0] - init).abs().max()) > 1e-3  # the updates were not empty
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], atol=1e-6, rtol=1e-5)


# ---- groups collected elsewhere -----------------------------------------------------------------
def bandit_trainer(**kw: Any) -> GRPOTrainer:
    torch.manual_seed(0)
    cfg = GRPOConfig(**{"group_size": 4, "batch_size": 8, "seed": 0, "learning_rate": 0.05, **kw})
    return GRPOTrainer(
        cfg, categorical_mlp(4, 3, hidden=(16,)), lambda s, a: (a == s[:, 0].long() % 3).float()
    )


@pytest.mark.parametrize(
    "kw",
    [
        {},  # one optimizer step: on-policy, no behaviour log-probs needed
        {"num_epochs_per_update": 2, "mini_batch_size": 4},  # recorded at collection
        {"num_epochs_per_update": 2, "kl_coeff": 0.1, "micro_batch_size": 2},
    ],
)
def test_train_on_batch_of_steps_own_collection_is_bitwise_step(kw: dict[str, Any]) -> None:
    a, b = bandit_trainer(**kw), bandit_trainer(**kw)
    init = [p.detach().clone() for p in a.params]
    states = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    ma = a.step(states)
    torch.manual_seed(5)
    decisions = b.plan.decide(len(states))
    batch = b.collector.collect_for_update(states, {}, record_old=decisions.old_at_collection)
    mb = b.train_on_batch(batch)
    assert any(not torch.equal(p, q) for p, q in zip(a.params, init, strict=True))  # it trained
    for p, q in zip(a.params, b.params, strict=True):
        assert torch.equal(p, q)
    assert {k: v for k, v in ma.items() if not k.startswith("time/")} == {
        k: v for k, v in mb.items() if not k.startswith("time/")
    }


def test_groups_from_elsewhere_train_the_policy() -> None:
    """A logged bandit: uneven groups as lists, rewards flat, no behaviour log-probs."""
    trainer = bandit_trainer(num_epochs_per_update=2)
    gen = torch.Generator().manual_seed(0)
    before = trainer.evaluate(torch.eye(4)[:3].repeat(4, 1), seed=0)["eval/reward/mean"]
    for _ in range(60):
        states = torch.randn(6, 4, generator=gen)
        states[:, 0] = torch.randint(0, 3, (6,), generator=gen).float()
        groups = [
            torch.randint(0, 3, (int(k),), generator=gen).tolist()
            for k in torch.randint(2, 6, (6,), generator=gen)
        ]
        rewards = [float(a == int(s[0]) % 3) for s, g in zip(states, groups, strict=True) for a in g]
        batch = ExperienceBatch.from_groups(states, [[torch.tensor(a) for a in g] for g in groups], rewards)
        assert batch.group_size is None
        trainer.train_on_batch(dataclasses.replace(batch, actions=torch.stack(batch.actions)))
    states = torch.zeros(30, 4)
    states[:, 0] = torch.arange(30).float() % 3
    after = trainer.evaluate(states, seed=0)["eval/reward/mean"]
    assert after > max(0.8, before + 0.3), (before, after)


def test_from_groups_checks_its_input_like_collection() -> None:
    states = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"actions must be 2 groups"):
        ExperienceBatch.from_groups(states, [[0, 1]], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"expected \(4,\): one reward per"):
        ExperienceBatch.from_groups(states, [[0, 1], [1, 2]], [1.0, 0.0])
    with pytest.raises(ValueError, match="non-finite rewards"):
        ExperienceBatch.from_groups(states, [[0, 1], [1, 2]], [1.0, 0.0, math.nan, 1.0])
    with pytest.raises(ValueError, match=r"old_log_probs returned log-probs of shape \(3,\)"):
        ExperienceBatch.from_groups(
            states, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), old_log_probs=torch.zeros(3)
        )
    with pytest.raises(ValueError, match="groups at \\[1\\] are not non-empty"):
        ExperienceBatch.from_groups(states, [[0], []], [1.0])
    trainer = bandit_trainer()
    with pytest.raises(TypeError, match="train_on_batch expects an ExperienceBatch"):
        trainer.train_on_batch({"states": states})  # type: ignore[arg-type]


class Unlinked(FreeLogProbs):
    """Log-probs that require grad but are a new leaf, not computed from ``theta``."""

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return torch.full(actions.shape, -1.0, requires_grad=True)


@pytest.mark.parametrize("mini_batch_size", [None, 1], ids=["one-optimizer-step", "two-optimizer-steps"])
def test_refused_updates_advance_neither_the_lr_schedule_nor_the_optimizer(
    mini_batch_size: int | None,
) -> None:
    """Log-probs that do not depend on the parameters, and a non-finite learning rate, are refused
    before the optimizer steps: weights, optimizer state and LR schedule as before."""
    cfg = GRPOConfig(
        group_size=2, batch_size=2, mini_batch_size=mini_batch_size, kl_coeff=0.0, seed=0,
        lr_schedule="linear", warmup_steps=2, total_steps=20,
    )  # fmt: skip
    policy = Unlinked(4)
    trainer = GRPOTrainer(cfg, policy, fixed_rewards([0.0, 1.0, 0.5, 0.25]))
    assert trainer.optimizer is not None
    assert trainer.scheduler is not None

    def state() -> tuple[Tensor, str, str]:
        assert trainer.optimizer is not None
        assert trainer.scheduler is not None
        sched = str(trainer.scheduler.state_dict())
        return policy.theta.detach().clone(), str(trainer.optimizer.state_dict()), sched

    before = state()
    with pytest.raises(ValueError, match=r"^Unlinked\.get_log_probabilities returned log-probs that require"):
        trainer.step(torch.zeros(2, 1))
    after = state()
    assert torch.equal(before[0], after[0])
    assert before[1:] == after[1:]
    assert trainer.scheduler.last_epoch == 0

    # the same trainer with linked log-probs trains; then a non-finite lr is refused
    policy.get_log_probabilities = lambda s, a: FreeLogProbs.get_log_probabilities(policy, s, a)  # type: ignore[method-assign]
    trainer.step(torch.zeros(2, 1))
    assert trainer.scheduler.last_epoch == trainer.config.optimizer_steps_per_step
    trainer.optimizer.param_groups[0]["lr"] = math.inf
    before = state()
    with pytest.warns(RuntimeWarning, match=r"the optimizer's lr=inf is not finite, so its step was not"):
        metrics = trainer.step(torch.zeros(2, 1))
    after = state()
    assert torch.equal(before[0], after[0])
    assert before[1:] == after[1:]
    assert metrics["optim/non_finite_steps"] == 1.0
