"""`GRPOTrainer`: one ``step(states)`` = collect, advantages, clipped-surrogate update, metrics.

The step reads top to bottom in the order it runs::

    batch = collect(states)                 # G actions per state, rewards, old/ref log-probs
    compute_advantages(batch)               # group-relative, per group id
    for epoch in range(num_epochs_per_update):
        for each optimizer step (mini_batch_size groups):
            for each micro-batch (micro_batch_size groups):
                log-probs (+ entropy) of the current policy     # one forward
                GRPOObjective(...)                              # the math lives there
                backward
            clip grad norm; optimizer step (skipped if the gradient is not finite)
    metrics -> dict[str, float]

The trainer has no math of its own: the advantage and the loss are pure functions in
`grpo.advantage_estimator` and `grpo.grpo_objective`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from grpo import checkpoint
from grpo.advantage_estimator import AdvantageEstimator, AdvantageFn, group_stats
from grpo.config import GRPOConfig
from grpo.deepspeed_engine import (
    DeepSpeedBackend,
    copy_partitioned_weights,
    cpu_adam,
    deepspeed_config_from,
    offloads_optimizer,
    policy_is_partitioned,
    training_module,
)
from grpo.denormals import flush_denormals_on, restore_denormals
from grpo.distributed import main_process_only, reseed_other_ranks, setup_distributed
from grpo.experience_collector import (
    ExperienceBatch,
    ExperienceCollector,
    evaluate_log_probs,
    same_device,
    select_rows,
)
from grpo.grpo_objective import STAT_NAMES, GRPOObjective, ObjectiveOutput
from grpo.kl import KLFn
from grpo.lr_schedules import build_scheduler
from grpo.optim import clip_to_norm, default_optimizer, grad_norm
from grpo.policy_base import (
    EntropyRequest,
    PolicyModel,
    check_policy,
    has_method,
    policy_parameters,
    set_training_mode,
)
from grpo.policy_losses import PolicyLossFn
from grpo.reward_model_base import RewardModel, as_reward_model
from grpo.rollback import UpdateSnapshot

if TYPE_CHECKING:
    import os

    from grpo.training_loop import TrainState

__all__ = ["GRPOConfig", "GRPOTrainer"]

logger = logging.getLogger(__name__)

_ADVANTAGE_METRICS = (
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "advantage/mean",
    "advantage/std",
    "advantage/min",
    "advantage/max",
    "reward/frac_zero_std",
)
_IS_METRICS = ("sampler/is_weight_mean", "sampler/is_frac_capped")
_N_LOSSES = 4  # STAT_NAMES[:4]: loss, policy_loss, kl_loss, entropy (aggregated like the loss)
_STEPS = STAT_NAMES.index("steps")
# update() metrics in the order of its values vector: the aggregated losses (mean over optimizer
# steps), the sums of STAT_NAMES after "steps" divided by the valid steps, the ratio extremes, the
# gradient norm (mean over optimizer steps) and the non-finite step counter
_UPDATE_METRICS = (
    "loss/total",
    "loss/policy",
    "loss/kl",
    "loss/entropy",
    "clip/frac_low",
    "clip/frac_high",
    "kl/old",
    "kl/ref",
    "policy/entropy",
    "ratio/mean",
    "ratio/min",
    "ratio/max",
    "grad/norm",
    "optim/non_finite_steps",
)
assert STAT_NAMES[_STEPS + 1 :] == ("clip_low", "clip_high", "kl_old", "kl_ref", "entropy_sum", "ratio_sum")


def resolve_device(name: str) -> torch.device:
    """``'auto'`` -> cuda when available else cpu; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class GRPOTrainer:
    """Trains any `PolicyModel` against any `RewardModel` with GRPO.

    Args:
        config: a `GRPOConfig`.
        policy: the policy to train (any object with the `PolicyModel` methods).
        reward_model: a `RewardModel`, or a plain callable ``f(states, actions) -> (N,) rewards``.
        reference_policy: the policy the KL term pulls towards. Default: a frozen copy of the
            starting policy (DeepSeekMath), made only when ``config.kl_coeff > 0``.
        optimizer: a torch optimizer over the policy's parameters. Default: AdamW with
            ``config.learning_rate`` over ``policy.get_parameters()`` (`grpo.optim.default_optimizer`:
            the fused implementation where torch has one).
        advantage_fn: replaces the baseline/scale step of the advantage
            (`grpo.advantage_estimator.AdvantageFn`); no subclassing needed.
        loss_fn: replaces the per-step policy loss (`grpo.policy_losses.PolicyLossFn`).
        kl_fn: replaces the KL estimator (`grpo.kl.KLFn`).
    """

    def __init__(
        self,
        config: GRPOConfig,
        policy: PolicyModel,
        reward_model: RewardModel | Any,
        reference_policy: PolicyModel | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        advantage_fn: AdvantageFn | None = None,
        loss_fn: PolicyLossFn | None = None,
        kl_fn: KLFn | None = None,
    ) -> None:
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}.")
        check_policy(policy, "policy")
        reward = as_reward_model(reward_model, "reward_model")
        if reference_policy is not None:
            check_policy(reference_policy, "reference_policy")
        self.config = config
        self.device = resolve_device(config.device)
        # More than one process (torchrun): None on one process; see grpo/distributed.py.
        self.distributed = setup_distributed(config.distributed, self.device)
        rank = 0
        if self.distributed is not None:
            self.device, rank = self.distributed.device, self.distributed.rank
        if config.seed is not None:
            seed_everything(config.seed + rank)  # ranks sample different actions
        self._generator = torch.Generator().manual_seed(0 if config.seed is None else config.seed)

        self.policy: PolicyModel = _moved(policy, self.device)
        self.reward_model: RewardModel = _moved(reward, self.device)
        self.params = policy_parameters(self.policy)
        self._check_param_devices()
        if self.distributed is not None:
            self.distributed.attach(self.params, self.policy)  # same layout; rank 0's weights
        ds_config = deepspeed_config_from(config.deepspeed)  # None: no DeepSpeed
        self.optimizer = self._make_optimizer(optimizer, ds_config)

        self.reference_policy: PolicyModel | None = None
        self._owns_reference = False
        if config.kl_coeff > 0:
            if reference_policy is None:
                self.reference_policy = self._snapshot(self.policy)
                self._owns_reference = True
            else:
                self.reference_policy = _moved(reference_policy, self.device)
        elif reference_policy is not None:
            warnings.warn(
                "reference_policy is ignored because kl_coeff=0 (no KL term); set "
                "GRPOConfig(kl_coeff=...) > 0 to use it.",
                UserWarning,
                stacklevel=2,
            )

        self.advantage_estimator = AdvantageEstimator.from_config(config, advantage_fn)
        kl_in_reward = config.kl_penalty == "reward" and config.kl_coeff > 0
        needs_old_early = kl_in_reward or self.advantage_estimator.needs_mask  # before the update
        multi_step = config.optimizer_steps_per_step > 1 or needs_old_early
        # DeepSpeed reduces the gradients, so they cannot be divided by a loss normaliser learnt
        # after the backward passes: with several micro-batches per optimizer step the mask must
        # be known before them, from a forward at collection.
        mask_first = (
            ds_config is not None and config.resolved_micro_batch_size < config.resolved_mini_batch_size
        )
        # Several epochs of one optimizer step each: the first epoch's forwards run before any
        # weight changes, so they give the behaviour log-probs and collection skips that forward
        # (for a step of at most this many states; 0 = never).
        defer = multi_step and not needs_old_early and not mask_first
        self._defer_old_up_to = config.resolved_mini_batch_size if defer else 0
        self.collector = ExperienceCollector(
            self.policy,
            self.reward_model,
            config.group_size,
            self.device,
            reference_policy=self.reference_policy,
            record_old_log_probs=multi_step or mask_first,
            record_sampler_log_probs=config.sampler_is_cap is not None,
            invalid_rewards=config.invalid_rewards,
            reward_timeout=config.reward_timeout,
        )
        self.objective = GRPOObjective(
            clip_epsilon=config.clip_epsilon,
            clip_epsilon_high=config.clip_epsilon_high,
            kl_coeff=0.0 if kl_in_reward else config.kl_coeff,
            kl_estimator=config.kl_estimator,
            entropy_coeff=config.entropy_coeff,
            aggregation=config.loss_aggregation,
            log_ratio_clamp=config.log_ratio_clamp,
            policy_loss=config.policy_loss,
            dual_clip_c=config.dual_clip_c if config.dual_clip else None,
            sapo_tau_pos=config.sapo_tau_pos,
            sapo_tau_neg=config.sapo_tau_neg,
            loss_normaliser=config.loss_normaliser,
            loss_fn=loss_fn,
            kl_fn=kl_fn,
        )
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = build_scheduler(
            self.optimizer, config.lr_schedule, config.warmup_steps, config.total_steps, config.lr_min_ratio
        )
        # the exact entropy from evaluate_actions: differentiable only when the loss trains it
        self._exact_entropy: EntropyRequest = (
            (True if config.entropy_coeff != 0 else "no_grad")
            if has_method(self.policy, "evaluate_actions")
            else False
        )
        if config.sampler_is_cap is not None and not has_method(
            self.policy, "generate_actions_with_log_probs"
        ):
            raise TypeError(
                f"GRPOConfig(sampler_is_cap={config.sampler_is_cap}) corrects a sampler/trainer "
                f"mismatch, so the policy must report its sampler's log-probs: "
                f"{type(self.policy).__name__} has no generate_actions_with_log_probs(states, G) -> "
                f"(actions, log_probs). Add it, or set sampler_is_cap=None."
            )
        # names of the update's statistics vector (`_update`)
        self._update_names = _UPDATE_METRICS + (_IS_METRICS if config.sampler_is_cap is not None else ())
        self._update_snapshot = UpdateSnapshot()  # buffers reused by every step's rollback copy
        self.step_count = 0
        self.non_finite_steps = 0
        self._warned_nothing_to_train = False
        # DeepSpeed ZeRO-1/2/3 (grpo.deepspeed_engine): backward and optimizer step through its engine
        self._deepspeed: DeepSpeedBackend | None = None
        self._deepspeed_loss = math.nan  # global loss of the last optimizer step (for the failure message)
        if ds_config is not None and self.optimizer is not None:
            self._deepspeed = DeepSpeedBackend(
                self.policy,
                self.params,
                self.optimizer,
                ds_config,
                max_grad_norm=config.max_grad_norm,
                world_size=1 if self.distributed is None else self.distributed.world_size,
                device=self.device,
            )
            reference = self._reference_module()
            if self._deepspeed.stage == 3 and reference is not None:
                self._deepspeed.partition_reference(reference)

    # ---- construction helpers -----------------------------------------------------------
    def _check_param_devices(self) -> None:
        wrong = sorted({str(p.device) for p in self.params if not same_device(p.device, self.device)})
        if wrong:
            raise ValueError(
                f"policy parameters are on {wrong} after policy.to({str(self.device)!r}), but "
                f"GRPOConfig.device is {str(self.device)!r}. Make policy.to(device) move every "
                f"tensor that get_parameters() returns, or set GRPOConfig(device=...) to match."
            )

    def _make_optimizer(
        self, optimizer: torch.optim.Optimizer | None, ds_config: dict[str, Any] | None = None
    ) -> torch.optim.Optimizer | None:
        if optimizer is not None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if self.params and not any(id(p) in held for p in self.params):
                raise ValueError(
                    f"the optimizer ({type(optimizer).__name__}) holds none of the "
                    f"{len(self.params)} parameters that policy.get_parameters() returns, so "
                    f"training would change nothing. Build it from those tensors, e.g. "
                    f"torch.optim.AdamW(policy.parameters(), lr=...), or pass optimizer=None."
                )
            return optimizer
        if not self.params:
            return None
        if ds_config is not None and offloads_optimizer(ds_config):  # ZeRO-Offload: Adam on the CPU
            return cpu_adam(self.params, self.config.learning_rate, self.config.weight_decay)
        return default_optimizer(self.params, self.config.learning_rate, self.config.weight_decay)

    def _snapshot(self, policy: PolicyModel) -> PolicyModel:
        if policy_is_partitioned(policy):
            raise ValueError(
                f"the weights of {type(policy).__name__} are already partitioned by DeepSpeed "
                f"ZeRO-3 (a trainer built on this policy earlier partitioned them), so they cannot "
                f"be copied for the frozen KL reference. Build a fresh policy for this trainer, "
                f"pass reference_policy=..., or set GRPOConfig(kl_coeff=0)."
            )
        try:
            ref = copy.deepcopy(policy)
        except Exception as e:  # deepcopy of arbitrary user objects can fail in many ways
            raise TypeError(
                f"could not copy the policy ({type(policy).__name__}) to make the frozen reference "
                f"policy for the KL term: {e!r}. Pass reference_policy=... yourself, or set "
                f"GRPOConfig(kl_coeff=0)."
            ) from e
        for p in policy_parameters(ref):
            p.requires_grad_(False)
        ref.eval()
        return ref

    def _reference_module(self) -> nn.Module | None:
        """The reference policy's own module (a copy of the policy's), or None: no reference, or
        one without a module of its own (e.g. the policy with its LoRA adapter disabled)."""
        if self.reference_policy is None:
            return None
        try:
            module = training_module(self.reference_policy)
        except TypeError:
            return None
        if self._deepspeed is not None and module is self._deepspeed.engine.module:
            return None
        return module

    def refresh_reference(self) -> None:
        """Copy the current policy's weights into the reference policy."""
        if self.reference_policy is None:
            return
        if self._deepspeed is not None and self._deepspeed.stage == 3:
            # both partitioned: copied module by module (every rank takes part)
            target = self._reference_module()
            if target is None:
                raise TypeError(
                    f"under DeepSpeed ZeRO-3 the reference policy is refreshed through its module, "
                    f"but {type(self.reference_policy).__name__} has none (no training_module()). "
                    f"Set reference_update_freq=None."
                )
            copy_partitioned_weights(self._deepspeed.engine.module, target)
            return
        if isinstance(self.reference_policy, nn.Module) and isinstance(self.policy, nn.Module):
            self.reference_policy.load_state_dict(self.policy.state_dict())
        else:
            self.reference_policy = self._snapshot(self.policy)
            self.collector.reference_policy = self.reference_policy

    # ---- the step -----------------------------------------------------------------------
    def step(self, states: Any, **generate_kwargs: Any) -> dict[str, float]:
        """One GRPO step on ``states`` (a sequence of B states, or a Tensor (B, ...)).

        Returns float metrics (names in docs/metrics.md): ``reward/*``, ``advantage/*``,
        ``loss/*``, ``kl/*``, ``clip/*``, ``ratio/*``, ``policy/entropy``, ``grad/norm``,
        ``time/*``.

        With ``config.flush_denormals`` (default) the step runs with subnormal floats flushed to
        zero on CPU (`grpo.denormals`); the setting is restored afterwards.
        """
        changed = flush_denormals_on() if self.config.flush_denormals else False
        try:
            return self._step(states, generate_kwargs)
        finally:
            restore_denormals(changed)

    def _step(self, states: Any, generate_kwargs: dict[str, Any]) -> dict[str, float]:
        t0 = time.perf_counter()
        self._check_lockstep(states)
        batch = self.collector.collect_for_update(
            states, generate_kwargs, defer_old_up_to=self._defer_old_up_to
        )
        names, values = self._advantages(batch)
        t1 = time.perf_counter()
        update = self._update_or_roll_back(batch)
        t2 = time.perf_counter()
        self.step_count += 1
        freq = self.config.reference_update_freq
        if freq is not None and self.step_count % freq == 0:
            self.refresh_reference()

        metrics = dict(zip(names, values.detach().tolist(), strict=True))
        if update is not None:
            metrics.update(zip(self._update_names, update, strict=True))
        metrics.update({f"time/{k}": v for k, v in batch.timings.items()})
        metrics["time/update"] = t2 - t1
        metrics["time/step"] = time.perf_counter() - t0
        metrics["step"] = float(self.step_count)
        if self.distributed is not None:
            metrics = self.distributed.reduce_metrics(
                metrics,
                samples=batch.num_samples,
                groups=len(batch.states),
                valid_steps=float(self._valid_steps) if update is not None else 0.0,
            )
        return metrics

    def _check_lockstep(self, states: Any) -> None:
        """ZeRO-3 on several processes: every forward all-gathers weights, so all ranks must run
        the same forwards; refuse different numbers of states before any of them (a clear error
        on every rank instead of a hang)."""
        if self.distributed is None or self.deepspeed_stage != 3:
            return
        try:
            n = len(states)
        except TypeError:
            return  # not sized: check_policy's own error follows in collection
        why = "DeepSpeed ZeRO-3 gathers the weights in every forward, so all ranks must run the same forwards"
        self.distributed.check_same_number_of_states(n, why)

    def collect(self, states: Any, **generate_kwargs: Any) -> ExperienceBatch:
        """Rollout only: G actions per state, rewards, and the log-probs the update needs."""
        return self.collector.collect(states, **generate_kwargs)

    def compute_advantages(self, batch: ExperienceBatch) -> dict[str, Tensor]:
        """Fill ``batch.advantages`` (N,) and return reward / advantage statistics (tensors)."""
        names, values = self._advantages(batch)
        return dict(zip(names, values.unbind(), strict=True))

    def _advantages(self, batch: ExperienceBatch) -> tuple[tuple[str, ...], Tensor]:
        """`compute_advantages` with the statistics as (names, one float32 vector)."""
        num_groups = len(batch.states)
        g = batch.group_size
        result = self.advantage_estimator(
            batch.rewards,
            batch.group_ids,
            num_groups,
            components=batch.reward_components,
            weights=getattr(self.reward_model, "reward_weights", None),
            mask=batch.mask,
            kl_penalty=self._kl_reward_penalty(batch),
            group_size=g,
        )
        adv = result.advantages
        batch.advantages = adv
        batch.loss_rows = result.keep
        r = batch.rewards
        if g is not None and r.numel() == num_groups * g:  # uniform group-major layout: a (B, G) view
            lo, hi = torch.aminmax(r.view(num_groups, g), dim=1)
            zero_std = lo == hi
        else:
            zero_std = group_stats(r, batch.group_ids, num_groups).zero_std
        # reward and advantage statistics in a few ops: rows of one (2, N) tensor (advantages
        # per step (N, T) are summarised over all their entries)
        both = torch.stack([r, adv.to(r.dtype)]) if adv.shape == r.shape else None
        if both is not None:
            if r.numel() > 1:
                std, mean = torch.std_mean(both, 1)
            else:
                std, mean = both.new_zeros(2), both[:, 0]
            mn, mx = torch.aminmax(both, dim=1)
            parts = [torch.stack([mean, std, mn, mx], 1).view(-1)]  # (2, 4): reward row, advantage row
        else:
            r_std = r.std() if r.numel() > 1 else r.new_zeros(())
            a_std = adv.std() if adv.numel() > 1 else adv.new_zeros(())
            r_stats = [r.mean(), r_std, r.min(), r.max()]
            parts = [torch.stack([*r_stats, adv.mean(), a_std, adv.min(), adv.max()])]
        names = list(_ADVANTAGE_METRICS)
        extra = [zero_std.float().mean()]
        for name, comp in batch.reward_components.items():
            names.append(f"reward/{name}/mean")
            extra.append(comp.mean())
        for name, value in result.stats.items():
            names.append(name)
            extra.append(value)
        if self.config.invalid_rewards == "drop_groups":
            names.append("reward/dropped_groups")
            extra.append(torch.full((), float(batch.dropped_groups), device=self.device))
        parts.append(torch.stack([e.float() for e in extra]))
        return tuple(names), torch.cat([p.float() for p in parts])

    def update(self, batch: ExperienceBatch) -> dict[str, Tensor]:
        """Optimise the policy on ``batch`` (advantages filled). Returns loss/ratio/KL statistics."""
        values = self._update(batch)
        if values is None:
            return {}
        return dict(zip(self._update_names, torch.tensor(values, device=self.device).unbind(), strict=True))

    def _update(self, batch: ExperienceBatch) -> list[float] | None:
        """`update` with the statistics as floats (names ``self._update_names``); None when there
        is nothing to train."""
        if self.optimizer is None:
            if not self._warned_nothing_to_train:
                warnings.warn(
                    f"policy {type(self.policy).__name__}.get_parameters() returned no tensor that "
                    "requires grad and no optimizer was given: nothing is trained. Reward and "
                    "advantage metrics are still reported. Return the policy's trainable tensors "
                    "from get_parameters() to train it.",
                    UserWarning,
                    stacklevel=3,
                )
                self._warned_nothing_to_train = True
            return None
        if batch.advantages is None:
            raise ValueError("update() needs batch.advantages; call compute_advantages(batch) first.")
        cfg = self.config
        num_groups = len(batch.states)
        mb = cfg.resolved_mini_batch_size
        if self.distributed is not None:
            self.distributed.check_same_optimizer_steps(num_groups, mb)
        micro = cfg.resolved_micro_batch_size
        uniform = batch.group_size
        device = self.device
        total: Tensor | float = 0.0  # sum over optimizer steps of the objective's stats vector
        extremes: Tensor | None = None  # (-min ratio, max ratio) over the micro-batches so far
        grad_sum = 0.0  # sum of the optimizer steps' gradient norms
        n_opt = 0
        params_changed = False

        set_training_mode(self.policy, True)
        self._failed_update: tuple[float, float] | None = None
        self._is_sums: Tensor | None = None  # (sum of IS weights, capped steps) over valid steps
        multi = cfg.optimizer_steps_per_step > 1
        snapshot: UpdateSnapshot | None = None
        if multi and self._deepspeed is None:  # DeepSpeed's optimizer state is partitioned
            snapshot = self._update_snapshot
            snapshot.capture(self.params, self.optimizer, self.scheduler)
        self._rollback: UpdateSnapshot | None = snapshot
        whole_batch_normaliser: Tensor | None = None
        normaliser: Tensor | None
        # Behaviour log-probs left to the update (see collect_for_update): the first epoch's
        # forwards, taken before its single optimizer step, are them.
        old_pieces: list[Tensor] | None = None
        if multi and batch.old_log_probs is None:
            if num_groups > mb:
                raise ValueError(
                    f"this batch has no old (behaviour) log-probs and {num_groups} groups, more than "
                    f"mini_batch_size={mb}: the update takes several optimizer steps per epoch, so "
                    f"they must be recorded at collection. Build the batch with trainer.collect()."
                )
            old_pieces = []
        for _ in range(cfg.num_epochs_per_update):
            order = torch.randperm(num_groups, generator=self._generator) if num_groups > mb else None
            for start in range(0, num_groups, mb):
                step_groups = _group_slice(order, start, mb)
                step_rows = _rows_of(batch, step_groups, uniform, device)
                if step_rows is None and whole_batch_normaliser is not None:
                    normaliser = whole_batch_normaliser  # the same rows every epoch: computed once
                else:
                    normaliser = self._normaliser(batch, step_rows)
                    if normaliser is not None and self.distributed is not None:  # the global count
                        step_mask = self._loss_mask(batch, select_rows(batch.mask, step_rows), step_rows)
                        normaliser = self.distributed.global_normaliser(normaliser, step_mask)
                    if step_rows is None:
                        whole_batch_normaliser = normaliser
                self._zero_grad()
                step_stats: Tensor | float = 0.0  # the objective's stats, summed over micro-batches
                deferred: Tensor | float = 0.0
                count = _count(step_groups, num_groups)
                for m_start in range(0, count, micro):
                    groups = _sub(step_groups, m_start, micro, num_groups)
                    rows = _rows_of(batch, groups, uniform, device)
                    out, mask, logp, normaliser = self._micro_step(
                        batch,
                        rows,
                        groups,
                        normaliser,
                        params_changed,
                        check_inf=old_pieces is not None,
                        boundary=m_start + micro >= count,
                        step_stats=step_stats,
                    )
                    if old_pieces is not None:
                        old_pieces.append(logp)
                    step_stats = out.stats if isinstance(step_stats, float) else step_stats + out.stats
                    extremes = out.extremes if extremes is None else torch.maximum(extremes, out.extremes)
                    if normaliser is None:
                        deferred = deferred + self.objective.normaliser(mask)
                assert isinstance(step_stats, Tensor)
                if old_pieces is not None:
                    batch.old_log_probs = old_pieces[0] if len(old_pieces) == 1 else torch.cat(old_pieces)
                    old_pieces = None
                if normaliser is None:
                    # The mask was unknown before the forwards: the micro-batch losses were sums,
                    # so dividing gradients and losses by the step's normaliser now is exact.
                    assert isinstance(deferred, Tensor)
                    if self.distributed is not None:
                        deferred = self.distributed.all_reduce_sum(deferred)  # global count
                    grads = [p.grad for p in self.params if p.grad is not None]
                    if grads:
                        torch._foreach_div_(grads, deferred)
                    step_stats = torch.cat([step_stats[:_N_LOSSES] / deferred, step_stats[_N_LOSSES:]])
                total = step_stats if isinstance(total, float) else total + step_stats
                n_opt += 1
                grad_sum = grad_sum + self._clip_and_step(step_stats[0])
                if self._failed_update is not None:
                    break
                params_changed = True
            if self._failed_update is not None:
                break
        if self._failed_update is not None:
            self._contain_non_finite(snapshot, *self._failed_update)

        assert isinstance(total, Tensor)
        assert extremes is not None
        # to the host once: the divisions below are a few Python floats (the metrics end as floats)
        sums = total.tolist()
        neg_min, ratio_max = extremes.tolist()
        steps = sums[_STEPS]
        self._valid_steps = steps  # weight of this rank's metrics across processes
        per_step = max(steps, 1.0)
        values = [v / n_opt for v in sums[:_N_LOSSES]]
        values += [v / per_step for v in sums[_N_LOSSES + 1 :]]
        values += [-neg_min, ratio_max, grad_sum / n_opt, float(self.non_finite_steps)]
        if self._is_sums is not None:  # sampler/trainer mismatch: mean weight, fraction capped
            values += [v / per_step for v in self._is_sums.tolist()]
        return values

    def _normaliser(self, batch: ExperienceBatch, rows: Tensor | None) -> Tensor | None:
        """The aggregation normaliser of one optimizer step, or None if the mask is not known yet."""
        if batch.mask is None:
            return None
        return self.objective.normaliser(self._loss_mask(batch, select_rows(batch.mask, rows), rows))

    def _micro_step(
        self,
        batch: ExperienceBatch,
        rows: Tensor | None,
        groups: Tensor | None,
        normaliser: Tensor | None,
        params_changed: bool,
        check_inf: bool = False,
        boundary: bool = True,
        step_stats: Tensor | float = 0.0,
    ) -> tuple[ObjectiveOutput, Tensor, Tensor, Tensor | None]:
        """Forward, loss and backward of one micro-batch; gradients accumulate.

        Returns the objective's output, the loss mask, the detached behaviour log-probs used and
        the loss normaliser (None: still unknown, the caller divides afterwards).
        ``check_inf``: reject +inf log-probs with a ValueError (when these are the behaviour
        log-probs, as at collection); otherwise a non-finite loss is contained by the caller.
        ``boundary`` (last micro-batch of the optimizer step) and ``step_stats`` (the objective's
        stats summed over the step's earlier micro-batches; [0] is the loss) are for DeepSpeed.
        """
        lp = evaluate_log_probs(
            self.policy,
            batch,
            rows,
            groups=groups,
            with_entropy=self._exact_entropy,
            device=self.device,
            check_inf=check_inf,
        )
        logp = lp.log_probs
        if not logp.requires_grad:
            raise ValueError(
                f"{type(self.policy).__name__} returned log-probs that do not require grad during "
                f"the update, so nothing would learn. Compute them from the policy's parameters "
                f"without torch.no_grad() / .detach() (the trainer disables grad itself during "
                f"collection)."
            )
        if params_changed:
            old = select_rows(batch.old_log_probs, rows)
            _check_same_shape(old, logp, "old log-probs recorded at collection", self.policy)
        else:
            # Nothing has changed since collection: the behaviour policy is the current one, so
            # the ratio is exactly 1 (no rounding noise from a different batch layout).
            old = logp.detach()
        ref = select_rows(batch.ref_log_probs, rows)
        if ref is not None:
            _check_same_shape(ref, logp, "reference log-probs", self.policy)
        adv = select_rows(batch.advantages, rows)
        mask = self._loss_mask(batch, lp.mask, rows)
        if normaliser is None and self._deepspeed is not None:
            # one micro-batch per optimizer step here (see __init__): its mask is the step's
            normaliser = self.objective.normaliser(mask)
            if self.distributed is not None:
                normaliser = self.distributed.global_normaliser(normaliser, mask)
        is_weights = self._is_weights(batch, rows, old, logp, mask)
        out = self.objective(
            logp,
            old,
            adv,
            mask,
            1.0 if normaliser is None else normaliser,
            logp_ref=ref,
            entropy=lp.entropy,
            on_policy=not params_changed,
            is_weights=is_weights,
        )
        if self._deepspeed is None:
            out.loss.backward()  # type: ignore[no-untyped-call]
        else:
            self._deepspeed_backward(out.loss, boundary, step_stats)
        return out, mask, old, normaliser

    def _deepspeed_backward(self, loss: Tensor, boundary: bool, step_stats: Tensor | float) -> None:
        """``engine.backward``; at the boundary, first decide on the global loss of the step (one
        all-reduce) and record it: a non-finite one poisons the gradients so DeepSpeed skips."""
        assert self._deepspeed is not None
        poison = False
        if boundary:
            total = loss.detach() + (step_stats if isinstance(step_stats, float) else step_stats[0])
            if self.distributed is not None:
                total = self.distributed.all_reduce_sum(total.reshape(1)).reshape(())
            self._deepspeed_loss = float(total)
            poison = not math.isfinite(self._deepspeed_loss)
        self._deepspeed.backward(loss, boundary=boundary, poison=poison)

    def _is_weights(
        self, batch: ExperienceBatch, rows: Tensor | None, old: Tensor, logp: Tensor, mask: Tensor
    ) -> Tensor | None:
        """Truncated importance weights ``min(exp(logp_old - logp_sampler), cap)`` (n, T) of a
        sampler/trainer mismatch (``config.sampler_is_cap``), or None when the correction is off.
        Adds (sum of weights, capped steps) over valid steps to ``self._is_sums``."""
        cap = self.config.sampler_is_cap
        if cap is None:
            return None
        sampler = select_rows(batch.sampler_log_probs, rows)
        if sampler is None:
            raise ValueError(
                "sampler_is_cap is set but this batch has no sampler_log_probs; build it with "
                "trainer.collect(), which records them."
            )
        _check_same_shape(sampler, logp, "sampler log-probs", self.policy)
        with torch.no_grad():
            raw = torch.exp(old.detach() - sampler)
            weights = raw.clamp(max=cap)
            mf = mask.to(weights.dtype)
            sums = torch.stack([(weights * mf).sum(), ((raw > cap) * mf).sum()])
            self._is_sums = sums if self._is_sums is None else self._is_sums + sums
        return weights

    def _zero_grad(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``; for a torch optimizer that does not override
        it, the same assignments without its profiler scope (a few us per call on small policies)."""
        assert self.optimizer is not None
        if self._deepspeed is not None:
            self._deepspeed.zero_grad()
            return
        if type(self.optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _clip_and_step(self, loss: Tensor | None = None) -> float:
        """Clip the gradient norm, then step the optimizer unless the gradient or the loss is not
        finite (then record ``self._failed_update`` and leave the weights alone). Returns the
        norm before clipping.

        The norm and the loss are read to the host together (one synchronisation); the clipping
        coefficient is computed there (`grpo.optim.clip_to_norm`, bitwise torch's).
        """
        assert self.optimizer is not None
        if self._deepspeed is not None:
            norm_value, applied = self._deepspeed.step()
            if applied:
                if self.scheduler is not None:
                    self.scheduler.step()
            else:
                self._failed_update = (norm_value, self._deepspeed_loss)
            return norm_value
        if self.distributed is not None:
            # sum: each rank's loss used the global count; the loss rides in the same all-reduce,
            # so every rank decides on the global loss
            reduced = self.distributed.all_reduce_gradients(loss)
            loss = reduced if loss is not None else None
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = grad_norm(grads)
        if loss is None:
            values = [float(norm)]
        elif loss.device == norm.device and loss.dtype == norm.dtype:
            values = torch.stack([norm, loss.detach()]).tolist()
        else:
            values = [float(norm), float(loss)]
        norm_value = values[0]
        if all(math.isfinite(v) for v in values):
            clip_to_norm(grads, norm_value, self.config.max_grad_norm, norm.dtype)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        else:
            self._zero_grad()
            self._failed_update = (norm_value, values[1] if len(values) > 1 else float("nan"))
        return norm_value

    # ---- algorithm variants (issue 3) ----------------------------------------------------
    def _kl_reward_penalty(self, batch: ExperienceBatch) -> Tensor | None:
        """Per-step penalty ``kl_coeff * k(logp_old, logp_ref)`` (N, T) when the KL is folded into
        the reward (``kl_penalty='reward'``), else None. No gradient: it is part of the reward."""
        cfg = self.config
        if cfg.kl_penalty != "reward" or cfg.kl_coeff == 0 or batch.ref_log_probs is None:
            return None
        if batch.old_log_probs is None:
            raise RuntimeError("internal error: kl_penalty='reward' needs old log-probs")  # pragma: no cover
        with torch.no_grad():
            return self.objective.kl_term(batch.old_log_probs, batch.ref_log_probs).mul(cfg.kl_coeff)

    def _loss_mask(self, batch: ExperienceBatch, mask: Tensor, rows: Tensor | None) -> Tensor:
        """``mask`` without the rows of dropped zero-variance groups (``drop_zero_variance_groups``)."""
        if batch.loss_rows is None:
            return mask
        keep: Tensor = select_rows(batch.loss_rows.to(mask.device), rows)
        return mask & keep.unsqueeze(-1)

    # ---- training loop (grpo.training_loop) ---------------------------------------------
    def evaluate(self, states: Any, *, seed: int | None = None, **generate_kwargs: Any) -> dict[str, float]:
        """Mean reward of G sampled actions per state; no update, no weight change, RNGs untouched.

        Returns ``eval/reward/{mean,std,min,max}``, ``eval/reward/<component>/mean`` and
        ``time/eval`` over all ``n * G`` samples; see `grpo.training_loop.evaluate`.
        """
        from grpo.training_loop import evaluate

        return evaluate(self, states, seed=seed, **generate_kwargs)

    def train(
        self,
        states_source: Any,
        num_steps: int,
        *,
        eval_states: Any = None,
        eval_every: int | None = None,
        callbacks: Sequence[Any] = (),
        sinks: Sequence[Any] = (),
        checkpoint_dir: str | os.PathLike[str] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        progress: bool | Literal["bar", "log"] = True,
        log_every: int | None = None,
    ) -> TrainState:
        """Run steps until ``step_count == num_steps``, with progress, evaluation, sinks and checkpoints.

        Args:
            states_source: a list / Tensor of states (cycled in ``batch_size`` chunks), an
                iterable of batches such as a ``DataLoader`` (restarted each epoch), an iterator
                (used once), or a callable returning a batch (``source(batch_size)`` or ``source()``).
            num_steps: the step count at which to stop (total, counting steps already done and
                those restored by ``resume_from``).
            eval_states: states to evaluate on (`evaluate`) every ``eval_every`` steps.
            eval_every: evaluation period in steps (needs ``eval_states``).
            callbacks: `grpo.callbacks.Callback` objects (hooks on_train_start, on_step_end,
                on_eval, on_checkpoint, on_train_end).
            sinks: `grpo.metric_sinks` writers; each gets every step's record (names in
                docs/metrics.md). They are flushed, not closed, at the end.
            checkpoint_dir: save a checkpoint here every ``config.checkpoint_freq`` steps and at
                the end (requires `save_checkpoint`).
            resume_from: a checkpoint (directory) to load before training.
            progress: True = a tqdm bar on a terminal or in a notebook, periodic log lines
                otherwise; ``'bar'`` / ``'log'`` force one; False = silent. When on, the
                resolved config is printed once at the start (it is always logged).
            log_every: steps between progress log lines (default: num_steps / 20).

        Returns:
            The `grpo.training_loop.TrainState`: ``history`` (one metric dict per step),
            ``eval_history``, ``checkpoints``, ``stop_reason``.
        """
        from grpo.training_loop import train

        return train(
            self,
            states_source,
            num_steps,
            eval_states=eval_states,
            eval_every=eval_every,
            callbacks=callbacks,
            sinks=sinks,
            checkpoint_dir=checkpoint_dir,
            resume_from=resume_from,
            progress=progress,
            log_every=log_every,
        )

    # ---- reliability: non-finite containment, checkpoints (grpo/rollback.py, grpo/checkpoint.py) ----
    def _contain_non_finite(self, snapshot: UpdateSnapshot | None, grad_norm: float, loss: float) -> None:
        """Undo this step's update after a NaN/inf loss or gradient, count it, then warn or raise."""
        if snapshot is not None:
            snapshot.restore()
        self.non_finite_steps += 1
        undone = (
            "the update of this step was undone, so the weights and the optimizer state are exactly "
            "as before it"
            if self._deepspeed is None or self.config.optimizer_steps_per_step == 1
            else "DeepSpeed skipped this optimizer step; the earlier optimizer steps of this update "
            "stand (their optimizer state is partitioned over the processes)"
        )
        msg = (
            f"step {self.step_count}: the loss is {loss} and the gradient norm {grad_norm}; {undone} "
            f"({self.non_finite_steps} step(s) skipped so far). Look for NaN/inf in the policy's "
            f"log-probs or weights, or lower the learning rate."
        )
        if self.config.non_finite == "raise":
            raise FloatingPointError(msg + " (GRPOConfig(non_finite='skip') skips such steps instead.)")
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _update_or_roll_back(self, batch: ExperienceBatch) -> list[float] | None:
        """`update`, undoing its optimizer steps if it raises (e.g. a policy that returns log-probs
        of a new shape in the second epoch), so a failed step leaves the weights as they were."""
        self._rollback = None
        try:
            return self._update(batch)
        except BaseException:
            if self._rollback is not None:
                self._rollback.restore()
            raise
        finally:
            if self._rollback is not None:
                self._rollback.release()
            self._rollback = None

    def register_checkpoint_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (with ``state_dict()`` / ``load_state_dict()``) in checkpoints.

        Trainer attributes with both methods are found on their own; this is for other objects
        (e.g. a data sampler). The state dict may hold tensors and plain data, never other objects.
        """
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"register_checkpoint_state({name!r}, ...) needs an object with state_dict() and "
                f"load_state_dict(); {type(obj).__name__} lacks them."
            )
        components: dict[str, Any] = self.__dict__.setdefault("_checkpoint_components", {})
        components[name] = obj

    def save_checkpoint(self, directory: str | os.PathLike[str], *, keep_last: int | None = None) -> Path:
        """Save everything needed to resume exactly to ``directory/step-<step_count>/`` (atomic).

        Holds the policy and reference weights (safetensors), optimizer and scheduler state, every
        RNG stream, step counters, stateful components and the config (JSON); see
        `grpo.checkpoint`. Keeps the newest ``keep_last`` checkpoints (None =
        ``config.checkpoint_keep_last``, itself None = keep all). Returns the checkpoint's path.
        """
        keep = self.config.checkpoint_keep_last if keep_last is None else keep_last
        self._refuse_under_deepspeed("save_checkpoint")
        return main_process_only(  # under torchrun rank 0 writes, the other ranks wait for it
            lambda: checkpoint.save_checkpoint(self, directory, keep_last=keep),
            Path(directory) / f"step-{self.step_count:08d}",
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Restore this trainer (built with the same objects and config) from ``path``: a directory
        given to `save_checkpoint` (its newest complete checkpoint is used) or one checkpoint.
        Never unpickles. Returns the checkpoint loaded."""
        self._refuse_under_deepspeed("load_checkpoint")
        loaded = checkpoint.load_checkpoint(self, path)
        reseed_other_ranks(self.config.seed, self.step_count)  # ranks > 0: their own RNG streams
        return loaded

    @property
    def deepspeed_stage(self) -> int | None:
        """The DeepSpeed ZeRO stage (1, 2 or 3) when DeepSpeed runs the backward pass and optimizer
        step (``GRPOConfig.deepspeed``), else None."""
        return None if self._deepspeed is None else self._deepspeed.stage

    def gathered_weights(self) -> contextlib.AbstractContextManager[None]:
        """A context manager within which the policy's weights (and those of the reference copy)
        hold their full values on every rank: under DeepSpeed ZeRO-3 each rank otherwise keeps
        only its partition (every rank must enter it: it all-gathers). A no-op otherwise. For
        reading (comparing, exporting); changes made inside are discarded."""
        if self._deepspeed is None:
            return contextlib.nullcontext()
        return self._deepspeed.gathered()

    def _refuse_under_deepspeed(self, what: str) -> None:
        if self._deepspeed is not None:
            raise NotImplementedError(
                f"GRPOTrainer.{what} is not supported with DeepSpeed ZeRO: the optimizer state is "
                f"partitioned over the processes, and the trainer's checkpoint holds one optimizer "
                f"state. Save the model itself (e.g. CausalLMPolicy.save_pretrained, as grpo-train "
                f"does), or train without DeepSpeed (GRPOConfig(deepspeed='off')) to get resumable "
                f"checkpoints."
            )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        policy: PolicyModel,
        reward_model: RewardModel | Any,
        reference_policy: PolicyModel | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> GRPOTrainer:
        """A trainer with the checkpoint's config, built around ``policy`` / ``reward_model`` (and
        the optional reference policy and optimizer, as in the constructor), then restored from it."""
        saved = checkpoint.read_checkpoint_config(path)
        known = {f.name for f in dataclasses.fields(GRPOConfig)}
        unknown = sorted(set(saved) - known)
        if unknown:
            raise checkpoint.CheckpointError(
                f"the checkpoint's config has fields {unknown} that this version of GRPOConfig does not "
                f"know; load it with the grpo version that saved it."
            )
        trainer = cls(GRPOConfig(**saved), policy, reward_model, reference_policy, optimizer)
        trainer.load_checkpoint(path)
        return trainer


def _moved(obj: Any, device: torch.device) -> Any:
    """``obj.to(device)``, keeping ``obj`` when ``to`` returns None (moved in place)."""
    moved = obj.to(device)
    return obj if moved is None else moved


def _group_slice(order: Tensor | None, start: int, size: int) -> Tensor | None:
    """Groups of one optimizer step: ``order[start:start+size]``, or None = all groups."""
    return None if order is None else order[start : start + size]


def _count(groups: Tensor | None, num_groups: int) -> int:
    return num_groups if groups is None else int(groups.shape[0])


def _sub(groups: Tensor | None, start: int, size: int, num_groups: int) -> Tensor | None:
    """Groups of one micro-batch inside an optimizer step's groups (None = all groups)."""
    if groups is None:
        if start == 0 and size >= num_groups:
            return None
        return torch.arange(start, min(start + size, num_groups))
    return groups[start : start + size]


def _rows_of(
    batch: ExperienceBatch, groups: Tensor | None, group_size: int | None, device: torch.device
) -> Tensor | None:
    """Flat rows of ``groups`` (in group order), or None = all rows."""
    if groups is None:
        return None
    if group_size is not None:
        rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()
        return rows.to(device)
    return torch.isin(batch.group_ids, groups.to(batch.group_ids.device)).nonzero().flatten()


def _check_same_shape(expected: Tensor | None, logp: Tensor, what: str, policy: object) -> None:
    if expected is None:
        raise RuntimeError(f"internal error: {what} were not recorded")  # pragma: no cover
    if expected.shape != logp.shape:
        raise ValueError(
            f"{type(policy).__name__} returned log-probs of shape {tuple(logp.shape)} during the "
            f"update but {what} have shape {tuple(expected.shape)}; the number of steps T of an "
            f"action must not change between calls."
        )
