"""Toy problem shared by the training-loop tests: a 3-armed contextual bandit.

State: a vector (4,); the rewarded arm is ``argmax(state[:3])``. Policy: a small categorical MLP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp
from grpo.reward_model_base import CombinedReward


def bandit_states(n: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g)


def correct_arm(states: Tensor, actions: Tensor) -> Tensor:
    return (actions == states[:, :3].argmax(-1)).float()


def small_action(states: Tensor, actions: Tensor) -> Tensor:
    return -0.1 * actions.float()


def combined_reward() -> CombinedReward:
    return CombinedReward({"correct": correct_arm, "small": small_action}, weights={"small": 0.5})


def make_trainer(reward: Any = correct_arm, **config: Any) -> GRPOTrainer:
    cfg: dict[str, Any] = {"group_size": 4, "batch_size": 4, "seed": 0, "learning_rate": 1e-2}
    cfg.update(config)
    config_obj = GRPOConfig(**cfg)
    torch.manual_seed(0)
    policy = categorical_mlp(4, 3, hidden=(16,))
    return GRPOTrainer(config_obj, policy, reward)


def params_of(trainer: GRPOTrainer) -> list[Tensor]:
    return [p.detach().clone() for p in trainer.params]
