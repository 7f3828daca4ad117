"""Step 1, the rollout: sample a group of actions per state, score them, record log-probs.

`ExperienceCollector.collect(states)` returns an `ExperienceBatch` (`grpo.rollout.batch`): flat,
group-major tensors (row k belongs to group ``group_ids[k]``) plus the user's own objects. For B
states and group size G: ``generate_actions(states, G)`` gives B groups of G actions (N = B*G),
the reward scores the N flat (state, action) pairs, and, when the update needs them before its
forwards, the behaviour log-probs (and so the step mask) are recorded; reference log-probs when a
KL term is on.

Everything a user's object returns is checked (`grpo.rollout.checks`,
`grpo.rollout.log_probs`), with errors naming the object, the method, what was seen and what was
expected.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from grpo.advantage_estimator import uniform_group_ids
from grpo.generation.engine import GenerationEngine, InProcessEngine
from grpo.policy_base import PolicyModel, PolicyOutput, has_method, set_training_mode
from grpo.reward_model_base import RewardModel
from grpo.rollout.batch import ExperienceBatch, evaluate_log_probs, select_rows
from grpo.rollout.checks import (
    checked_step_rewards,
    method_name,
    same_device,
    stack_hint,
    states_type_error,
    to_reward_tensor,
)
from grpo.rollout.log_probs import LogProbs, normalise_log_probs
from grpo.rollout.reward_guard import call_reward

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = [
    "ExperienceBatch",
    "ExperienceCollector",
    "LogProbs",
    "evaluate_log_probs",
    "same_device",
    "select_rows",
    "to_reward_tensor",
    "truncated_actions",
]


def truncated_actions(actions: Any, device: torch.device) -> Tensor | None:
    """(N,) bool: which of the N flat ``actions`` did not end (cut at a length limit), read from each
    action's ``truncated`` attribute, else from ``finished`` (False = truncated: the flag the
    ``completion/*`` metrics read, `grpo.rollout.action_stats`). An LLM `grpo.llm.Completion` has
    both; any action type may offer either. None when the actions are a Tensor or none has either
    attribute; an action without them among others that have them counts as ended."""

    def cut(a: Any) -> bool | None:
        if hasattr(a, "truncated"):
            return bool(a.truncated)
        return None if not hasattr(a, "finished") else not bool(a.finished)

    if isinstance(actions, Tensor):
        return None
    flags = [cut(a) for a in actions]
    if all(f is None for f in flags):
        return None
    return torch.tensor([bool(f) for f in flags], device=device)


class Scored(NamedTuple):
    """The rewards of a rollout, after groups with an invalid reward were dropped.

    ``rewards`` (N,) totals; ``step`` (N, T) per-step rewards or None; ``kept`` the kept flat rows
    of the generated N (None: every group kept)."""

    states: Any
    flat_states: Any
    actions: Any
    group_ids: Tensor
    rewards: Tensor
    components: dict[str, Tensor]
    step: Tensor | None
    kept: Tensor | None


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
        mask_truncated: ``GRPOConfig.mask_truncated_completions``: the batch's ``loss_rows`` are
            False for actions that did not end (`truncated_actions`), so they contribute no
            gradient; their rewards still enter the advantages. This is the one place the choice
            is made; the update zeroes those loss-mask rows (`grpo.update.loop`).
        config: the trainer's `GRPOConfig`: when given, ``group_size`` is read from it at each
            collection (a run-time change is one assignment to the config).
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
        mask_truncated: bool = False,
        engine: GenerationEngine | None = None,
        config: GRPOConfig | None = None,
    ) -> None:
        self.policy = policy
        self.reward_model = reward_model
        self._group_size = group_size
        self.config = config  # the trainer's live config: G is read from it (one assignment changes it)
        self.device = device
        self.reference_policy = reference_policy
        self.record_old_log_probs = record_old_log_probs
        self.record_sampler_log_probs = record_sampler_log_probs
        self.invalid_rewards = invalid_rewards
        self.reward_timeout = reward_timeout
        self.mask_truncated = mask_truncated
        self._ids_cache: tuple[tuple[int, int, torch.device], Tensor] | None = None
        self.engine: GenerationEngine = InProcessEngine(policy) if engine is None else engine

    @property
    def group_size(self) -> int:
        """G: ``config.group_size`` when built with the trainer's config, else the argument."""
        return self._group_size if self.config is None else self.config.group_size

    def _flatten_actions(self, actions: Any, num_states: int) -> tuple[Any, Tensor, int | None]:
        g = self.group_size
        where = method_name(self.policy, "generate_actions")
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
                        m.compute_rewards,
                        f"{method_name(rm, 'components')}[{k!r}]",
                        flat_states,
                        flat_actions,
                    )
                    for k, m in parts.items()
                }
            else:
                raw = self._call(
                    rm.compute_reward_components,  # type: ignore[attr-defined]
                    method_name(rm, "compute_reward_components"),
                    flat_states,
                    flat_actions,
                )
            if not isinstance(raw, Mapping) or not raw:
                raise TypeError(
                    f"{method_name(rm, 'compute_reward_components')} must return a non-empty dict "
                    f"name -> (N,) rewards, got {type(raw).__name__}."
                )
            comps = {
                k: to_reward_tensor(
                    v,
                    n,
                    f"{method_name(rm, 'compute_reward_components')}[{k!r}]",
                    self.device,
                    allow_invalid=allow,
                )
                for k, v in raw.items()
            }
            total = torch.zeros(n, device=self.device)
            for k, v in comps.items():
                total = total + float(rm.reward_weights[k]) * v  # type: ignore[attr-defined]
            return total, comps
        where = method_name(rm, "compute_rewards")
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
                f"{method_name(self.reward_model, 'compute_rewards')} returned an invalid reward "
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
        return self.collect_for_update(self.checked_states(states), generate_kwargs)

    def checked_states(self, states: Any) -> Any:
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
            raise TypeError(states_type_error(states))
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
    ) -> ExperienceBatch:
        """``batch`` with its sampler / behaviour / reference log-probs and mask (under no_grad).
        ``behaviour``: what the sampler reported with its actions for its ``n`` samples, before
        groups were dropped (``kept``: the kept rows)."""
        sampler = self.record_sampler_log_probs
        reported: LogProbs | None = None
        changes: dict[str, Any] = {}
        if behaviour is not None:
            where = method_name(self.policy, "generate_actions_with_log_probs")
            reported = normalise_log_probs(behaviour, n, where, self.device, actions=batch.actions)
            if kept is not None:  # groups were dropped after generation
                reported = LogProbs(select_rows(reported.log_probs, kept), select_rows(reported.mask, kept))
            if sampler:
                changes["sampler_log_probs"] = reported.log_probs.detach()
        elif sampler:
            raise TypeError(
                f"{method_name(self.policy, 'generate_actions_with_log_probs')} is needed to correct a "
                f"sampler/trainer mismatch (sampler_is_cap): the policy must report the sampler's "
                f"log-probs of its actions."
            )
        if record:
            if reported is not None and not sampler:
                old = reported  # the sampler's log-probs are the behaviour log-probs
            else:
                old = evaluate_log_probs(self.policy, batch, device=self.device)
            changes.update(old_log_probs=old.log_probs.detach(), mask=old.mask)
        if self.reference_policy is not None:
            set_training_mode(self.reference_policy, False)
            ref = evaluate_log_probs(self.reference_policy, batch, device=self.device)
            changes["ref_log_probs"] = ref.log_probs.detach()
            changes.setdefault("mask", ref.mask)
        return dataclasses.replace(batch, **changes)

    def collect_for_update(
        self, states: Any, generate_kwargs: dict[str, Any], *, record_old: bool | None = None
    ) -> ExperienceBatch:
        """`collect` of ``states`` as `checked_states` returns them (the trainer checks them once,
        before it decides the update's plan), recording ``old_log_probs`` (and so the mask) only
        when ``record_old``: the update needs them before its forwards
        (`grpo.update.plan.UpdateDecisions`, decided by the trainer once per step); None =
        ``record_old_log_probs``. Otherwise they come from the update's first forwards, saving a
        policy forward."""
        record = self.record_old_log_probs if record_old is None else record_old
        with torch.no_grad():
            t0 = time.perf_counter()
            raw_actions, behaviour, version = self._generate(states, generate_kwargs, record)
            actions, group_ids, g = self._flatten_actions(raw_actions, len(states))
            t1 = time.perf_counter()
            scored = self._score(states, self._flatten_states(states), actions, group_ids)
            t2 = time.perf_counter()
            batch = ExperienceBatch(
                states=scored.states, flat_states=scored.flat_states, actions=scored.actions,
                group_ids=scored.group_ids, group_size=g, rewards=scored.rewards,
                reward_components=scored.components, dropped_groups=len(states) - len(scored.states),
                loss_rows=self._loss_rows(scored.actions),
                policy_versions=torch.full_like(scored.group_ids, self._checked_version(version)),
            )  # fmt: skip
            # per-step credit needs the step mask before the update: record the log-probs now
            n = int(group_ids.shape[0])
            batch = self._record_log_probs(
                batch, behaviour, n, scored.kept, record or scored.step is not None
            )
            if scored.step is not None:
                step = checked_step_rewards(scored.step, batch.mask, self.reward_model)
                batch = dataclasses.replace(batch, step_rewards=step, rewards=step.sum(-1))
            timings = {"generate": t1 - t0, "score": t2 - t1, "logprobs": time.perf_counter() - t2}
        return dataclasses.replace(batch, timings=timings)

    def _checked_version(self, version: int) -> int:
        """``version`` (the weights that sampled the batch); a batch sampled by older weights than
        the trainer's needs the sampler's log-probs kept for the importance correction."""
        if version != self.engine.version and not self.record_sampler_log_probs:
            raise RuntimeError(
                f"the generation engine returned actions sampled by policy version {version}, but the "
                f"trainer is at version {self.engine.version} and keeps no sampler log-probs to "
                f"correct for it. Off-policy generation needs GRPOConfig(async_staleness=K) (which "
                f"turns the sampler correction on) or sampler_is_cap."
            )
        return int(version)

    def _loss_rows(self, actions: Any) -> Tensor | None:
        """``ExperienceBatch.loss_rows``: with ``mask_truncated``, False for the actions that did
        not end (None when every action ended, or without ``mask_truncated``)."""
        if not self.mask_truncated:
            return None
        truncated = truncated_actions(actions, self.device)
        if truncated is None:
            kind = type(actions).__name__ if isinstance(actions, Tensor) else type(actions[0]).__name__
            raise TypeError(
                f"GRPOConfig(mask_truncated_completions=True) needs actions that say whether they "
                f"ended: {method_name(self.policy, 'generate_actions')} returned {kind} actions "
                f"without a 'truncated' (or 'finished') attribute. Give the actions a 'truncated' "
                f"bool (True = cut at the length limit), or set mask_truncated_completions=False."
            )
        return ~truncated if bool(truncated.any()) else None

    def _generate(
        self, states: Any, generate_kwargs: dict[str, Any], record: bool
    ) -> tuple[Any, Tensor | PolicyOutput | None, int]:
        """The engine's B groups of G actions (`grpo.generation.engine`; the trainer's own policy
        in eval mode by default), the sampler's log-probs of them when it reports them and they
        are wanted, and the policy version that sampled them."""
        # an engine with its own weights reports the sampler's log-probs for the correction only:
        # the behaviour log-probs are always the trainer's own numbers
        want = self.record_sampler_log_probs or (record and not self.engine.owns_weights)
        try:
            gen = self.engine.submit(states, self.group_size, with_log_probs=want, **generate_kwargs).result()
        except (TypeError, AttributeError) as e:
            hint = stack_hint(states, e)
            if hint is None:
                raise
            raise TypeError(f"{method_name(self.policy, 'generate_actions')} raised {hint}") from e
        return gen.actions, gen.log_probs if want else None, gen.version

    def _score(self, states: Any, flat_states: Any, actions: Any, group_ids: Tensor) -> Scored:
        """The rewards of the N flat samples; with ``invalid_rewards="drop_groups"`` the groups
        holding an invalid one are left out (of the states, actions and rewards)."""
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
        return Scored(states, flat_states, actions, group_ids, rewards, comps, step, kept)
