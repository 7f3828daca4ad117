"""The update guard: an update that raises or goes non-finite leaves no trace.

`UpdateGuard.protect` wraps one update. When the update takes more than one optimizer step and
the backend's state can be copied (`Backend.supports_rollback`), it first captures the weights,
the optimizer and the LR schedule (`grpo.rollback.UpdateSnapshot`); an exception inside the
block restores them and propagates. `UpdateGuard.accept` is asked after each optimizer step:
a step whose loss or gradient was not finite was not applied by the backend; the guard restores
the snapshot (undoing the earlier optimizer steps of the update), counts the step in
``non_finite_steps``, and warns (``non_finite="skip"``) or raises `FloatingPointError`
(``"raise"``). With a single optimizer step nothing has changed before the check, so no snapshot
is needed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo.backends import Backend, OptimizerStepResult
from grpo.rollback import UpdateSnapshot

__all__ = ["UpdateGuard"]


class UpdateGuard:
    """Undo an update that raised or went non-finite; see the module docstring.

    Args:
        non_finite: ``"skip"`` (warn and go on) or ``"raise"`` (`FloatingPointError`).
    """

    def __init__(self, non_finite: str) -> None:
        self.non_finite = non_finite
        self.non_finite_steps = 0
        self._snapshot = UpdateSnapshot()  # buffers reused by every update's copy
        self._active: UpdateSnapshot | None = None
        self._multi = False
        self._step = 0

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
    ) -> Iterator[UpdateGuard]:
        """Guard one update of ``multi_step`` (more than one optimizer step) at trainer ``step``."""
        self._multi, self._step = multi_step, step
        self._active = None
        if multi_step and backend.supports_rollback:
            self._snapshot.capture(list(params), optimizer, scheduler)
            self._active = self._snapshot
        try:
            yield self
        except BaseException:
            if self._active is not None:
                self._active.restore()
            raise
        finally:
            if self._active is not None:
                self._active.release()
            self._active = None

    def accept(self, result: OptimizerStepResult) -> bool:
        """True when the optimizer step was applied; otherwise undo the update so far, count,
        and warn or raise."""
        if result.applied:
            return True
        if self._active is not None:
            self._active.restore()
        self.non_finite_steps += 1
        undone = (
            "the update of this step was undone, so the weights and the optimizer state are exactly "
            "as before it"
            if self._active is not None or not self._multi
            else "the backend skipped this optimizer step; the earlier optimizer steps of this update "
            "stand (their optimizer state is partitioned over the processes)"
        )
        msg = (
            f"step {self._step}: the loss is {result.loss} and the gradient norm {result.grad_norm}; "
            f"{undone} ({self.non_finite_steps} step(s) skipped so far). Look for NaN/inf in the "
            f"policy's log-probs or weights, or lower the learning rate."
        )
        if self.non_finite == "raise":
            raise FloatingPointError(msg + " (GRPOConfig(non_finite='skip') skips such steps instead.)")
        warnings.warn(msg, RuntimeWarning, stacklevel=5)
        return False
