"""Adaptive learning rate: keep each optimizer step's KL(π_old ‖ π_θ) near a target.

One learning rate does not suit every policy: Adam moves every parameter by about ``lr`` a step,
which moves a softmax over a few learned logits far less than a 64x64 MLP's outputs. Measuring how
far the policy actually moved and scaling the learning rate to it makes one setting work for
both (benchmarks/RESULTS.md, "Small policies"). The rule is the "adaptive" schedule of rsl_rl
(Rudin et al. 2022, "Learning to Walk in Minutes Using Massively Parallel Deep RL") and
rl_games, used for legged robots, with the KL estimated from the update's own log-probs.

With ``κ = GRPOConfig.adaptive_lr_kl`` and, for optimizer step ``s`` of an update,

    KL_s = Σ_valid (ρ - 1 - log ρ) / #valid,   ρ = π_θ(a) / π_old(a)

(the k3 estimate of KL(π_old ‖ π_θ) over the valid steps of the step's rows, on every process
together, measured by the step's own forwards, i.e. after steps 0..s-1 of the update), the
learning rate ``η`` of step ``s`` and later is set *before* step ``s`` is applied:

    KL_s > 2 κ          ->  η ← max(η / 1.5, adaptive_lr_min)
    0 < KL_s < κ / 2    ->  η ← min(1.5 η, adaptive_lr_max)
    otherwise           ->  η unchanged

``KL_s = 0`` (the update's first step, whose forwards are the behaviour policy; or a policy so
sure that the change underflows) and a non-finite ``KL_s`` leave ``η`` alone. ``η`` starts at
``learning_rate``; warmup and decay (`grpo.engine.lr_schedules`) multiply it as usual. ``η`` is kept as
the schedule's ``scale`` (``η = learning_rate * scale``), so it is saved in checkpoints and undone
with an update the guard undoes. Reading ``KL_s`` costs one host sync (and one all-reduce of two
numbers across processes) per optimizer step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo.engine.lr_schedules import LRSchedule

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = ["ADAPT_FACTOR", "AdaptiveLR", "adapted_lr"]

ADAPT_FACTOR = 1.5  # rsl_rl's factor


def adapted_lr(lr: float, kl: float, target: float, lr_min: float, lr_max: float) -> float:
    """One application of the rule of the module docstring: the learning rate after observing
    ``kl`` at learning rate ``lr`` (``lr`` unchanged for ``kl`` <= 0 or non-finite)."""
    if not math.isfinite(kl) or kl <= 0.0:
        return lr
    if kl > 2.0 * target:
        return max(lr / ADAPT_FACTOR, lr_min)
    if kl < 0.5 * target:
        return min(lr * ADAPT_FACTOR, lr_max)
    return lr


class AdaptiveLR:
    """Applies `adapted_lr` to a `LambdaLR` over an `LRSchedule` (see the module docstring).

    Args:
        scheduler: the trainer's scheduler; its every ``lr_lambdas`` entry is an `LRSchedule`.
        target_kl: κ (> 0).
        lr_min: the lower bound of ``η`` (> 0), the first parameter group's adapted learning
            rate; the other groups keep their ratio to it.
        lr_max: the upper bound of ``η`` (>= lr_min).
    """

    def __init__(
        self, scheduler: torch.optim.lr_scheduler.LambdaLR, target_kl: float, lr_min: float, lr_max: float
    ) -> None:
        self.schedules: list[LRSchedule] = list(scheduler.lr_lambdas)  # type: ignore[arg-type]
        if not all(isinstance(fn, LRSchedule) for fn in self.schedules):
            raise TypeError(
                "AdaptiveLR needs a LambdaLR whose lr_lambdas are grpo.engine.lr_schedules.LRSchedule."
            )
        self.scheduler = scheduler
        self.target_kl, self.lr_min, self.lr_max = float(target_kl), float(lr_min), float(lr_max)

    @classmethod
    def from_config(cls, config: GRPOConfig, scheduler: Any) -> AdaptiveLR | None:
        """The controller of ``config.adaptive_lr_kl`` over the trainer's ``scheduler``; None when
        off. Raises when the scheduler is not one `grpo.engine.lr_schedules.build_scheduler` made."""
        if config.adaptive_lr_kl is None:
            return None
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            raise TypeError(
                f"GRPOConfig.adaptive_lr_kl needs the trainer's LambdaLR scheduler, got "
                f"{type(scheduler).__name__}."
            )
        return cls(scheduler, config.adaptive_lr_kl, config.adaptive_lr_min, config.adaptive_lr_max)

    @property
    def lr(self) -> float:
        """``η``: the first group's base learning rate times the adapted scale (before warmup or
        decay)."""
        return float(self.scheduler.base_lrs[0]) * self.schedules[0].scale

    def observe(self, kl_and_count: Tensor) -> None:
        """Adapt to one optimizer step: ``kl_and_count`` (2,) is ``(Σ k3, #valid)`` over all
        processes. Sets the new learning rate on the optimizer at once (the step not yet applied
        uses it). One host sync."""
        kl_sum, count = kl_and_count.tolist()
        if count <= 0:
            return
        lr = self.lr
        new = adapted_lr(lr, kl_sum / count, self.target_kl, self.lr_min, self.lr_max)
        if new != lr:
            self._set_lr(new)

    def set_bounds(self, lr_min: float, lr_max: float) -> None:
        """New bounds of ``η`` (a population's learning-rate mutation moves them with the rate:
        grpo/population/settings.py); ``η`` is clamped into ``[lr_min, lr_max]`` if it lies outside."""
        if not 0.0 < lr_min <= lr_max:
            raise ValueError(f"AdaptiveLR bounds need 0 < lr_min <= lr_max, got [{lr_min}, {lr_max}].")
        self.lr_min, self.lr_max = float(lr_min), float(lr_max)
        lr = self.lr
        clamped = min(max(lr, self.lr_min), self.lr_max)
        if clamped != lr:
            self._set_lr(clamped)

    def _set_lr(self, new: float) -> None:
        """Make ``η = new``: the schedules' scale, and every group's ``lr`` at once."""
        scale = new / float(self.scheduler.base_lrs[0])
        for fn in self.schedules:
            fn.scale = scale
        step = self.scheduler.last_epoch
        groups = self.scheduler.optimizer.param_groups
        for group, base, fn in zip(groups, self.scheduler.base_lrs, self.schedules, strict=True):
            group["lr"] = base * fn(step)  # what the scheduler's next step() would also set
