"""grpo: model-agnostic Group Relative Policy Optimization.

Bring any policy (`PolicyModel`) and any reward (`RewardModel`, or a plain function);
`GRPOTrainer(config, policy, reward_model).step(states)` does the rest.

The top level holds the core only: the trainer and its config, the two protocols with their
checkers (`check_policy`, `check_reward_model`) and the types they exchange with the trainer
(`PolicyOutput`: masked per-step log-probs; `ExperienceBatch`: what `GRPOTrainer.collect`
returns and `GRPOTrainer.train_on_batch` takes). Everything else is imported from the module
that defines it, named after what it holds: ready policies from `grpo.policies`, rewards'
adapters from `grpo.reward_model_base`, the loss and advantage functions from `grpo.algorithms`
and `grpo.advantage_estimator`, the objective from `grpo.grpo_objective`, backends from
`grpo.engine`, checkpoints from `grpo.state.checkpoint`, the training loop's callbacks, options
and watchers from `grpo.training`, metric sinks from `grpo.metrics.sinks` (docs/architecture.md
lists them).
"""

from grpo.config import GRPOConfig
from grpo.experience_collector import ExperienceBatch
from grpo.policy_base import PolicyModel, PolicyOutput, check_policy
from grpo.reward_model_base import RewardModel, check_reward_model
from grpo.trainer import GRPOTrainer

__version__ = "0.2.0"

__all__ = [
    "ExperienceBatch",
    "GRPOConfig",
    "GRPOTrainer",
    "PolicyModel",
    "PolicyOutput",
    "RewardModel",
    "__version__",
    "check_policy",
    "check_reward_model",
]
