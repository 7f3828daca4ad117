"""Reading and setting a live trainer's hyperparameters so that the next step uses them.

The trainer's parts read its config (``trainer.config``, the trainer's own copy) when they use
it: the objective its ``clip_epsilon`` / ``clip_epsilon_high`` / ``kl_coeff`` / ``entropy_coeff``,
the collector its ``group_size`` (so does the evaluation's default G), the stall watch its
``kl_coeff`` / ``entropy_coeff``. Changing one of those is one assignment,
``trainer.config.kl_coeff = v``, made by `apply_hyperparameters` after every check. Two values
live outside the config and are set where they live:

* ``learning_rate``: every optimizer param group's ``lr`` (and ``initial_lr``) and the LR
  scheduler's ``base_lrs``, all scaled by ``new / old`` base rate, so a warmup or decay schedule
  keeps its position and multiplier ``m(s)``: the next optimizer step uses ``new * m(s)``. With
  ``adaptive_lr_kl`` on, the adaptive range moves with the rate: with ``r = new / old`` (``old``
  the config's ``learning_rate``)::

      adaptive_lr_min <- min(r * adaptive_lr_min, new),   adaptive_lr_max <- max(r * adaptive_lr_max, new)

  (the ``min`` / ``max`` only absorb rounding: ``old`` lay in the range, so ``new`` lies in the
  scaled one), in the config and in the trainer's controller (`grpo.update.adaptive_lr`); the
  adapted rate ``eta = base * scale`` is scaled by ``r`` with the base, so it keeps its place in
  the range (and is clamped into it if it lay outside, e.g. after a clone from a slot whose range
  had other ratios). The range is a band around the slot's rate: the ``small_policy`` recipe's
  "never above the start" (``adaptive_lr_max == learning_rate``) stays "never above the slot's
  current rate";
* ``temperature``: ``trainer.policy.temperature`` (a policy such as `grpo.llm.CausalLMPolicy`;
  not a `GRPOConfig` field).

Checkpoints, `GRPOTrainer.evaluate` and the stall watch see the new values. The objective's
constant cache is keyed by its coefficients (`grpo.algorithms.objective_statistics.ConstantCache`),
so the changed coefficients take effect in the next loss. The optimizer's moment estimates
(Adam's ``exp_avg``, ``exp_avg_sq``, ``step``) are kept: only the step size changes.

`checked_config` runs every check of `apply_hyperparameters` and returns the config it would set,
changing nothing: a population validates every slot's new values before it changes any slot.

Values that would switch a part of the trainer on or off are refused (``kl_coeff`` or
``entropy_coeff`` crossing 0: a reference policy and the entropy's gradient are decided at
construction), as are changes the fused Liger loss would not see (``use_liger_loss``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from grpo.trainer import GRPOTrainer

__all__ = ["apply_hyperparameters", "checked_config", "read_hyperparameters", "set_learning_rate"]

_CONFIG_FIELDS = ("learning_rate", "clip_epsilon", "kl_coeff", "entropy_coeff", "group_size")


def read_hyperparameters(trainer: GRPOTrainer, names: Iterable[str]) -> dict[str, float]:
    """The current values of ``names`` in ``trainer`` (the config's; ``temperature`` the policy's)."""
    out: dict[str, float] = {}
    for name in names:
        if name == "temperature":
            out[name] = float(_temperature_holder(trainer).temperature)
        elif name == "group_size":
            out[name] = int(trainer.config.group_size)
        else:
            out[name] = float(getattr(trainer.config, name))
    return out


def checked_config(trainer: GRPOTrainer, hp: Mapping[str, float]) -> Any:
    """The `GRPOConfig` that `apply_hyperparameters(trainer, hp)` would give ``trainer``, after
    every check it makes (names, switches, the fused loss, the temperature, the optimizer, the
    config's own validation); raises the same errors and changes nothing."""
    return dataclasses.replace(trainer.config, **_checked_changes(trainer, hp))


def _checked_changes(trainer: GRPOTrainer, hp: Mapping[str, float]) -> dict[str, Any]:
    """The config fields `apply_hyperparameters` sets (``hp``'s and the moved adaptive range),
    after every check; the config's own validation runs on a copy (ValueError naming the field)."""
    cfg = trainer.config
    changes: dict[str, Any] = {k: v for k, v in hp.items() if k in _CONFIG_FIELDS}
    unknown = sorted(set(hp) - set(_CONFIG_FIELDS) - {"temperature"})
    if unknown:
        raise ValueError(
            f"apply_hyperparameters: {unknown} cannot be set; known: {[*_CONFIG_FIELDS, 'temperature']}."
        )
    _check_switches(cfg, changes)
    if trainer.fused_loss is not None and {"clip_epsilon", "kl_coeff"} & set(changes):
        raise NotImplementedError(
            "use_liger_loss=True builds Liger's loss with clip_epsilon and kl_coeff once; mutate other "
            "hyperparameters, or train with use_liger_loss=False."
        )
    if "temperature" in hp:
        _temperature_holder(trainer)
        if not (math.isfinite(hp["temperature"]) and hp["temperature"] > 0):
            raise ValueError(f"temperature={hp['temperature']} must be a finite number > 0.")
    if "learning_rate" in changes:
        _check_learning_rate(trainer, float(changes["learning_rate"]))
        changes.update(_moved_adaptive_range(cfg, float(changes["learning_rate"])))
    dataclasses.replace(cfg, **changes)  # __post_init__ validates (ValueError naming the field)
    return changes


def apply_hyperparameters(trainer: GRPOTrainer, hp: Mapping[str, float]) -> None:
    """Set ``hp`` (name -> value, names of `grpo.population.MUTABLE`) in ``trainer`` so that its
    next step uses them (the module docstring says where each goes). Every value is checked
    (`checked_config`) before anything changes; then each config value is one assignment."""
    changes = _checked_changes(trainer, hp)
    if "learning_rate" in hp:
        set_learning_rate(trainer, float(hp["learning_rate"]))
    for name, value in changes.items():
        setattr(trainer.config, name, value)  # the parts read the config when they use it
    if trainer.adaptive_lr is not None:
        trainer.adaptive_lr.set_bounds(trainer.config.adaptive_lr_min, trainer.config.adaptive_lr_max)
    if "temperature" in hp:
        _temperature_holder(trainer).temperature = float(hp["temperature"])


def _moved_adaptive_range(cfg: Any, lr: float) -> dict[str, float]:
    """``adaptive_lr_min`` / ``adaptive_lr_max`` scaled by ``lr / cfg.learning_rate`` (module
    docstring); nothing when ``adaptive_lr_kl`` is off or the rate is unchanged."""
    if cfg.adaptive_lr_kl is None or lr == cfg.learning_rate:
        return {}
    r = lr / cfg.learning_rate
    return {
        "adaptive_lr_min": min(cfg.adaptive_lr_min * r, lr),
        "adaptive_lr_max": max(cfg.adaptive_lr_max * r, lr),
    }


def _check_switches(cfg: Any, changes: Mapping[str, float]) -> None:
    """Refuse ``kl_coeff`` / ``entropy_coeff`` crossing 0 (parts of the trainer are built for one side)."""
    for name, why in (
        ("kl_coeff", "the reference policy exists only when kl_coeff > 0 at construction"),
        ("entropy_coeff", "the entropy's gradient is requested only when entropy_coeff != 0 at construction"),
    ):
        if name in changes and (getattr(cfg, name) == 0) != (changes[name] == 0):
            raise ValueError(
                f"{name} {getattr(cfg, name)} -> {changes[name]} crosses 0, but {why}; build the "
                f"members with {name} > 0 and declare RLParameter(min > 0)."
            )


def _temperature_holder(trainer: GRPOTrainer) -> Any:
    policy = trainer.policy
    if not isinstance(getattr(policy, "temperature", None), (int, float)):
        raise TypeError(
            f"temperature is mutated on the policy, but {type(policy).__name__} has no numeric "
            f"'temperature' attribute (grpo.llm.CausalLMPolicy has one); drop temperature from the "
            f"HyperparameterConfig."
        )
    return policy


def set_learning_rate(trainer: GRPOTrainer, lr: float) -> None:
    """Make ``lr`` the base learning rate of ``trainer``'s optimizer (and schedule).

    With ``b`` the current base rate (the scheduler's ``base_lrs[0]``, or the first group's
    ``lr`` without a scheduler) every group's ``lr`` and ``initial_lr`` and every ``base_lrs``
    entry is multiplied by ``lr / b``: groups keep their ratios, a schedule keeps its position,
    and the next optimizer step uses ``lr * m(s)`` (`grpo.engine.lr_schedules`)."""
    base = _check_learning_rate(trainer, lr)
    opt, sched = trainer.optimizer, trainer.scheduler
    assert opt is not None  # checked
    base_lrs = getattr(sched, "base_lrs", None)
    factor = lr / base
    for group in opt.param_groups:
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    if base_lrs:
        sched.base_lrs = [lr, *(b * factor for b in base_lrs[1:])]  # the first exactly lr
    if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):  # what its next step() sets, exactly
        for group, b, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = b * fn(sched.last_epoch)
    elif not base_lrs and len(opt.param_groups) == 1:
        opt.param_groups[0]["lr"] = lr


def _check_learning_rate(trainer: GRPOTrainer, lr: float) -> float:
    """Refuse a rate `set_learning_rate` cannot set; returns the current base rate ``b``."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"learning_rate={lr} must be a finite number > 0.")
    opt, sched = trainer.optimizer, trainer.scheduler
    if opt is None:
        raise ValueError(
            "set_learning_rate: this trainer has no optimizer (the policy has nothing to train); "
            "drop learning_rate from the HyperparameterConfig."
        )
    base_lrs = getattr(sched, "base_lrs", None)
    base = float(base_lrs[0]) if base_lrs else float(opt.param_groups[0]["lr"])
    if not base > 0:
        raise ValueError(
            f"set_learning_rate: the current base learning rate is {base}; it must be > 0 to rescale."
        )
    return base
