"""The update plan: epochs x whole-group optimizer steps x micro-batches, decided once per batch.

For a batch of B groups, ``num_epochs_per_update`` epochs each shuffle the groups (when there is
more than one optimizer step per epoch) and cut them into optimizer steps of
``mini_batch_size`` groups, each cut into micro-batches of ``micro_batch_size`` groups whose
gradients accumulate. A group is never split.

The plan is also the one place that decides the two shortcuts of the update (`UpdatePlan.decide`):

* **behaviour log-probs from the first epoch** (``old_from_first_epoch``): with one optimizer
  step per epoch nothing changes before the first epoch's forwards, so they *are* the behaviour
  log-probs and collection skips a policy forward;
* **the loss normaliser** Z (`aggregation_normaliser` over the optimizer step's rows, summed over
  processes). ``"known"``: the mask was recorded at collection, Z is computed before the forwards.
  ``"deferred"``: the mask is revealed by the forwards; the micro-batch losses are sums (Z = 1),
  the raw counts are added up and the gradients divided by ``max(1, sum of counts)`` once, after
  the last backward (exact: the gradient is linear in 1/Z). ``"from_forward"``: the same for a
  backend that cannot divide its gradients afterwards (DeepSpeed, FSDP); the optimizer step then
  has one micro-batch (otherwise the plan asks for the mask at collection), whose Z is taken from
  its own forward before its backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["MicroBatch", "NormaliserMode", "OptimizerStep", "UpdateDecisions", "UpdatePlan"]

NormaliserMode = Literal["known", "deferred", "from_forward"]


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward/backward: ``groups`` (group indices, in order) and their flat
    ``rows`` (None = every group / row of the batch); ``last``: the optimizer step's last one."""

    groups: Tensor | None
    rows: Tensor | None
    last: bool


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step: its groups / rows (None = all), its micro-batches, and ``on_policy``:
    no optimizer step of this update has run before it, so the current policy is the behaviour
    policy and the ratio is exactly 1."""

    groups: Tensor | None
    rows: Tensor | None
    micro_batches: tuple[MicroBatch, ...]
    on_policy: bool


@dataclass(frozen=True)
class UpdateDecisions:
    """What a batch of ``num_groups`` groups needs before its update (see the module docstring).

    Attributes:
        steps_per_epoch: optimizer steps per epoch, ``ceil(num_groups / mini_batch_size)``.
        needs_old: the update reads behaviour log-probs (more than one optimizer step, or a
            consumer before the update such as a KL folded into the reward).
        old_from_first_epoch: they come from the first epoch's forwards (not from collection).
        mask_at_collection: the loss mask must be known before the update's forwards.
    """

    steps_per_epoch: int
    needs_old: bool
    old_from_first_epoch: bool
    mask_at_collection: bool

    @property
    def old_at_collection(self) -> bool:
        """Record behaviour log-probs (and so the mask) at collection."""
        return (self.needs_old and not self.old_from_first_epoch) or self.mask_at_collection


class UpdatePlan:
    """Epochs x optimizer steps x micro-batches for a batch; see the module docstring.

    Args:
        num_epochs: ``num_epochs_per_update``.
        mini_batch_size: groups per optimizer step.
        micro_batch_size: groups per forward/backward.
        old_before_update: something reads the behaviour log-probs before the update (a KL in
            the reward, advantage whitening over the mask).
        rescales_gradients: the backend can divide gradients after the backward passes.
        generator: the CPU generator that shuffles the groups of each epoch.
    """

    def __init__(
        self,
        *,
        num_epochs: int,
        mini_batch_size: int,
        micro_batch_size: int,
        old_before_update: bool,
        rescales_gradients: bool,
        generator: torch.Generator,
    ) -> None:
        self.num_epochs = num_epochs
        self.mini_batch_size = mini_batch_size
        self.micro_batch_size = micro_batch_size
        self.old_before_update = old_before_update
        self.rescales_gradients = rescales_gradients
        self.generator = generator

    def optimizer_steps_per_update(self, num_groups: int) -> int:
        """``num_epochs * ceil(num_groups / mini_batch_size)``."""
        return self.num_epochs * -(-num_groups // self.mini_batch_size)

    def decide(self, num_groups: int) -> UpdateDecisions:
        """The decisions for a batch of ``num_groups`` groups (the same on every call).

        The trainer decides once per step, from the B states it is given, before collection.
        Collection may then drop groups with an invalid reward (``invalid_rewards="drop_groups"``),
        and every decision stays right for B' < B groups: fewer groups never need more than B
        did (``needs_old`` and ``old_from_first_epoch`` are the same for B' whenever the behaviour
        log-probs were not recorded at collection, since both hold with one optimizer step per
        epoch at B, hence at B'); what depends on the batch's own size (the optimizer steps, and
        whether there is more than one) is read from the batch itself.
        """
        per_epoch = -(-num_groups // self.mini_batch_size)
        micro_per_step = -(-min(num_groups, self.mini_batch_size) // self.micro_batch_size)
        needs_old = self.num_epochs * per_epoch > 1 or self.old_before_update
        mask_first = not self.rescales_gradients and micro_per_step > 1
        first_epoch = needs_old and per_epoch == 1 and not self.old_before_update and not mask_first
        return UpdateDecisions(per_epoch, needs_old, first_epoch, mask_first)

    def normaliser_mode(self, mask_known: bool) -> NormaliserMode:
        """How the optimizer steps' loss normaliser is found (see the module docstring)."""
        if mask_known:
            return "known"
        return "deferred" if self.rescales_gradients else "from_forward"

    def optimizer_steps(
        self, num_groups: int, group_size: int | None, group_ids: Tensor
    ) -> Iterator[OptimizerStep]:
        """The optimizer steps of the whole update, in order (epochs one after the other).

        ``group_size``: G when the batch is uniform and group-major (rows of group g are
        ``g*G ... g*G + G - 1``), else None (rows are looked up in ``group_ids`` (N,)).
        """
        mb, micro = self.mini_batch_size, self.micro_batch_size
        first = True
        for _ in range(self.num_epochs):
            order = torch.randperm(num_groups, generator=self.generator) if num_groups > mb else None
            for start in range(0, num_groups, mb):
                groups = None if order is None else order[start : start + mb]
                count = num_groups if groups is None else int(groups.shape[0])
                micro_batches = tuple(
                    self._micro_batch(groups, m, micro, count, num_groups, group_size, group_ids)
                    for m in range(0, count, micro)
                )
                rows = rows_of(groups, group_size, group_ids)
                yield OptimizerStep(groups, rows, micro_batches, on_policy=first)
                first = False

    @staticmethod
    def _micro_batch(
        step_groups: Tensor | None,
        start: int,
        size: int,
        count: int,
        num_groups: int,
        group_size: int | None,
        group_ids: Tensor,
    ) -> MicroBatch:
        if step_groups is None:
            groups = (
                None
                if start == 0 and size >= num_groups
                else torch.arange(start, min(start + size, num_groups))
            )
        else:
            groups = step_groups[start : start + size]
        return MicroBatch(groups, rows_of(groups, group_size, group_ids), last=start + size >= count)


def rows_of(groups: Tensor | None, group_size: int | None, group_ids: Tensor) -> Tensor | None:
    """Flat rows of ``groups`` (in group order), or None = all rows."""
    if groups is None:
        return None
    if group_size is not None:
        rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()
        return rows.to(group_ids.device)
    return torch.isin(group_ids, groups.to(group_ids.device)).nonzero().flatten()
