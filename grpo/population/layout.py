"""Where the members live: all in this process, or one per process under torchrun.

`LocalLayout` holds every slot; `ProcessLayout` holds slot ``rank`` on each of ``world_size ==
P`` processes of the default process group (gloo or NCCL) and moves what the generation needs:

* ``gather``: each process's ``{index: value}`` (fitness, step metrics) merged on every process
  (``torch.distributed.all_gather_object``);
* ``share``: a winner's state dict from its process to every process
  (``torch.distributed.broadcast_object_list``; the objects are this job's own state dicts).

Both layouts run the same population code, so a fixed seed gives the same result either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = ["LocalLayout", "MemberLayout", "ProcessLayout", "choose_layout"]


class MemberLayout(Protocol):
    """Which slots this process trains, and how values move between processes."""

    rank: int
    is_main: bool

    def local(self, size: int) -> list[int]: ...
    def gather(self, values: Mapping[int, Any]) -> dict[int, Any]: ...
    def share(self, state: Any, owner: int) -> Any: ...
    def barrier(self) -> None: ...


class LocalLayout:
    """Every slot in this process; nothing to communicate."""

    rank = 0
    is_main = True

    def local(self, size: int) -> list[int]:
        return list(range(size))

    def gather(self, values: Mapping[int, Any]) -> dict[int, Any]:
        return dict(values)

    def share(self, state: Any, owner: int) -> Any:
        return state

    def barrier(self) -> None:
        return None


class ProcessLayout:
    """Slot ``r`` on rank ``r`` (``world_size`` must equal the population size)."""

    def __init__(self) -> None:
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.is_main = self.rank == 0

    def local(self, size: int) -> list[int]:
        if size != self.world_size:
            raise ValueError(
                f"a distributed population holds one member per process: size={size} but the process "
                f"group has {self.world_size} processes; launch torchrun --nproc-per-node {size}, or "
                f"pass distributed=False to train every member in each process."
            )
        return [self.rank]

    def gather(self, values: Mapping[int, Any]) -> dict[int, Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, dict(values))
        merged: dict[int, Any] = {}
        for part in out:
            merged.update(part)
        return merged

    def share(self, state: Any, owner: int) -> Any:
        box = [state if self.rank == owner else None]
        torch.distributed.broadcast_object_list(box, src=owner)
        return box[0]

    def barrier(self) -> None:
        torch.distributed.barrier()


def choose_layout(distributed: bool | None) -> MemberLayout:
    """`ProcessLayout` when ``distributed`` (None: when a process group of > 1 processes is up),
    else `LocalLayout`."""
    up = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed is None:
        distributed = up and torch.distributed.get_world_size() > 1
    if distributed and not up:
        raise RuntimeError(
            "Population(distributed=True) needs an initialised process group: call "
            "torch.distributed.init_process_group() (torchrun sets its environment) first."
        )
    return ProcessLayout() if distributed else LocalLayout()
