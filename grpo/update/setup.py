"""The update's parts as `GRPOTrainer` builds them from its config: the plan (`grpo.update.plan`)
and the parts `grpo.update.loop.run_update` runs with (`UpdateParts`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.policy_base import entropy_request
from grpo.update.adaptive_lr import AdaptiveLR
from grpo.update.loop import FusedLoss, UpdateParts
from grpo.update.plan import UpdatePlan

if TYPE_CHECKING:
    from grpo.config import GRPOConfig
    from grpo.engine.backends import Backend
    from grpo.engine.setup import TrainerSetup
    from grpo.grpo_objective import GRPOObjective
    from grpo.update.guard import UpdateGuard

__all__ = ["make_plan", "make_update_parts"]


def make_plan(
    config: GRPOConfig, backend: Backend | None, generator: torch.Generator, *, old_before_update: bool
) -> UpdatePlan:
    """The `UpdatePlan` of ``config`` (epochs, mini- and micro-batch sizes); ``old_before_update``:
    the behaviour log-probs are read before the update (a KL in the reward, a mask, the shift
    check); ``generator`` shuffles the groups."""
    return UpdatePlan(
        num_epochs=config.num_epochs_per_update,
        mini_batch_size=config.resolved_mini_batch_size,
        micro_batch_size=config.resolved_micro_batch_size,
        old_before_update=old_before_update,
        rescales_gradients=backend is None or backend.rescales_gradients,
        generator=generator,
    )


def make_update_parts(
    config: GRPOConfig,
    run: TrainerSetup,
    objective: GRPOObjective,
    plan: UpdatePlan,
    guard: UpdateGuard,
    fused_loss: FusedLoss | None,
) -> UpdateParts | None:
    """The `UpdateParts` of a trainer set up as ``run`` (`grpo.engine.setup.TrainerSetup`), or
    None when it has nothing to train (no backend or no optimizer)."""
    if run.backend is None or run.optimizer is None:
        return None
    return UpdateParts(
        policy=run.policy,
        objective=objective,
        plan=plan,
        backend=run.backend,
        guard=guard,
        params=run.params,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        device=run.device,
        exact_entropy=entropy_request(run.policy, config.entropy_coeff),
        sampler_is_cap=config.effective_sampler_is_cap,
        adaptive_lr=AdaptiveLR.from_config(config, run.scheduler),
        fused_loss=fused_loss,
        sampler_correction=config.sampler_correction,
    )
