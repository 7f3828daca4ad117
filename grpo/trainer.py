"""`GRPOTrainer`: one ``step(states)`` = collect, advantages, update, counters, metrics, watchers.

`GRPOTrainer.step` reads as the numbered pipeline; each line calls one part with one job, in the
file named after it (1. grpo/experience_collector.py, 2. grpo/advantage_estimator.py, 3.
grpo/update/ over the backend of grpo/engine/, 5. grpo/metrics/, 6.-7. grpo/training/). It composes
the parts and holds the state they share (step count, RNG); no math of its own (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import torch
from torch import Tensor

from grpo.advantage_estimator import AdvantageEstimator, AdvantageFn, Advantages
from grpo.algorithms.kl import KLFn
from grpo.algorithms.loss_plugins import loss_plugin
from grpo.algorithms.policy_losses import PolicyLossFn
from grpo.config import GRPOConfig
from grpo.engine.backends import Backend
from grpo.engine.lr_schedules import warn_short_schedule
from grpo.engine.setup import batch_size_problem, check_lockstep, refresh_reference, setup_trainer
from grpo.experience_collector import ExperienceBatch, ExperienceCollector
from grpo.generation.async_rollouts import PrefetchingEngine
from grpo.generation.engine import GenerationEngine, engine_metrics
from grpo.generation.setup import check_engine, make_engine
from grpo.grpo_objective import GRPOObjective
from grpo.metrics import StepCounts, empty_extremes_as_nan
from grpo.policy_base import PolicyModel, has_method
from grpo.reward_model_base import RewardModel
from grpo.rollout.action_stats import action_metrics, success_metrics
from grpo.rollout.dynamic_sampling import MoreStates
from grpo.runtime.threads import step_numerics
from grpo.state.trainer_state import TrainerStateMixin
from grpo.training.loop import TrainingLoopMixin
from grpo.training.reward_shift import RewardShiftRestart
from grpo.training.stall_watch import StallWatch
from grpo.update.adaptive_lr import AdaptiveLR
from grpo.update.guard import UpdateGuard
from grpo.update.loop import FusedLoss, run_update
from grpo.update.plan import UpdateDecisions, UpdatePlan
from grpo.update.setup import make_plan, make_update_parts

__all__ = ["GRPOConfig", "GRPOTrainer"]

logger = logging.getLogger(__name__)


class GRPOTrainer(TrainerStateMixin, TrainingLoopMixin):
    """Trains any `PolicyModel` against any `RewardModel` with GRPO.

    Args:
        config: a `GRPOConfig`.
        policy: the policy to train (any object with the `PolicyModel` methods).
        reward_model: a `RewardModel`, or a plain callable ``f(states, actions) -> (N,) rewards``.
        reference_policy: the policy the KL term pulls towards (used only when
            ``config.kl_coeff > 0``). Default: the one the policy offers through its optional
            ``policy.reference_policy()`` hook (a LoRA `grpo.llm.CausalLMPolicy`: its model with
            the adapter disabled, no second copy), else a frozen copy of the starting policy
            (DeepSeekMath). `grpo.engine.setup` describes the refresh hooks.
        optimizer: a torch optimizer over the policy's parameters. Default: AdamW with
            ``config.learning_rate`` over ``policy.get_parameters()`` (`grpo.engine.optim.default_optimizer`:
            the fused implementation where torch has one).
        advantage_fn: replaces the baseline/scale step of the advantage
            (`grpo.advantage_estimator.AdvantageFn`); no subclassing needed.
        loss_fn: replaces the per-step policy loss (`grpo.algorithms.policy_losses.PolicyLossFn`).
        kl_fn: replaces the KL estimator (`grpo.algorithms.kl.KLFn`).
    """

    last_batch: ExperienceBatch | None = None
    """The last step's batch (None before the first step), kept for callbacks such as
    `grpo.training.completions_table.CompletionsTable` until the next step replaces it."""
    last_advantages: Advantages | None = None
    """The last step's advantages (``values`` (N,) or (N, T)), kept with `last_batch`."""

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
        engine: GenerationEngine | None = None,
    ) -> None:
        super().__init__()
        self.config = config = dataclasses.replace(config)  # its own copy, which the parts read live
        run = setup_trainer(config, policy, reward_model, reference_policy, optimizer)  # grpo/engine/setup.py
        self.device, self.distributed = run.device, run.distributed  # distributed: None on one process
        self.policy, self.reward_model = run.policy, run.reward_model
        self.reference_policy = run.reference_policy  # the KL term's (None without one)
        self.params, self.optimizer, self.scheduler = run.params, run.optimizer, run.scheduler
        self.backend: Backend | None = run.backend  # owns the optimizer step; None: nothing to train
        self.step_threads, self._advantage_dtype = run.step_threads, run.advantage_dtype
        self.generator = torch.Generator().manual_seed(0 if config.seed is None else config.seed)
        self.advantage_estimator: AdvantageEstimator = AdvantageEstimator.from_config(config, advantage_fn)
        self.plan = self._plan()
        self.collector = ExperienceCollector.from_config(
            config,
            self.policy,
            self.reward_model,
            self.device,
            self.reference_policy,
            make_engine(config, self.policy, engine),
        )
        prefetching = self.collector.engine
        self.async_rollouts = prefetching if isinstance(prefetching, PrefetchingEngine) else None
        """Async rollouts' engine (``async_staleness >= 1``; component ``"async_rollouts"``) or None."""
        self.dynamic_sampling = self.collector.draws if config.max_sampling_draws > 1 else None
        """Dynamic sampling's draw counter (``max_sampling_draws > 1``; checkpointed) or None."""
        self.objective = GRPOObjective.from_config(config, loss_fn=loss_fn, kl_fn=kl_fn)
        self.guard: UpdateGuard = UpdateGuard(config.non_finite)
        self.fused_loss = self._fused_loss()  # use_liger_loss, checked even with nothing to train
        self._update = make_update_parts(config, run, self.objective, self.plan, self.guard, self.fused_loss)
        self.step_count = 0
        self._closed = self._warned_nothing_to_train = self._warned_batch_size = False
        check_engine(config, self.collector.engine, self.policy, self.distributed)  # generation/setup.py
        if self.collector.engine.owns_weights:
            self.sync_engine()  # the initial weights, version 0
        self.stall_watch = StallWatch.from_config(config, self.optimizer, self.scheduler)  # stall_watch.py
        warn_short_schedule(config, self.scheduler)
        self.reward_shift = RewardShiftRestart.from_config(config, run)  # step 7, or None; checkpointed

    def _plan(self) -> UpdatePlan:
        """The update's plan (`grpo.update.setup.make_plan`); old log-probs first: KL reward, mask, shift."""
        cfg = self.config
        kl_in_reward = self._kl_in_reward = cfg.kl_penalty == "reward" and cfg.kl_coeff > 0
        old_before = kl_in_reward or self.advantage_estimator.needs_mask or cfg.reward_shift_z is not None
        return make_plan(cfg, self.backend, self.generator, old_before_update=old_before)

    def _fused_loss(self) -> FusedLoss | None:
        """``GRPOConfig.use_liger_loss``: Liger's fused GRPO loss (the loss plugin ``"liger"``,
        `grpo.llm.liger.LigerGRPOLoss`) on the policy's ``lm_head_inputs``, or None. Here the
        policy and user loss functions; building it checks the config's settings (ValueError) and
        the package (ImportError)."""
        if not self.config.use_liger_loss:
            return None
        if self.objective.loss_fn is not None or self.objective.kl_fn is not None:
            raise ValueError(
                "GRPOConfig(use_liger_loss=True) computes Liger's built-in loss and KL, so a custom "
                "loss_fn / kl_fn would be ignored; drop them or set use_liger_loss=False."
            )
        if not has_method(self.policy, "lm_head_inputs"):
            raise TypeError(
                f"GRPOConfig(use_liger_loss=True) needs the policy's last hidden states and LM head: "
                f"{type(self.policy).__name__} has no lm_head_inputs(actions) -> "
                f"grpo.llm.policy.LMHeadInputs (grpo.llm.CausalLMPolicy has it). Set "
                f"use_liger_loss=False for this policy."
            )
        plugin = loss_plugin("liger")  # registered by grpo.llm.liger (import grpo.llm)
        if plugin is None:
            raise ImportError(
                "GRPOConfig(use_liger_loss=True): Liger's loss is registered by grpo.llm, which is not "
                "imported; import grpo.llm (pip install liger-kernel too) or set use_liger_loss=False."
            )
        fused: FusedLoss = plugin.build(self.config, self.device)  # ImportError names liger-kernel
        return fused

    @property
    def adaptive_lr(self) -> AdaptiveLR | None:
        """``config.adaptive_lr_kl``'s controller (`grpo.update.adaptive_lr`); None: off or untrained."""
        return None if self._update is None else self._update.adaptive_lr

    # ---- the step -----------------------------------------------------------------------
    def step(
        self, states: Any, *, more_states: MoreStates | None = None, **generate_kwargs: Any
    ) -> dict[str, float]:
        """One GRPO step on ``states`` (B states: a sequence, or a Tensor (B, ...)), or on an
        `ExperienceBatch` collected elsewhere (`train_on_batch`); ``more_states() -> states | None``
        feeds dynamic sampling's back-fill (``max_sampling_draws > 1``). Returns float metrics
        (docs/metrics.md). Runs with subnormals flushed (``flush_denormals``) and ``step_threads``
        intra-op threads (`grpo.runtime.threads.step_numerics`), restored afterwards.
        """
        self._note_batch_size(states)
        with step_numerics(self.config.flush_denormals, self.step_threads):
            t0 = time.perf_counter()
            lr = self._learning_rate()  # optim/lr: the rate this step's first optimizer step uses
            self.check_lockstep(states)
            states = self._checked(states)
            decisions = self.plan.decide(_num_groups(states))  # the update's shortcuts, decided once
            batch = self._collect(states, decisions, generate_kwargs, more_states)  # 1. the rollout
            adv = self.advantages(batch)  # 2. group-relative advantages and reward statistics
            t1 = time.perf_counter()
            update, valid_steps = self._run_update(batch, adv, decisions)  # 3. the update
            t2 = time.perf_counter()
            self._count_step()  # 4. the step counter; the reference refreshed every N steps
            metrics = self._metrics(batch, adv, update, valid_steps, (t0, t1, t2), lr)  # 5. reduced
            metrics = self.stall_watch.observe(metrics)  # 6. StallWarning when learning has stalled
            return self._observe_reward_shift(batch, adv, metrics)  # 7. restart on a changed task

    def train_on_batch(self, batch: ExperienceBatch) -> dict[str, float]:
        """One GRPO step on groups collected elsewhere (logs, a real robot, another sampler):
        `step` with ``batch`` in place of its collection.

        ``batch``: from `ExperienceBatch.from_groups` (validated there) or `collect`. Missing
        reference log-probs are computed when a KL term needs them. Without behaviour log-probs
        the current policy's before the update stand in (ratio 1 in the first optimizer step:
        exact on-policy, an approximation off-policy). Fed `step`'s own batch, the update is
        bitwise `step`'s.
        """
        if not isinstance(batch, ExperienceBatch):
            raise TypeError(
                f"train_on_batch expects an ExperienceBatch, got {type(batch).__name__}; build one "
                f"with grpo.ExperienceBatch.from_groups(states, actions, rewards, group_size=G)."
            )
        return self.step(batch)

    def _collect(
        self, states: Any, decisions: UpdateDecisions, kwargs: dict[str, Any], more: MoreStates | None
    ) -> ExperienceBatch:
        """Step 1: the rollout of ``states``, recording behaviour log-probs only when the update
        needs them before its forwards; a batch collected elsewhere is completed instead."""
        old = decisions.old_at_collection
        if isinstance(states, ExperienceBatch):
            if kwargs or more is not None:
                got = sorted(kwargs) + (["more_states"] if more is not None else [])
                raise TypeError(f"step(batch) takes no generate kwargs or more_states, got {got}.")
            return self.collector.complete(states, old=states.old_log_probs is None and old)
        return self.collector.collect_for_update(states, kwargs, record_old=old, more_states=more)

    def _checked(self, states: Any) -> Any:
        """``states`` as the collector takes them (a batch as it is), or a clear error."""
        return states if isinstance(states, ExperienceBatch) else self.collector.checked_states(states)

    def _count_step(self) -> None:
        """Step 4: count the step; refresh the reference every ``reference_update_freq`` steps;
        hand the generation engine the new weights (version = the step count)."""
        self.step_count += 1
        freq = self.config.reference_update_freq
        if freq is not None and self.step_count % freq == 0:
            self.refresh_reference()
        self.sync_engine()

    def sync_engine(self) -> None:
        """Give the generation engine the policy's weights, tagged with ``step_count`` (after each
        update, a checkpoint's load, a restart; nothing moves for the in-process engine)."""
        self.collector.engine.sync(self.policy, self.step_count)

    def prefetch(self, states: Any) -> None:
        """Async rollouts: submit the generation of ``states`` now, for a later ``step(states)`` with
        the same object (`train` calls it k steps ahead; `grpo.generation.async_rollouts`)."""
        if self.async_rollouts is None:
            raise RuntimeError(
                "prefetch() needs async rollouts: GRPOConfig(async_staleness=K >= 1) with an engine "
                "that owns its weights (generation_engine='worker' or 'vllm')."
            )
        self.async_rollouts.prefetch(self._checked(states), self.config.group_size)

    def discard_prefetched(self) -> int:
        """Wait for and drop the generations `prefetch` submitted that no step took; how many."""
        return 0 if self.async_rollouts is None else self.async_rollouts.discard_pending()

    def _metrics(
        self,
        batch: ExperienceBatch,
        adv: Advantages,
        update: dict[str, float],
        valid_steps: float,
        times: tuple[float, float, float],
        lr: float | None,
    ) -> dict[str, float]:
        """Step 5: the step's metrics, in one place: the advantages' and the update's, the actions'
        lengths (``completion/*``, when they report them: `grpo.rollout.action_stats`), the
        learning rate ``lr`` read as the step began, the timings and the step count, reduced over
        processes (``times``: the step's start, the update's start and end). Keeps the batch and
        advantages as `last_batch` / `last_advantages`."""
        t0, t1, t2 = times
        self.last_batch, self.last_advantages = batch, adv
        metrics = adv.metrics() | update | action_metrics(batch.actions) | success_metrics(batch.actions)
        metrics |= engine_metrics(self.collector.engine, batch.policy_versions, self.step_count - 1)
        metrics |= batch.sampling  # sampling/* with dynamic sampling
        if lr is not None:
            metrics["optim/lr"] = lr
        metrics.update({f"time/{k}": v for k, v in batch.timings.items()})
        metrics["time/update"] = t2 - t1
        metrics["time/step"] = time.perf_counter() - t0
        metrics["step"] = float(self.step_count)
        if self.backend is not None:
            counts = StepCounts(float(batch.num_samples), float(batch.num_groups), valid_steps)
            metrics = self.backend.reduce_metrics(metrics, counts)
        return empty_extremes_as_nan(metrics)  # an update without a valid step has no ratio

    def _learning_rate(self) -> float | None:
        """The first parameter group's learning rate now (None without an optimizer)."""
        return None if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])

    def _note_batch_size(self, states: Any) -> None:
        """Warn once when ``step`` gets another number of states than ``config.batch_size``."""
        problem = None if self._warned_batch_size else batch_size_problem(states, self.config.batch_size)
        if problem is not None:
            self._warned_batch_size = True
            warnings.warn(problem, UserWarning, stacklevel=3)

    def _observe_reward_shift(
        self, batch: ExperienceBatch, adv: Advantages, metrics: dict[str, float]
    ) -> dict[str, float]:
        """Step 7 (``config.reward_shift_z``): the restart rule reads the step (`grpo.training.
        reward_shift.RewardShiftRestart.observe_step`); the engine gets the weights it may change."""
        if self.reward_shift is None:
            return metrics
        metrics = self.reward_shift.observe_step(metrics, batch, adv)
        self.sync_engine()  # a restart (or its undoing) may have changed the weights
        return metrics

    def _run_update(
        self, batch: ExperienceBatch, adv: Advantages, decisions: UpdateDecisions
    ) -> tuple[dict[str, float], float]:
        """Step 3 (`grpo.update.loop.run_update`): the update's metrics and valid steps."""
        if self._update is None:
            if not self._warned_nothing_to_train:
                warnings.warn(
                    f"policy {type(self.policy).__name__}.get_parameters() returned no tensor that "
                    "requires grad and no optimizer was given: nothing is trained. Reward and "
                    "advantage metrics are still reported. Return the policy's trainable tensors "
                    "from get_parameters() to train it.",
                    UserWarning,
                    stacklevel=4,
                )
                self._warned_nothing_to_train = True
            return {}, 0.0
        return run_update(self._update, batch, adv.values, adv.keep, decisions, self.step_count)

    def check_lockstep(self, states: Any) -> None:
        """Refuse to step a closed trainer, and different numbers of states on the ranks where every
        forward gathers partitioned weights (`grpo.engine.setup.check_lockstep`: DeepSpeed ZeRO-3)."""
        if self._closed:
            raise RuntimeError(
                "this trainer was closed (close / grpo.engine.distributed.shutdown); build a new one"
            )
        check_lockstep(self.distributed, self.backend, lambda: _num_groups(states))

    # ---- the parts, one at a time ----------------------------------------------------------
    def collect(self, states: Any, **generate_kwargs: Any) -> ExperienceBatch:
        """Rollout only: G actions per state, rewards, behaviour log-probs (always recorded here;
        `step` skips them when its update takes them from its first forwards) and reference
        log-probs when a KL term is on."""
        return self.collector.collect(states, **generate_kwargs)

    def advantages(self, batch: ExperienceBatch) -> Advantages:
        """The batch's group-relative advantages and reward statistics (the batch is not changed).
        The advantages are float32, or float64 when the policy has a float64 weight."""
        return self.advantage_estimator.of_batch(
            batch,
            weights=getattr(self.reward_model, "reward_weights", None),
            kl_penalty=self._kl_reward_penalty(batch),
            dtype=self._advantage_dtype,
            count_dropped=self.config.invalid_rewards == "drop_groups",
        )

    def update(self, batch: ExperienceBatch, advantages: Advantages) -> dict[str, Tensor]:
        """Optimise the policy on ``batch`` with ``advantages`` (from `advantages`). Returns the
        update's statistics (empty when nothing is trained). Does not count a step."""
        if not isinstance(advantages, Advantages):
            raise TypeError(
                f"update(batch, advantages) needs the Advantages of trainer.advantages(batch), got "
                f"{type(advantages).__name__}."
            )
        with step_numerics(self.config.flush_denormals, self.step_threads):
            decisions = self.plan.decide(batch.num_groups)
            update, _ = self._run_update(self._collect(batch, decisions, {}, None), advantages, decisions)
        return {k: torch.tensor(v, device=self.device) for k, v in update.items()}

    def _kl_reward_penalty(self, batch: ExperienceBatch) -> Tensor | None:
        """Per-step penalty ``kl_coeff * k(logp_old, logp_ref)`` (N, T) when the KL is folded into
        the reward (``kl_penalty='reward'``), else None. No gradient: it is part of the reward."""
        if not self._kl_in_reward or batch.ref_log_probs is None:
            return None
        if batch.old_log_probs is None:
            raise ValueError(
                "kl_penalty='reward' needs the batch's old log-probs; build it with trainer.collect()."
            )
        with torch.no_grad():
            return self.objective.kl_term(batch.old_log_probs, batch.ref_log_probs).mul(self.config.kl_coeff)

    def refresh_reference(self) -> None:
        """Copy the current policy's weights into the reference policy."""
        self.reference_policy = refresh_reference(self.policy, self.reference_policy, self.backend)
        self.collector.reference_policy = self.reference_policy

    def close(self) -> None:
        """Release the backend's (`grpo.engine.backends.Backend.close`) and the generation engine's
        resources; no step afterwards, closing twice is a no-op (`grpo.engine.distributed.shutdown`)."""
        if not self._closed:
            if self.backend is not None:
                self.backend.close()
            self.collector.engine.close()
        self._closed = True


def _num_groups(states: Any) -> int:
    """B: the number of states (or of a batch's groups)."""
    return states.num_groups if isinstance(states, ExperienceBatch) else len(states)
