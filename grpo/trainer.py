"""`GRPOTrainer`: one ``step(states)`` = collect, advantages, update, metrics.

`GRPOTrainer.step` reads as the pipeline; each line is one part with one job, in the file named
after it::

    batch = collector.collect(states)           # 1. grpo/experience_collector.py
    adv   = self.advantages(batch)              # 2. grpo/advantage_estimator.py
    run_update(parts, batch, adv, ...)          # 3. grpo/update/loop.py over grpo/update/plan.py,
                                                #    grpo/engine/backends.py and grpo/update/guard.py
    step_count += 1; maybe refresh reference    # 4.
    backend.reduce_metrics(...)                 # 5. grpo/metrics/__init__.py

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
from grpo.algorithms.policy_losses import PolicyLossFn
from grpo.config import GRPOConfig
from grpo.engine.backends import Backend
from grpo.engine.lr_schedules import schedule_length_problem
from grpo.engine.setup import (
    checked_inputs,
    join_processes,
    make_backend,
    make_reference,
    reference_module,
    refresh_reference,
)
from grpo.experience_collector import ExperienceBatch, ExperienceCollector, evaluate_log_probs
from grpo.grpo_objective import GRPOObjective
from grpo.metrics import StepCounts, empty_extremes_as_nan
from grpo.policy_base import EntropyRequest, PolicyModel, has_method, set_training_mode
from grpo.reward_model_base import RewardModel
from grpo.runtime.denormals import flush_denormals_on, restore_denormals
from grpo.runtime.threads import describe, intra_op_threads, policy_elements, resolve_num_threads
from grpo.state.trainer_state import TrainerStateMixin
from grpo.training.reward_shift import RewardShiftRestart, incumbent_advantages
from grpo.training.stall_watch import StallWatch
from grpo.update.adaptive_lr import AdaptiveLR
from grpo.update.guard import UpdateGuard
from grpo.update.loop import UpdateParts, run_update
from grpo.update.plan import UpdatePlan

if TYPE_CHECKING:
    from grpo.training.loop import TrainState

__all__ = ["GRPOConfig", "GRPOTrainer"]

logger = logging.getLogger(__name__)


class GRPOTrainer(TrainerStateMixin):
    """Trains any `PolicyModel` against any `RewardModel` with GRPO.

    Args:
        config: a `GRPOConfig`.
        policy: the policy to train (any object with the `PolicyModel` methods).
        reward_model: a `RewardModel`, or a plain callable ``f(states, actions) -> (N,) rewards``.
        reference_policy: the policy the KL term pulls towards. Default: a frozen copy of the
            starting policy (DeepSeekMath), made only when ``config.kl_coeff > 0``.
        optimizer: a torch optimizer over the policy's parameters. Default: AdamW with
            ``config.learning_rate`` over ``policy.get_parameters()`` (`grpo.engine.optim.default_optimizer`:
            the fused implementation where torch has one).
        advantage_fn: replaces the baseline/scale step of the advantage
            (`grpo.advantage_estimator.AdvantageFn`); no subclassing needed.
        loss_fn: replaces the per-step policy loss (`grpo.algorithms.policy_losses.PolicyLossFn`).
        kl_fn: replaces the KL estimator (`grpo.algorithms.kl.KLFn`).
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
        reward = checked_inputs(config, policy, reward_model, reference_policy)
        self.config = config
        self.device, self.distributed = join_processes(config)  # distributed: None on one process
        self.generator = torch.Generator().manual_seed(0 if config.seed is None else config.seed)
        self.policy: PolicyModel = _moved(policy, self.device)
        self.reward_model: RewardModel = _moved(reward, self.device)

        # the backend owns the optimizer step (and shards the policy when it partitions weights)
        copy_reference = config.kl_coeff > 0 and reference_policy is None
        setup = make_backend(
            config, self.policy, self.device, self.distributed, optimizer, copy_reference=copy_reference
        )
        self.params, self.optimizer, self.scheduler = setup.params, setup.optimizer, setup.scheduler
        self.backend: Backend | None = setup.backend
        self._deepspeed = setup.deepspeed
        self.reference_policy = make_reference(
            config, self.policy, reference_policy, self.device, self._deepspeed, setup.reference_copy
        )

        self.advantage_estimator = AdvantageEstimator.from_config(config, advantage_fn)
        trained = self.optimizer.param_groups if self.optimizer is not None else []
        # float64 for float64 weights: their update is not computed from float32-rounded advantages
        weights = [*self.params, *(p for g in trained for p in g["params"])]
        self._advantage_dtype = advantage_dtype(weights)
        # intra-op threads in each step: 1 for a small CPU policy by default (grpo/runtime/threads.py)
        elements = policy_elements(self.policy, weights)
        self.step_threads = resolve_num_threads(config.num_threads, device=self.device, elements=elements)
        logger.info(describe(config.num_threads, self.step_threads, device=self.device, elements=elements))
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
        self.collector = ExperienceCollector(
            self.policy, self.reward_model, config.group_size, self.device,
            reference_policy=self.reference_policy, record_old_log_probs=True,
            record_sampler_log_probs=config.sampler_is_cap is not None,
            invalid_rewards=config.invalid_rewards, reward_timeout=config.reward_timeout,
        )  # fmt: skip
        self.objective = GRPOObjective.from_config(config, loss_fn=loss_fn, kl_fn=kl_fn)
        self._check_sampler_correction()
        self.guard: UpdateGuard = UpdateGuard(config.non_finite)
        self._update = self._update_parts()
        self.step_count = 0
        self._warned_nothing_to_train = self._warned_batch_size = False
        self.stall_watch = StallWatch.from_config(config, self.optimizer, self.scheduler)  # stall_watch.py
        self._check_schedule_length()
        shard = config.fsdp or self._deepspeed is not None
        self.reward_shift = RewardShiftRestart.from_config(
            config, self.params, sharded=shard, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self._checkpoint_components: dict[str, Any] = {}
        if self.reward_shift is not None:  # its state (the starting weights too) is checkpointed
            self._checkpoint_components["reward_shift"] = self.reward_shift

    def _update_parts(self) -> UpdateParts | None:
        """The parts of the update (None when there is nothing to train)."""
        if self.backend is None or self.optimizer is None:
            return None
        return UpdateParts(
            self.policy, self.objective, self.plan, self.backend, self.guard, self.params, self.optimizer,
            self.scheduler, self.device, self._entropy_request(), self.config.sampler_is_cap,
            AdaptiveLR.from_config(self.config, self.scheduler),
        )  # fmt: skip

    def _entropy_request(self) -> EntropyRequest:
        """The exact entropy from ``evaluate_actions``: differentiable only when the loss trains it."""
        if not has_method(self.policy, "evaluate_actions"):
            return False
        return True if self.config.entropy_coeff != 0 else "no_grad"

    def _check_sampler_correction(self) -> None:
        cap = self.config.sampler_is_cap
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
        return reference_module(self.reference_policy, self._deepspeed)

    @property
    def non_finite_steps(self) -> int:
        """Steps whose update was undone because the loss or the gradient was NaN/inf."""
        return int(self.guard.non_finite_steps)

    @non_finite_steps.setter
    def non_finite_steps(self, value: int) -> None:
        self.guard.non_finite_steps = value

    # ---- the step -----------------------------------------------------------------------
    def step(self, states: Any, **generate_kwargs: Any) -> dict[str, float]:
        """One GRPO step on ``states`` (a sequence of B states, or a Tensor (B, ...)).

        Returns float metrics (names and meanings in docs/metrics.md, declared in
        `grpo.metrics`). With ``config.flush_denormals`` (default) the step runs with subnormal
        floats flushed to zero on CPU (`grpo.runtime.denormals`), and with ``step_threads`` intra-op
        threads (``config.num_threads``: one for a small CPU policy by default, `grpo.runtime.threads`);
        both settings are restored afterwards.
        """
        self._note_batch_size(states)
        with self._numerics():
            t0 = time.perf_counter()
            self.check_lockstep(states)
            batch = self.collector.collect_for_update(  # 1. G actions, rewards, log-probs
                states, generate_kwargs, record_old=self._record_old
            )
            return self._learn(batch, t0)  # 2-5

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

    def train_on_batch(self, batch: ExperienceBatch) -> dict[str, float]:
        """One GRPO step on groups collected elsewhere (logs, a real robot, another sampler).

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
        with self._numerics():
            t0 = time.perf_counter()
            self.check_lockstep(batch.states)
            return self._learn(self._complete(batch), t0)

    def _learn(self, batch: ExperienceBatch, t0: float) -> dict[str, float]:
        """Steps 2-5 of `step`: advantages, update, counters, metrics."""
        adv = self.advantages(batch)  # 2. group-relative advantages (and reward statistics)
        t1 = time.perf_counter()
        update, valid_steps = self._run_update(batch, adv)  # 3. the update (grpo/update/loop.py)
        t2 = time.perf_counter()
        self.step_count += 1  # 4. counters, reference refresh
        freq = self.config.reference_update_freq
        if freq is not None and self.step_count % freq == 0:
            self.refresh_reference()
        metrics = adv.metrics() | update  # 5. metrics, reduced over processes
        metrics.update({f"time/{k}": v for k, v in batch.timings.items()})
        metrics["time/update"] = t2 - t1
        metrics["time/step"] = time.perf_counter() - t0
        metrics["step"] = float(self.step_count)
        if self.backend is not None:
            counts = StepCounts(float(batch.num_samples), float(batch.num_groups), valid_steps)
            metrics = self.backend.reduce_metrics(metrics, counts)
        metrics = empty_extremes_as_nan(metrics)  # an update without a valid step has no ratio
        metrics = self.stall_watch.observe(metrics)  # warns (StallWarning) when learning has stalled
        if self.reward_shift is not None:  # restarts on a change of the task (grpo/training/reward_shift.py)
            metrics = self._observe_reward_shift(self.reward_shift, batch, adv, metrics)
        return metrics

    def _observe_reward_shift(
        self, watch: RewardShiftRestart, batch: ExperienceBatch, adv: Advantages, metrics: dict[str, float]
    ) -> dict[str, float]:
        """The restart rule reads the step's metrics and, while a restart is on probation, the
        incumbent's advantages in the step's groups (`grpo.training.reward_shift.incumbent_advantages`:
        one forward of the batch with the incumbent's weights, summed over processes)."""
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
        return watch.observe(metrics, batch.num_samples * world, sums)

    def _run_update(self, batch: ExperienceBatch, adv: Advantages) -> tuple[dict[str, float], float]:
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
        decisions = self.plan.decide(batch.num_groups)
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
        """ZeRO-3 on several processes: every forward all-gathers weights, so all ranks must run
        the same forwards; refuse different numbers of states before any of them (a clear error
        on every rank instead of a hang). A closed trainer refuses to step at all."""
        if self._deepspeed is not None and self._deepspeed.engine is None:
            raise RuntimeError(
                "this trainer was closed (close / grpo.engine.distributed.shutdown); build a new one"
            )
        if self.distributed is None or self.deepspeed_stage != 3:
            return
        try:
            n = len(states)
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

    def _record_old(self, num_states: int) -> bool:
        return self.plan.decide(num_states).old_at_collection

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

    def compute_advantages(self, batch: ExperienceBatch) -> dict[str, Tensor]:
        """Deprecated: use ``adv = trainer.advantages(batch)`` then ``trainer.update(batch, adv)``.

        Fills ``batch.advantages`` / ``batch.loss_rows`` and returns the statistics as tensors."""
        warnings.warn(
            "GRPOTrainer.compute_advantages(batch) writes into the batch and is deprecated; use "
            "adv = trainer.advantages(batch), then trainer.update(batch, adv).",
            DeprecationWarning,
            stacklevel=2,
        )
        adv = self.advantages(batch)
        batch.advantages, batch.loss_rows = adv.values, adv.keep
        return dict(zip(adv.names, adv.stats.unbind(), strict=True))

    def update(self, batch: ExperienceBatch, advantages: Advantages | None = None) -> dict[str, Tensor]:
        """Optimise the policy on ``batch`` with ``advantages`` (from `advantages`). Returns the
        update's statistics (empty when nothing is trained). Does not count a step."""
        if advantages is None:
            if batch.advantages is None:
                raise ValueError("update() needs advantages: call update(batch, trainer.advantages(batch)).")
            empty = torch.zeros(0)
            advantages = Advantages(batch.advantages, batch.loss_rows, (), empty)
        with self._numerics():
            update, _ = self._run_update(self._complete(batch), advantages)
        return {k: torch.tensor(v, device=self.device) for k, v in update.items()}

    def _complete(self, batch: ExperienceBatch) -> ExperienceBatch:
        """``batch`` with the log-probs the update needs and it lacks (see `train_on_batch`)."""
        need_old = batch.old_log_probs is None and self.plan.decide(batch.num_groups).old_at_collection
        return self.collector.complete(batch, old=need_old)

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
        self.reference_policy = refresh_reference(self.policy, self.reference_policy, self._deepspeed)
        self.collector.reference_policy = self.reference_policy

    def close(self) -> None:
        """Release what the trainer holds outside itself (DeepSpeed's engines, hooks and groups; see
        `grpo.engine.deepspeed.DeepSpeedBackend.close`); a no-op without DeepSpeed. The trainer
        cannot step afterwards. `grpo.engine.distributed.shutdown` calls it before destroying the group."""
        if self._deepspeed is not None:
            self._deepspeed.close()

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
    ) -> TrainState:
        """Run steps until ``step_count == num_steps``, with progress, evaluation, sinks and
        checkpoints; the arguments are those of `grpo.training.loop.train`, which documents them.
        Returns its `grpo.training.loop.TrainState` (history, eval history, checkpoints, stop reason).
        """
        from grpo.training.loop import train

        return train(
            self, states_source, num_steps, eval_states=eval_states, eval_every=eval_every,
            callbacks=callbacks, sinks=sinks, checkpoint_dir=checkpoint_dir, resume_from=resume_from,
            progress=progress, log_every=log_every,
        )  # fmt: skip


def _moved(obj: Any, device: torch.device) -> Any:
    """``obj.to(device)``, keeping ``obj`` when ``to`` returns None (moved in place)."""
    moved = obj.to(device)
    return obj if moved is None else moved
