"""Dynamic sampling with back-fill (DAPO; verl's ``filter_groups``): which groups a step keeps.

With ``GRPOConfig(drop_zero_variance_groups=True, max_sampling_draws=M)``, M > 1, a step draws
batches of states until it holds B groups with mixed rewards, at most M batches (draws) in all.
A group is *mixed* when its G rewards, clipped as the advantages clip them
(``reward_clip``), are not all equal::

    mixed_b = max_j r_bj > min_j r_bj        (reward std > 0 within group b)

The r_bj are the episodes' total rewards (the outcome), also with per-step credit (step rewards,
``gamma`` < 1): a group whose G episodes all succeed, faster or slower, is all-equal and left out,
as DAPO and SimpleVLA-RL filter by outcome accuracy in (0, 1). Its per-step advantages would
only rank the speeds of successes; kept, such groups would crowd the mixed ones (the success
signal) out of the batch as the success rate rises. The advantage's own filter
(`grpo.advantage_estimator.AdvantageEstimator`, ``drop_zero_variance_groups``) tests the same
totals, so the two never disagree on a group.

The step's batch is then, over the groups of every draw in draw order (`pick_groups`):

* the first B mixed groups; mixed groups found beyond B are left out (``sampling/surplus_groups``),
  so that every update has B groups (verl's ``filter_groups`` also truncates to its batch size);
* at the cap (M draws, or the source ran out) with k < B mixed groups: those k, topped up with the
  first B - k all-equal groups drawn. ``drop_zero_variance_groups`` leaves these out of the loss
  and its normaliser, so the update trains on the k mixed groups found; a `UserWarning` says
  so and ``sampling/capped`` is 1. It never draws more than M batches.

The draws are counted (`DrawCounter`, checkpointed by the trainer) so that
`grpo.training.loop.train` resumes its source at the batch an uninterrupted run draws next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo.rollout.action_stats import success_metrics
from grpo.rollout.batch import ExperienceBatch, concat_batches

__all__ = [
    "DRAWS_COMPONENT",
    "DrawCounter",
    "MoreStates",
    "drawn_successes",
    "kept_groups",
    "mixed_groups",
    "pick_groups",
    "sampling_metrics",
    "short_of_message",
]

MoreStates = Callable[[], Any]
"""``more_states()``: one more batch of states for back-fill (a sequence or a Tensor (B', ...)),
or None when the source has no more."""

DRAWS_COMPONENT = "dynamic_sampling"
"""The name of the trainer's checkpointed `DrawCounter` (``trainer.stateful_components()``)."""


class DrawCounter:
    """How many batches of states back-fill drew beyond one per step, over the trainer's life
    (``extra``); saved in checkpoints, so a resumed `train` starts its source at batch
    ``step_count + extra``."""

    def __init__(self) -> None:
        self.extra = 0

    def state_dict(self) -> dict[str, int]:
        return {"extra": self.extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.extra = int(state["extra"])


def mixed_groups(rewards: Tensor, group_size: int, reward_clip: float | None = None) -> Tensor:
    """(B,) bool: the groups of the group-major ``rewards`` (N = B*G,) whose G rewards, clipped to
    [-c, c] as the advantages clip them, are not all equal (max > min)."""
    r = rewards.detach().to(torch.float64).view(-1, group_size)
    if reward_clip is not None:
        r = r.clamp(-reward_clip, reward_clip)
    return r.amax(1) > r.amin(1)


def pick_groups(mixed: Tensor, target: int) -> Tensor:
    """(k,) int64 indices, ascending, of the groups a step keeps among the drawn ones (``mixed``
    (K,) bool, in draw order): the first ``target`` mixed groups; with fewer, all mixed groups and
    the first all-equal ones up to ``target`` (or all groups when fewer than ``target`` were
    drawn)."""
    mixed_idx = mixed.nonzero().flatten()
    if mixed_idx.numel() >= target:
        return mixed_idx[:target]
    equal_idx = (~mixed).nonzero().flatten()[: target - int(mixed_idx.numel())]
    return torch.cat([mixed_idx, equal_idx]).sort().values


def kept_groups(draws: Sequence[ExperienceBatch], mixed: Sequence[Tensor], target: int) -> ExperienceBatch:
    """The step's batch from its ``draws`` (``mixed[i]``: (B_i,) bool, `mixed_groups` of draw i):
    the groups `pick_groups` chooses, taken from each draw before the draws are joined (so the
    per-step fields are padded only to the longest T of a draw that keeps a group), with every
    draw's ``dropped_groups`` and ``timings`` summed and the ``sampling/*`` metrics."""
    every = torch.cat(list(mixed))
    picked = pick_groups(every, target)
    parts, start = [], 0
    for draw in draws:
        mine = picked[(picked >= start) & (picked < start + draw.num_groups)] - start
        start += draw.num_groups
        if mine.numel() > 0:
            parts.append(draw.select_groups(mine))
    joined = concat_batches(parts) if parts else draws[0]
    timings: dict[str, float] = {}
    for draw in draws:
        for k, v in draw.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    metrics = sampling_metrics(every, target, len(draws), int(every.sum()) < target)
    return dataclasses.replace(
        joined,
        dropped_groups=sum(d.dropped_groups for d in draws),
        timings=timings,
        sampling=metrics | drawn_successes(draws),
    )


def drawn_successes(draws: Sequence[ExperienceBatch]) -> dict[str, float]:
    """``sampling/drawn_episodes`` and ``sampling/drawn_successes``: every episode the step drew,
    kept or left out, and how many succeeded, when the actions report success (episodes of an
    env whose info holds ``success``; `grpo.rollout.action_stats.success_metrics`); ``{}``
    otherwise. Their ratio is the policy's success rate at this step: ``episode/success_rate``
    is the kept batch's, which back-fill fills with mixed groups (near 1/2 whatever the policy)."""
    actions: list[Any] = []
    for draw in draws:
        if not isinstance(draw.actions, Sequence):
            return {}
        actions.extend(draw.actions)
    if "episode/success_rate" not in success_metrics(actions):
        return {}
    wins = sum(1 for a in actions if a.success)
    return {"sampling/drawn_episodes": float(len(actions)), "sampling/drawn_successes": float(wins)}


def sampling_metrics(mixed: Tensor, target: int, draws: int, capped: bool) -> dict[str, float]:
    """The ``sampling/*`` metrics of one step: its ``draws``, the mixed groups kept
    (min(mixed, B)), the all-equal groups drawn and left out, the mixed groups beyond B left out,
    and whether it stopped short of B mixed groups (``capped``)."""
    found = int(mixed.sum())
    kept = min(found, target)
    equal_in_batch = min(int(mixed.numel()) - found, target - kept)
    return {
        "sampling/draws": float(draws),
        "sampling/kept_groups": float(kept),
        "sampling/dropped_groups": float(int(mixed.numel()) - found - equal_in_batch),
        "sampling/surplus_groups": float(found - kept),
        "sampling/capped": float(capped),
    }


def short_of_message(found: int, target: int, draws: int, why: str, max_draws: int) -> str:
    """The warning of a step that found ``found`` < ``target`` mixed groups in ``draws`` draws;
    ``why``: ``"cap"`` (``max_draws`` reached), ``"ran out"`` (the source) or ``"no source"``."""
    reason = {
        "no source": "no source of more states was given (use train(), or step(states, more_states=...))",
        "ran out": "the source of states ran out",
        "cap": f"max_sampling_draws={max_draws} batches were drawn",
    }[why]
    return (
        f"dynamic sampling: {found} of {target} groups have mixed rewards after {draws} draw(s): "
        f"{reason}. The step trains on those {found} (the all-equal groups filling the batch are "
        f"left out of the loss by drop_zero_variance_groups). If sampling/capped is often 1, raise "
        f"max_sampling_draws, or the tasks are too easy or too hard for the policy."
    )
