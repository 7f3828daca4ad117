"""One member of a population: its slot ``index``, trainer, hyperparameters, fitness and RNG streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.trainer import GRPOTrainer

__all__ = ["Member", "cloned_tree"]


@dataclass
class Member:
    """A slot of the population (AgileRL's ``index``: the slot's number, kept across generations).

    Attributes:
        index: the slot, 0..P-1. A clone takes the slot of the member it replaces.
        hp: the slot's current hyperparameters, name -> value (those of `HyperparameterConfig`).
        trainer: the slot's `GRPOTrainer`; None on processes that do not hold the slot (one member
            per process under torchrun).
        fitness: the fitness measured at the end of each generation, oldest first.
        samples: actions sampled by this slot's trainer steps so far (states x G per step; for an
            episode policy these are episodes, not env steps).
        train_env_steps: env steps (for a policy without an env-step counter: actions) drawn by
            this slot's trainer steps so far (grpo/population/cost.py says exactly what counts).
        eval_env_steps: env steps (or actions) drawn by measuring this slot's fitness so far.
        step_metrics: the metrics of the slot's trainer steps in the current generation, one dict
            per step, set before its fitness is measured (on the process that trains the slot).
            A fitness on the training reward costs nothing more:
            ``fitness=lambda m: m.step_metrics[-1]["reward/mean"]``.
        rng: the slot's own process-global RNG streams (``grpo.state.checkpoint.capture_rng``):
            put in place while the slot trains, so each slot draws the same numbers however many
            slots a process holds.
    """

    index: int
    hp: dict[str, float]
    trainer: GRPOTrainer | None = None
    fitness: list[float] = field(default_factory=list)
    samples: int = 0
    train_env_steps: int = 0
    eval_env_steps: int = 0
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    rng: tuple[Any, ...] | None = None

    @property
    def env_steps(self) -> int:
        """The slot's whole cost so far: ``train_env_steps + eval_env_steps``."""
        return self.train_env_steps + self.eval_env_steps

    def require_trainer(self) -> GRPOTrainer:
        """The trainer, or a `RuntimeError` on a process that does not hold this slot."""
        if self.trainer is None:
            raise RuntimeError(
                f"member {self.index} is trained by another process (one member per process under "
                f"torchrun); read it on its own rank, or use Population.local_members."
            )
        return self.trainer


def cloned_tree(obj: Any) -> Any:
    """``obj`` (a state dict: dicts, lists, tuples, tensors, plain values) with every tensor
    copied (``detach().clone()``) and every container rebuilt, so that later changes to the live
    trainer never reach it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: cloned_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cloned_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cloned_tree(v) for v in obj)
    return obj
