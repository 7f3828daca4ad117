"""Rollout: sample a group of actions per state, score them, record behaviour/reference log-probs.

`ExperienceCollector.collect(states)` returns an `ExperienceBatch`: flat, group-major tensors (row k
belongs to group ``group_ids[k]``) plus the user's own objects. Two data forms are handled, each
on its own (states and actions independently):

* lists: ``states`` any sequence of B objects; ``generate_actions`` returns B lists of G actions;
  flat states / actions are Python lists of N = B*G items;
* tensors: ``states`` a Tensor (B, ...), actions a Tensor (B, G, ...); flat states are
  ``states.repeat_interleave(G, 0)`` and flat actions ``actions.flatten(0, 1)``: no Python loop.

Everything a user's object returns is checked here, with errors naming the object, the method,
what was seen and what was expected. `evaluate_log_probs` is the one place where the policy's
log-probs — ``(N,)``, ``(N, T)`` or a `PolicyOutput` — become ``(N, T)`` + a bool mask. There the
one shape that means two things is refused (`_check_not_per_component`): float actions ``(N, D)``
with log-probs ``(N, D)`` and no mask, the mark of a Gaussian policy that forgot ``.sum(-1)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.advantage_estimator import uniform_group_ids
from grpo.policy_base import EntropyRequest, PolicyModel, PolicyOutput, has_method, set_training_mode
from grpo.reward_model_base import FunctionReward, RewardModel
from grpo.rollout.reward_guard import call_reward

__all__ = [
    "ExperienceBatch",
    "ExperienceCollector",
    "LogProbs",
    "evaluate_log_probs",
    "same_device",
    "select_rows",
    "to_reward_tensor",
]


@dataclass
class LogProbs:
    """Normalised log-probs: ``log_probs`` (n, T) float, ``mask`` (n, T) bool, ``entropy`` or None."""

    log_probs: Tensor
    mask: Tensor
    entropy: Tensor | None = None


@dataclass
class ExperienceBatch:
    """One step's experience, flat and group-major; nothing changes it after collection.

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
        advantages: deprecated, None: advantages are returned by `GRPOTrainer.advantages`
            (`grpo.advantage_estimator.Advantages`), not written into the batch; only the
            deprecated `GRPOTrainer.compute_advantages` still fills this field.
        loss_rows: deprecated, None; like ``advantages`` (``Advantages.keep`` now).
        timings: seconds spent in ``generate``, ``score`` and ``logprobs``.
        dropped_groups: groups left out because a reward was invalid
            (``invalid_rewards="drop_groups"``); ``states`` holds only the kept ones.
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
    advantages: Tensor | None = None
    loss_rows: Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    dropped_groups: int = 0
    step_rewards: Tensor | None = None

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
        if isinstance(states, Tensor):
            if states.dim() == 0 or states.shape[0] == 0:
                raise ValueError(
                    f"{where}: states is a Tensor of shape {tuple(states.shape)}; expected (B, ...)."
                )
            states = states.to(device)
        elif isinstance(states, (str, bytes)) or not isinstance(states, Sequence) or len(states) == 0:
            raise TypeError(f"{where}: states must be a non-empty sequence of B states or a Tensor (B, ...).")
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
        old = None
        if old_log_probs is not None:
            given = PolicyOutput(old_log_probs.detach(), mask) if mask is not None else old_log_probs.detach()
            lp = _normalise(
                given, n, f"{where} old_log_probs", device, actions=flat_actions,
                explicit=f"pass mask=torch.ones_like(old_log_probs, dtype=torch.bool) to {where}",
            )  # fmt: skip
            old, mask = lp.log_probs, lp.mask
        elif mask is not None:
            raise ValueError(
                f"{where}: a mask was given without old_log_probs; the mask describes their steps."
            )
        return cls(
            states=states, flat_states=flat_states, actions=flat_actions, group_ids=group_ids,
            group_size=g, rewards=r, old_log_probs=old, mask=mask,
        )  # fmt: skip

    @property
    def num_groups(self) -> int:
        return len(self.states)


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


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when ``a`` is ``b`` (``cuda`` matches any ``cuda:N``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _where(obj: object, method: str) -> str:
    """``Class.method`` naming the user's object in messages (a wrapped function by its name)."""
    name = repr(obj) if isinstance(obj, FunctionReward) else type(obj).__name__
    return f"{name}.{method}"


_TRUE: dict[torch.device, Tensor] = {}


def _all_valid(shape: torch.Size, device: torch.device) -> Tensor:
    """An all-True bool mask of ``shape``: a read-only expanded view of one cached element (in-place
    writes to it raise), cheaper than allocating and filling a new tensor every call."""
    true = _TRUE.get(device)
    if true is None:
        true = _TRUE[device] = torch.ones((), dtype=torch.bool, device=device)
    return true.expand(shape)


_EXPLICIT = "return grpo.PolicyOutput(log_probs, mask=torch.ones_like(log_probs, dtype=torch.bool))"


def _normalise(
    out: Tensor | PolicyOutput,
    n: int,
    where: str,
    device: torch.device,
    *,
    check_inf: bool = True,
    actions: Any = None,
    explicit: str = _EXPLICIT,
) -> LogProbs:
    """The one normalisation point: (n,) | (n, T) | PolicyOutput -> LogProbs (n, T).

    ``check_inf=False`` skips the +-inf check (`_check_no_inf`): the update passes it, because
    `grpo.grpo_objective.GRPOObjective` turns a non-finite log-prob on a valid step into a
    non-finite loss, which the trainer's non-finite policy contains (no weight changes).
    ``actions``: the actions the log-probs belong to (rows of the same shape; None = not known),
    for `_check_not_per_component`; ``explicit`` is the fix that error offers for per-step values.
    """
    entropy = mask = None
    if isinstance(out, PolicyOutput):
        logp, mask, entropy = out.log_probs, out.mask, out.entropy
    else:
        logp = out
    if not isinstance(logp, Tensor):
        raise TypeError(
            f"{where} returned {type(logp).__name__}; expected a torch.Tensor of shape ({n},) or "
            f"({n}, T), or a grpo.PolicyOutput. Return torch log-probs, not numbers or arrays."
        )
    if logp.dim() not in (1, 2) or logp.shape[0] != n:
        raise ValueError(
            f"{where} returned log-probs of shape {tuple(logp.shape)}; expected ({n},) for one-shot "
            f"actions or ({n}, T) per step, one row per (state, action) pair it was given."
        )
    if not logp.dtype.is_floating_point:
        raise TypeError(f"{where} returned log-probs of dtype {logp.dtype}; expected a float dtype.")
    if mask is None and logp.dim() == 2:
        _check_not_per_component(logp, actions, where, explicit)
    logp_device = logp.device
    if logp_device != device and not same_device(logp_device, device):
        raise ValueError(
            f"{where} returned log-probs on {logp.device}, but the trainer runs on {device}. "
            f"Move the policy with policy.to({str(device)!r}) or set GRPOConfig(device=...)."
        )
    if logp.dim() == 1:
        logp = logp.unsqueeze(-1)
        entropy = entropy.unsqueeze(-1) if entropy is not None and entropy.dim() == 1 else entropy
    if mask is None:
        mask = _all_valid(logp.shape, logp_device)
    else:
        if mask.dim() == 1:
            mask = mask.unsqueeze(-1)
        if mask.shape != logp.shape:
            raise ValueError(
                f"{where} returned a mask of shape {tuple(mask.shape)} for log-probs of shape "
                f"{tuple(logp.shape)}; the mask must have the same shape."
            )
        mask = mask.to(device=logp.device, dtype=torch.bool)
    if entropy is not None and entropy.shape != logp.shape:
        raise ValueError(
            f"{where} returned entropy of shape {tuple(entropy.shape)}; expected "
            f"{tuple(logp.shape)} like the log-probs."
        )
    if isinstance(out, PolicyOutput) and out.mask is not None:
        logp = logp.masked_fill(~mask, 0.0)  # padding steps are ignored: any value (-inf, NaN) is fine
    if check_inf:
        _check_no_inf(logp, where)
    return LogProbs(logp, mask, entropy)


def _check_not_per_component(logp: Tensor, actions: Any, where: str, explicit: str) -> None:
    """Raise on log-probs (n, D) without a mask for float actions (·, D), D > 1: the one shape
    that means two things.

    Per-step log-probs of an action of T = D steps, or one log-prob per component of a single
    D-dimensional action: a Gaussian policy that forgets ``.sum(-1)`` (``Normal(mu, std)
    .log_prob(a)`` is (N, D)) returns exactly this, and read as steps it trains each component
    with its own ratio, clipping and KL, which is not the GRPO objective of a vector action.
    Integer actions (token ids (N, T)), list actions (objects the trainer cannot look into:
    completions, episodes), (N, T, D) actions with (N, T) log-probs, and a `PolicyOutput` with
    a mask are not ambiguous and pass. Only shapes and the dtype are read: no device sync.
    """
    if not isinstance(actions, Tensor) or actions.dim() != 2 or not actions.is_floating_point():
        return
    d = int(actions.shape[1])
    if d < 2 or logp.shape[1] != d:
        return
    n = int(logp.shape[0])
    raise ValueError(
        f"{where} returned log-probs of shape ({n}, {d}) without a mask for float actions of shape "
        f"{tuple(actions.shape)}: that is ambiguous. It reads as per-step log-probs of actions made "
        f"of {d} steps, but it is also what a policy returns when it forgets to sum over the {d} "
        f"components of one vector action (Normal(mu, std).log_prob(a) has shape (N, {d})); trained "
        f"as steps, each component would get its own ratio and clipping. If each action is one "
        f"vector of {d} components, return one log-prob per action, shape ({n},): "
        f"dist.log_prob(a).sum(-1), or build the distribution as "
        f"torch.distributions.Independent(Normal(mu, std), 1). If the {d} columns really are steps "
        f"of one action, say so: {explicit}."
    )


def _check_no_inf(logp: Tensor, where: str) -> None:
    """Raise on +inf anywhere or -inf on a real step (NaN is left to the non-finite policy).

    A log-probability is <= 0, so +inf is always a bug; -inf means the action has probability 0
    under the policy, which makes the ratio and the KL term infinite. Padding steps (mask False)
    were zeroed before this check, so -inf is allowed there.
    """
    if math.isfinite(float(logp.detach().sum())):  # one reduction in the common case; else look closer
        return
    if bool(torch.isinf(logp).any()):
        rows = torch.isinf(logp).any(-1).nonzero().flatten()[:10].tolist()
        sign = "+inf" if bool((logp == torch.inf).any()) else "-inf"
        raise ValueError(
            f"{where} returned log-probs with {sign} at rows {rows} (on steps the mask marks as "
            f"real); expected finite values <= 0. +inf means p > 1 (a bug in the log-prob); -inf "
            f"means the action has probability 0 under this policy. Return a PolicyOutput whose mask "
            f"is False on padding steps, and give every sampled action a positive probability "
            f"(e.g. clamp logits, not probabilities)."
        )


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
        where = _where(policy, "evaluate_actions")
    else:
        out = policy.get_log_probabilities(select_rows(batch.flat_states, rows), actions)
        where = _where(policy, "get_log_probabilities")
    return _normalise(out, n, where, device, check_inf=check_inf, actions=actions)


def to_reward_tensor(
    values: Any,
    n: int,
    where: str,
    device: torch.device,
    *,
    allow_invalid: bool = False,
    per_step: bool = False,
) -> Tensor:
    """Turn what a reward returned into a finite float32 (n,) tensor, or raise naming the problem.

    ``allow_invalid=True`` (``invalid_rewards="drop_groups"``): None, NaN and inf become NaN in
    the result instead of raising; the caller drops their groups. ``per_step=True``: an (n, T)
    array of per-step rewards (T > 1) is accepted too and returned as (n, T).
    """
    if isinstance(values, Tensor):
        t = values.detach()
    else:
        if isinstance(values, np.ndarray):
            arr = values
        else:
            if not isinstance(values, Sequence):
                raise TypeError(
                    f"{where} returned {type(values).__name__}; expected a Tensor, NumPy array or "
                    f"list of {n} numbers."
                )
            if allow_invalid:
                values = [float("nan") if v is None else v for v in values]
            bad = [i for i, v in enumerate(values) if v is None or isinstance(v, (str, bytes))]
            if bad:
                raise TypeError(
                    f"{where} returned non-numeric rewards at positions {bad[:10]} "
                    f"(e.g. {values[bad[0]]!r}); every sample needs a number. Return 0.0 (or a "
                    f"penalty) for samples the reward does not apply to, or (for None) set "
                    f"GRPOConfig(invalid_rewards='drop_groups') to leave their groups out."
                )
            try:
                arr = np.asarray(values, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{where} returned rewards that are not numbers: {e}") from e
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"{where} returned rewards of dtype {arr.dtype}; expected numbers.")
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.dim() == 2 and t.shape[-1] == 1:
        t = t.squeeze(-1)
    if t.shape != (n,) and not (per_step and t.dim() == 2 and t.shape[0] == n and t.shape[1] > 0):
        per = f" or ({n}, T): one reward per step of each action" if per_step else ""
        raise ValueError(
            f"{where} returned rewards of shape {tuple(t.shape)}; expected ({n},): one reward per "
            f"(state, action) pair, in the flat group-major order it was given{per}."
        )
    if t.is_complex():
        raise TypeError(f"{where} returned complex rewards ({t.dtype}); expected real numbers.")
    t = t.to(device=device, dtype=torch.float32)
    if allow_invalid:
        return torch.where(torch.isfinite(t), t, torch.nan)
    if math.isfinite(float(t.sum())):  # one reduction in the common case (an overflow of the sum
        return t  # of finite values falls through to the exact check below, which passes)
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        bad_idx = (~finite).nonzero().flatten()[:10].tolist()
        raise ValueError(
            f"{where} returned non-finite rewards (NaN or inf) at flat positions {bad_idx} "
            f"(group = position // group_size). Fix the reward, clip it to a finite range, or set "
            f"GRPOConfig(invalid_rewards='drop_groups') to leave such groups out of the step."
        )
    return t


def _checked_step_rewards(step: Tensor, mask: Tensor | None, reward_model: Any) -> Tensor:
    """Per-step rewards (N, T) zeroed on invalid steps, or an error when their T is not the
    policy's: step t's reward must belong to the log-prob of step t."""
    if mask is None or mask.shape != step.shape:
        got = "one log-prob per action" if mask is None else f"log-probs of shape {tuple(mask.shape)}"
        raise ValueError(
            f"{_where(reward_model, 'compute_rewards')} returned per-step rewards of shape "
            f"{tuple(step.shape)}, but the policy gives {got}. Per-step rewards need per-step "
            f"log-probs of the same (N, T) (PolicyOutput(log_probs, mask)); return one reward "
            f"per action, shape ({step.shape[0]},), otherwise."
        )
    return step.masked_fill(~mask, 0.0)


def _states_type_error(states: Any) -> str:
    """Why ``states`` (not a Tensor, not a sequence) is refused, and what to pass instead."""
    kind = type(states).__name__
    if isinstance(states, np.ndarray):
        return (
            f"states is a NumPy array of shape {states.shape}; pass a Tensor (B, ...): "
            f"torch.from_numpy(states), or a list of states: list(states)."
        )
    if isinstance(states, (str, bytes)):
        return f"states is a single {kind}; pass a list of states, e.g. step([state])."
    if hasattr(states, "__iter__"):  # a generator, iterator, set...: not indexable
        return (
            f"states is a {kind}, not a sequence the trainer can index and count; pass a list or "
            f"a Tensor (B, ...), e.g. step(list(states))."
        )
    return (
        f"states must be a sequence of states or a Tensor (B, ...), got {kind}. Wrap a single "
        f"state in a list: step([state])."
    )


def _stack_hint(states: Any, error: BaseException) -> str | None:
    """The message for a policy that failed on ``states`` given as a list of same-shape Tensors
    because it takes one Tensor (B, ...) (the error names the list type); None otherwise."""
    if isinstance(states, Tensor) or not isinstance(states, Sequence) or not states:
        return None
    if type(states).__name__ not in str(error) or not all(isinstance(s, Tensor) for s in states):
        return None
    shapes = {tuple(s.shape) for s in states}
    if len(shapes) != 1:
        return None
    shape = next(iter(shapes))
    return (
        f"{type(error).__name__}: {error}, with states given as a {type(states).__name__} of "
        f"{len(states)} Tensors of shape {shape}. If the policy takes a Tensor (B, ...), pass "
        f"torch.stack(states) (shape {(len(states), *shape)})."
    )


class ExperienceCollector:
    """Runs the policy, the reward and (if any) the reference policy to build an `ExperienceBatch`.

    Args:
        policy: the policy being trained.
        reward_model: scores the flat (state, action) pairs.
        group_size: G, actions per state.
        device: where tensors of the batch live.
        reference_policy: computes ``ref_log_probs`` when given (only when a KL term is on).
        record_old_log_probs: compute behaviour log-probs at collection (needed when the update
            takes more than one optimizer step).
        record_sampler_log_probs: sample through ``generate_actions_with_log_probs`` and keep
            its log-probs as ``sampler_log_probs``; behaviour log-probs then come from a forward
            of the policy (``GRPOConfig.sampler_is_cap``).
        invalid_rewards: ``"raise"`` on a None/NaN/inf reward, or ``"drop_groups"``: leave the
            groups holding one out of the batch (counted in ``batch.dropped_groups``).
        reward_timeout: seconds one reward call may take (None = no limit); see
            `grpo.rollout.reward_guard`.
    """

    def __init__(
        self,
        policy: PolicyModel,
        reward_model: RewardModel,
        group_size: int,
        device: torch.device,
        *,
        reference_policy: PolicyModel | None = None,
        record_old_log_probs: bool = True,
        record_sampler_log_probs: bool = False,
        invalid_rewards: str = "raise",
        reward_timeout: float | None = None,
    ) -> None:
        self.policy = policy
        self.reward_model = reward_model
        self.group_size = group_size
        self.device = device
        self.reference_policy = reference_policy
        self.record_old_log_probs = record_old_log_probs
        self.record_sampler_log_probs = record_sampler_log_probs
        self.invalid_rewards = invalid_rewards
        self.reward_timeout = reward_timeout
        self._ids_cache: tuple[tuple[int, int, torch.device], Tensor] | None = None

    def _flatten_actions(self, actions: Any, num_states: int) -> tuple[Any, Tensor, int | None]:
        g = self.group_size
        where = _where(self.policy, "generate_actions")
        if isinstance(actions, Tensor):
            if actions.dim() < 2 or actions.shape[0] != num_states or actions.shape[1] != g:
                raise ValueError(
                    f"{where} returned a Tensor of shape {tuple(actions.shape)}; expected "
                    f"({num_states}, {g}, ...): {num_states} states x group_size={g} actions each."
                )
            flat_t = actions.flatten(0, 1)
            if flat_t.device != self.device:
                flat_t = flat_t.to(self.device)
            return flat_t, self._group_ids(num_states), g
        if not isinstance(actions, Sequence) or isinstance(actions, (str, bytes)):
            raise TypeError(
                f"{where} returned {type(actions).__name__}; expected a list of {num_states} lists "
                f"of {g} actions, or a Tensor of shape ({num_states}, {g}, ...)."
            )
        if len(actions) != num_states:
            raise ValueError(
                f"{where} returned {len(actions)} groups for {num_states} states; expected one list "
                f"of {g} actions per state."
            )
        bad = [
            (i, len(a) if isinstance(a, Sequence) else type(a).__name__)
            for i, a in enumerate(actions)
            if not isinstance(a, Sequence) or isinstance(a, (str, bytes)) or len(a) != g
        ]
        if bad:
            shown = ", ".join(f"state {i}: {v}" for i, v in bad[:5])
            raise ValueError(
                f"{where} must return group_size={g} actions for every state; got {shown}"
                f"{' ...' if len(bad) > 5 else ''}. Sample exactly num_actions_per_state actions "
                f"per state."
            )
        flat = [a for group in actions for a in group]
        return flat, self._group_ids(num_states), g

    def _group_ids(self, num_states: int) -> Tensor:
        """`uniform_group_ids` for ``num_states`` groups, kept for the next batch of the same size
        (the ids are only read, never written in place)."""
        key = (num_states, self.group_size, self.device)
        cached = self._ids_cache
        if cached is None or cached[0] != key:
            cached = (key, uniform_group_ids(num_states, self.group_size, self.device))
            self._ids_cache = cached
        return cached[1]

    def _flatten_states(self, states: Any) -> Any:
        g = self.group_size
        if isinstance(states, Tensor):
            return states.repeat_interleave(g, 0)
        return [s for s in states for _ in range(g)]

    def _call(self, fn: Any, where: str, flat_states: Any, flat_actions: Any) -> Any:
        return call_reward(
            fn, where, flat_states, flat_actions, group_size=self.group_size, timeout=self.reward_timeout
        )

    def _rewards(self, flat_states: Any, flat_actions: Any, n: int) -> tuple[Tensor, dict[str, Tensor]]:
        rm = self.reward_model
        allow = self.invalid_rewards == "drop_groups"
        if has_method(rm, "compute_reward_components"):
            parts = getattr(rm, "components", None)
            weights = getattr(rm, "reward_weights", {})
            if isinstance(parts, Mapping) and set(parts) == set(weights):
                # call each component ourselves, so that a failure names the component
                raw: Any = {
                    k: self._call(
                        m.compute_rewards, f"{_where(rm, 'components')}[{k!r}]", flat_states, flat_actions
                    )
                    for k, m in parts.items()
                }
            else:
                raw = self._call(
                    rm.compute_reward_components,  # type: ignore[attr-defined]
                    _where(rm, "compute_reward_components"),
                    flat_states,
                    flat_actions,
                )
            if not isinstance(raw, Mapping) or not raw:
                raise TypeError(
                    f"{_where(rm, 'compute_reward_components')} must return a non-empty dict "
                    f"name -> (N,) rewards, got {type(raw).__name__}."
                )
            comps = {
                k: to_reward_tensor(
                    v,
                    n,
                    f"{_where(rm, 'compute_reward_components')}[{k!r}]",
                    self.device,
                    allow_invalid=allow,
                )
                for k, v in raw.items()
            }
            total = torch.zeros(n, device=self.device)
            for k, v in comps.items():
                total = total + float(rm.reward_weights[k]) * v  # type: ignore[attr-defined]
            return total, comps
        where = _where(rm, "compute_rewards")
        return to_reward_tensor(
            self._call(rm.compute_rewards, where, flat_states, flat_actions),
            n,
            where,
            self.device,
            allow_invalid=allow,
            per_step=True,
        ), {}

    def _drop_invalid_groups(
        self, states: Any, flat_states: Any, actions: Any, rewards: Tensor, comps: dict[str, Tensor]
    ) -> tuple[Any, Any, Any, Tensor, dict[str, Tensor], Tensor | None]:
        """Leave out every group holding a NaN reward (None/NaN/inf were mapped to NaN).

        Returns the kept states, flat states, actions, rewards, components, and the kept flat rows
        (None when every group is kept)."""
        g = self.group_size
        bad = torch.isnan(rewards).view(-1, g).any(1)  # (B,)
        dropped = int(bad.sum())
        if dropped == 0:
            return states, flat_states, actions, rewards, comps, None
        if dropped == bad.numel():
            raise ValueError(
                f"{_where(self.reward_model, 'compute_rewards')} returned an invalid reward "
                f"(None, NaN or inf) in every one of the {dropped} groups, so nothing is left to train "
                f"on. Fix the reward."
            )
        keep = (~bad).nonzero().flatten()
        rows = (keep.unsqueeze(1) * g + torch.arange(g, device=keep.device)).flatten()
        return (
            select_rows(states, keep),
            select_rows(flat_states, rows),
            select_rows(actions, rows),
            rewards.index_select(0, rows),
            {k: v.index_select(0, rows) for k, v in comps.items()},
            rows,
        )

    def complete(self, batch: ExperienceBatch, *, old: bool) -> ExperienceBatch:
        """``batch`` with what an update needs and it lacks, computed now without gradient:
        reference log-probs when there is a reference policy, and (``old=True``) the current
        policy's log-probs as the behaviour log-probs. ``batch`` itself is not changed."""
        need_ref = self.reference_policy is not None and batch.ref_log_probs is None
        if not (need_ref or old):
            return batch
        changes: dict[str, Any] = {}
        with torch.no_grad():
            if old:
                set_training_mode(self.policy, False)
                lp = evaluate_log_probs(self.policy, batch, device=self.device)
                changes.update(old_log_probs=lp.log_probs.detach(), mask=lp.mask)
            if need_ref:
                assert self.reference_policy is not None
                set_training_mode(self.reference_policy, False)
                ref = evaluate_log_probs(self.reference_policy, batch, device=self.device)
                changes["ref_log_probs"] = ref.log_probs.detach()
                if batch.mask is None and "mask" not in changes:
                    changes["mask"] = ref.mask
        return dataclasses.replace(batch, **changes)

    def collect(self, states: Any, **generate_kwargs: Any) -> ExperienceBatch:
        """Sample G actions per state, score them, and record old/ref log-probs (no gradient)."""
        return self.collect_for_update(states, generate_kwargs)

    def _checked_states(self, states: Any) -> Any:
        """``states`` as the collector takes them (a Tensor moved to the device), or a clear error."""
        if isinstance(states, Tensor):
            if states.dim() == 0 or states.shape[0] == 0:
                raise ValueError(
                    f"states is a Tensor of shape {tuple(states.shape)}; expected (B, ...) with "
                    "B >= 1 states."
                )
            if states.device != self.device:
                states = states.to(self.device)
        elif isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
            raise TypeError(_states_type_error(states))
        elif len(states) == 0:
            raise ValueError("states is empty; step() needs at least one state.")
        return states

    def _record_log_probs(
        self,
        batch: ExperienceBatch,
        behaviour: Tensor | PolicyOutput | None,
        n: int,
        kept: Tensor | None,
        record: bool,
    ) -> None:
        """Fill the new batch's sampler / behaviour / reference log-probs and mask (under no_grad,
        before `collect_for_update` returns it). ``behaviour``: what the sampler reported with its
        actions for its ``n`` samples, before groups were dropped (``kept``: the kept rows)."""
        sampler = self.record_sampler_log_probs
        reported: LogProbs | None = None
        if behaviour is not None:
            where = _where(self.policy, "generate_actions_with_log_probs")
            reported = _normalise(behaviour, n, where, self.device, actions=batch.actions)
            if kept is not None:  # groups were dropped after generation
                reported = LogProbs(select_rows(reported.log_probs, kept), select_rows(reported.mask, kept))
            if sampler:
                batch.sampler_log_probs = reported.log_probs.detach()
        elif sampler:
            raise TypeError(
                f"{_where(self.policy, 'generate_actions_with_log_probs')} is needed to correct a "
                f"sampler/trainer mismatch (sampler_is_cap): the policy must report the sampler's "
                f"log-probs of its actions."
            )
        if record:
            if reported is not None and not sampler:
                old = reported  # the sampler's log-probs are the behaviour log-probs
            else:
                old = evaluate_log_probs(self.policy, batch, device=self.device)
            batch.old_log_probs, batch.mask = old.log_probs.detach(), old.mask
        if self.reference_policy is not None:
            set_training_mode(self.reference_policy, False)
            ref = evaluate_log_probs(self.reference_policy, batch, device=self.device)
            batch.ref_log_probs = ref.log_probs.detach()
            if batch.mask is None:
                batch.mask = ref.mask

    def collect_for_update(
        self, states: Any, generate_kwargs: dict[str, Any], *, record_old: Callable[[int], bool] | None = None
    ) -> ExperienceBatch:
        """`collect`, recording ``old_log_probs`` (and so the mask) only when ``record_old(B)``
        says the update of B states needs them before its forwards (`grpo.update.plan`); None =
        ``record_old_log_probs``. Otherwise they come from the update's first forwards, saving a
        policy forward."""
        states = self._checked_states(states)
        num_states = len(states)
        record = self.record_old_log_probs if record_old is None else record_old(num_states)
        timings: dict[str, float] = {}
        with torch.no_grad():
            t0 = time.perf_counter()
            set_training_mode(self.policy, False)
            behaviour: Tensor | PolicyOutput | None = None
            sampler = self.record_sampler_log_probs
            if (record or sampler) and has_method(self.policy, "generate_actions_with_log_probs"):
                raw_actions, behaviour = self.policy.generate_actions_with_log_probs(  # type: ignore[attr-defined]
                    states, self.group_size, **generate_kwargs
                )
            else:
                try:
                    raw_actions = self.policy.generate_actions(states, self.group_size, **generate_kwargs)
                except (TypeError, AttributeError) as e:
                    hint = _stack_hint(states, e)
                    if hint is None:
                        raise
                    raise TypeError(f"{_where(self.policy, 'generate_actions')} raised {hint}") from e
            actions, group_ids, g = self._flatten_actions(raw_actions, num_states)
            flat_states = self._flatten_states(states)
            t1 = time.perf_counter()
            n = int(group_ids.shape[0])
            rewards, comps = self._rewards(flat_states, actions, n)
            step = rewards if rewards.dim() == 2 else None  # per-step rewards (N, T)
            if step is not None:
                rewards = step.sum(-1)  # NaN stays NaN (drop_groups)
            kept: Tensor | None = None
            if self.invalid_rewards == "drop_groups":
                states, flat_states, actions, rewards, comps, kept = self._drop_invalid_groups(
                    states, flat_states, actions, rewards, comps
                )
                group_ids = uniform_group_ids(len(states), self.group_size, self.device)
                if step is not None and kept is not None:
                    step = step.index_select(0, kept)
            t2 = time.perf_counter()
            batch = ExperienceBatch(
                states=states,
                flat_states=flat_states,
                actions=actions,
                group_ids=group_ids,
                group_size=g,
                rewards=rewards,
                reward_components=comps,
                dropped_groups=num_states - len(states),
            )
            # per-step credit needs the step mask before the update: record the log-probs now
            self._record_log_probs(batch, behaviour, n, kept, record or step is not None)
            if step is not None:
                batch.step_rewards = _checked_step_rewards(step, batch.mask, self.reward_model)
                batch.rewards = batch.step_rewards.sum(-1)
            timings = {"generate": t1 - t0, "score": t2 - t1, "logprobs": time.perf_counter() - t2}
        batch.timings = timings
        return batch
