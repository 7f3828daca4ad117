"""The population tests' shared toy: a 10-armed bandit whose arm a pays a / 9, a members'
trainer for it, and its exact fitness."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.population import HyperparameterConfig, Member, RLParameter
from tests.conftest import bandit_policy

ARMS = torch.linspace(0.0, 1.0, 10)  # arm a pays a / 9
HPC = HyperparameterConfig(
    learning_rate=RLParameter(min=1e-4, max=1.0, shrink_factor=0.5, grow_factor=3.0),
    clip_epsilon=RLParameter(min=0.05, max=0.4),
)


def arm_reward(states: Tensor, actions: Tensor) -> Tensor:
    return ARMS[actions.long()]


def expected_reward(member: Member) -> float:
    """The bandit policy's exact expected reward: softmax(logits) . ARMS."""
    assert member.trainer is not None
    (logits,) = member.trainer.policy.get_parameters().values()
    return float(torch.softmax(logits.detach(), 0) @ ARMS)


def make_clipped_bandit(hp: dict[str, float], **config: Any) -> GRPOTrainer:
    """A member with ``hp``'s learning rate and clip epsilon, two epochs per update, ``config``
    on top."""
    cfg = GRPOConfig(
        group_size=4, batch_size=4, learning_rate=hp["learning_rate"], clip_epsilon=hp["clip_epsilon"],
        num_epochs_per_update=2, seed=0, distributed="off", **config,
    )  # fmt: skip
    return GRPOTrainer(cfg, bandit_policy(10), arm_reward)
