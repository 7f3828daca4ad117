"""grpo: model-agnostic Group Relative Policy Optimization.

Bring any policy (`PolicyModel`) and any reward (`RewardModel`, or a plain function);
`GRPOTrainer(config, policy, reward_model).step(states)` does the rest.
"""

from grpo.advantage_estimator import (
    AdvantageEstimator,
    AdvantageFn,
    Advantages,
    group_advantages,
    group_stats,
)
from grpo.advantages import RunningMeanStd
from grpo.aggregation import aggregate, aggregation_normaliser
from grpo.backends import Backend, OptimizerStepResult
from grpo.callbacks import Callback, EarlyStopping
from grpo.checkpoint import CheckpointError, find_latest_checkpoint
from grpo.config import GRPOConfig
from grpo.distributed import is_main_process, shard
from grpo.experience_collector import ExperienceBatch, ExperienceCollector
from grpo.grpo_objective import GRPOObjective, ObjectiveOutput
from grpo.kl import KLFn, kl_estimate
from grpo.lr_schedules import LRSchedule
from grpo.metric_sinks import (
    CSVSink,
    JSONLSink,
    LoggingSink,
    MetricSink,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
)
from grpo.policies import DistributionPolicy, categorical_mlp, gaussian_mlp
from grpo.policy_base import PolicyModel, PolicyOutput, SupportsEvaluateActions, check_policy
from grpo.policy_losses import (
    PolicyLoss,
    PolicyLossFn,
    cispo_loss,
    clip_loss,
    gspo_loss,
    reinforce_loss,
    sapo_loss,
)
from grpo.recipes import RECIPES
from grpo.reward_guard import RewardError, RewardTimeoutError
from grpo.reward_model_base import (
    CombinedReward,
    FunctionReward,
    RewardModel,
    check_reward_model,
)
from grpo.stall_watch import StallWarning, StallWatch
from grpo.trainer import GRPOTrainer
from grpo.training_loop import TrainState

__version__ = "0.1.0"

__all__ = [
    "RECIPES",
    "AdvantageEstimator",
    "AdvantageFn",
    "Advantages",
    "Backend",
    "CSVSink",
    "Callback",
    "CheckpointError",
    "CombinedReward",
    "DistributionPolicy",
    "EarlyStopping",
    "ExperienceBatch",
    "ExperienceCollector",
    "FunctionReward",
    "GRPOConfig",
    "GRPOObjective",
    "GRPOTrainer",
    "JSONLSink",
    "KLFn",
    "LRSchedule",
    "LoggingSink",
    "MetricSink",
    "ObjectiveOutput",
    "OptimizerStepResult",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyModel",
    "PolicyOutput",
    "RewardError",
    "RewardModel",
    "RewardTimeoutError",
    "RunningMeanStd",
    "StallWarning",
    "StallWatch",
    "SupportsEvaluateActions",
    "TensorBoardSink",
    "TrainState",
    "WandbSink",
    "__version__",
    "aggregate",
    "aggregation_normaliser",
    "categorical_mlp",
    "check_policy",
    "check_reward_model",
    "cispo_loss",
    "clip_loss",
    "find_latest_checkpoint",
    "gaussian_mlp",
    "group_advantages",
    "group_stats",
    "gspo_loss",
    "is_main_process",
    "kl_estimate",
    "read_jsonl",
    "reinforce_loss",
    "sapo_loss",
    "shard",
]
