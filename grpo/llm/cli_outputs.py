"""What a ``grpo-train`` run writes: the model saves, the metric sinks, the command's callbacks and
where the trainer's checkpoints go (and which one ``--resume`` loads).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from grpo.config import GRPOConfig
from grpo.engine.deepspeed import deepspeed_config_from
from grpo.engine.distributed import is_main_process, main_process_only
from grpo.llm.checkpoint import save_llm_checkpoint
from grpo.llm.cli_rewards import StepRewards
from grpo.llm.multiturn import ConversationReward, MultiTurnPolicy
from grpo.llm.policy import CausalLMPolicy
from grpo.llm.rewards import RewardFunctions
from grpo.metrics.sinks import JSONLSink, LoggingSink, PeriodicSink, WandbSink
from grpo.state.checkpoint import find_latest_checkpoint
from grpo.trainer import GRPOTrainer
from grpo.training.callbacks import Callback, TrainState

__all__ = [
    "CheckpointPlan",
    "RunOutputs",
    "SaveModels",
    "StepMetrics",
    "checkpoint_plan",
    "open_outputs",
    "save_model",
]

logger = logging.getLogger("grpo.llm")


def save_model(
    trainer: GRPOTrainer, directory: Path, args: argparse.Namespace, metrics: dict[str, float]
) -> None:
    """The model (`save_llm_checkpoint`: the LoRA adapter only, or the whole model; the tokenizer)
    and ``trainer_state.json``, written by rank 0; every rank calls this and returns when the files
    are complete. Under ZeRO-3 and FSDP every rank takes part in gathering the weights. With
    ``--env`` the causal LM inside the `MultiTurnPolicy` is saved."""
    policy = trainer.policy.policy if isinstance(trainer.policy, MultiTurnPolicy) else trainer.policy
    policy = typing.cast(CausalLMPolicy, policy)  # train() built it
    target = _PolicyAtStep(policy, trainer.step_count)  # what save_llm_checkpoint reads of a trainer

    def write_state() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {"step": trainer.step_count, "args": vars(args), "metrics": metrics}
        text = json.dumps(state, indent=2, default=str)
        (directory / "trainer_state.json").write_text(text, encoding="utf-8")

    def write_all() -> None:
        save_llm_checkpoint(target, directory)
        write_state()

    if policy.is_partitioned:
        save_llm_checkpoint(target, directory)  # collective gather; rank 0 writes
        main_process_only(write_state, None)
    else:
        main_process_only(write_all, None)


class _PolicyAtStep(NamedTuple):
    """The causal LM and the step count: a trainer to `save_llm_checkpoint` (its ``policy`` and
    ``step_count``), also when the trainer's policy is the `MultiTurnPolicy` around it."""

    policy: CausalLMPolicy
    step_count: int


class StepMetrics(Callback):
    """What ``grpo-train`` adds to each step's record (`on_metrics`, before the sinks): the reward
    functions' counters of the step's own call (``reward/<name>/applicable``, ...; not those of an
    evaluation after it) and ``throughput/tokens_per_s`` = ``completion/tokens / time/step``.
    It also keeps ``rewards.trainer_state`` (what TRL's reward functions get as
    ``trainer_state``): ``global_step`` (steps done), ``max_steps`` and ``epoch`` (passes over the
    dataset done, fractional). With ``--env`` (a `ConversationReward`) there are no counters.
    """

    def __init__(
        self, rewards: RewardFunctions | ConversationReward, max_steps: int, steps_per_epoch: int
    ) -> None:
        self.rewards = rewards
        self.steps_per_epoch = max(steps_per_epoch, 1)
        self.trainer_state = types.SimpleNamespace(global_step=0, max_steps=max_steps, epoch=0.0)
        if isinstance(rewards, RewardFunctions):
            rewards.trainer_state = self.trainer_state

    def _at(self, step: int) -> None:
        self.trainer_state.global_step = step
        self.trainer_state.epoch = step / self.steps_per_epoch

    def on_train_start(self, state: TrainState) -> None:
        self._at(state.step)  # a resumed run starts at its checkpoint's step
        if isinstance(self.rewards, StepRewards):
            self.rewards.trainer = state.trainer

    def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
        if isinstance(self.rewards, StepRewards):
            metrics.update(self.rewards.step_counters(state.step))
        elif isinstance(self.rewards, RewardFunctions):
            metrics.update(self.rewards.last_metrics)
        if "completion/tokens" in metrics:
            metrics["throughput/tokens_per_s"] = metrics["completion/tokens"] / max(
                metrics["time/step"], 1e-9
            )

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        self._at(state.step)


class SaveModels(Callback):
    """``<output-dir>/checkpoint-{step}/`` (the model, loadable with ``from_pretrained``) every
    ``--save-steps`` steps. Runs on every process: `save_model` is collective under ZeRO-3 and FSDP."""

    def __init__(self, trainer: GRPOTrainer, out_dir: Path, args: argparse.Namespace) -> None:
        self.trainer = trainer
        self.out_dir = out_dir
        self.args = args

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        every = self.args.checkpoint_freq
        if every and state.step % every == 0:
            save_model(self.trainer, self.out_dir / f"checkpoint-{state.step}", self.args, dict(metrics))


class _LoggingPeriod(PeriodicSink):
    """`PeriodicSink` that also writes every record holding evaluation results (``eval/*``), so
    an evaluation reaches the outputs whatever ``--logging-steps`` is."""

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        super().write(metrics, step)  # written, or held in place of the one held before
        if any(k.startswith("eval/") for k in metrics):
            self.flush()  # the held record is this one


class RunOutputs(NamedTuple):
    sinks: list[PeriodicSink]
    wandb_run: Any  # the W&B run with --use-wandb (for the completions table), else None


def open_outputs(args: argparse.Namespace, out_dir: Path, stack: contextlib.ExitStack) -> RunOutputs:
    """Rank 0's sinks, each writing every ``--logging-steps`` steps, at each evaluation and at
    the last step: ``metrics.jsonl`` (appended), a ``grpo.llm`` log line, and W&B with
    ``--use-wandb``. Closed (the W&B run finished) when ``stack`` exits."""
    jsonl = JSONLSink(out_dir / "metrics.jsonl", append=True)
    stack.callback(jsonl.close)
    inner: list[Any] = [jsonl, LoggingSink(logger, keys=("reward/mean", "kl/ref", "throughput/tokens_per_s"))]
    wandb_run = None
    if args.use_wandb:
        try:
            wandb = WandbSink(project=args.wandb_project, name=args.wandb_run_name, config=vars(args))
        except ImportError as e:
            raise ImportError(f"--use-wandb needs Weights & Biases: {e}") from e
        stack.callback(wandb.close)
        inner.append(wandb)
        wandb_run = getattr(wandb, "run", None)
    sinks: list[PeriodicSink] = [_LoggingPeriod(s, args.logging_steps) for s in inner]
    for sink in sinks:
        stack.callback(sink.flush)  # a held record is written before its sink closes (LIFO)
    return RunOutputs(sinks, wandb_run)


# ---- checkpoints and resume ------------------------------------------------------------------------
class CheckpointPlan(NamedTuple):
    directory: Path | None  # train(checkpoint_dir=...): None = no trainer checkpoints
    resume_from: Path | None


def checkpoint_plan(args: argparse.Namespace, config: GRPOConfig) -> CheckpointPlan:
    """Where the trainer's checkpoints go (``<output-dir>/checkpoints``; none under DeepSpeed, whose
    partitioned optimizer state they cannot hold, or with ``--save-steps none``) and which one
    ``--resume`` loads; refused before any model is loaded when it cannot be found."""
    root = Path(args.output_dir) / "checkpoints"
    deepspeed = deepspeed_config_from(config.deepspeed) is not None
    if args.resume is not None and deepspeed:
        raise SystemExit(
            "grpo-train: error: --resume needs the trainer's checkpoints, which DeepSpeed ZeRO cannot "
            "write (its optimizer state is partitioned); train with --deepspeed off (or FSDP: --fsdp)."
        )
    directory = None if deepspeed or config.checkpoint_freq is None else root
    if args.resume is None:
        if directory is not None and is_main_process() and any(root.glob("step-*")):
            logger.warning(
                "%s holds checkpoints of an earlier run; this run starts anew (--resume continues "
                "one) and its checkpoints go beside them.",
                root,
            )
        return CheckpointPlan(directory, None)
    path = _resume_path(args.resume, root)
    if find_latest_checkpoint(path) is None:
        raise SystemExit(
            f"grpo-train: error: --resume {args.resume}: no complete trainer checkpoint in {path}; "
            f"give a step-N directory or their root (the run's <output-dir>/checkpoints), or run "
            f"without --resume."
        )
    return CheckpointPlan(directory, path)


def _resume_path(spec: str, root: Path) -> Path:
    """``latest`` -> ``root``; ``.../checkpoint-N`` (a model save of this command) -> the trainer
    checkpoint of step N under ``root``; anything else as given."""
    if spec == "latest":
        return root
    path = Path(spec)
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    if match and not path.joinpath("state.json").exists():
        step_dir = path.parent / "checkpoints" / f"step-{int(match.group(1)):08d}"
        if step_dir.is_dir():
            return step_dir
    return path
