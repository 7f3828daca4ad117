"""The update guard: an update that raises or goes non-finite leaves no trace.

`UpdateGuard.protect` wraps one update. When the update takes more than one optimizer step and
the backend's state can be copied (`Backend.supports_rollback`), it first captures the weights,
the optimizer and the LR schedule (`grpo.update.rollback.UpdateSnapshot`); an exception inside the
block restores them and propagates. Three checks refuse an update, each restoring the snapshot
(undoing the earlier optimizer steps of the update), counting the step in ``non_finite_steps``
and warning (``non_finite="skip"``) or raising `FloatingPointError` (``"raise"``):

* `UpdateGuard.optimizer_step`, before the update's first optimizer step (backends with
  ``local_weights``: local and data-parallel): a learning rate or weight decay of the optimizer
  that is NaN/inf (a user's optimizer, or one changed by hand) refuses the step before it
  changes anything. Host only: a few dict reads per parameter group. (Within an update only the
  trainer's LR schedule changes them; a later step made non-finite is left to the weight check.)
* `UpdateGuard.accept`, after each optimizer step: a step whose loss or gradient was not finite
  was not applied by the backend.
* `UpdateGuard.check_weights`, after the update's last optimizer step (backends with
  ``local_weights``): a weight that is NaN/inf although the loss and the gradient were finite (a
  huge learning rate, an optimizer that divides by zero). One fused reduction over the weights
  and one host read per update (`weights_finite`). Checking once per update suffices: a
  non-finite weight stays non-finite through later optimizer steps, or makes their loss or
  gradient non-finite, which `accept` refuses.

With a single optimizer step nothing has changed before `optimizer_step` and `accept` refuse
it, so no snapshot is needed. A non-finite weight found by `check_weights` after a single
optimizer step cannot be undone (no copy was taken: copying the weights and the optimizer state
on every step costs their memory again), so it raises `FloatingPointError` whatever
``non_finite`` says: training cannot go on from such weights.

The size of the update (`UpdateGuard.update_ratio`, logged as ``optim/update_ratio``)::

    update_ratio = ||theta_after - theta_before|| / ||theta_before||

global L2 norms over every weight the optimizer steps (all its tensors as one vector; a sharded
weight's shards are summed over the processes with ``Backend.global_sum``). It needs the weights
before the update, and the guard has them only when it holds a copy anyway, so it is measured:

* after an update of several optimizer steps with a snapshot (``Backend.supports_rollback``): the
  snapshot's copy of the weights is used, at no extra memory;
* after an update of a single optimizer step, on a backend with ``local_weights``, when the
  weights hold at most ``ratio_copy_limit`` elements (default `RATIO_COPY_LIMIT` = 2**22, 16 MiB
  in float32): their values are copied first (one fused copy into buffers reused every step, 1x
  the weights' memory, no optimizer state). Small policies (control, bandits) are where a stall
  goes unnoticed longest, and there the copy costs less than the forward pass;
* otherwise (one optimizer step of a larger model, DeepSpeed's partitioned weights): it is NaN,
  meaning "not measured": copying a large model's weights every step would cost their memory
  again only to log one number. Several epochs or mini-batches (``num_epochs_per_update > 1``)
  measure it for free.

An update the guard undid reports 0 (the weights are bitwise as before). Cost when measured: three
fused passes over the copy (its norm, the difference written into it, the difference's norm),
no allocation, and one host read per update (plus one ``global_sum`` of two numbers across
processes); with the single-step copy, one more pass to take it. Measured on a busy 2-core CPU
(benchmarks/RESULTS.md, "Stalls"): the single-step copy and the ratio add 4% to a step of a
6k-weight MLP and 7% to one of 1.08M weights (B=64, G=8); from a snapshot the ratio alone
takes 0.3 ms for 1.08M weights.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo.engine.backends import Backend, OptimizerStepResult
from grpo.update.rollback import UpdateSnapshot, local_shards

__all__ = ["RATIO_COPY_LIMIT", "UpdateGuard"]

RATIO_COPY_LIMIT = 1 << 22
"""Most weight elements the guard copies before a single-step update to measure its size."""

_HYPERPARAMETERS = ("lr", "weight_decay")


def _bad_hyperparameter(optimizer: torch.optim.Optimizer) -> str | None:
    """``"lr=inf (param group 0)"`` for the first non-finite learning rate or weight decay of
    ``optimizer``'s groups, else None. Numbers and one-element CPU tensors are read; tensors on an
    accelerator are left to the weight check (reading them would wait for the device)."""
    for i, group in enumerate(optimizer.param_groups):
        for key in _HYPERPARAMETERS:
            value = group.get(key)
            if isinstance(value, Tensor) and value.device.type == "cpu" and value.numel() == 1:
                value = float(value)
            if isinstance(value, float) and not math.isfinite(value):
                where = f" (param group {i})" if len(optimizer.param_groups) > 1 else ""
                return f"{key}={value}{where}"
    return None


def _norm_dtype(tensors: Sequence[Tensor]) -> torch.dtype:
    """The dtype norms of ``tensors`` accumulate in without narrowing any of them: float64 when
    one is float64, else float32 (float32, and bfloat16/float16 accumulated in float32)."""
    for t in tensors:
        if t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def weights_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when no weight the optimizer steps holds a NaN/inf (`grpo.update.guard.UpdateGuard.
    check_weights`, once per update). Every process holds the same weights, so every process
    decides the same without communicating.

    Cost: one fused ``torch._foreach_norm`` (float32; float64 when a weight is float64,
    `_norm_dtype`) over the weights, summed and read to the
    host. A NaN/inf weight always makes that sum NaN/inf; a sum that is not finite is
    confirmed tensor by tensor (``isfinite``), because huge finite weights (above ~1e19) can
    overflow it too.
    """
    weights = [p for g in optimizer.param_groups for p in g["params"] if p.is_floating_point()]
    if not weights:
        return True
    with torch.no_grad():
        norms = torch._foreach_norm(weights, 2, dtype=_norm_dtype(weights))
        if norms[0].is_cpu:  # reading each norm is cheaper than stacking them (no device)
            total = sum(map(float, norms))
        else:
            try:
                total = float(torch.stack(norms).sum())  # one read from the device
            except RuntimeError:  # weights on several devices: one read per tensor
                total = sum(map(float, norms))
        if math.isfinite(total):
            return True
        return all(bool(torch.isfinite(w).all()) for w in weights)


def _update_ratio(after: list[Tensor], before: list[Tensor], backend: Backend) -> float:
    """``||after - before|| / ||before||``: global L2 norms over all the tensors as one vector.

    ``after[i]`` and ``before[i]`` are the same weight after and before an update (plain tensors
    or a process's local shards); ``before`` (the guard's copy, not needed afterwards) is
    overwritten with ``before - after``, so no memory is allocated. Three fused passes: a norm of
    ``before``, the in-place difference (in the weights' dtype: exact for close values, Sterbenz),
    a norm of the difference, norms accumulated in float32 (float64 when a weight is float64:
    `_norm_dtype`). The two sums of squares are summed
    over processes with ``backend.global_sum`` (one call, on every process): replicated weights
    scale both alike, so the ratio is the same. ``before`` all zero: 0 when nothing moved, else inf.
    """
    if not before:
        return math.nan
    dev = before[0].device
    with torch.no_grad():
        acc = _norm_dtype(before)
        sizes = torch._foreach_norm(before, 2, dtype=acc)
        torch._foreach_sub_(before, after)
        moved = torch._foreach_norm(before, 2, dtype=acc)
        squares = [torch.stack([t.to(dev) for t in norms]).square().sum() for norms in (moved, sizes)]
        d2, w2 = backend.global_sum(torch.stack(squares)).tolist()  # .to: weights on several devices
    if w2 > 0:
        return math.sqrt(d2 / w2)
    return 0.0 if d2 == 0 else math.inf


def _non_finite_weights(optimizer: torch.optim.Optimizer, policy: Any) -> str:
    """The names (or positions and shapes) of the optimizer's weights that hold a NaN/inf."""
    named = policy.get_parameters() if hasattr(policy, "get_parameters") else {}
    names = {id(p): n for n, p in named.items()} if isinstance(named, Mapping) else {}
    weights = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        bad = [
            names.get(id(p), f"tensor {i} of shape {tuple(p.shape)}")
            for i, p in enumerate(weights)
            if p.is_floating_point() and not bool(torch.isfinite(p).all())
        ]
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return f"{len(bad)} of {len(weights)} weight tensors: {shown}"


class UpdateGuard:
    """Undo an update that raised or went non-finite; see the module docstring.

    Args:
        non_finite: ``"skip"`` (warn and go on) or ``"raise"`` (`FloatingPointError`).
        ratio_copy_limit: most weight elements copied before a single-step update to measure
            `update_ratio` (see the module docstring; 0 = never copy).

    Attributes:
        update_ratio: ``||theta_after - theta_before|| / ||theta_before||`` of the last update
            that ended without an exception, NaN when it was not measured.
    """

    def __init__(self, non_finite: str, ratio_copy_limit: int = RATIO_COPY_LIMIT) -> None:
        self.non_finite = non_finite
        self.non_finite_steps = 0
        self.ratio_copy_limit = ratio_copy_limit
        self.update_ratio = math.nan
        self._copy: list[Tensor] = []  # the weights before a single-step update (reused buffers)
        self._snapshot = UpdateSnapshot()  # buffers reused by every update's copy
        self._active: UpdateSnapshot | None = None
        self._multi = False
        self._step = 0
        self._backend: Backend | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._refused: str | None = None  # why `optimizer_step` refused the last step
        self._check_hyperparameters = False
        self._policy: Any = None
        self._last: OptimizerStepResult | None = None

    @contextlib.contextmanager
    def protect(
        self,
        backend: Backend,
        params: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        multi_step: bool,
        step: int,
        policy: Any = None,
    ) -> Iterator[UpdateGuard]:
        """Guard one update of ``multi_step`` (more than one optimizer step) at trainer ``step``;
        ``policy`` names the weights in messages (its ``get_parameters()`` mapping)."""
        self._multi, self._step = multi_step, step
        self._backend, self._optimizer, self._policy = backend, optimizer, policy
        self._check_hyperparameters = True
        self._active = None
        self.update_ratio = math.nan
        weights: list[Tensor] = []
        before: list[Tensor] = []
        if multi_step and backend.supports_rollback:
            self._snapshot.capture(list(params), optimizer, scheduler)
            self._active = self._snapshot
            weights = self._snapshot.params
            before = self._snapshot.saved_params  # its copy of the weights, in order
        elif backend.local_weights:
            weights, before = self._copy_weights(optimizer)
        try:
            yield self
        except BaseException:
            if self._active is not None:
                self._active.restore()
            raise
        else:
            if before:
                after = local_shards([p.detach() for p in weights])
                self.update_ratio = _update_ratio(after, before, backend)
        finally:
            if self._active is not None:
                self._active.release()
            self._active = None
            self._backend = self._optimizer = self._last = self._policy = None
            self._refused = None

    def _copy_weights(self, optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[Tensor]]:
        """The optimizer's floating-point weights and a copy of their values (reused buffers),
        or two empty lists when they hold more than ``ratio_copy_limit`` elements."""
        weights = [p for g in optimizer.param_groups for p in g["params"] if p.is_floating_point()]
        if not weights or sum(p.numel() for p in weights) > self.ratio_copy_limit:
            return [], []
        sources = [p.detach() for p in weights]
        layout = [(t.shape, t.dtype, t.device) for t in sources]
        if layout != [(b.shape, b.dtype, b.device) for b in self._copy]:
            self._copy = [torch.empty_like(t) for t in sources]
        torch._foreach_copy_(self._copy, sources)
        return weights, self._copy

    def optimizer_step(self) -> OptimizerStepResult:
        """The backend's optimizer step, or, at the update's first one (a backend with
        ``local_weights``), a refused one (not applied, gradients cleared) when the
        optimizer's learning rate or weight decay is not finite: `accept` then says which."""
        backend, optimizer = self._backend, self._optimizer
        assert backend is not None, "optimizer_step() outside protect()"
        assert optimizer is not None
        if self._check_hyperparameters and backend.local_weights:
            self._check_hyperparameters = False
            self._refused = _bad_hyperparameter(optimizer)
            if self._refused is not None:
                backend.zero_grad()
                return OptimizerStepResult(math.nan, math.nan, applied=False)
        return backend.optimizer_step()

    def accept(self, result: OptimizerStepResult) -> bool:
        """True when the optimizer step was applied; otherwise undo the update so far, count,
        and warn or raise."""
        self._last = result
        if result.applied:
            return True
        # a loss or gradient made non-finite by NaN/inf weights (e.g. from an earlier optimizer
        # step of this update): name them (failure path only; before the restore repairs them)
        broken = ""
        backend, optimizer = self._backend, self._optimizer
        if (
            self._refused is None
            and backend is not None
            and backend.local_weights
            and optimizer is not None
            and not weights_finite(optimizer)
        ):
            broken = f" (the weights hold NaN/inf: {_non_finite_weights(optimizer, self._policy)})"
        if self._active is not None:
            self._active.restore()
        undone = (
            "the update of this step was undone, so the weights and the optimizer state are exactly "
            "as before it"
            if self._active is not None or not self._multi
            else "the backend skipped this optimizer step; the earlier optimizer steps of this update "
            "stand (their optimizer state is partitioned over the processes)"
        )
        if self._refused is not None:
            what = f"the optimizer's {self._refused} is not finite, so its step was not taken; {undone}"
            fix = (
                "Give the optimizer a finite learning rate and weight decay, e.g. "
                "torch.optim.AdamW(params, lr=3e-4), or use the trainer's default optimizer "
                "(GRPOConfig(learning_rate=3e-4))."
            )
        else:
            what = f"the loss is {result.loss} and the gradient norm {result.grad_norm}{broken}; {undone}"
            fix = "Look for NaN/inf in the policy's log-probs or weights, or lower the learning rate."
        self._refuse(what, fix, can_skip=True)
        return False

    def check_weights(self) -> None:
        """After the update's last optimizer step (all applied): undo the update if a weight is
        NaN/inf (a backend with ``local_weights``; one fused reduction and one host read)."""
        backend, optimizer = self._backend, self._optimizer
        assert backend is not None, "check_weights() outside protect()"
        assert optimizer is not None
        if not backend.local_weights or weights_finite(optimizer):
            return
        which = _non_finite_weights(optimizer, self._policy)
        lrs = sorted({g.get("lr") for g in optimizer.param_groups}, key=str)
        norm = "" if self._last is None else f" ({self._last.grad_norm:.4g})"
        cause = (
            f"the optimizer step made weights NaN/inf ({which}) although the loss and the gradient "
            f"norm{norm} were finite"
        )
        fix = (
            f"Lower the learning rate (now {lrs[0] if len(lrs) == 1 else lrs}: "
            f"GRPOConfig(learning_rate=...) or your optimizer's lr), keep max_grad_norm set, and "
            f"check the optimizer's other hyper-parameters (weight_decay, eps > 0)."
        )
        if self._active is not None:
            self._active.restore()
            self._refuse(
                f"{cause}; the update of this step was undone, so the weights and the optimizer "
                f"state are exactly as before it",
                fix,
                can_skip=True,
            )
            return
        self._refuse(
            f"{cause}. With one optimizer step per trainer step no copy of the weights is kept "
            f"(grpo/update/rollback.py), so this cannot be undone and training cannot go on; resume from "
            f"the last checkpoint",
            fix,
            can_skip=False,
        )

    def _refuse(self, what: str, fix: str, *, can_skip: bool) -> None:
        """Count the step, then warn (``non_finite="skip"`` and ``can_skip``) or raise."""
        self.non_finite_steps += 1
        count = f"{self.non_finite_steps} {'step(s) skipped' if can_skip else 'non-finite step(s)'} so far"
        msg = f"step {self._step}: {what} ({count}). {fix}"
        if self.non_finite == "raise" or not can_skip:
            hint = " (GRPOConfig(non_finite='skip') skips such steps instead.)" if can_skip else ""
            raise FloatingPointError(msg + hint)
        warnings.warn(msg, RuntimeWarning, stacklevel=6)
