"""`GRPOTrainer`: one ``step(states)`` = collect, advantages, update, counters, metrics, watchers.

`GRPOTrainer.step` reads as the pipeline; each line is one part with one job, in the file named
after it::

    decisions = plan.decide(B)                  #    grpo/update/plan.py, once per step
    batch = collector.collect(states)           # 1. grpo/experience_collector.py
    adv   = self.advantages(batch)              # 2. grpo/advantage_estimator.py
    update = run_update(parts, batch, adv, ...) # 3. grpo/update/loop.py over grpo/update/plan.py,
                                                #    the backend (grpo/engine/) and grpo/update/guard.py
    step_count += 1; maybe refresh reference    # 4.
    metrics = backend.reduce_metrics(...)       # 5. grpo/metrics/
    stall_watch.observe(metrics)                # 6. grpo/training/stall_watch.py
    reward_shift.observe(metrics)               # 7. grpo/training/reward_shift.py

The trainer composes the parts and holds the state they share (step count, RNG generator); it
has no math of its own (the loss is `grpo.grpo_objective`). docs/architecture.md is the map.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from grpo.advantage_estimator import (
    AdvantageEstimator,
    AdvantageFn,
    Advantages,
    advantage_dtype,
    with_statistics,
)
from grpo.algorithms.kl import KLFn
from grpo.algorithms.loss_plugins import loss_plugin
from grpo.algorithms.policy_losses import PolicyLossFn
from grpo.config import GRPOConfig
from grpo.engine.backends import Backend
from grpo.engine.lr_schedules import schedule_length_problem
from grpo.engine.setup import (
    checked_inputs,
    join_processes,
    make_backend,
    make_reference,
    offered_reference,
    reference_module,
    refresh_reference,
)
from grpo.experience_collector import ExperienceBatch, ExperienceCollector, evaluate_log_probs
from grpo.generation.async_rollouts import PrefetchingEngine
from grpo.generation.engine import GenerationEngine, engine_metrics
from grpo.generation.setup import make_engine
from grpo.grpo_objective import GRPOObjective
from grpo.metrics import StepCounts, empty_extremes_as_nan
from grpo.policy_base import EntropyRequest, PolicyModel, has_method, set_training_mode
from grpo.reward_model_base import RewardModel
from grpo.rollout.action_stats import action_metrics, success_metrics
from grpo.rollout.dynamic_sampling import DRAWS_COMPONENT, MoreStates
from grpo.runtime.denormals import flush_denormals_on, restore_denormals
from grpo.runtime.threads import describe, intra_op_threads, policy_elements, resolve_num_threads
from grpo.state.trainer_state import TrainerStateMixin
from grpo.training.reward_shift import RewardShiftRestart, incumbent_advantages
from grpo.training.stall_watch import StallWatch
from grpo.update.adaptive_lr import AdaptiveLR
from grpo.update.guard import UpdateGuard
from grpo.update.loop import FusedLoss, UpdateParts, run_update
from grpo.update.plan import UpdateDecisions, UpdatePlan

if TYPE_CHECKING:
    from grpo.training.evaluation import EvalOptions
    from grpo.training.loop import TrainState

__all__ = ["GRPOConfig", "GRPOTrainer"]

logger = logging.getLogger(__name__)


class GRPOTrainer(TrainerStateMixin):
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
        reward = checked_inputs(config, policy, reward_model, reference_policy)
        self.config = config
        self.device, self.distributed = join_processes(config)  # distributed: None on one process
        self.generator = torch.Generator().manual_seed(0 if config.seed is None else config.seed)
        self.policy: PolicyModel = _moved(policy, self.device)
        self.reward_model: RewardModel = _moved(reward, self.device)
        reference_policy = offered_reference(config, self.policy, reference_policy)  # LoRA: no copy
        copy_reference = config.kl_coeff > 0 and reference_policy is None
        setup = make_backend(  # owns the optimizer step (and shards the policy when it partitions weights)
            config, self.policy, self.device, self.distributed, optimizer, copy_reference=copy_reference
        )
        self.params, self.optimizer, self.scheduler = setup.params, setup.optimizer, setup.scheduler
        self.backend: Backend | None = setup.backend
        self.reference_policy = make_reference(
            config, self.policy, reference_policy, self.device, self.backend, setup.reference_copy
        )

        self.advantage_estimator = AdvantageEstimator.from_config(config, advantage_fn)
        self._choose_numerics()
        self._kl_in_reward = config.kl_penalty == "reward" and config.kl_coeff > 0
        self.plan = UpdatePlan(
            num_epochs=config.num_epochs_per_update,
            mini_batch_size=config.resolved_mini_batch_size,
            micro_batch_size=config.resolved_micro_batch_size,
            old_before_update=(  # read before the update: a KL in the reward, a mask, the shift check
                self._kl_in_reward or self.advantage_estimator.needs_mask or config.reward_shift_z is not None
            ),
            rescales_gradients=self.backend is None or self.backend.rescales_gradients,
            generator=self.generator,
        )
        self.collector = ExperienceCollector.from_config(
            config, self.policy, self.reward_model, self.device, self.reference_policy,
            make_engine(config, self.policy, engine),
        )  # fmt: skip
        self.objective = GRPOObjective.from_config(config, loss_fn=loss_fn, kl_fn=kl_fn)
        self.guard: UpdateGuard = UpdateGuard(config.non_finite)
        self._update = self._update_parts()
        self.step_count = 0
        self._closed = self._warned_nothing_to_train = self._warned_batch_size = False
        self._checkpoint_components: dict[str, Any] = {}
        self._register_draws()  # dynamic sampling: train() resumes its source after the extra draws
        self._start_engine()  # the sampler's log-probs are reported; an own-weights engine synced
        self.stall_watch = StallWatch.from_config(config, self.optimizer, self.scheduler)  # stall_watch.py
        self._check_schedule_length()
        self.reward_shift = self._make_reward_shift()  # step 7 (config.reward_shift_z), or None

    def _register_draws(self) -> None:
        """With dynamic sampling (``config.max_sampling_draws`` > 1) the batches drawn beyond one
        a step are checkpointed (`grpo.rollout.dynamic_sampling.DrawCounter`); refused under
        torchrun, whose ranks would draw different numbers of batches."""
        draws = self.config.max_sampling_draws
        if draws == 1:
            return
        if self.distributed is not None:
            raise ValueError(
                f"GRPOConfig(max_sampling_draws={draws}) back-fills each process's batch with its own "
                f"number of draws, which torchrun's ranks cannot keep in step; use "
                f"max_sampling_draws=1 under torchrun."
            )
        self._checkpoint_components[DRAWS_COMPONENT] = self.collector.draws

    def _make_reward_shift(self) -> RewardShiftRestart | None:
        """The restart on a reward shift (`grpo.training.reward_shift`); its state (the starting
        weights too) is checkpointed."""
        shard = self.backend is not None and not self.backend.local_weights  # FSDP, DeepSpeed
        watch = RewardShiftRestart.from_config(
            self.config, self.params, sharded=shard, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if watch is not None:
            self._checkpoint_components["reward_shift"] = watch
        return watch

    def _choose_numerics(self) -> None:
        """The advantages' dtype (float64 for float64 weights: their update is not computed from
        float32-rounded advantages) and the intra-op threads of each step (one for a small CPU
        policy by default, `grpo.runtime.threads`)."""
        trained = self.optimizer.param_groups if self.optimizer is not None else []
        weights = [*self.params, *(p for g in trained for p in g["params"])]
        self._advantage_dtype = advantage_dtype(weights)
        elements = policy_elements(self.policy, weights)
        cfg = self.config
        self.step_threads = resolve_num_threads(cfg.num_threads, device=self.device, elements=elements)
        logger.info(describe(cfg.num_threads, self.step_threads, device=self.device, elements=elements))

    def _update_parts(self) -> UpdateParts | None:
        """The parts of the update (None when there is nothing to train)."""
        self.fused_loss = self._fused_loss()  # use_liger_loss, checked even with nothing to train
        if self.backend is None or self.optimizer is None:
            return None
        return UpdateParts(
            self.policy, self.objective, self.plan, self.backend, self.guard, self.params, self.optimizer,
            self.scheduler, self.device, self._entropy_request(), self.config.effective_sampler_is_cap,
            AdaptiveLR.from_config(self.config, self.scheduler), self.fused_loss,
            self.config.sampler_correction,
        )  # fmt: skip

    def _entropy_request(self) -> EntropyRequest:
        """The exact entropy from ``evaluate_actions``: differentiable only when the loss trains it."""
        if not has_method(self.policy, "evaluate_actions"):
            return False
        return True if self.config.entropy_coeff != 0 else "no_grad"

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

    def _start_engine(self) -> None:
        """The sampler's log-probs must come from somewhere: an engine with its own weights
        reports them (and gets the initial weights now, version 0); the in-process one asks the
        policy's ``generate_actions_with_log_probs``. With async rollouts the generations drawn
        ahead are checkpointed (component ``"async_rollouts"``)."""
        cap = self.config.sampler_is_cap
        engine = self.collector.engine
        if engine.owns_weights and self.distributed is not None:
            engine.close()
            raise ValueError(
                f"GRPOConfig(generation_engine={self.config.generation_engine!r}) generates on one "
                f"process; under torchrun ({self.distributed.world_size} processes) use "
                f"generation_engine='hf' and async_staleness=0."
            )
        if isinstance(engine, PrefetchingEngine):
            self._checkpoint_components["async_rollouts"] = engine
        if engine.owns_weights:
            self.sync_engine()
            return
        if cap is not None and not has_method(self.policy, "generate_actions_with_log_probs"):
            raise TypeError(
                f"GRPOConfig(sampler_is_cap={cap}) corrects a sampler/trainer mismatch, so the policy "
                f"must report its sampler's log-probs: {type(self.policy).__name__} has no "
                f"generate_actions_with_log_probs(states, G) -> (actions, log_probs). Add it, or set "
                f"sampler_is_cap=None."
            )

    def _check_schedule_length(self) -> None:
        """Warn when a decaying schedule ends within a few trainer steps (total_steps counts
        optimizer steps; `grpo.engine.lr_schedules.schedule_length_problem`)."""
        cfg = self.config
        if self.scheduler is None:
            return
        problem = schedule_length_problem(cfg.lr_schedule, cfg.total_steps, cfg.optimizer_steps_per_step)
        if problem is not None:
            warnings.warn(problem, UserWarning, stacklevel=3)

    def _reference_module(self) -> Any:
        return reference_module(self.reference_policy, self.backend)

    @property
    def adaptive_lr(self) -> AdaptiveLR | None:
        """The controller of ``config.adaptive_lr_kl`` (`grpo.update.adaptive_lr`); None when off
        or when nothing is trained."""
        return None if self._update is None else self._update.adaptive_lr

    @property
    def non_finite_steps(self) -> int:
        """Steps whose update was undone because the loss or the gradient was NaN/inf."""
        return int(self.guard.non_finite_steps)

    @non_finite_steps.setter
    def non_finite_steps(self, value: int) -> None:
        self.guard.non_finite_steps = value

    # ---- the step -----------------------------------------------------------------------
    def step(
        self, states: Any, *, more_states: MoreStates | None = None, **generate_kwargs: Any
    ) -> dict[str, float]:
        """One GRPO step on ``states`` (a sequence of B states, or a Tensor (B, ...)), or on an
        `ExperienceBatch` collected elsewhere (see `train_on_batch`). ``more_states``: a callable
        returning another batch of states (None when it has no more), from which dynamic sampling
        (``config.max_sampling_draws`` > 1) back-fills the groups whose rewards are all equal.

        Returns float metrics (names and meanings in docs/metrics.md, declared in
        `grpo.metrics`). With ``config.flush_denormals`` (default) the step runs with subnormal
        floats flushed to zero on CPU (`grpo.runtime.denormals`), and with ``step_threads``
        intra-op threads (``config.num_threads``: one for a small CPU policy by default,
        `grpo.runtime.threads`); both settings are restored afterwards.
        """
        self._note_batch_size(states)
        with self._numerics():
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

        ``batch``: an `ExperienceBatch` from `ExperienceBatch.from_groups` (validated there) or
        from `collect`. Missing reference log-probs are computed when a KL term needs them.
        Without behaviour log-probs (``old_log_probs``) the actions are taken as sampled by the
        current policy: its log-probs before the update are the behaviour log-probs (ratio 1 in
        the first optimizer step), which is exact for on-policy data and an approximation for
        off-policy data. Fed `step`'s own batch, the update is bitwise the same as `step`'s.
        """
        if not isinstance(batch, ExperienceBatch):
            raise TypeError(
                f"train_on_batch expects an ExperienceBatch, got {type(batch).__name__}; build one "
                f"with grpo.ExperienceBatch.from_groups(states, actions, rewards, group_size=G)."
            )
        return self.step(batch)

    def _collect(
        self,
        states: Any,
        decisions: UpdateDecisions,
        generate_kwargs: dict[str, Any],
        more_states: MoreStates | None = None,
    ) -> ExperienceBatch:
        """Step 1: the rollout of ``states``, recording behaviour log-probs only when the update
        needs them before its forwards; a batch collected elsewhere is completed instead."""
        if isinstance(states, ExperienceBatch):
            if generate_kwargs or more_states is not None:
                got = sorted(generate_kwargs) + (["more_states"] if more_states is not None else [])
                raise TypeError(f"step(batch) takes no generate kwargs or more_states, got {got}.")
            return self.collector.complete(
                states, old=states.old_log_probs is None and decisions.old_at_collection
            )
        return self.collector.collect_for_update(
            states, generate_kwargs, record_old=decisions.old_at_collection, more_states=more_states
        )

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
        """Give the generation engine (`grpo.generation`) the policy's current weights, tagged
        with ``step_count``: after each update, after a checkpoint is loaded, after a restart
        (nothing moves for the in-process engine)."""
        self.collector.engine.sync(self.policy, self.step_count)

    def prefetch(self, states: Any) -> None:
        """Async rollouts (``config.async_staleness >= 1``): submit the generation of ``states``
        now, to be taken by a later ``step(states)`` with the same object (`train` calls this k
        steps ahead; `grpo.generation.async_rollouts`)."""
        engine = self.collector.engine
        if not isinstance(engine, PrefetchingEngine):
            raise RuntimeError(
                "prefetch() needs async rollouts: GRPOConfig(async_staleness=K >= 1) with an engine "
                "that owns its weights (generation_engine='worker' or 'vllm')."
            )
        engine.prefetch(self._checked(states), self.config.group_size)

    def discard_prefetched(self) -> int:
        """Wait for and drop the generations `prefetch` submitted that no step took (the end of
        a run); returns how many. 0 without async rollouts."""
        engine = self.collector.engine
        return engine.discard_pending() if isinstance(engine, PrefetchingEngine) else 0

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
        sized = isinstance(states, (list, tuple)) or (isinstance(states, Tensor) and states.dim() > 0)
        n, b = (len(states) if sized else 0), self.config.batch_size
        if not n or n == b or self._warned_batch_size:
            return
        self._warned_batch_size = True
        warnings.warn(
            f"step() got {n} states but GRPOConfig.batch_size={b}; step() uses every state it is "
            f"given. batch_size only sets how many states train() draws per step and the arithmetic "
            f"of optimizer_steps_per_step / samples_per_step (the summary, total_steps). Warned once.",
            UserWarning,
            stacklevel=3,
        )

    def _observe_reward_shift(
        self, batch: ExperienceBatch, adv: Advantages, metrics: dict[str, float]
    ) -> dict[str, float]:
        """Step 7 (``config.reward_shift_z``): the restart rule reads the step's metrics and, while
        a restart is on probation, the incumbent's advantages in the step's groups
        (`grpo.training.reward_shift.incumbent_advantages`: one forward of the batch with the
        incumbent's weights, summed over processes)."""
        watch = self.reward_shift
        if watch is None:
            return metrics
        world = 1 if self.distributed is None else self.distributed.world_size
        sums = None
        if watch.incumbent is not None and batch.old_log_probs is not None:
            with watch.incumbent_weights():
                set_training_mode(self.policy, False)
                inc = evaluate_log_probs(self.policy, batch, device=self.device, check_inf=False)
            local = incumbent_advantages(
                inc.log_probs, batch.old_log_probs, batch.mask, adv.values, batch.group_ids,
                batch.num_groups, adv.keep,
            )  # fmt: skip
            sums = (local if self.backend is None else self.backend.global_sum(local)).tolist()
        metrics = watch.observe(metrics, batch.num_samples * world, sums)
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

    @contextlib.contextmanager
    def _numerics(self) -> Any:
        """Subnormals flushed (``config.flush_denormals``) and ``step_threads`` intra-op threads
        (``config.num_threads``) for the block; the caller's settings are restored after it."""
        changed = flush_denormals_on() if self.config.flush_denormals else False
        try:
            with intra_op_threads(self.step_threads):
                yield
        finally:
            restore_denormals(changed)

    def check_lockstep(self, states: Any) -> None:
        """Refuse to step a closed trainer. Where every forward gathers partitioned weights
        (``backend.lockstep_forwards``: DeepSpeed ZeRO-3) on several processes, all ranks must run
        the same forwards: refuse different numbers of states before any of them (a clear error
        on every rank instead of a hang)."""
        if self._closed:
            raise RuntimeError(
                "this trainer was closed (close / grpo.engine.distributed.shutdown); build a new one"
            )
        if self.distributed is None or self.backend is None or not self.backend.lockstep_forwards:
            return
        try:
            n = _num_groups(states)
        except TypeError:
            return  # not sized: check_policy's own error follows in collection
        why = "DeepSpeed ZeRO-3 gathers the weights in every forward, so all ranks must run the same forwards"
        self.distributed.check_same_number_of_states(n, why)

    # ---- the parts, one at a time ----------------------------------------------------------
    def collect(self, states: Any, **generate_kwargs: Any) -> ExperienceBatch:
        """Rollout only: G actions per state, rewards, behaviour log-probs (always recorded here;
        `step` skips them when its update can take them from its first forwards, see
        `grpo.update.plan`) and reference log-probs when a KL term is on."""
        return self.collector.collect(states, **generate_kwargs)

    def advantages(self, batch: ExperienceBatch) -> Advantages:
        """The batch's group-relative advantages and reward statistics (the batch is not changed).
        The advantages are float32, or float64 when the policy has a float64 weight."""
        result = self.advantage_estimator(
            batch.rewards, batch.group_ids, batch.num_groups, components=batch.reward_components,
            weights=getattr(self.reward_model, "reward_weights", None), mask=batch.mask,
            kl_penalty=self._kl_reward_penalty(batch), group_size=batch.group_size,
            step_rewards=batch.step_rewards, dtype=self._advantage_dtype,
        )  # fmt: skip
        dropped = batch.dropped_groups if self.config.invalid_rewards == "drop_groups" else None
        return with_statistics(
            result, batch.rewards, batch.group_ids, batch.num_groups, batch.group_size,
            batch.reward_components, dropped,
        )  # fmt: skip

    def update(self, batch: ExperienceBatch, advantages: Advantages) -> dict[str, Tensor]:
        """Optimise the policy on ``batch`` with ``advantages`` (from `advantages`). Returns the
        update's statistics (empty when nothing is trained). Does not count a step."""
        if not isinstance(advantages, Advantages):
            raise TypeError(
                f"update(batch, advantages) needs the Advantages of trainer.advantages(batch), got "
                f"{type(advantages).__name__}."
            )
        with self._numerics():
            decisions = self.plan.decide(batch.num_groups)
            update, _ = self._run_update(self._collect(batch, decisions, {}), advantages, decisions)
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
        """Release what the trainer holds outside itself (`grpo.engine.backends.Backend.close`:
        DeepSpeed's engines, hooks and groups; nothing for the other backends). The trainer
        cannot step afterwards; closing twice is a no-op. `grpo.engine.distributed.shutdown`
        calls it before destroying the process group."""
        if self.backend is not None and not self._closed:
            self.backend.close()
        if not self._closed:
            self.collector.engine.close()
        self._closed = True

    # ---- training loop (grpo.training.loop) ---------------------------------------------
    def evaluate(self, states: Any, *, seed: int | None = None, **generate_kwargs: Any) -> dict[str, float]:
        """Mean reward of G sampled actions per state; no update, no weight change, RNGs untouched.

        Returns ``eval/reward/{mean,std,min,max}``, ``eval/reward/<component>/mean`` and
        ``time/eval`` over all ``n * G`` samples; see `grpo.training.loop.evaluate`.
        """
        from grpo.training.loop import evaluate

        with intra_op_threads(self.step_threads):  # the step's thread policy (grpo/runtime/threads.py)
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
        eval_options: EvalOptions | None = None,
    ) -> TrainState:
        """Run steps until ``step_count == num_steps``, with progress, evaluation, sinks and
        checkpoints; the arguments are those of `grpo.training.loop.train`, which documents them.
        Returns its `grpo.training.loop.TrainState` (history, eval history, checkpoints, stop reason).
        """
        from grpo.training.loop import train

        return train(
            self, states_source, num_steps, eval_states=eval_states, eval_every=eval_every,
            callbacks=callbacks, sinks=sinks, checkpoint_dir=checkpoint_dir, resume_from=resume_from,
            progress=progress, log_every=log_every, eval_options=eval_options,
        )  # fmt: skip


def _num_groups(states: Any) -> int:
    """B: the number of states (or of a batch's groups)."""
    return states.num_groups if isinstance(states, ExperienceBatch) else len(states)


def _moved(obj: Any, device: torch.device) -> Any:
    """``obj.to(device)``, keeping ``obj`` when ``to`` returns None (moved in place)."""
    moved = obj.to(device)
    return obj if moved is None else moved
