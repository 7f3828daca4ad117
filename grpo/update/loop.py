"""The update of one step: for each optimizer step of the plan, micro-batch forwards, the
objective, backward passes, then one optimizer step through the backend::

    for opt_step in plan.optimizer_steps(...):           # epochs x whole-group optimizer steps
        Z = global normaliser of opt_step's rows          # when the mask is known (see update_plan)
        backend.zero_grad()
        for mb in opt_step.micro_batches:
            lp   = policy log-probs (+ entropy) of mb     # one forward
            out  = objective(lp, logp_old, A, mask, Z)    # grpo.grpo_objective
            # (parts.fused_loss, GRPOConfig.use_liger_loss: both lines are one fused loss on the
            #  policy's last hidden states and LM head, grpo.llm.liger; _fused_micro_batch)
            backend.backward(out.loss, last=mb.last)      # (update's 1st: raise if no parameter
                                                          #  got a gradient)
        adaptive_lr.observe(KL of opt_step)               # optional: grpo.update.adaptive_lr sets the lr
        result = guard.optimizer_step()                   # backend: reduce, clip, step; or skip if
                                                          # non-finite (or lr/weight decay is)
        if not guard.accept(result): break                # grpo.update.guard: undo the whole update
    else: guard.check_weights()                           # all applied: undo if a weight is NaN/inf

`run_update` returns the update's metrics (`grpo.metrics` names) and the number of valid steps
they were averaged over. Nothing here writes to the batch or the advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from grpo.algorithms.sampler_correction import (
    ImportanceSums,
    SamplerCorrection,
    corrected_weights,
    importance_statistics,
    importance_sums,
    is_per_row,
)
from grpo.engine.backends import Backend, OptimizerStepResult
from grpo.experience_collector import ExperienceBatch, LogProbs, evaluate_log_probs, select_rows
from grpo.grpo_objective import STAT_NAMES, GRPOObjective, ObjectiveOutput, update_metrics
from grpo.policy_base import EntropyRequest, PolicyModel, has_method, set_training_mode
from grpo.update.adaptive_lr import AdaptiveLR
from grpo.update.guard import UpdateGuard
from grpo.update.plan import MicroBatch, NormaliserMode, OptimizerStep, UpdateDecisions, UpdatePlan

__all__ = ["FusedLoss", "UpdateParts", "UpdateStatistics", "run_update"]

_KL_AND_COUNT = [STAT_NAMES.index("kl_old"), STAT_NAMES.index("steps")]  # (sum k3, #valid) of a step


class UpdateStatistics:
    """The update's statistics, accumulated as it runs: the objective's (summed over micro-batches
    and optimizer steps), the ratio extremes, gradient norms and the sampler-correction sums."""

    def __init__(self, *, with_is: bool, omitted: frozenset[str] = frozenset()) -> None:
        self.omitted = omitted  # metrics a fused loss does not give (`FusedLoss.omitted_metrics`)
        self.objective: Tensor | None = None
        self.extremes: Tensor | None = None
        self.is_sums: Tensor | None = None
        self.with_is = with_is
        self.grad_norm_sum = 0.0
        self.optimizer_steps = 0
        self.non_finite_steps = 0

    def add_objective(self, stats: Tensor) -> None:
        self.objective = stats if self.objective is None else self.objective + stats

    def add_extremes(self, extremes: Tensor) -> None:
        self.extremes = extremes if self.extremes is None else torch.maximum(self.extremes, extremes)

    def add_is(self, sums: ImportanceSums) -> None:
        stacked = torch.stack(list(sums))  # (6,): one add per micro-batch
        self.is_sums = stacked if self.is_sums is None else self.is_sums + stacked

    def add_step(self, result: OptimizerStepResult) -> None:
        self.grad_norm_sum += result.grad_norm
        self.optimizer_steps += 1

    def finish(self, global_sum: Callable[[Tensor], Tensor]) -> tuple[dict[str, float], float]:
        """Metrics by name (`grpo.metrics`) and the valid steps they were averaged over.
        ``global_sum``: the backend's sum over processes (`Backend.global_sum`), called on every
        process when ``with_is``: the ESS is computed from the global sums of w, w^2 and units."""
        assert self.objective is not None
        assert self.extremes is not None
        out, steps = update_metrics(self.objective, self.extremes, self.optimizer_steps)
        out["grad/norm"] = self.grad_norm_sum / self.optimizer_steps
        out["optim/non_finite_steps"] = float(self.non_finite_steps)
        if self.with_is:  # sampler/trainer mismatch: mean weight, fraction capped (local), ESS (global)
            local = (
                self.is_sums
                if self.is_sums is not None
                else self.objective.new_zeros(len(ImportanceSums._fields))
            )
            mine = importance_statistics(ImportanceSums(*local))
            every = importance_statistics(ImportanceSums(*global_sum(local)))
            out["sampler/is_weight_mean"] = mine.weight_mean
            out["sampler/is_frac_capped"] = mine.frac_capped
            out["sampler/ess"] = every.ess
        if self.omitted:  # a fused loss: its clip_low holds the clipped steps, low and high
            out["clip/frac"] = out["clip/frac_low"]
            out = {k: v for k, v in out.items() if k not in self.omitted}
        return out, steps


class FusedLoss(Protocol):
    """A loss computed from the policy's own tensors in place of log-probs + `GRPOObjective`
    (``GRPOConfig.use_liger_loss``: `grpo.llm.liger.LigerGRPOLoss` on
    `grpo.llm.CausalLMPolicy.lm_head_inputs`, which the trainer builds through the loss plugin
    ``"liger"`` of `grpo.algorithms.loss_plugins`). ``inputs`` returns an object with ``mask`` (n, T)."""

    def inputs(self, policy: Any, actions: Any) -> Any:
        """One forward of the micro-batch's ``actions`` (with grad)."""

    def objective(
        self,
        inputs: Any,
        mask: Tensor,
        advantages: Tensor,
        normaliser: Tensor | float,
        *,
        logp_old: Tensor | None,
        logp_ref: Tensor | None,
    ) -> ObjectiveOutput:
        """The micro-batch's loss and statistics; ``logp_old`` None: on-policy (ratio 1)."""

    def log_probs(self, inputs: Any) -> Tensor:
        """Detached log-probs (n, T) of ``inputs`` (the behaviour log-probs when not recorded)."""

    def omitted_metrics(self, has_reference: bool) -> frozenset[str]:
        """The update metrics this loss does not give."""


@dataclass
class UpdateParts:
    """What an update is made of (the trainer builds them once).

    ``exact_entropy``: what to ask ``evaluate_actions`` for (see `grpo.policy_base`);
    ``sampler_is_cap``: the importance-weight cap C of a sampler/trainer mismatch, or None (off);
    ``sampler_correction``: how the weights use C (`grpo.algorithms.sampler_correction`);
    ``adaptive_lr``: the learning-rate controller of ``GRPOConfig.adaptive_lr_kl``, or None;
    ``fused_loss``: computes each micro-batch's loss in place of log-probs + ``objective``
    (``GRPOConfig.use_liger_loss``), or None.
    """

    policy: PolicyModel
    objective: GRPOObjective
    plan: UpdatePlan
    backend: Backend
    guard: UpdateGuard
    params: Sequence[Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device
    exact_entropy: EntropyRequest
    sampler_is_cap: float | None
    adaptive_lr: AdaptiveLR | None = None
    fused_loss: FusedLoss | None = None
    sampler_correction: SamplerCorrection = "token_truncate"


def run_update(
    parts: UpdateParts,
    batch: ExperienceBatch,
    advantages: Tensor,
    keep: Tensor | None,
    decisions: UpdateDecisions,
    step: int,
) -> tuple[dict[str, float], float]:
    """Optimise the policy on ``batch`` with ``advantages`` (N,) or (N, T) and loss rows ``keep``
    (N,) bool (None = all). Returns the update's metrics and its number of valid steps."""
    plan, backend = parts.plan, parts.backend
    backend.check_same_optimizer_steps(batch.num_groups, plan.mini_batch_size)
    set_training_mode(parts.policy, True)
    mode = plan.normaliser_mode(batch.mask is not None)
    omitted = (
        frozenset()
        if parts.fused_loss is None
        else parts.fused_loss.omitted_metrics(has_reference=batch.ref_log_probs is not None)
    )
    stats = UpdateStatistics(with_is=parts.sampler_is_cap is not None, omitted=omitted)
    old = batch.old_log_probs
    if batch.loss_rows is not None:  # the collector's rows without gradient (mask_truncated_completions)
        keep = batch.loss_rows if keep is None else keep & batch.loss_rows
    from_first_epoch = old is None and decisions.needs_old  # behaviour log-probs from its forwards
    multi = plan.optimizer_steps_per_update(batch.num_groups) > 1  # this batch's (groups may be dropped)
    data = _UpdateData(batch, advantages, keep, old)
    with parts.guard.protect(
        backend,
        parts.params,
        parts.optimizer,
        parts.scheduler,
        multi_step=multi,
        step=step,
        policy=parts.policy,
    ) as guard:
        for opt_step in plan.optimizer_steps(batch.num_groups, batch.group_size, batch.group_ids):
            result, logps = _optimizer_step(parts, data, opt_step, mode, stats, check_inf=from_first_epoch)
            if from_first_epoch:  # the first epoch's forwards are the behaviour log-probs
                data = data._replace(old=logps[0] if len(logps) == 1 else torch.cat(logps))
                from_first_epoch = False
            stats.add_step(result)
            if not guard.accept(result):
                break
        else:  # every optimizer step was applied
            guard.check_weights()
    stats.non_finite_steps = parts.guard.non_finite_steps
    out, steps = stats.finish(backend.global_sum)
    out["optim/update_ratio"] = parts.guard.update_ratio  # ||theta' - theta|| / ||theta|| (grpo.update.guard)
    if parts.adaptive_lr is not None:
        out["optim/adaptive_lr"] = parts.adaptive_lr.lr
    return out, steps


class _UpdateData(NamedTuple):
    """What the update trains on: the ``batch`` (N rows), its ``advantages`` (N,) or (N, T), the
    loss rows ``keep`` (N,) bool (None = all) and the behaviour log-probs ``old`` (N, T) (None
    until the first epoch's forwards record them when the collector did not)."""

    batch: ExperienceBatch
    advantages: Tensor
    keep: Tensor | None
    old: Tensor | None


def _optimizer_step(
    parts: UpdateParts,
    data: _UpdateData,
    opt_step: OptimizerStep,
    mode: NormaliserMode,
    stats: UpdateStatistics,
    *,
    check_inf: bool,
) -> tuple[OptimizerStepResult, list[Tensor]]:
    """Zero grad, the micro-batches' forwards and backwards, the optimizer step. Returns its
    result and the micro-batches' log-probs ``logp_old`` (detached), in order. ``check_inf``:
    refuse +-inf log-probs as collection does (they become the behaviour log-probs)."""
    backend, objective = parts.backend, parts.objective
    z: Tensor | None = None
    if mode == "known":
        assert data.batch.mask is not None
        step_mask = _loss_mask(select_rows(data.batch.mask, opt_step.rows), data.keep, opt_step.rows)
        z = global_normaliser(backend, objective, step_mask)
    backend.zero_grad()
    counts: Tensor | None = None  # "deferred": the raw counts of the step's micro-batches
    step_stats: Tensor | None = None
    check_grads = stats.optimizer_steps == 0  # the update's first backward
    logps: list[Tensor] = []
    for mb in opt_step.micro_batches:
        step = _MicroStep(mb, mode, z, opt_step.on_policy, check_inf)
        if parts.fused_loss is None:
            out, logp_old, raw = _micro_batch(parts, data, step, stats)
        else:
            out, logp_old, raw = _fused_micro_batch(parts, parts.fused_loss, data, step)
        if raw is not None:
            counts = raw if counts is None else counts + raw
        backend.backward(out.loss, last=mb.last)
        if check_grads:
            _check_gradients_reached(parts, out.loss)
            check_grads = False
        step_stats = out.stats if step_stats is None else step_stats + out.stats
        stats.add_extremes(out.extremes)
        logps.append(logp_old)
    assert step_stats is not None
    if counts is not None:  # the losses were sums: divide by the step's global count, clamped once
        divisor = objective.normaliser_from_count(backend.global_sum(counts))
        backend.rescale_gradients(divisor)
        step_stats = ObjectiveOutput.rescale(step_stats, divisor)
    stats.add_objective(step_stats)
    if parts.adaptive_lr is not None and stats.optimizer_steps > 0:  # step 0 has not moved yet
        parts.adaptive_lr.observe(backend.global_sum(step_stats[_KL_AND_COUNT]))  # grpo.update.adaptive_lr
    return parts.guard.optimizer_step(), logps


class _MicroStep(NamedTuple):
    """One micro-batch of an optimizer step: its rows, the step's normaliser mode and ``Z`` (None
    unless known before the forwards), whether it is on-policy, whether to refuse +-inf log-probs."""

    mb: MicroBatch
    mode: NormaliserMode
    z: Tensor | None
    on_policy: bool
    check_inf: bool


def _micro_normaliser(
    parts: UpdateParts, step: _MicroStep, mask: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """``Z`` of the micro-batch with loss mask ``mask`` and its raw count ("deferred": summed over
    the step, the loss divided once after the backwards) or None."""
    if step.mode == "from_forward":
        return global_normaliser(parts.backend, parts.objective, mask), None
    if step.mode == "deferred":
        return step.z, parts.objective.count(mask)
    return step.z, None


def _micro_batch(
    parts: UpdateParts, data: _UpdateData, step: _MicroStep, stats: UpdateStatistics
) -> tuple[ObjectiveOutput, Tensor, Tensor | None]:
    """The default micro-batch: log-probs (one forward), then the objective. Returns its output,
    its ``logp_old`` (detached) and its raw normaliser count ("deferred") or None."""
    mb = step.mb
    lp = _log_probs(parts, data.batch, mb, check_inf=step.check_inf)
    mask = _loss_mask(lp.mask, data.keep, mb.rows)
    z, raw = _micro_normaliser(parts, step, mask)
    logp_old = (
        lp.log_probs.detach()
        if step.on_policy
        else _same_shape(data.old, mb, lp.log_probs, "old log-probs recorded at collection", parts)
    )
    out = _objective(parts, data, step._replace(z=z), lp, logp_old, mask, stats)
    return out, logp_old, raw


def _fused_micro_batch(
    parts: UpdateParts, fused: FusedLoss, data: _UpdateData, step: _MicroStep
) -> tuple[ObjectiveOutput, Tensor, Tensor | None]:
    """A micro-batch through ``parts.fused_loss`` (``GRPOConfig.use_liger_loss``): the policy's
    forward to the LM head's input, then the fused loss. Same returns as `_micro_batch`; its
    ``logp_old`` is computed (one more no-grad head pass) only when these forwards record the
    behaviour log-probs (``check_inf``), otherwise it is the recorded one or empty (on-policy)."""
    mb, batch = step.mb, data.batch
    adv = select_rows(data.advantages, mb.rows)
    if adv.dim() != 1:
        raise ValueError(
            f"use_liger_loss: Liger's loss takes one advantage per sample, got shape {tuple(adv.shape)} "
            "(per-step advantages); set GRPOConfig(use_liger_loss=False)."
        )
    inputs = fused.inputs(parts.policy, select_rows(batch.actions, mb.rows))
    mask = _loss_mask(inputs.mask, data.keep, mb.rows)
    z, raw = _micro_normaliser(parts, step, mask)
    recorded = fused.log_probs(inputs) if step.check_inf else None
    if recorded is not None and bool(torch.isinf(recorded).any()):
        raise ValueError(
            f"{type(parts.policy).__name__} gave +-inf log-probs for recorded actions (an action "
            "the policy cannot take); the behaviour log-probs must be finite."
        )
    what = "old log-probs recorded at collection"
    logp_old = None if step.on_policy else _same_shape(data.old, mb, inputs.targets, what, parts)
    ref = select_rows(batch.ref_log_probs, mb.rows)
    if ref is not None:
        _check_shape(ref, inputs.targets, "reference log-probs", parts)
    out = fused.objective(inputs, mask, adv, 1.0 if z is None else z, logp_old=logp_old, logp_ref=ref)
    if recorded is None:
        recorded = logp_old if logp_old is not None else inputs.targets.new_empty(0, dtype=torch.float32)
    return out, recorded, raw


def global_normaliser(backend: Backend, objective: GRPOObjective, mask: Tensor) -> Tensor:
    """``Z`` from ``sum_r count_r``: the aggregation count of ``mask`` summed over processes and
    clamped to >= 1 once (clamping per process or per micro-batch would add 1 for each empty one)."""
    return objective.normaliser_from_count(backend.global_sum(objective.count(mask)))


def _log_probs(parts: UpdateParts, batch: ExperienceBatch, mb: MicroBatch, *, check_inf: bool) -> LogProbs:
    """The current policy's log-probs (+ entropy) of ``mb``'s actions: one forward, with grad.

    ``check_inf``: reject +-inf as collection does (these log-probs become the behaviour
    log-probs); otherwise a non-finite log-prob makes the loss non-finite and the guard undoes it.
    """
    lp = evaluate_log_probs(
        parts.policy,
        batch,
        mb.rows,
        groups=mb.groups,
        with_entropy=parts.exact_entropy,
        device=parts.device,
        check_inf=check_inf,
    )
    if not lp.log_probs.requires_grad:
        raise ValueError(
            f"{type(parts.policy).__name__} returned log-probs that do not require grad during "
            f"the update, so nothing would learn. Compute them from the policy's parameters "
            f"without torch.no_grad() / .detach() (the trainer disables grad itself during "
            f"collection)."
        )
    return lp


def _check_gradients_reached(parts: UpdateParts, loss: Tensor) -> None:
    """After the update's first backward: raise if the loss has a graph but none of the
    policy's trainable tensors received a gradient (log-probs that require grad without depending
    on the parameters, e.g. ``torch.full(..., requires_grad=True)``): the optimizer step would
    train nothing while its state and the LR schedule advance. Backends with ``local_weights``
    only (their gradients are the tensors' ``.grad``, cleared to None before
    the step); usually one attribute read (the first tensor has a gradient)."""
    if not loss.requires_grad or not parts.backend.local_weights:
        return
    for p in parts.params:
        if p.grad is not None:
            return
    parts.backend.zero_grad()
    method = "evaluate_actions" if has_method(parts.policy, "evaluate_actions") else "get_log_probabilities"
    raise ValueError(
        f"{type(parts.policy).__name__}.{method} returned log-probs that require grad but do not "
        f"depend on the policy's parameters: after the backward pass none of the {len(parts.params)} "
        f"tensors from get_parameters() has a gradient, so nothing would learn while the optimizer "
        f"state and the LR schedule advance (stopped before the optimizer step: nothing changed). "
        f"Compute the log-probs from the parameters (e.g. "
        f"log_softmax of the network's output), not from a new tensor such as torch.full(..., "
        f"requires_grad=True), and return from get_parameters() the tensors they are computed from."
    )


def _objective(
    parts: UpdateParts,
    data: _UpdateData,
    step: _MicroStep,
    lp: LogProbs,
    logp_old: Tensor,
    mask: Tensor,
    stats: UpdateStatistics,
) -> ObjectiveOutput:
    """The objective of one micro-batch ``step`` (its ``z``: the micro-batch's normaliser or None
    for 1) on the current log-probs ``lp`` and ``logp_old`` (n, T) under the loss mask ``mask``
    (n, T), with the sampler correction's weights when on."""
    logp, mb = lp.log_probs, step.mb
    ref = select_rows(data.batch.ref_log_probs, mb.rows)
    if ref is not None:
        _check_shape(ref, logp, "reference log-probs", parts)
    is_weights = None
    if parts.sampler_is_cap is not None:
        is_weights = _is_weights(parts, data.batch, mb, logp_old, logp, mask, stats)
    return parts.objective(
        logp,
        logp_old,
        select_rows(data.advantages, mb.rows),
        mask,
        1.0 if step.z is None else step.z,
        logp_ref=ref,
        entropy=lp.entropy,
        on_policy=step.on_policy,
        is_weights=is_weights,
    )


def _is_weights(
    parts: UpdateParts,
    batch: ExperienceBatch,
    mb: MicroBatch,
    old: Tensor,
    logp: Tensor,
    mask: Tensor,
    stats: UpdateStatistics,
) -> Tensor:
    """Importance weights (n, T) of a sampler/trainer mismatch, no gradient: ``parts.sampler_correction``
    with cap ``parts.sampler_is_cap`` (`grpo.algorithms.sampler_correction`; "token_truncate":
    ``min(exp(logp_old - logp_sampler), cap)``); their sums over valid steps go to ``stats``."""
    cap = parts.sampler_is_cap
    assert cap is not None
    sampler = select_rows(batch.sampler_log_probs, mb.rows)
    if sampler is None:
        raise ValueError(
            "sampler_is_cap is set but this batch has no sampler_log_probs; build it with "
            "trainer.collect(), which records them."
        )
    _check_shape(sampler, logp, "sampler log-probs", parts)
    mode = parts.sampler_correction
    corrected = corrected_weights(old, sampler, mask, mode=mode, cap=cap)
    stats.add_is(importance_sums(corrected, mask, per_row=is_per_row(mode)))
    return corrected.weights


def _loss_mask(mask: Tensor, keep: Tensor | None, rows: Tensor | None) -> Tensor:
    """``mask`` without the rows of dropped zero-variance groups and the batch's ``loss_rows``
    (``keep`` False)."""
    if keep is None:
        return mask
    kept: Tensor = select_rows(keep.to(mask.device), rows)
    return mask & kept.unsqueeze(-1)


def _same_shape(old: Tensor | None, mb: MicroBatch, logp: Tensor, what: str, parts: UpdateParts) -> Tensor:
    if old is None:
        raise RuntimeError(f"internal error: {what} were not recorded")  # pragma: no cover
    rows: Tensor = select_rows(old, mb.rows)
    _check_shape(rows, logp, what, parts)
    return rows


def _check_shape(expected: Tensor, logp: Tensor, what: str, parts: UpdateParts) -> None:
    if expected.shape != logp.shape:
        raise ValueError(
            f"{type(parts.policy).__name__} returned log-probs of shape {tuple(logp.shape)} during "
            f"the update but {what} have shape {tuple(expected.shape)}; the number of steps T of "
            f"an action must not change between calls."
        )
