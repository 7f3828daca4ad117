"""The per-step tensors of one micro-batch that the objective reads (both of its paths:
`grpo.grpo_objective.GRPOObjective.composed` and `grpo.algorithms.clip_twin.clip_objective_twin`)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["ObjectiveInputs"]


class ObjectiveInputs(NamedTuple):
    """One micro-batch of n samples with T steps, as the objective takes it.

    Attributes:
        logp: (n, T) the current policy's log-probs of the actions (differentiable).
        logp_old: (n, T) the behaviour log-probs (no gradient).
        advantages: (n,) one per sample, or (n, T) per step.
        mask: (n, T) bool, the valid steps that enter the loss.
        normaliser: ``Z`` of the whole optimizer step (`grpo.algorithms.aggregation`), 0-d or a float.
        logp_ref: (n, T) the reference policy's log-probs, or None (no KL).
        entropy: (n, T) the exact entropy (its gradient flows back), or None (the estimate -logp).
        is_weights: (n, T) per-step weights of the policy term, no gradient (the sampler
            correction), or None.
    """

    logp: Tensor
    logp_old: Tensor
    advantages: Tensor
    mask: Tensor
    normaliser: Tensor | float
    logp_ref: Tensor | None = None
    entropy: Tensor | None = None
    is_weights: Tensor | None = None
