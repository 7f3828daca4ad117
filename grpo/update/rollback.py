"""Undo an update: copies of the weights and optimizer state taken before it, restored bitwise.

`GRPOTrainer.update` captures an `UpdateSnapshot` when one step of the trainer runs more than one
optimizer step (several epochs or minibatches). If a later optimizer step meets a NaN/inf loss
or gradient, `restore` puts back the parameters, the optimizer's per-parameter state and
hyper-parameters, and the LR scheduler's state exactly as they were before the step, so a
skipped step leaves no trace. With a single optimizer step per trainer step nothing has changed
before the check, and no snapshot is taken.

Cost: one copy of the parameters and of the optimizer state (for Adam, 3x the parameters' memory)
on their own device, for the duration of the update.

Sharded tensors (``DTensor``, e.g. the parameters and Adam moments under FSDP2,
`grpo.engine.fsdp`) are copied shard by shard: each process saves and restores its own local
shard (``DTensor.to_local()``, which aliases the shard's storage), since DTensor has no sharding
rule for ``_foreach_copy_``. No communication is involved.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["UpdateSnapshot", "local_shards"]


_IMMUTABLE = (int, float, bool, str, type(None))


def local_shards(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each ``DTensor`` replaced by its local shard (an alias of its storage); plain tensors as
    they are. DTensors exist only once ``torch.distributed.tensor`` was imported, so nothing is
    imported here."""
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None)
    if dtensor is None:
        return list(tensors)
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def _clone(v: Any) -> Any:
    """A copy of a param-group value; immutable ones (numbers, strings, None and tuples of them,
    e.g. ``lr`` and ``betas``) are returned as they are (deepcopy would only return them too, slower)."""
    if isinstance(v, Tensor):
        return v.detach().clone()
    if isinstance(v, _IMMUTABLE) or (isinstance(v, tuple) and all(isinstance(x, _IMMUTABLE) for x in v)):
        return v
    return copy.deepcopy(v)


class UpdateSnapshot:
    """What an update may change: parameter values, optimizer state, scheduler state.

    The tensors are copied with one fused ``torch._foreach_copy_`` into buffers that are kept and
    reused by the next `capture` (allocated again only when the set of tensors changes), so taking
    a snapshot every step costs a few dispatches, not one clone per tensor.
    """

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._shapes: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.captured = False

    def capture(self, params: list[Tensor], optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """Record the values to restore: call before the update's first optimizer step."""
        seen = {id(p) for p in params}
        extra = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in seen]
        self.params: list[Tensor] = [*params, *extra]
        self.optimizer = optimizer
        # Per-parameter optimizer state: tensors are copied into buffers, the rest deep-copied.
        self.had_state = {p for p in self.params if p in optimizer.state}
        self.state_tensors: list[Tensor] = []
        self.state_other: dict[Any, dict[str, Any]] = {}
        for p in self.params:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, Tensor):
                    self.state_tensors.append(v)
                else:
                    self.state_other.setdefault(p, {})[k] = copy.deepcopy(v)
        self.groups = [{k: _clone(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.scheduler = scheduler
        self.scheduler_state = None if scheduler is None else copy.deepcopy(scheduler.state_dict())
        sources = local_shards([p.detach() for p in self.params] + self.state_tensors)
        shapes = [(t.shape, t.dtype, t.device) for t in sources]
        if shapes != self._shapes:
            self._buffers = [torch.empty_like(t) for t in sources]
            self._shapes = shapes
        torch._foreach_copy_(self._buffers, sources)  # detached sources: no autograd involved
        self.captured = True

    @property
    def saved_params(self) -> list[Tensor]:
        """The captured copies of `params`' values (local shards), in their order; valid until
        the next `capture` overwrites them."""
        return self._buffers[: len(self.params)]

    def restore(self) -> None:
        """Put every value back (bitwise) and clear the gradients."""
        if not self.captured:
            return
        targets = local_shards([p.detach() for p in self.params] + self.state_tensors)
        with torch.no_grad():
            torch._foreach_copy_(targets, self._buffers)
        state = self.optimizer.state
        for p in self.params:
            if p not in self.had_state:
                state.pop(p, None)  # the optimizer had not touched it yet: back to no state
            else:
                state[p].update({k: copy.deepcopy(v) for k, v in self.state_other.get(p, {}).items()})
        for g, saved in zip(self.optimizer.param_groups, self.groups, strict=True):
            g.update({k: _clone(v) for k, v in saved.items()})
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self.scheduler_state))
        self.optimizer.zero_grad(set_to_none=True)

    def release(self) -> None:
        """Forget the references of the last capture (the buffers are kept for reuse)."""
        self.captured = False
        self.params, self.state_tensors, self.state_other = [], [], {}
