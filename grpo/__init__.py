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
from grpo.algorithms.advantages import RunningMeanStd
from grpo.algorithms.aggregation import aggregate, aggregation_normaliser
from grpo.algorithms.kl import KLFn, kl_estimate
from grpo.algorithms.policy_losses import (
    PolicyLoss,
    PolicyLossFn,
    cispo_loss,
    clip_loss,
    gspo_loss,
    reinforce_loss,
    sapo_loss,
)
from grpo.algorithms.recipes import RECIPES
from grpo.config import GRPOConfig
from grpo.engine.backends import Backend, OptimizerStepResult
from grpo.engine.distributed import is_main_process, shard
from grpo.engine.lr_schedules import LRSchedule
from grpo.experience_collector import ExperienceBatch, ExperienceCollector
from grpo.grpo_objective import GRPOObjective, ObjectiveOutput
from grpo.metrics.sinks import (
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
from grpo.reward_model_base import (
    CombinedReward,
    FunctionReward,
    RewardModel,
    check_reward_model,
)
from grpo.rollout.reward_guard import RewardError, RewardTimeoutError
from grpo.state.checkpoint import CheckpointError, find_latest_checkpoint
from grpo.trainer import GRPOTrainer
from grpo.training.callbacks import Callback, EarlyStopping
from grpo.training.completions_table import CompletionsTable
from grpo.training.evaluation import EvalOptions
from grpo.training.loop import TrainState
from grpo.training.stall_watch import StallWarning, StallWatch

__version__ = "0.2.0"

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
    "CompletionsTable",
    "DistributionPolicy",
    "EarlyStopping",
    "EvalOptions",
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
