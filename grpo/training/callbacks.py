"""Callbacks: small hooks that `GRPOTrainer.train` calls while it runs, and the state they get.

Subclass `Callback` and override the hooks you need (any object with some of these methods also
works). Each hook gets the loop's `TrainState` (``state.trainer``, ``state.step``,
``state.history``, ...); a hook stops training by calling ``state.stop(reason)``. Order within one
step::

    metrics = trainer.step(states)            # optim/lr too; + the loop's own keys (time/data, throughput/*)
    on_eval(state, eval_metrics)              # every eval_every steps; merged into the step's record
    on_metrics(state, record)                 # may add or change keys before anything sees them
    sinks.write(record)
    on_step_end(state, record)
    on_checkpoint(state, path)                # every checkpoint_freq steps
    (stop if state.should_stop)
    ...
    on_train_end(state)                       # always, also after an early stop

`EarlyStopping` is the ready callback: stop when a monitored metric stops improving or reaches a
threshold.

This module imports nothing of the trainer: `TrainState.trainer` is typed by the `TrainerLike`
Protocol, the part of `grpo.GRPOTrainer` the loop and its callbacks use.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from grpo.config import GRPOConfig
    from grpo.policy_base import PolicyModel
    from grpo.reward_model_base import RewardModel

__all__ = ["HOOKS", "Callback", "EarlyStopping", "TrainState", "TrainerLike"]

HOOKS: tuple[str, ...] = (
    "on_train_start",
    "on_metrics",
    "on_step_end",
    "on_eval",
    "on_checkpoint",
    "on_train_end",
)


class TrainerLike(Protocol):
    """What the training loop and its callbacks use of a trainer (`grpo.GRPOTrainer` is one).

    A structural type: any object with these members is accepted; the loop uses no other member
    of the trainer. Callbacks that need more of it (``reference_policy``, ...) use it as the
    `grpo.GRPOTrainer` it is.
    """

    @property
    def config(self) -> GRPOConfig:
        """The trainer's configuration."""
        ...

    @property
    def policy(self) -> PolicyModel:
        """The policy being trained."""
        ...

    @property
    def reward_model(self) -> RewardModel:
        """The reward model."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the trainer's tensors live."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer (None when there is nothing to train)."""
        ...

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate schedule (None: constant learning rate)."""
        ...

    @property
    def params(self) -> Sequence[Tensor]:
        """The trainable tensors."""
        ...

    @property
    def distributed(self) -> object:
        """The collectives of a multi-process run; None on one process."""
        ...

    @property
    def step_count(self) -> int:
        """Steps done so far."""
        ...

    @property
    def deepspeed_stage(self) -> int | None:
        """The DeepSpeed ZeRO stage (1, 2 or 3) when DeepSpeed runs the update, else None (the loop
        refuses checkpoints under DeepSpeed)."""
        ...

    @property
    def step_threads(self) -> int | None:
        """The intra-op threads a step runs with (None: torch's own setting); evaluations in the
        loop run with them too."""
        ...

    def step(self, states: Any, *, more_states: Callable[[], Any] | None = None) -> dict[str, float]:
        """One GRPO step on a batch of states; returns its metrics. ``more_states``: more batches
        for dynamic sampling's back-fill (``config.max_sampling_draws`` > 1; None when exhausted)."""
        ...

    def prefetch(self, states: Any) -> None:
        """Async rollouts (``config.async_staleness >= 1``): submit the generation of ``states``
        ahead of the step that trains on them."""
        ...

    def discard_prefetched(self) -> int:
        """Drop the generations submitted ahead and not trained on; returns how many."""
        ...

    def check_lockstep(self, states: Any) -> None:
        """Raise on every rank when the ranks would run different forwards (DeepSpeed ZeRO-3)."""
        ...

    def stateful_components(self) -> dict[str, Any]:
        """The objects whose state is saved in checkpoints besides the models (those given to
        ``register_checkpoint_state``); a states source among them restores its own position."""
        ...

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Save everything needed to resume exactly under ``directory``; returns the checkpoint's path."""
        ...

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Restore the trainer from the checkpoint at ``path`` (or the newest under it); returns the
        checkpoint loaded."""
        ...


@dataclasses.dataclass
class TrainState:
    """What `GRPOTrainer.train` returns and passes to every callback hook.

    Attributes:
        trainer: the trainer being trained.
        num_steps: the step count at which training ends.
        history: one record per step run by this call (the dict sent to the sinks).
        eval_history: one ``{'step': s, 'eval/...': ...}`` dict per evaluation.
        checkpoints: paths of the checkpoints written by this call.
        should_stop: set by `stop`; the loop ends after the current step.
        stop_reason: why training ended: ``"reached num_steps=N"``, or why it stopped early (the
            source ran out, a callback's `stop`); None while it runs.
        resumed_from: the checkpoint loaded by ``resume_from`` (None when not resuming).
    """

    trainer: TrainerLike
    num_steps: int
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    eval_history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    checkpoints: list[Path] = dataclasses.field(default_factory=list)
    should_stop: bool = False
    stop_reason: str | None = None
    resumed_from: Path | None = None

    @property
    def step(self) -> int:
        """Steps done so far (``trainer.step_count``)."""
        return self.trainer.step_count

    def stop(self, reason: str) -> None:
        """Ask the loop to end after the current step; ``reason`` is logged and kept."""
        if not self.should_stop:
            self.should_stop = True
            self.stop_reason = reason


class Callback:
    """Base class with every hook a no-op. Override what you need."""

    def on_train_start(self, state: TrainState) -> None:
        """Before the first step (after resuming, if any)."""

    def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
        """After each step (and its evaluation), before the record goes anywhere: add or change
        keys of ``metrics``, the step's mutable record. What this hook puts there reaches the
        sinks, ``state.history``, the progress display and `on_step_end`."""

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        """After each step; ``metrics`` is the step's full record (eval keys included on eval steps)."""

    def on_eval(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        """After each evaluation; ``metrics`` holds the ``eval/*`` keys."""

    def on_checkpoint(self, state: TrainState, path: Path) -> None:
        """After a checkpoint was written to ``path``."""

    def on_train_end(self, state: TrainState) -> None:
        """After the last step (also after an early stop or when the source ran out)."""


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks, or reached ``threshold``.

    A check happens at every step whose record holds ``monitor`` (every step for training keys
    such as ``reward/mean``; every evaluation for ``eval/*`` keys). With ``mode='max'`` a value
    improves when ``value > best + min_delta`` (``'min'``: ``value < best - min_delta``). A
    non-finite value never improves. After ``patience`` checks in a row without improvement,
    training stops.

    Args:
        monitor: a metric name from docs/metrics.md (default: mean evaluation reward).
        patience: checks without improvement before stopping (>= 1).
        mode: ``'max'`` (higher is better) or ``'min'``.
        min_delta: the smallest change that counts as an improvement (>= 0).
        threshold: also stop as soon as the value is >= threshold (``'max'``) / <= threshold
            (``'min'``); None = no threshold.
    """

    def __init__(
        self,
        monitor: str = "eval/reward/mean",
        *,
        patience: int = 3,
        mode: Literal["max", "min"] = "max",
        min_delta: float = 0.0,
        threshold: float | None = None,
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping(mode={mode!r}) is not allowed: choose 'max' or 'min'.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"EarlyStopping(patience={patience!r}) is not allowed: expected an integer >= 1."
            )
        if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
            raise ValueError(
                f"EarlyStopping(min_delta={min_delta!r}) is not allowed: expected a number >= 0."
            )
        self.monitor = monitor
        self.patience = patience
        self.mode = mode
        self.min_delta = float(min_delta)
        self.threshold = threshold
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self.checks = 0

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def _reached(self, value: float) -> bool:
        if self.threshold is None:
            return False
        return value >= self.threshold if self.mode == "max" else value <= self.threshold

    def on_train_start(self, state: TrainState) -> None:
        self.best, self.best_step, self.wait, self.checks = None, None, 0, 0

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        if self.monitor not in metrics:
            return
        value = float(metrics[self.monitor])
        self.checks += 1
        if self._improves(value):
            self.best, self.best_step, self.wait = value, state.step, 0
        else:
            self.wait += 1
        if self._reached(value):
            state.stop(f"EarlyStopping: {self.monitor}={value:.6g} reached threshold {self.threshold}")
        elif self.wait >= self.patience:
            state.stop(
                f"EarlyStopping: {self.monitor} did not improve by more than {self.min_delta} for "
                f"{self.wait} checks (best {self.best} at step {self.best_step})"
            )

    def on_train_end(self, state: TrainState) -> None:
        if self.checks == 0 and state.history:
            warnings.warn(
                f"EarlyStopping monitored {self.monitor!r}, which no step logged, so it never "
                f"checked anything. Logged keys: {sorted(state.history[-1])}. For eval/* keys pass "
                f"eval_states= and eval_every= to train().",
                UserWarning,
                stacklevel=2,
            )
