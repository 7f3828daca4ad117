"""Adaptive learning rate (GRPOConfig.adaptive_lr_kl, grpo.update.adaptive_lr): the rule against the
documented formula, step by step inside real updates; bounds; one setting for two
parameterisations; checkpoints and the guard's rollback; config errors."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer
from grpo.engine.lr_schedules import build_scheduler
from grpo.policies import categorical_mlp
from grpo.state.checks import scheduler_problem
from grpo.update.adaptive_lr import adapted_lr
from tests.loop_toys import bandit_states, correct_arm

pytestmark = pytest.mark.usefixtures("one_thread")

ARMS = 5
PAYOFF = torch.tensor([0.1, 0.9, 0.3, 0.5, 0.0])


class Logits(nn.Module):
    """A policy over ARMS arms that ignores the state: ARMS learned logits.

    ``poison_call``: the n-th log-prob call made with grad enabled (an update's forward) returns NaN.
    """

    def __init__(self, poison_call: int | None = None) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(ARMS))
        self.poison_call, self.grad_calls = poison_call, 0

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        probs = torch.softmax(self.logits, -1).expand(states.shape[0], -1)
        return torch.multinomial(probs, num_actions_per_state, replacement=True)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        out = torch.log_softmax(self.logits, -1)[actions]
        if torch.is_grad_enabled():
            self.grad_calls += 1
            if self.grad_calls == self.poison_call:
                return out * float("nan")
        return out

    def get_parameters(self) -> dict[str, Tensor]:
        return {"logits": self.logits}


def payoff(states: Tensor, actions: Tensor) -> Tensor:
    return PAYOFF[actions]


def rule(lr: float, kl: float, target: float, lo: float, hi: float) -> float:
    """The module docstring's rule, written again here."""
    if kl > 2 * target:
        return max(lr / 1.5, lo)
    if 0 < kl < target / 2:
        return min(lr * 1.5, hi)
    return lr


@pytest.mark.parametrize(
    ("kl", "want"),
    [
        (0.05, 0.01 / 1.5),  # > 2 target: down
        (0.021, 0.01 / 1.5),
        (0.02, 0.01),  # the band [target/2, 2 target] is inclusive: unchanged
        (0.01, 0.01),
        (0.005, 0.01),
        (0.004, 0.015),  # < target / 2: up
        (1e-9, 0.015),
        (0.0, 0.01),  # no movement measured: unchanged
        (-1e-7, 0.01),
        (math.nan, 0.01),
        (math.inf, 0.01),
    ],
)
def test_rule_by_hand(kl: float, want: float) -> None:
    assert adapted_lr(0.01, kl, 0.01, 1e-5, 1.0) == pytest.approx(want, rel=1e-12)


def test_rule_stops_at_the_bounds() -> None:
    assert adapted_lr(0.012, 1e-6, 0.01, 1e-5, 0.015) == 0.015
    assert adapted_lr(1.2e-5, 1.0, 0.01, 1e-5, 0.015) == 1e-5


def test_every_optimizer_step_follows_the_rule_with_the_kl_measured_before_it() -> None:
    """Inside real updates (6 full-batch optimizer steps each): before optimizer step s >= 1 the
    learning rate equals the rule applied to the k3 KL of the current policy against the
    behaviour policy on the update's samples, computed here in float64."""
    target, lo, hi, lr0 = 2e-3, 1e-4, 0.3, 0.05
    config = GRPOConfig(
        group_size=8, batch_size=2, num_epochs_per_update=6, learning_rate=lr0, seed=0,
        adaptive_lr_kl=target, adaptive_lr_min=lo, adaptive_lr_max=hi,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = Logits()
    seen: dict[str, Tensor] = {}

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        seen["actions"] = actions.reshape(-1).clone()
        return payoff(states, actions)

    trainer = GRPOTrainer(config, policy, reward)
    assert trainer.optimizer is not None
    expected = {"lr": lr0, "s": 0}
    old: dict[str, Tensor] = {}
    checked: list[float] = []

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        logp = torch.log_softmax(policy.logits.detach().double(), -1)[seen["actions"]]
        if expected["s"] == 0:  # nothing applied yet: the behaviour policy
            old["logp"] = logp
        else:
            rho = torch.exp(logp - old["logp"])
            kl = float((rho - 1 - torch.log(rho)).mean())
            expected["lr"] = rule(expected["lr"], kl, target, lo, hi)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected["lr"], rel=1e-9)
        checked.append(optimizer.param_groups[0]["lr"])
        expected["s"] += 1

    trainer.optimizer.register_step_pre_hook(before_step)
    for _ in range(8):
        expected["s"] = 0
        metrics = trainer.step(torch.zeros(2, 1))
        assert metrics["optim/adaptive_lr"] == pytest.approx(expected["lr"], rel=1e-9)
    assert len(checked) == 48
    assert len(set(checked)) > 3  # the rate moved (the checks have teeth) ...
    assert any(b < a for a, b in itertools.pairwise(checked))  # ... down at least once


def test_the_rate_goes_where_each_parameterisation_needs() -> None:
    """One target, two policies: logits (Adam moves the policy little per step) get a larger
    rate, a 64x64 MLP at a large rate gets a smaller one; both stay inside the bounds."""
    common: dict[str, Any] = {"group_size": 8, "num_epochs_per_update": 4, "seed": 0, "adaptive_lr_kl": 0.01}
    torch.manual_seed(0)
    logits = GRPOTrainer(GRPOConfig(batch_size=1, learning_rate=1e-3, **common), Logits(), payoff)
    rates = [logits.step(torch.zeros(1, 1))["optim/adaptive_lr"] for _ in range(15)]
    assert max(rates) == 1e-2
    assert rates[-1] > 1e-3
    torch.manual_seed(0)
    mlp = GRPOTrainer(
        GRPOConfig(batch_size=8, learning_rate=1e-2, **common), categorical_mlp(4, 3), correct_arm
    )
    rates = [mlp.step(bandit_states(8, seed=k))["optim/adaptive_lr"] for k in range(15)]
    assert rates[-1] < 1e-2
    assert min(rates) >= 1e-5


def test_scale_is_checkpointed_and_restored(tmp_path: Path) -> None:
    cfg = GRPOConfig(
        group_size=8, batch_size=2, num_epochs_per_update=4, learning_rate=1e-3, seed=0, adaptive_lr_kl=0.01
    )  # fmt: skip
    torch.manual_seed(0)
    t1 = GRPOTrainer(cfg, Logits(), payoff)
    for _ in range(4):
        t1.step(torch.zeros(2, 1))
    assert t1.optimizer is not None
    assert t1.scheduler is not None
    lr = t1.optimizer.param_groups[0]["lr"]
    assert lr != pytest.approx(1e-3)
    t1.save_checkpoint(tmp_path)
    t2 = GRPOTrainer(cfg, Logits(), payoff)
    t2.load_checkpoint(tmp_path)
    assert t2.optimizer is not None
    assert t2.scheduler is not None
    assert t2.scheduler.lr_lambdas[0].scale == t1.scheduler.lr_lambdas[0].scale  # type: ignore[attr-defined]
    assert t2.optimizer.param_groups[0]["lr"] == lr
    m1, m2 = t1.step(torch.zeros(2, 1)), t2.step(torch.zeros(2, 1))
    assert m2["optim/adaptive_lr"] == m1["optim/adaptive_lr"]


def test_a_scheduler_state_from_before_the_scale_still_loads() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = build_scheduler(opt, "constant", 2)
    assert sched is not None
    saved = sched.state_dict()
    old = {**saved, "lr_lambdas": [{k: v for k, v in saved["lr_lambdas"][0].items() if k != "scale"}]}
    assert scheduler_problem(sched, old) is None
    bad = {**saved, "lr_lambdas": [{**saved["lr_lambdas"][0], "scale": -2.0}]}
    problem = scheduler_problem(sched, bad)
    assert problem is not None
    assert "scale must be a finite number > 0" in problem[1]


def test_an_undone_update_undoes_its_rate_changes() -> None:
    """The guard undoes an update whose 5th optimizer step is non-finite: the weights and the
    learning rate are those from before the update (its steps 1-4 had raised the rate)."""
    cfg = GRPOConfig(
        group_size=8, batch_size=2, num_epochs_per_update=6, learning_rate=1e-3, seed=0, adaptive_lr_kl=0.05
    )  # fmt: skip
    torch.manual_seed(0)
    policy = Logits()
    trainer = GRPOTrainer(cfg, policy, payoff)
    trainer.step(torch.zeros(2, 1))  # one clean update: the rate went up
    assert trainer.optimizer is not None
    assert trainer.scheduler is not None
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    scale_before = trainer.scheduler.lr_lambdas[0].scale  # type: ignore[attr-defined]
    weights_before = policy.logits.detach().clone()
    assert lr_before > 1e-3
    policy.poison_call = policy.grad_calls + 5  # the next update's 5th forward
    with pytest.warns(RuntimeWarning, match="the update of this step was undone"):
        trainer.step(torch.zeros(2, 1))
    assert torch.equal(policy.logits.detach(), weights_before)
    assert trainer.optimizer.param_groups[0]["lr"] == lr_before
    assert trainer.scheduler.lr_lambdas[0].scale == scale_before  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"adaptive_lr_kl": 0.0}, r"adaptive_lr_kl=0.0 is not allowed: expected a finite number > 0"),
        ({"adaptive_lr_kl": math.inf}, r"adaptive_lr_kl=inf is not allowed"),
        ({"adaptive_lr_kl": 0.01, "learning_rate": 0.1}, r"learning_rate=0.1 is not allowed: with adaptive"),
        ({"adaptive_lr_min": 0.0}, r"adaptive_lr_min=0.0 is not allowed"),
        ({"adaptive_lr_min": 1e-2, "adaptive_lr_max": 1e-3}, r"adaptive_lr_max=0.001 is not allowed"),
        ({"adaptive_lr_kl": 0.01, "num_epochs_per_update": 1}, r"makes one optimizer step per update"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"num_epochs_per_update": 4, "learning_rate": 1e-3}
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**{**base, **kwargs})


def test_rsl_rl_name_points_to_the_field() -> None:
    with pytest.raises(TypeError, match="adaptive_lr_kl"):
        GRPOConfig(desired_kl=0.01)  # type: ignore[call-arg]


def test_off_by_default_and_no_metric() -> None:
    torch.manual_seed(0)
    trainer = GRPOTrainer(GRPOConfig(group_size=4, batch_size=1), Logits(), payoff)
    assert "optim/adaptive_lr" not in trainer.step(torch.zeros(1, 1))
    assert trainer.scheduler is None


def test_a_recipe_whose_rate_only_falls_keeps_that_for_a_new_start() -> None:
    """small_policy's ceiling is its start (5e-3): an overridden start becomes the ceiling, unless
    the ceiling is overridden too."""
    assert GRPOConfig.recipe("small_policy").adaptive_lr_max == 5e-3
    assert GRPOConfig.recipe("small_policy", learning_rate=2e-2).adaptive_lr_max == 2e-2
    assert GRPOConfig.recipe("small_policy", learning_rate=1e-3).adaptive_lr_max == 1e-3
    mixed = GRPOConfig.recipe("small_policy", learning_rate=1e-3, adaptive_lr_max=1e-2)
    assert mixed.adaptive_lr_max == 1e-2
