"""Learning-rate schedules: constant, linear and cosine decay, each with linear warmup.

The multiplier of the base learning rate for the optimizer step with 0-based index ``s``
(``W = warmup_steps``, ``S = total_steps``, ``r = lr_min_ratio``)::

    warmup   (s < W):   m(s) = (s + 1) / (W + 1)
    after    (s >= W):  p = clamp((s - W) / (S - W), 0, 1)
             constant:  m = 1
             linear:    m = r + (1 - r) * (1 - p)
             cosine:    m = r + (1 - r) * (1 + cos(pi * p)) / 2

so the learning rate of optimizer step ``s`` is ``base_lr * c * m(s)``, where ``c`` (``scale``,
1 unless ``GRPOConfig.adaptive_lr_kl`` is set) is the factor `grpo.update.adaptive_lr` adjusts. Warmup
follows nanoGPT: the first step already moves (``m(0) = 1/(W+1)``, not 0). Steps count
*optimizer* steps (the scheduler is stepped once per ``optimizer.step()``), i.e.
``GRPOConfig.optimizer_steps_per_step`` per trainer step. A skipped (non-finite) optimizer step
does not advance the schedule.

`build_scheduler` wraps the multiplier in a `torch.optim.lr_scheduler.LambdaLR`; the schedule
object's fields are plain numbers, so they are part of ``scheduler.state_dict()`` (checkpoints).
"""

from __future__ import annotations

import math
import warnings

import torch

from grpo.config import LR_SCHEDULES, GRPOConfig, LRScheduleName

__all__ = ["LRSchedule", "build_scheduler", "schedule_length_problem", "warn_short_schedule"]

MIN_SCHEDULE_TRAINER_STEPS = 10
"""A decaying schedule shorter than this many trainer steps is warned about when a trainer is built."""


class LRSchedule:
    """The multiplier ``m(s)`` of the module docstring, as a callable whose fields are plain numbers.

    Args:
        name: ``'constant'``, ``'linear'`` or ``'cosine'``.
        warmup_steps: W, optimizer steps of linear warmup (>= 0).
        total_steps: S, the optimizer step at which decay reaches ``lr_min_ratio``; required
            (and > W) for ``'linear'`` and ``'cosine'``, ignored for ``'constant'``.
        lr_min_ratio: r, the final multiplier of the decaying schedules, in [0, 1].
        scale: c, a factor on every step's multiplier (> 0): `grpo.update.adaptive_lr` keeps the
            adapted learning rate here, so that it is part of the scheduler's state (checkpoints,
            the guard's rollback). 1 otherwise.
    """

    def __init__(
        self,
        name: LRScheduleName = "constant",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        lr_min_ratio: float = 0.0,
        scale: float = 1.0,
    ) -> None:
        if name not in LR_SCHEDULES:
            raise ValueError(f"lr schedule {name!r} is unknown; choose one of {LR_SCHEDULES}.")
        if name != "constant" and (total_steps is None or total_steps <= warmup_steps):
            raise ValueError(
                f"the {name!r} schedule needs total_steps > warmup_steps={warmup_steps}, got "
                f"total_steps={total_steps}. Set it to the number of optimizer steps of the run "
                f"(num_steps * optimizer_steps_per_step)."
            )
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"lr schedule scale must be a finite number > 0, got {scale}.")
        self.name: str = name
        self.warmup_steps = int(warmup_steps)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.lr_min_ratio = float(lr_min_ratio)
        self.scale = float(scale)

    def __call__(self, s: int) -> float:
        """c * m(s) for the 0-based optimizer step ``s``."""
        w, c = self.warmup_steps, self.scale
        if s < w:
            return c * (s + 1) / (w + 1)
        if self.name == "constant" or self.total_steps is None:
            return c
        p = min(max((s - w) / (self.total_steps - w), 0.0), 1.0)
        r = self.lr_min_ratio
        if self.name == "linear":
            return c * (r + (1.0 - r) * (1.0 - p))
        return c * (r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p)))

    def __repr__(self) -> str:
        return (
            f"LRSchedule({self.name!r}, warmup_steps={self.warmup_steps}, "
            f"total_steps={self.total_steps}, lr_min_ratio={self.lr_min_ratio}, scale={self.scale})"
        )


def build_scheduler(
    optimizer: torch.optim.Optimizer | None,
    name: LRScheduleName,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    lr_min_ratio: float = 0.0,
    *,
    adaptive: bool = False,
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A `LambdaLR` applying `LRSchedule` to every parameter group of ``optimizer``.

    Returns None when there is nothing to schedule: no optimizer, or a constant schedule without
    warmup and not ``adaptive`` (the learning rate never changes, so no scheduler state is kept).
    """
    if optimizer is None or (name == "constant" and warmup_steps == 0 and not adaptive):
        return None
    schedule = LRSchedule(name, warmup_steps, total_steps, lr_min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def schedule_length_problem(
    name: str, total_steps: int | None, optimizer_steps_per_step: int, num_steps: int | None = None
) -> str | None:
    """Why a decaying schedule cannot match the run, or None.

    ``total_steps`` S counts optimizer steps, K = ``optimizer_steps_per_step`` per trainer step,
    so the schedule reaches its final rate after ``ceil(S / K)`` trainer steps. Without
    ``num_steps`` (a trainer being built): a problem when that is fewer than
    `MIN_SCHEDULE_TRAINER_STEPS` trainer steps (the usual cause: S given in trainer steps). With
    ``num_steps`` N (``train``): a problem when it ends more than ``max(1, N / 10)`` trainer steps
    before N (the rest of the run would train at the final rate). A schedule longer than the run
    is no problem: a later ``train`` call may continue it.
    """
    if name == "constant" or total_steps is None or optimizer_steps_per_step < 1:
        return None
    k = optimizer_steps_per_step
    end = math.ceil(total_steps / k)
    if num_steps is None:
        if end >= MIN_SCHEDULE_TRAINER_STEPS:
            return None
        where = f"within the first {end} trainer step{'s' if end > 1 else ''}"
    elif end >= num_steps - max(1, num_steps // 10):
        return None
    else:
        where = f"at trainer step {end} of the {num_steps} this run makes"
    fix = (
        f"total_steps = {num_steps} * {k} = {num_steps * k}"
        if num_steps
        else f"total_steps = num_steps * {k}"
    )
    return (
        f"lr_schedule={name!r} reaches its final rate {where}: GRPOConfig.total_steps={total_steps} "
        f"counts optimizer steps, and each trainer step makes {k} (optimizer_steps_per_step = "
        f"num_epochs_per_update * batch_size / mini_batch_size). For a schedule over the whole run, "
        f"set {fix}."
    )


def warn_short_schedule(config: GRPOConfig, scheduler: object) -> None:
    """Warn, at the caller of the trainer's constructor, when ``config``'s decaying schedule ends
    within a few trainer steps (`schedule_length_problem`; ``total_steps`` counts optimizer
    steps). Nothing without a ``scheduler``."""
    if scheduler is None:
        return
    problem = schedule_length_problem(config.lr_schedule, config.total_steps, config.optimizer_steps_per_step)
    if problem is not None:
        warnings.warn(problem, UserWarning, stacklevel=3)
