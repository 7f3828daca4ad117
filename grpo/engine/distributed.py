"""Data-parallel GRPO over ``torch.distributed``: the same trainer on many processes.

Launch the unchanged training script with ``torchrun --nproc_per_node=N script.py``. Each process
(rank) builds the same policy and a `GRPOTrainer`, and calls ``trainer.step(local_states)`` with
its own shard of the states. The trainer then:

* joins the default process group (it initialises it from torchrun's environment variables —
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` — when the script has not done so
  itself: ``nccl`` for a CUDA device, ``gloo`` for the CPU), and on CUDA uses ``cuda:LOCAL_RANK``;
* broadcasts the policy's parameters from rank 0 once, so every replica starts equal (as DDP does),
  and seeds each rank's global RNGs with ``seed + rank`` so that ranks sample different actions
  (and a script drawing random states draws a different shard on each rank);
* collects, scores and computes advantages locally: groups are built on one rank, so a group is
  never split across processes and the advantages need no communication;
* makes the loss normaliser global. For the rows ``i`` of one optimizer step on all ranks ``r``::

      loss_r   = sum_{i in rank r} sum_t mask * l  /  C,     C = sum_r C_r   (all-reduced count)
      grad     = sum_r grad(loss_r)                           (all-reduce SUM of the gradients)

  so ``grad`` is exactly the gradient of the single-process loss on the global batch (``C`` is the
  number of valid steps for ``token-mean``, of samples for ``seq-mean-token-mean``). Gradients are
  *summed*, not averaged: each rank's loss is already its share of the global mean. With equal
  counts on every rank this equals DDP's average of per-rank means; with unequal counts (variable
  lengths) only the sum over a global normaliser is right;
* reduces the gradients of ``policy.get_parameters()`` itself (flat buckets, one all-reduce each),
  so any `PolicyModel` works, not only an ``nn.Module``; a parameter whose gradient is None on
  every rank stays None (the optimizer skips it, as on one process);
* clips and decides to skip a non-finite step on the reduced gradient, identical on every rank,
  so all ranks take the same decision;
* reduces the step's metrics across ranks in one collective, each by the reduction it declares
  in `grpo.metrics` (means weighted by samples / groups / valid steps, stds pooled, min/max by
  min/max, losses summed, times by max).

Every rank runs the same sequence of collectives whatever its data (no collective is skipped on
local information: a rank whose groups all have zero reward variance still sends zero gradients),
so no rank waits forever. This needs the same number of optimizer steps on every rank
(``ceil(states / mini_batch_size)``); a mismatch raises a `ValueError` on every rank. Pass the
same number of states on every rank; a shorter batch on some rank (the tail of a dataset) is fine
when it gives the same number of optimizer steps, and the update is then that of the union of the
ranks' groups.

Sizes in `GRPOConfig` (``batch_size``, ``mini_batch_size``, ``micro_batch_size``) are *per
process*; the global batch is ``world_size * batch_size`` states and one optimizer step consumes
``world_size * mini_batch_size`` groups (each rank shuffles its own groups into mini-batches).

`is_main_process` tells the one rank that should write checkpoints and logs; `shutdown` ends a
run on every rank.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from grpo.config import DISTRIBUTED_MODES

__all__ = [
    "DistributedSync",
    "barrier",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "is_distributed",
    "is_main_process",
    "main_process_only",
    "rank_batches",
    "reseed_other_ranks",
    "setup_distributed",
    "shard",
    "shutdown",
]

logger = logging.getLogger(__name__)


_T = TypeVar("_T")

#: Elements per gradient bucket (one all-reduce each): 2**25 float32 = 128 MiB of extra memory.
BUCKET_NUMEL = 2**25


# ---- process-group queries (safe without torch.distributed) --------------------------------------
def is_distributed() -> bool:
    """True when a default process group with more than one process is initialised."""
    return _initialised() and torch.distributed.get_world_size() > 1


def get_rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    if _initialised():
        return int(torch.distributed.get_rank())
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """Number of processes in the default group (1 when not distributed)."""
    if _initialised():
        return int(torch.distributed.get_world_size())
    return _env_int("WORLD_SIZE", 1)


def is_main_process() -> bool:
    """True on rank 0 (and on a single process): the one process that writes checkpoints and logs.

    Before the process group exists it reads torchrun's ``RANK`` variable, so it is right from the
    first line of a script launched with torchrun.
    """
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op on a single process)."""
    if is_distributed():
        torch.distributed.barrier()


def shutdown(*trainers: Any) -> None:
    """End a distributed run: release each trainer (`GRPOTrainer.close`), wait for every rank,
    then destroy the default process group if one is initialised (on a single process without one
    it only releases the trainers).

    Call it last, on every rank. A process group still referenced when the interpreter exits is
    freed during finalisation, where gloo's worker threads can abort the process after all its
    work is done (SIGABRT, "terminate called without an active exception"; DeepSpeed ZeRO-3 keeps
    the policy and its groups referenced from module globals until the trainer is closed). A
    ZeRO-3 policy's partitioned parameters reference the groups too: let the script's last
    reference to the policy go before exit (train inside a function, or ``del`` it).
    """
    for trainer in trainers:
        trainer.close()
    barrier()  # every rank done before any tears the group down
    if _initialised():
        torch.distributed.destroy_process_group()


def main_process_only(fn: Callable[[], _T], fallback: _T) -> _T:
    """``fn()`` on rank 0 only (e.g. writing a checkpoint or a log file); every rank then waits.

    Other ranks return ``fallback`` once rank 0 is done, so nothing reads a file before it is
    complete. If ``fn`` raises on rank 0, the other ranks raise a `RuntimeError` naming the error
    instead of waiting forever. On a single process it is just ``fn()``.
    """
    if not is_distributed():
        return fn()
    error: list[str | None] = [None]
    result = fallback
    if is_main_process():
        try:
            result = fn()
        except BaseException as e:
            error[0] = f"{type(e).__name__}: {e}"
            torch.distributed.broadcast_object_list(error, src=0)
            raise
    torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(f"rank 0 failed in {getattr(fn, '__qualname__', fn)!s}: {error[0]}")
    return result


def reseed_other_ranks(seed: int | None, step: int) -> None:
    """After every rank loaded the same checkpoint: give ranks > 0 their own RNG streams again.

    A checkpoint holds one set of RNG states (rank 0's); restored on every rank, the ranks would
    sample the same actions (and draw the same random states). Rank 0 keeps the restored state,
    so a run resumed on one process continues exactly; rank r > 0 re-seeds Python, NumPy and torch
    with ``(seed or 0) * 1_000_003 + step * 1_009 + r``. No-op on a single process. Not a
    collective (no communication).
    """
    rank = get_rank() if is_distributed() else 0
    if rank == 0:
        return
    derived = ((seed or 0) * 1_000_003 + step * 1_009 + rank) % 2**32
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


def _initialised() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; torchrun sets it to one. "
            f"Unset it, or launch with torchrun."
        ) from None


def init_from_env(device: torch.device) -> bool:
    """Initialise the default process group from torchrun's variables, if they ask for > 1 process.

    Backend: ``nccl`` for a CUDA ``device``, else ``gloo``. Returns True when this call created the
    group; False when there is nothing to do (already initialised, or ``WORLD_SIZE`` unset or 1).
    """
    if _initialised():
        return False
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return False
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world} is set but {missing} are not, so the processes cannot find each "
            f"other. Launch with `torchrun --nproc_per_node={world} script.py` (it sets them all), "
            f"or call torch.distributed.init_process_group(...) before building the trainer."
        )
    if not torch.distributed.is_available():
        raise RuntimeError(
            f"WORLD_SIZE={world} asks for {world} processes but this torch build has no "
            f"torch.distributed. Install a torch build with distributed support."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    # torch._dynamo imported *after* the group exists keeps it referenced until interpreter exit
    # (torch 2.13; any torch optimizer imports it), so that destroy_process_group() cannot free it
    # and gloo can abort the process at exit (see `shutdown`). Imported first, it does not.
    importlib.import_module("torch._dynamo")
    torch.distributed.init_process_group(backend=backend)
    logger.info(
        "initialised torch.distributed (%s): rank %d of %d",
        backend,
        torch.distributed.get_rank(),
        torch.distributed.get_world_size(),
    )
    return True


def shard(items: Sequence[_T] | Tensor, rank: int | None = None, world_size: int | None = None) -> Any:
    """This rank's contiguous slice of a global batch of states: ``items[rank*b : (rank+1)*b]``.

    ``b = len(items) // world_size``; the length must divide evenly so every rank takes the same
    number of optimizer steps. Concatenating the shards of ranks 0..W-1 gives back ``items``.
    Shapes: Tensor (W*b, ...) -> (b, ...); sequence of W*b -> list of b.
    """
    r = get_rank() if rank is None else rank
    w = get_world_size() if world_size is None else world_size
    n = len(items)
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"shard: rank={r} is not in [0, world_size={w}).")
    if n % w:
        raise ValueError(
            f"shard: {n} states cannot be split evenly over {w} processes; every process must get "
            f"the same number of states. Use a multiple of {w} (e.g. {n - n % w or w})."
        )
    b = n // w
    part = items[r * b : (r + 1) * b]
    return part if isinstance(part, Tensor) else list(part)


def rank_batches(source: Any, batches: Iterable[Any]) -> Iterator[Any]:
    """This rank's share of each global batch drawn from a list / Tensor ``source``.

    ``batches`` yields global batches of ``world_size * B`` states (cut from ``source`` in order);
    each is `shard`-ed, so rank r steps on states ``[r*B, (r+1)*B)`` of it and the ranks together
    cover the source exactly as one process with batch ``world_size * B`` would. Other sources
    (iterables, callables) are per rank already and pass through unchanged. Identity on one
    process.
    """
    sharded = is_distributed() and isinstance(source, (Tensor, Sequence))
    for batch in batches:
        yield shard(batch) if sharded else batch


def setup_distributed(mode: str, device: torch.device) -> DistributedSync | None:
    """The trainer's entry point: a `DistributedSync` when running on > 1 process, else None.

    ``mode='auto'``: use the default process group, initialising it from torchrun's environment
    when needed; ``'off'``: never communicate (each process trains on its own).
    """
    if mode == "off":
        return None
    if mode != "auto":
        raise ValueError(f"distributed={mode!r} is not one of {DISTRIBUTED_MODES}.")
    init_from_env(device)
    if not is_distributed():
        return None
    return DistributedSync(_process_device(device))


def _process_device(device: torch.device) -> torch.device:
    """A bare ``cuda`` becomes ``cuda:LOCAL_RANK`` (one GPU per process), made current."""
    if device.type == "cuda" and device.index is None:
        local = _env_int("LOCAL_RANK", get_rank() % max(torch.cuda.device_count(), 1))
        device = torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


# ---- the synchronisation the trainer needs ---------------------------------------------------
class DistributedSync:
    """Collectives of data-parallel GRPO on the default process group.

    Every method is a collective: all ranks must call it, in the same order, with tensors of the
    same layout. Tensors live on ``device`` (the trainer's device: CUDA tensors under NCCL).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = int(torch.distributed.get_rank())
        self.world_size = int(torch.distributed.get_world_size())
        self._buckets: list[list[Tensor]] = []

    # ---- parameters --------------------------------------------------------------------------
    def attach(self, params: Sequence[Tensor], owner: object) -> None:
        """Check that every rank has the same parameter layout, then broadcast rank 0's values.

        ``params``: the trainable tensors (``policy.get_parameters()``), in the same order on
        every rank. Raises `ValueError` on every rank when the layouts differ.
        """
        _reject_ddp(owner)
        layout = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
        mine = torch.tensor(
            [len(params), sum(p.numel() for p in params), zlib.crc32(layout.encode())],
            dtype=torch.float64,
            device=self.device,
        )
        every = self.all_gather(mine)
        if not bool((every == every[0]).all()):
            rows = ", ".join(
                f"rank {r}: {int(x[0])} tensors / {int(x[1])} elements" for r, x in enumerate(every.tolist())
            )
            raise ValueError(
                f"{type(owner).__name__}.get_parameters() differs between processes ({rows}; or "
                f"the same counts with different shapes/dtypes). Every rank must build the same "
                f"policy; data parallelism replicates one model."
            )
        self._buckets = _buckets(params)
        with torch.no_grad():
            for bucket in self._buckets:
                flat = torch.cat([p.detach().reshape(-1) for p in bucket])
                torch.distributed.broadcast(flat, src=0)
                for p, value in zip(bucket, _views(flat, bucket), strict=True):
                    p.copy_(value)

    def all_reduce_gradients(self, extra: Tensor | None = None) -> Tensor | None:
        """Sum ``p.grad`` over ranks for every attached parameter (flat buckets).

        A missing gradient counts as zeros; a parameter with no gradient on any rank keeps
        ``grad = None``, exactly as on one process. ``extra`` (a scalar, e.g. the loss) is summed
        in the same all-reduce as the last bucket (in that bucket's dtype) and returned; with no
        bucket it gets an all-reduce of its own.
        """
        if not self._buckets:
            return None if extra is None else self.all_reduce_sum(extra)
        reduced_extra: Tensor | None = None
        for i, bucket in enumerate(self._buckets):
            ref = bucket[0]
            for p in bucket:
                if p.grad is not None and p.grad.is_sparse:
                    raise TypeError(
                        "sparse gradients are not supported by grpo's distributed gradient sync; use "
                        "dense embeddings (nn.Embedding(sparse=False))."
                    )
            flags = torch.tensor([p.grad is not None for p in bucket], dtype=ref.dtype, device=ref.device)
            tail = [flags]
            last = i == len(self._buckets) - 1
            if last and extra is not None:
                tail.append(extra.detach().reshape(1).to(device=ref.device, dtype=ref.dtype))
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket] + tail
            )
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
            if last and extra is not None:
                reduced_extra = flat[-1].to(extra.dtype)
                flat = flat[:-1]
            present = (flat[-len(bucket) :] > 0).tolist()
            for p, value, has in zip(bucket, _views(flat, bucket), present, strict=True):
                if not has:
                    p.grad = None
                elif p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
        return reduced_extra

    # ---- counts -------------------------------------------------------------------------------
    def all_reduce_sum(self, value: Tensor) -> Tensor:
        """``sum_r value_r`` (a new tensor; ``value`` is unchanged)."""
        out = value.detach().clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
        return out

    def check_same_optimizer_steps(self, num_groups: int, mini_batch_size: int) -> None:
        """Raise `ValueError` on every rank unless all ranks take the same number of optimizer steps.

        Each rank takes ``ceil(num_groups / mini_batch_size)`` steps per epoch, and each step runs
        collectives, so the counts must agree. The numbers of groups may differ (e.g. a shorter
        last batch): with the global normaliser the update is still that of the union of the
        ranks' groups.
        """
        steps = -(-num_groups // mini_batch_size)
        mine = torch.tensor([float(num_groups), float(steps)], dtype=torch.float64, device=self.device)
        every = self.all_gather(mine).cpu()
        if len(set(every[:, 1].tolist())) > 1:
            groups = [int(x) for x in every[:, 0].tolist()]
            per_rank = [int(x) for x in every[:, 1].tolist()]
            raise ValueError(
                f"the processes would take different numbers of optimizer steps this step (per "
                f"rank: {per_rank} steps for {groups} states, mini_batch_size={mini_batch_size}), "
                f"and every optimizer step synchronises all of them. Pass the same number of "
                f"states on every rank, e.g. with grpo.engine.distributed.shard(states)."
            )

    def check_same_number_of_states(self, num_states: int, why: str) -> None:
        """Raise `ValueError` on every rank unless all ranks got ``num_states`` states (one
        all-gather). ``why`` says what makes the counts matter (it ends the message's clause)."""
        mine = torch.tensor([float(num_states)], dtype=torch.float64, device=self.device)
        every = [int(x) for x in self.all_gather(mine).cpu().flatten().tolist()]
        if len(set(every)) > 1:
            raise ValueError(
                f"the processes got different numbers of states this step (per rank: {every}), "
                f"but {why}. Pass the same number of states on every rank, e.g. with "
                f"grpo.engine.distributed.shard(states) on a global batch divisible by the world size."
            )

    def all_gather(self, t: Tensor) -> Tensor:
        """Every rank's ``t`` stacked: ``(world_size, *t.shape)`` (on ``t``'s device: move it to
        this process's device first under NCCL)."""
        t = t.to(self.device)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, t.contiguous())
        return torch.stack(parts)


def _buckets(params: Iterable[Tensor]) -> list[list[Tensor]]:
    """Group parameters by (device, dtype), in order, into buckets of at most BUCKET_NUMEL elements."""
    out: list[list[Tensor]] = []
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[int]]] = {}
    for p in params:
        key = (p.device, p.dtype)
        if key not in open_ or (open_[key][1][0] + p.numel() > BUCKET_NUMEL and open_[key][0]):
            bucket: list[Tensor] = []
            out.append(bucket)
            open_[key] = (bucket, [0])
        bucket, size = open_[key]
        bucket.append(p)
        size[0] += p.numel()
    return out


def _views(flat: Tensor, bucket: Sequence[Tensor]) -> list[Tensor]:
    """Each parameter's slice of ``flat`` (its bucket, concatenated in order), shaped like it."""
    out = []
    offset = 0
    for p in bucket:
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


def _reject_ddp(owner: object) -> None:
    """A policy that is (or holds) a DistributedDataParallel would have its gradients reduced twice."""
    if not isinstance(owner, torch.nn.Module):
        return
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, DistributedDataParallel) for m in owner.modules()):
        raise TypeError(
            f"{type(owner).__name__} contains a torch DistributedDataParallel module. GRPOTrainer "
            f"synchronises gradients itself under torchrun; wrapping in DDP would reduce them "
            f"twice. Pass the unwrapped module (ddp.module)."
        )
