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
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo.advantage_estimator import uniform_group_ids
from grpo.generation.engine import GenerationEngine, InProcessEngine
from grpo.policy_base import PolicyModel, has_method, set_training_mode
from grpo.reward_model_base import RewardModel
from grpo.rollout.batch import ExperienceBatch, evaluate_log_probs, select_rows
from grpo.rollout.checks import (
    checked_step_rewards,
    method_name,
    stack_hint,
    states_type_error,
    to_reward_tensor,
)
from grpo.rollout.dynamic_sampling import DrawCounter, MoreStates, kept_groups, mixed_groups, short_of_message
from grpo.rollout.log_probs import LogProbs, normalise_log_probs
from grpo.rollout.reward_guard import call_reward

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = [
    "ExperienceBatch",
    "ExperienceCollector",
    "LogProbs",
    "evaluate_log_probs",
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
        engine: the generation engine (None: the policy itself, in-process).
        allow_empty: with ``invalid_rewards="drop_groups"``, a collection in which every group
            holds an invalid reward returns a batch of no group (all counted in
            ``dropped_groups``) instead of raising. Off for training (a step needs a group);
            `grpo.training.evaluation.evaluate` turns it on and raises only when no group of the
            whole evaluation is left.
        max_draws: ``GRPOConfig.max_sampling_draws``: with more than 1, dynamic sampling with
            back-fill (`grpo.rollout.dynamic_sampling`): up to this many batches of states a
            step, drawn from ``more_states`` (`collect_for_update`), until B groups have mixed
            rewards; ``draws`` counts the batches drawn beyond one per step.
        reward_clip: ``GRPOConfig.reward_clip``: rewards are clipped so before a group's rewards
            are compared (as the advantages compare them).
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
        allow_empty: bool = False,
        max_draws: int = 1,
        reward_clip: float | None = None,
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
        self.mask_truncated = mask_truncated
        self.allow_empty = allow_empty
        self.max_draws = max_draws
        self.reward_clip = reward_clip
        self.draws = DrawCounter()
        self._ids_cache: tuple[tuple[int, int, torch.device], Tensor] | None = None
        self.engine: GenerationEngine = InProcessEngine(policy) if engine is None else engine

    @classmethod
    def from_config(
        cls,
        config: GRPOConfig,
        policy: PolicyModel,
        reward_model: RewardModel,
        device: torch.device,
        reference_policy: PolicyModel | None,
        engine: GenerationEngine,
    ) -> ExperienceCollector:
        """The trainer's collector: its settings from ``config`` (``group_size``,
        ``invalid_rewards``, ``reward_timeout``, ``mask_truncated_completions``, the sampler
        correction, ``max_sampling_draws``, ``reward_clip``); behaviour log-probs recorded by default."""
        return cls(
            policy,
            reward_model,
            config.group_size,
            device,
            reference_policy=reference_policy,
            record_sampler_log_probs=config.effective_sampler_is_cap is not None,
            invalid_rewards=config.invalid_rewards,
            reward_timeout=config.reward_timeout,
            mask_truncated=config.mask_truncated_completions,
            engine=engine,
            max_draws=config.max_sampling_draws,
            reward_clip=config.reward_clip,
        )

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

    def collect_for_update(
        self,
        states: Any,
        generate_kwargs: dict[str, Any],
        *,
        record_old: bool | None = None,
        more_states: MoreStates | None = None,
    ) -> ExperienceBatch:
        """`collect` of ``states`` as `checked_states` returns them (the trainer checks them once,
        before it decides the update's plan), recording ``old_log_probs`` (and so the mask) only
        when ``record_old``: the update needs them before its forwards
        (`grpo.update.plan.UpdateDecisions`, decided by the trainer once per step); None =
        ``record_old_log_probs``. Otherwise they come from the update's first forwards, saving a
        policy forward. ``more_states``: where back-fill draws more states (``max_draws`` > 1).

        The rollout, in one pass (each line one part, below in this order)::

            batch = drawn(states)              # generate B groups of G, score, drop invalid groups
            batch = back_filled(batch)         # max_draws > 1: draw until B groups are mixed
            batch = with_log_probs(batch)      # behaviour / reference log-probs, no gradient
        """
        record = self.record_old_log_probs if record_old is None else record_old
        with torch.no_grad():
            batch = self._drawn(states, generate_kwargs, record)
            if self.max_draws > 1:
                batch = self._back_filled(batch, len(states), more_states, generate_kwargs, record)
            batch = dataclasses.replace(batch, loss_rows=self._loss_rows(batch.actions))
            t0 = time.perf_counter()
            # per-step credit needs the step mask before the update: record the log-probs now
            batch = self._with_log_probs(batch, record or batch.step_rewards is not None)
            if batch.step_rewards is not None:
                step = checked_step_rewards(batch.step_rewards, batch.mask, self.reward_model)
                batch = dataclasses.replace(batch, step_rewards=step, rewards=step.sum(-1))
            timings = {**batch.timings, "logprobs": time.perf_counter() - t0}
        return dataclasses.replace(batch, timings=timings)

    def _drawn(self, states: Any, generate_kwargs: dict[str, Any], record: bool) -> ExperienceBatch:
        """One draw: G actions for each of the B ``states``, their rewards, without the groups
        holding an invalid reward (``invalid_rewards="drop_groups"``); timed."""
        t0 = time.perf_counter()
        actions, reported, version = self._generate(states, generate_kwargs, record)
        t1 = time.perf_counter()
        batch = self._valid_groups(self._scored(states, actions, reported, version))
        return dataclasses.replace(batch, timings={"generate": t1 - t0, "score": time.perf_counter() - t1})

    def _back_filled(
        self,
        first: ExperienceBatch,
        target: int,
        more_states: MoreStates | None,
        generate_kwargs: dict[str, Any],
        record: bool,
    ) -> ExperienceBatch:
        """Dynamic sampling (`grpo.rollout.dynamic_sampling`): draw batches of ``more_states()``
        after ``first`` until ``target`` (B) groups are mixed or ``max_draws`` batches were drawn,
        then keep `pick_groups` of them, with the ``sampling/*`` metrics."""
        draws, mixed, ran_out = [first], [self._mixed(first)], False
        while sum(int(m.sum()) for m in mixed) < target and len(draws) < self.max_draws:
            states = None if more_states is None else more_states()
            if states is None:
                ran_out = True
                break
            self.draws.extra += 1  # the source moved on, whatever happens to this draw
            draws.append(self._drawn(self.checked_states(states), generate_kwargs, record))
            mixed.append(self._mixed(draws[-1]))
        found = sum(int(m.sum()) for m in mixed)
        if found < target:
            why = "no source" if more_states is None else "ran out" if ran_out else "cap"
            warnings.warn(
                short_of_message(found, target, len(draws), why, self.max_draws), UserWarning, stacklevel=5
            )
        return kept_groups(draws, mixed, target)

    def _mixed(self, batch: ExperienceBatch) -> Tensor:
        """(B,) bool: `mixed_groups` of ``batch``."""
        return mixed_groups(batch.rewards, self.group_size, self.reward_clip)

    def _generate(
        self, states: Any, generate_kwargs: dict[str, Any], record: bool
    ) -> tuple[Any, LogProbs | None, int]:
        """The engine's B groups of G actions, flat (`grpo.generation.engine`; the trainer's own
        policy in eval mode by default), the sampler's log-probs of them (N, T) with their mask
        when it reports them and they are wanted, and the policy version that sampled them."""
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
        actions = self._flatten_actions(gen.actions, len(states))
        if not want or gen.log_probs is None:
            return actions, None, gen.version
        where = method_name(self.policy, "generate_actions_with_log_probs")
        n = len(states) * self.group_size
        return (
            actions,
            normalise_log_probs(gen.log_probs, n, where, self.device, actions=actions),
            gen.version,
        )

    def _flatten_actions(self, actions: Any, num_states: int) -> Any:
        """The B groups of G ``actions`` as N = B*G flat actions (a list, or a Tensor (N, ...) on
        the device), or an error naming what ``generate_actions`` returned instead."""
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
            return flat_t
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
        return [a for group in actions for a in group]

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

    def _scored(self, states: Any, actions: Any, reported: LogProbs | None, version: int) -> ExperienceBatch:
        """The batch of all N = B*G samples with their rewards (None/NaN/inf as NaN with
        ``invalid_rewards="drop_groups"``), per-step rewards (N, T) when the reward returns them
        (``rewards`` then their sum), and what the sampler reported (``sampler_log_probs`` and
        ``mask``, until `_with_log_probs` decides what they are)."""
        flat_states = self._flatten_states(states)
        group_ids = self._group_ids(len(states))
        rewards, comps = self._rewards(flat_states, actions, int(group_ids.shape[0]))
        step = rewards if rewards.dim() == 2 else None  # per-step rewards (N, T)
        return ExperienceBatch(
            states=states,
            flat_states=flat_states,
            actions=actions,
            group_ids=group_ids,
            group_size=self.group_size,
            rewards=rewards if step is None else step.sum(-1),  # NaN stays NaN (drop_groups)
            reward_components=comps,
            step_rewards=step,
            sampler_log_probs=None if reported is None else reported.log_probs.detach(),
            mask=None if reported is None else reported.mask,
            policy_versions=torch.full_like(group_ids, self._checked_version(version)),
        )

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

    def _valid_groups(self, batch: ExperienceBatch) -> ExperienceBatch:
        """With ``invalid_rewards="drop_groups"``: ``batch`` without the groups holding an invalid
        (NaN) reward, counted in ``dropped_groups``. When every group holds one: a `ValueError`,
        or (``allow_empty``) a batch of no group."""
        if self.invalid_rewards != "drop_groups":
            return batch
        bad = torch.isnan(batch.rewards).view(-1, self.group_size).any(1)  # (B,)
        dropped = int(bad.sum())
        if dropped == 0:
            return batch
        if dropped == bad.numel() and not self.allow_empty:
            raise ValueError(
                f"{method_name(self.reward_model, 'compute_rewards')} returned an invalid reward "
                f"(None, NaN or inf) in every one of the {dropped} groups, so nothing is left to train "
                f"on. Fix the reward."
            )
        kept = batch.select_groups((~bad).nonzero().flatten())
        return dataclasses.replace(kept, dropped_groups=dropped)

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

    def _with_log_probs(self, batch: ExperienceBatch, record: bool) -> ExperienceBatch:
        """``batch`` with its behaviour log-probs and mask (``record``: the sampler's reported
        ones, unless they are kept apart for the correction, else a policy forward), the
        sampler's log-probs (``record_sampler_log_probs``) and the reference log-probs (a
        reference policy), all without gradient. ``batch.sampler_log_probs`` / ``batch.mask``
        hold what the sampler reported (`_scored`), or None."""
        sampler = self.record_sampler_log_probs
        reported = batch.sampler_log_probs
        if reported is None and sampler:
            raise TypeError(
                f"{method_name(self.policy, 'generate_actions_with_log_probs')} is needed to correct a "
                f"sampler/trainer mismatch (sampler_is_cap): the policy must report the sampler's "
                f"log-probs of its actions."
            )
        old = mask = ref = None
        if record:
            if reported is not None and not sampler:
                old, mask = reported, batch.mask  # the sampler's log-probs are the behaviour log-probs
            else:
                lp = evaluate_log_probs(self.policy, batch, device=self.device)
                old, mask = lp.log_probs.detach(), lp.mask
        if self.reference_policy is not None:
            set_training_mode(self.reference_policy, False)
            ref_lp = evaluate_log_probs(self.reference_policy, batch, device=self.device)
            ref, mask = ref_lp.log_probs.detach(), ref_lp.mask if mask is None else mask
        return dataclasses.replace(
            batch,
            old_log_probs=old,
            ref_log_probs=ref,
            mask=mask,
            sampler_log_probs=reported if sampler else None,
        )

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
