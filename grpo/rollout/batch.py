"""`ExperienceBatch`: one step's experience, flat and group-major, frozen once made.

Made by `grpo.experience_collector.ExperienceCollector` (a rollout) or by
`ExperienceBatch.from_groups` (groups gathered elsewhere); read by the advantages and the update.
Its pure operations live here: `ExperienceBatch.select_groups` (some of its groups, every field at
once), `concat_batches` (the groups of several batches as one), `select_rows` (rows of one item,
Tensor or list) and `evaluate_log_probs` (the policy's forward over a batch's actions, all rows or
a micro-batch's).

Two data forms are handled, each on its own (states and actions independently):

* lists: ``states`` any sequence of B objects; actions B lists of G actions; flat states / actions
  are Python lists of N = B*G items;
* tensors: ``states`` a Tensor (B, ...), actions a Tensor (B, G, ...); flat states are
  ``states.repeat_interleave(G, 0)`` and flat actions ``actions.flatten(0, 1)``: no Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.policy_base import EntropyRequest, PolicyModel, PolicyOutput, has_method
from grpo.rollout.checks import method_name, to_reward_tensor
from grpo.rollout.log_probs import LogProbs, normalise_log_probs

__all__ = ["ExperienceBatch", "concat_batches", "evaluate_log_probs", "select_rows"]


@dataclass(frozen=True)
class ExperienceBatch:
    """One step's experience, flat and group-major; frozen: nothing changes it after it is made
    (`dataclasses.replace` makes a changed copy).

    Attributes:
        states: the B states as given (list or Tensor (B, ...)).
        flat_states: N = B*G states, one per sample (list, or Tensor (N, ...)).
        actions: N flat actions (list, or Tensor (N, ...)).
        group_ids: (N,) int64, the group (state index) each sample belongs to.
        group_size: G when every group has G samples in the group-major layout, else None.
        rewards: (N,) float32 total reward of each sample (with per-step rewards: their sum over
            the sample's valid steps).
        step_rewards: (N, T) float32 per-step rewards, when the reward model returns one reward
            per step (credited by returns-to-go, `GRPOConfig.gamma`); 0 on invalid steps.
        reward_components: name -> (N,) float32, when the reward model exposes components.
        old_log_probs: (N, T) behaviour log-probs, recorded at collection (None when the update
            needs none: a single epoch with a single optimizer step is exactly on-policy).
        ref_log_probs: (N, T) reference log-probs (None when there is no KL term).
        sampler_log_probs: (N, T) the log-probs the sampler reported with its actions
            (``generate_actions_with_log_probs``), kept apart from ``old_log_probs`` when the
            trainer corrects a sampler/trainer mismatch (``GRPOConfig.sampler_is_cap``).
        mask: (N, T) bool, True for real steps (None until a log-prob call has revealed T).
        timings: seconds spent in ``generate``, ``score`` and ``logprobs``.
        dropped_groups: groups left out because a reward was invalid
            (``invalid_rewards="drop_groups"``); ``states`` holds only the kept ones.
        loss_rows: (N,) bool, False for the samples that contribute no gradient (their loss-mask
            rows are zeroed in the update), set by the collector with
            ``GRPOConfig.mask_truncated_completions``: actions that did not end. None = all rows.
        policy_versions: (N,) int64, the policy version (the trainer's ``step_count`` when the
            generation engine last received weights) that sampled each action; None for a batch
            built elsewhere (`from_groups`). Older than the trainer's = off-policy (async).
        sampling: the ``sampling/*`` metrics of dynamic sampling (``GRPOConfig.max_sampling_draws``
            > 1, `grpo.rollout.dynamic_sampling`); empty otherwise.
    """

    states: Any
    flat_states: Any
    actions: Any
    group_ids: Tensor
    group_size: int | None
    rewards: Tensor
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    sampler_log_probs: Tensor | None = None
    mask: Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    dropped_groups: int = 0
    step_rewards: Tensor | None = None
    loss_rows: Tensor | None = None
    policy_versions: Tensor | None = None
    sampling: dict[str, float] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.group_ids.shape[0])

    @classmethod
    def from_groups(
        cls,
        states: Any,
        actions: Any,
        rewards: Any,
        *,
        old_log_probs: Tensor | None = None,
        mask: Tensor | None = None,
        device: str | torch.device = "cpu",
    ) -> ExperienceBatch:
        """A batch of groups gathered elsewhere (logs, a real robot, another sampler), checked as
        `ExperienceCollector.collect` checks what a policy and a reward return.

        Args:
            states: B states (a sequence, or a Tensor (B, ...)).
            actions: B groups: a list of B lists of actions (groups may differ in size), or a
                Tensor (B, G, ...).
            rewards: N = sum of group sizes rewards, flat and group-major (Tensor, array or
                list), or a (B, G) Tensor / array.
            old_log_probs: the behaviour log-probs (N,) or (N, T) of the actions under the
                policy that chose them, if known. Without them `GRPOTrainer.train_on_batch`
                takes the current policy as the behaviour policy (exact for on-policy data).
            mask: (N, T) bool, True for real steps of ``old_log_probs`` (None = all real).
            device: where the batch's tensors go (the trainer's device).
        """
        device = torch.device(device)
        where = "ExperienceBatch.from_groups"
        states = _checked_group_states(states, where, device)
        b = len(states)
        sizes, flat_actions, g = _group_sizes(actions, b, where, device)
        group_ids = torch.repeat_interleave(
            torch.arange(b, device=device), torch.tensor(sizes, device=device)
        )
        n = int(group_ids.shape[0])
        if isinstance(states, Tensor):
            flat_states: Any = states.repeat_interleave(torch.tensor(sizes, device=device), 0)
        else:
            flat_states = [s for s, k in zip(states, sizes, strict=True) for _ in range(k)]
        if isinstance(rewards, (Tensor, np.ndarray)) and rewards.ndim == 2:
            rewards = rewards.reshape(-1)
        r = to_reward_tensor(rewards, n, f"{where} rewards", device)
        old, mask = _given_log_probs(old_log_probs, mask, n, flat_actions, where, device)
        return cls(
            states=states,
            flat_states=flat_states,
            actions=flat_actions,
            group_ids=group_ids,
            group_size=g,
            rewards=r,
            old_log_probs=old,
            mask=mask,
        )

    @property
    def num_groups(self) -> int:
        return len(self.states)

    def select_groups(self, groups: Tensor) -> ExperienceBatch:
        """The groups ``groups`` ((k,) int64 indices, in that order) of a group-major batch with a
        uniform group size G, as a batch of k groups: every per-group and per-sample field takes
        the same rows, ``rows = groups[:, None] * G + arange(G)`` flattened (k*G,), and
        ``group_ids`` become ``[0]*G + ... + [k-1]*G``. ``loss_rows`` are kept as selected (rows
        without gradient stay so); ``timings`` and ``dropped_groups`` are kept as they are."""
        g = self.group_size
        if g is None:
            raise ValueError("select_groups needs a uniform group size; this batch's groups differ in size.")
        groups = groups.to(self.group_ids.device)
        rows = (groups.unsqueeze(1) * g + torch.arange(g, device=groups.device)).flatten()
        per_row = {name: select_rows(getattr(self, name), rows) for name in _ROW_FIELDS}
        return replace(
            self,
            states=select_rows(self.states, groups),
            group_ids=torch.arange(int(groups.shape[0]), device=rows.device).repeat_interleave(g),
            reward_components={k: v.index_select(0, rows) for k, v in self.reward_components.items()},
            **per_row,
        )


def concat_batches(batches: Sequence[ExperienceBatch]) -> ExperienceBatch:
    """The groups of ``batches`` one after the other, as one group-major batch (every batch with
    the same uniform G, states and actions of the same kind). Per-step fields (N_i, T_i) are
    right-padded to the largest T (log-probs and rewards with 0, the mask with False: padding is
    no step); ``group_ids`` are renumbered, ``dropped_groups`` and ``timings`` summed. A batch
    without ``step_rewards`` beside batches with them is a batch of 1-step actions whose (N, 1)
    step rewards were read as (N,) (`grpo.rollout.checks.to_reward_tensor`): its rewards become
    its (N, 1) step rewards."""
    first = batches[0]
    if len(batches) == 1:
        return first
    g = first.group_size
    if g is None or any(b.group_size != g for b in batches):
        raise ValueError("concat_batches needs batches with one uniform group size.")
    if any(b.step_rewards is not None for b in batches):
        batches = [
            b if b.step_rewards is not None else replace(b, step_rewards=b.rewards[:, None]) for b in batches
        ]
        first = batches[0]
    joined: dict[str, Any] = {name: _concat([getattr(b, name) for b in batches]) for name in _ROW_FIELDS}
    timings: dict[str, float] = {}
    for b in batches:
        for k, v in b.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    states = _concat([b.states for b in batches])
    return replace(
        first,
        states=states,
        group_ids=torch.arange(len(states), device=first.group_ids.device).repeat_interleave(g),
        reward_components={
            k: torch.cat([b.reward_components[k] for b in batches]) for k in first.reward_components
        },
        timings=timings,
        dropped_groups=sum(b.dropped_groups for b in batches),
        **joined,
    )


def _concat(items: list[Any]) -> Any:
    """Lists joined, Tensors concatenated along rows ((N_i, T_i) right-padded to the largest T:
    zeros, False for a bool mask); None when every item is None."""
    if all(x is None for x in items):
        return None
    if not isinstance(items[0], Tensor):
        return [x for part in items for x in part]
    if items[0].dim() == 2 and len({int(x.shape[1]) for x in items}) > 1:
        t = max(int(x.shape[1]) for x in items)
        items = [torch.nn.functional.pad(x, (0, t - int(x.shape[1]))) for x in items]
    return torch.cat(items)


_ROW_FIELDS = (
    "flat_states",
    "actions",
    "rewards",
    "step_rewards",
    "old_log_probs",
    "ref_log_probs",
    "sampler_log_probs",
    "mask",
    "loss_rows",
    "policy_versions",
)
"""The `ExperienceBatch` fields with one row per sample (N rows)."""


def _checked_group_states(states: Any, where: str, device: torch.device) -> Any:
    """`ExperienceBatch.from_groups`'s states: a Tensor (B, ...) moved to ``device``, or a
    non-empty sequence; else a clear error."""
    if isinstance(states, Tensor):
        if states.dim() == 0 or states.shape[0] == 0:
            raise ValueError(
                f"{where}: states is a Tensor of shape {tuple(states.shape)}; expected (B, ...)."
            )
        return states.to(device)
    if isinstance(states, (str, bytes)) or not isinstance(states, Sequence) or len(states) == 0:
        raise TypeError(f"{where}: states must be a non-empty sequence of B states or a Tensor (B, ...).")
    return states


def _given_log_probs(
    old_log_probs: Tensor | None, mask: Tensor | None, n: int, actions: Any, where: str, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """`ExperienceBatch.from_groups`'s behaviour log-probs (n, T) and mask, normalised and checked."""
    if old_log_probs is None:
        if mask is not None:
            raise ValueError(
                f"{where}: a mask was given without old_log_probs; the mask describes their steps."
            )
        return None, None
    given = PolicyOutput(old_log_probs.detach(), mask) if mask is not None else old_log_probs.detach()
    lp = normalise_log_probs(
        given,
        n,
        f"{where} old_log_probs",
        device,
        actions=actions,
        explicit=f"pass mask=torch.ones_like(old_log_probs, dtype=torch.bool) to {where}",
    )
    return lp.log_probs, lp.mask


def _group_sizes(actions: Any, b: int, where: str, device: torch.device) -> tuple[list[int], Any, int | None]:
    """Sizes of the B groups of ``actions``, the flat actions, and G when every group has G."""
    if isinstance(actions, Tensor):
        if actions.dim() < 2 or actions.shape[0] != b:
            raise ValueError(f"{where}: actions has shape {tuple(actions.shape)}; expected ({b}, G, ...).")
        g = int(actions.shape[1])
        if g == 0:
            raise ValueError(f"{where}: actions has empty groups (shape {tuple(actions.shape)}).")
        return [g] * b, actions.flatten(0, 1).to(device), g
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence) or len(actions) != b:
        got = len(actions) if isinstance(actions, Sequence) else type(actions).__name__
        raise ValueError(f"{where}: actions must be {b} groups (one list of actions per state), got {got}.")
    bad = [
        i
        for i, a in enumerate(actions)
        if isinstance(a, (str, bytes)) or not isinstance(a, Sequence) or not a
    ]
    if bad:
        raise ValueError(f"{where}: the groups at {bad[:10]} are not non-empty lists of actions.")
    sizes = [len(a) for a in actions]
    uniform = sizes[0] if len(set(sizes)) == 1 else None
    return sizes, [x for a in actions for x in a], uniform


def select_rows(items: Any, rows: Tensor | None) -> Any:
    """``items[rows]`` for a Tensor (index_select) or a list (comprehension).

    ``rows=None`` means all rows; ``items=None`` stays None.
    """
    if rows is None or items is None:
        return items
    if isinstance(items, Tensor):
        return items.index_select(0, rows.to(items.device))
    return [items[i] for i in rows.tolist()]


def evaluate_log_probs(
    policy: PolicyModel,
    batch: ExperienceBatch,
    rows: Tensor | None = None,
    *,
    groups: Tensor | None = None,
    with_entropy: EntropyRequest = False,
    device: torch.device,
    check_inf: bool = True,
) -> LogProbs:
    """Log-probs of ``batch``'s actions (rows ``rows``, or all) under ``policy``, as (n, T) + mask.

    When the policy has ``evaluate_actions``, the states are tensors and the batch is group-major
    with a uniform G, the policy evaluates each state once per group (``groups`` are the group
    indices whose rows ``rows`` lists, in order). Otherwise ``get_log_probabilities`` is called on
    the flat rows. ``check_inf``: see `_normalise`. Float actions (n, D) with log-probs (n, D)
    and no mask are refused as ambiguous (`_check_not_per_component`).
    """
    n = batch.num_samples if rows is None else int(rows.shape[0])
    actions = select_rows(batch.actions, rows)
    if has_method(policy, "evaluate_actions"):
        g = batch.group_size
        if g is not None and g > 1 and isinstance(batch.states, Tensor):
            states = select_rows(batch.states, groups)
            out: Tensor | PolicyOutput = policy.evaluate_actions(  # type: ignore[attr-defined]
                states, actions, group_size=g, with_entropy=with_entropy
            )
        else:
            states = select_rows(batch.flat_states, rows)
            out = policy.evaluate_actions(  # type: ignore[attr-defined]
                states, actions, group_size=1, with_entropy=with_entropy
            )
        where = method_name(policy, "evaluate_actions")
    else:
        out = policy.get_log_probabilities(select_rows(batch.flat_states, rows), actions)
        where = method_name(policy, "get_log_probabilities")
    lp = normalise_log_probs(out, n, where, device, check_inf=check_inf, actions=actions)
    return _to_batch_width(lp, batch, rows)


def _to_batch_width(lp: LogProbs, batch: ExperienceBatch, rows: Tensor | None) -> LogProbs:
    """``lp`` (n, t) right-padded to the batch's T (its mask's width): log-probs and entropy 0,
    mask False. A policy may return the width of the actions it was given (episodes of one draw
    are padded to that draw's longest, and back-fill joins draws of different lengths), so a
    mini-batch can come back narrower than the batch's advantages and recorded log-probs; the
    columns beyond t must then be padding for these rows, else ``lp`` is returned as it is and
    the shape checks of the update name the mismatch."""
    if batch.mask is None or lp.log_probs.dim() != 2:
        return lp
    t, width = int(lp.log_probs.shape[1]), int(batch.mask.shape[1])
    if t >= width or bool(select_rows(batch.mask, rows)[:, t:].any()):
        return lp

    def pad(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_zeros((x.shape[0], width - t))], dim=1)

    return LogProbs(pad(lp.log_probs), pad(lp.mask), None if lp.entropy is None else pad(lp.entropy))
