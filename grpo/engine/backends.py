"""Backends: how one optimizer step's gradients are made, reduced and applied.

The update (`grpo.update.loop`) is the same loop whatever runs it; a backend owns the parts that
depend on where the weights live::

    backend.zero_grad()
    for each micro-batch:  backend.backward(loss, last=...)      # accumulates the step's loss
    backend.optimizer_step() -> OptimizerStepResult(grad_norm, loss, applied)

plus the sums over processes that make the loss normaliser global (`Backend.global_sum`) and
the cross-process reduction of the step's metrics (`Backend.reduce_metrics`, driven by each
metric's declared reduction in `grpo.metrics`).

Implementations:

* `LocalBackend`: one process; any `PolicyModel` (its ``get_parameters()``).
* `DataParallelBackend`: torchrun; the trainer's own gradient sync (`grpo.engine.distributed`),
  any `PolicyModel`.
* `grpo.engine.deepspeed.DeepSpeedBackend`: DeepSpeed ZeRO-1/2/3 for ``nn.Module`` policies.
* `grpo.engine.fsdp.FSDPBackend`: PyTorch FSDP2 (``fully_shard``) for ``nn.Module`` policies.

Adding one: implement the `Backend` protocol, then choose it in
`grpo.engine.setup.make_backend` (docs/architecture.md, "How to add a backend").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from grpo.engine.distributed import DistributedSync
from grpo.engine.optim import clip_to_norm, grad_norm
from grpo.metrics import StepCounts, reduce_across_ranks

__all__ = [
    "Backend",
    "DataParallelBackend",
    "LocalBackend",
    "OptimizerStepResult",
    "ShardedWeights",
    "apply_or_skip",
]


@dataclass(frozen=True)
class OptimizerStepResult:
    """What one optimizer step did.

    Attributes:
        grad_norm: the global gradient norm before clipping (NaN/inf when not finite).
        loss: the global loss of the optimizer step (the sum of its micro-batch losses over
            every process).
        applied: False when the loss or the gradient was not finite: the weights were not
            changed and the gradients were cleared.
    """

    grad_norm: float
    loss: float
    applied: bool


@runtime_checkable
class Backend(Protocol):
    """The parts of an optimizer step that depend on where the weights live.

    Attributes:
        world_size: processes taking part (1 = one process).
        rescales_gradients: gradients can be divided after the backward passes
            (`rescale_gradients`); False when the backend reduces or partitions them during
            the backward (DeepSpeed, FSDP), so the loss normaliser must be known before.
        supports_rollback: an `grpo.update.rollback.UpdateSnapshot` of the parameters and optimizer
            state taken before an update restores it (False where the state is partitioned).
        local_weights: every trainable weight and its gradient are whole tensors of this process
            (``p``, ``p.grad``), so `grpo.update.guard` checks them directly (non-finite weights, an
            optimizer's non-finite learning rate, log-probs that reach no parameter); False where
            they are partitioned (DeepSpeed, FSDP).
        lockstep_forwards: every process must run the same forwards, because each forward
            gathers partitioned weights (DeepSpeed ZeRO-3); the trainer then refuses different
            numbers of states on different processes before any forward, instead of hanging.
        checkpointable: `GRPOTrainer.state_dict` can hold this backend's whole state (False for
            DeepSpeed, whose optimizer state stays partitioned over the processes).
        name: what the backend is, for messages ("one process", "DDP", "FSDP2", "DeepSpeed ZeRO-2").
        sharded_weights: None when the weights are whole tensors of the policy on every process
            (the trainer reads and writes them through the policy); else the `ShardedWeights`
            that gathers them for a checkpoint and shards them back on load (FSDP).
    """

    world_size: int
    rescales_gradients: bool
    supports_rollback: bool
    local_weights: bool
    lockstep_forwards: bool
    checkpointable: bool
    name: str
    sharded_weights: ShardedWeights | None

    def zero_grad(self) -> None:
        """Clear the gradients before an optimizer step's first backward."""

    def global_sum(self, value: Tensor) -> Tensor:
        """``sum_r value_r`` over processes (a new tensor; the value itself on one process)."""

    def backward(self, loss: Tensor, *, last: bool) -> None:
        """Backward of one micro-batch's ``loss``; ``last``: the optimizer step's last one."""

    def rescale_gradients(self, divisor: Tensor) -> None:
        """Divide this process's gradients and accumulated loss by ``divisor`` (a deferred loss
        normaliser; only when ``rescales_gradients``)."""

    def optimizer_step(self) -> OptimizerStepResult:
        """Reduce, clip and apply the gradients unless the loss or the gradient is not finite;
        step the LR schedule when applied."""

    def reduce_metrics(self, metrics: Mapping[str, float], counts: StepCounts) -> dict[str, float]:
        """The global value of each metric (`grpo.metrics.reduce_across_ranks`)."""

    def check_same_optimizer_steps(self, num_groups: int, mini_batch_size: int) -> None:
        """Raise on every process unless all take the same number of optimizer steps."""

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}``: whole (not partitioned) states."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def gathered(self) -> AbstractContextManager[None]:
        """A context in which the policy's (and the reference copy's) weights hold their full
        values on every process, for reading (every process must enter it); a no-op where the
        weights are whole already."""

    def close(self) -> None:
        """Release what the backend holds outside the trainer (engines, hooks, process groups)."""


class ShardedWeights(Protocol):
    """Weights sharded over the processes (`Backend.sharded_weights`): the policy's gathered into
    one whole state for a checkpoint (in `grpo.state.checkpoint.policy_state`'s format, so that
    a checkpoint moves between sharded and whole runs), checked and sharded back on load (FSDP,
    `grpo.engine.fsdp`). The trainer's state knows them only through these three methods."""

    def check_policy(self, policy: Any) -> None:
        """Raise (ValueError, NotImplementedError; on every rank alike, before any collective) for
        a policy whose weights this cannot map to the sharded module's."""

    def policy_state(self, policy: Any) -> dict[str, Tensor]:
        """The policy's whole weights by its own names on rank 0 (``{}`` on the others); a collective."""

    def load_policy_state(
        self, policy: Any, state: Mapping[str, Any], problem: str | None, source: str
    ) -> str | None:
        """Load a trainer state's ``policy`` weights once every rank agrees the state fits
        (``problem``: this rank's own verdict; rank 0 also checks the weights and the optimizer
        state); returns the first problem with nothing changed, else None. A collective."""


class _Steps(Protocol):
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    max_grad_norm: float | None

    def zero_grad(self) -> None: ...


def apply_or_skip(
    backend: _Steps, grads: Sequence[Tensor], norm: float, loss: float, dtype: torch.dtype
) -> OptimizerStepResult:
    """The end of an optimizer step once the global gradient ``norm`` and ``loss`` are known (read
    on the host): clip ``grads`` (`grpo.engine.optim.clip_to_norm`; ``dtype`` of the norm), step the
    optimizer and the LR schedule when both are finite; otherwise clear the gradients and leave
    the weights alone."""
    applied = math.isfinite(norm) and math.isfinite(loss)
    if applied:
        clip_to_norm(grads, norm, backend.max_grad_norm, dtype)
        backend.optimizer.step()
        if backend.scheduler is not None:
            backend.scheduler.step()
    else:
        backend.zero_grad()
    return OptimizerStepResult(norm, loss, applied)


class LocalBackend:
    """One process: ``loss.backward()``, clip, ``optimizer.step()`` over ``params``.

    The gradient norm and the loss are read to the host together (one synchronisation) and the
    clipping coefficient is computed there (`grpo.engine.optim.clip_to_norm`, bitwise torch's).
    """

    world_size = 1
    rescales_gradients = True
    supports_rollback = True
    local_weights = True
    lockstep_forwards = False
    checkpointable = True
    name = "one process"
    sharded_weights: ShardedWeights | None = None

    def __init__(
        self,
        params: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        max_grad_norm: float | None,
    ) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self._loss: Tensor | None = None
        # a torch optimizer that does not override zero_grad: the same assignments without its
        # profiler scope (a few us per call on small policies)
        self._plain_zero_grad = type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad

    def zero_grad(self) -> None:
        self._loss = None
        if not self._plain_zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def global_sum(self, value: Tensor) -> Tensor:
        return value.detach()  # one process: the sum is the value (callers never write to it)

    def backward(self, loss: Tensor, *, last: bool) -> None:
        loss.backward()  # type: ignore[no-untyped-call]
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def rescale_gradients(self, divisor: Tensor) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, divisor)
        if self._loss is not None:
            self._loss = self._loss / divisor

    def _reduce(self, loss: Tensor | None) -> Tensor | None:
        """The gradients and the loss over processes (nothing to do on one)."""
        return loss

    def optimizer_step(self) -> OptimizerStepResult:
        loss = self._reduce(self._loss)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = grad_norm(grads)
        if loss is None:
            values = [float(norm), 0.0]
        elif loss.device == norm.device and loss.dtype == norm.dtype:
            values = torch.stack([norm, loss]).tolist()
        else:
            values = [float(norm), float(loss)]
        self._loss = None
        return apply_or_skip(self, grads, values[0], values[1], norm.dtype)

    def reduce_metrics(self, metrics: Mapping[str, float], counts: StepCounts) -> dict[str, float]:
        return dict(metrics)

    def check_same_optimizer_steps(self, num_groups: int, mini_batch_size: int) -> None:
        return

    def state_dict(self) -> dict[str, Any]:
        sched = self.scheduler
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if sched is None else sched.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()  # the weights are whole tensors of this process

    def close(self) -> None:
        return None


class DataParallelBackend(LocalBackend):
    """torchrun: every process holds the whole policy; gradients are summed over processes.

    Each process's loss is its share of the global mean (the normaliser is global), so the sum
    of the gradients is the gradient of the one-process loss on the union of the batches. The
    loss rides in the last gradient bucket's all-reduce, so every rank decides on the same
    global loss and norm (see `grpo.engine.distributed`).
    """

    name = "DDP"

    def __init__(
        self,
        sync: DistributedSync,
        params: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        max_grad_norm: float | None,
    ) -> None:
        super().__init__(params, optimizer, scheduler, max_grad_norm)
        self.sync = sync
        self.world_size = sync.world_size

    def global_sum(self, value: Tensor) -> Tensor:
        return self.sync.all_reduce_sum(value)

    def _reduce(self, loss: Tensor | None) -> Tensor | None:
        return self.sync.all_reduce_gradients(loss)

    def reduce_metrics(self, metrics: Mapping[str, float], counts: StepCounts) -> dict[str, float]:
        return reduce_across_ranks(metrics, counts, self.sync.all_gather)

    def check_same_optimizer_steps(self, num_groups: int, mini_batch_size: int) -> None:
        self.sync.check_same_optimizer_steps(num_groups, mini_batch_size)
