"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) for ``nn.Module`` policies.

FSDP2 shards every parameter over the W data-parallel processes (dim 0, one slice per rank, as
a ``DTensor``), and with it the gradients and the optimizer state: each process holds about 1/W
of the weights, gradients and Adam moments. A module's full weights are all-gathered just before
its forward (and again for its backward) and freed afterwards, one sharded unit at a time;
gradients are reduce-scattered after each unit's backward.

Use (every process runs the same script under torchrun)::

    policy = ...                                    # an nn.Module policy, or CausalLMPolicy
    module = shard_policy(policy, device)           # BEFORE the optimizer: parameters become DTensors
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = default_optimizer(params, lr, weight_decay)
    backend = FSDPBackend(module, params, optimizer, scheduler, max_grad_norm, sync)

The update is that of one process on the union of the ranks' batches:

* each process's loss is its share of the global mean, ``loss_r = sum_{i in rank r} l_i / C`` with
  the all-reduced normaliser ``C`` (`Backend.global_sum`), so the gradient must be the SUM over
  ranks ``g = sum_r grad(loss_r)``. FSDP2 averages (divides by W) by default; `shard_policy` sets
  every sharded unit's gradient divide factor to 1 and forces plain SUM collectives
  (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``): the reduced
  gradient is the exact sum, with no multiplication by W then division by W (scaling the loss by
  W would round). The second setter matters: a divide factor alone makes FSDP2 reduce with
  ``ReduceOp.PREMUL_SUM``, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo");
* gradients are reduce-scattered after every micro-batch's backward and accumulate in the sharded
  ``p.grad`` (the memory stays 1/W; ``set_requires_gradient_sync(False)`` would keep full
  gradients on every rank until the last micro-batch, which is what sharding avoids);
* the gradient norm is global: ``||g|| = sqrt(sum_r sum_{p} ||g_{p,r}||^2)`` over the local
  shards, all-reduced together with the step's loss (one collective); every rank then takes the
  same decision: skip when the loss or the norm is not finite (gradients cleared, nothing
  applied), else clip with ``coef = min(1, max_norm / (||g|| + 1e-6))`` (`grpo.engine.optim.clip_to_norm`,
  as ``torch.nn.utils.clip_grad_norm_``), ``optimizer.step()`` on the shards, ``scheduler.step()``.

The optimizer and scheduler states of `FSDPBackend.state_dict` are whole (unsharded) and in
torch's own format (``{"state": {index: ...}, "param_groups": [...]}``), the same as one
process's ``optimizer.state_dict()``: a checkpoint moves between FSDP and non-FSDP runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from grpo.engine.backends import OptimizerStepResult, ShardedWeights, apply_or_skip
from grpo.engine.deepspeed import training_module
from grpo.engine.distributed import DistributedSync
from grpo.engine.optim import grad_norm
from grpo.metrics import StepCounts, reduce_across_ranks

__all__ = [
    "FSDPBackend",
    "default_units",
    "full_state_dict",
    "is_fsdp_sharded",
    "run_as_forward",
    "shard_policy",
]

logger = logging.getLogger(__name__)

# prefixes that torch.distributed.checkpoint leaves out of a parameter's fully qualified name
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


# ---- sharding -----------------------------------------------------------------------------------
def _fsdp() -> Any:
    """``torch.distributed.fsdp`` (FSDP2's ``fully_shard`` and ``FSDPModule``), with a clear
    error where this torch lacks them."""
    try:
        from torch.distributed import fsdp
    except ImportError as e:  # pragma: no cover - torch without torch.distributed
        raise ImportError(
            "GRPOConfig(fsdp=True) needs torch.distributed, which this torch build lacks. Install a "
            "torch build with distributed support, or set GRPOConfig(fsdp=False)."
        ) from e
    if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
        raise ImportError(
            f"GRPOConfig(fsdp=True) needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
            f"this is torch {torch.__version__}. Upgrade torch, or set GRPOConfig(fsdp=False)."
        )
    return fsdp


def is_fsdp_sharded(module: nn.Module) -> bool:
    """True when ``module`` was sharded by FSDP2 (``fully_shard``; its class is an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return False
    return isinstance(module, FSDPModule)


def _policy_module(policy: Any) -> nn.Module:
    """`grpo.engine.deepspeed.training_module`, with FSDP's message for a policy without one."""
    return training_module(
        policy,
        needs="FSDP shards the parameters of an nn.Module",
        way_out="train with distributed data parallelism instead (GRPOConfig(fsdp=False)): it works "
        "with any PolicyModel",
    )


def _shares_parameters_outside(unit: nn.Module, counts: Mapping[int, int]) -> bool:
    """True when a parameter of ``unit`` is also registered outside it (a tied weight): such a
    parameter must stay in an enclosing unit, so that one unit owns it."""
    inside: dict[int, int] = {}
    for _, p in unit.named_parameters(remove_duplicate=False):
        inside[id(p)] = inside.get(id(p), 0) + 1
    return any(counts[k] > n for k, n in inside.items())


def default_units(module: nn.Module) -> list[nn.Module]:
    """The submodules that `shard_policy` shards as their own units (before the root), deepest
    first (FSDP2 shards children before their parents).

    * A Hugging Face model: every submodule whose class is in its ``_no_split_modules`` (the
      transformer blocks, e.g. ``model.model.layers[i]``, ``LlamaDecoderLayer``), as accelerate's
      FSDP auto-wrap does. Embeddings, final norm and LM head stay in the root unit (tied
      input/output embeddings must share one unit).
    * Any other module: every submodule that owns parameters itself (``nn.Linear``,
      ``nn.Embedding``, a module with an ``nn.Parameter`` attribute, ...). Those are the modules
      that are called whenever their weights are used, which is what FSDP needs: a unit's shards
      are gathered by its forward hook. (Their parents are not always called: e.g.
      `grpo.policies.DistributionPolicy` runs ``CategoricalMLP.net`` directly.)

    Submodules sharing a parameter with something outside them (tied weights) are left to an
    enclosing unit (the root).
    """
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    names = getattr(module, "_no_split_modules", None)
    if names:
        wanted = set(names)
        candidates = [(n, m) for n, m in module.named_modules() if n and type(m).__name__ in wanted]
    else:
        candidates = [
            (n, m) for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))
        ]
    candidates.sort(key=lambda nm: -nm[0].count("."))  # deepest first; stable within a depth
    return [m for _, m in candidates if not _shares_parameters_outside(m, counts)]


_T = TypeVar("_T")


def run_as_forward(module: nn.Module, fn: Callable[..., _T], *args: Tensor) -> _T:
    """``fn(*args)`` run as ``module``'s forward, so that the hooks FSDP2 or DeepSpeed ZeRO-3 put
    on ``module`` gather its shards for the call (and again for the backward of what it returns)
    and free them afterwards: one gather per call, however many chunks ``fn`` makes.

    Needed when a computation uses weights of a module without calling it, typically the root of
    a Hugging Face model whose backbone and LM head are used directly (e.g.
    `grpo.llm.CausalLMPolicy`'s chunked log-probs: ``model.model(...)`` then
    ``lm_head.weight``). Modules inside still gather their own shards when called. The tensors of
    the result that need a gradient (in tuples, lists, dicts, dataclasses) carry the hook that
    re-gathers the weights for the backward. A module that is not sharded simply runs ``fn`` as
    its forward.
    """
    own = module.__dict__.get("forward")  # an instance-level forward (another library's hook)
    module.forward = fn
    try:
        out: _T = module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
    return out


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module) -> None:
    """Every rank's full parameters and buffers := rank 0's (before sharding), so that the shards
    come from one model even when the ranks built theirs from different seeds (as DDP does)."""
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        torch.distributed.broadcast(t.data, src=0)


def shard_policy(
    policy: Any,
    device: torch.device,
    *,
    units: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    reshard_after_forward: bool = True,
    broadcast_from_rank0: bool = True,
) -> nn.Module:
    """Shard the policy's module with FSDP2, in place, and return it (now an ``FSDPModule``).

    Every process must call it, with the same policy architecture, BEFORE the optimizer is built:
    FSDP2 replaces each parameter by a sharded ``DTensor`` (an optimizer built earlier would hold
    the old, full tensors). Steps: rank 0's weights are broadcast to every rank (unless
    ``broadcast_from_rank0=False``); each unit of
    ``units(module)`` (default `default_units`: the transformer blocks of a Hugging Face model,
    else every submodule owning parameters) is sharded with ``fully_shard``, then the root;
    every unit's gradient reduction is set to a plain SUM (see the module docstring).

    Args:
        policy: an ``nn.Module`` policy, or one with ``training_module()`` (e.g.
            `grpo.llm.CausalLMPolicy`, whose Hugging Face model is sharded).
        device: where the shards live (``cuda:LOCAL_RANK`` under NCCL, or ``cpu`` under gloo);
            the device mesh is one-dimensional over the default process group.
        units: which submodules become their own FSDP units (a unit's full weights exist only
            while it runs); the root is always one.
        reshard_after_forward: free each unit's full weights after its forward (all-gather again
            for the backward; least memory). False keeps them until the backward (less traffic).
        broadcast_from_rank0: first make every rank's weights and buffers rank 0's (one
            broadcast of the whole model); False when the caller did it already (e.g.
            ``DistributedSync.attach``) or loads the weights afterwards.

    Raises:
        TypeError: the policy has no ``nn.Module``.
        RuntimeError: torch.distributed is not initialised.
    """
    module = _policy_module(policy)
    fsdp = _fsdp()
    dist = torch.distributed
    _check_can_shard(module)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    if broadcast_from_rank0:
        _broadcast_from_rank0(module)
    chosen = list((units or default_units)(module))
    for unit in [*chosen, module]:
        fsdp.fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    _sum_gradients(module)
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in module.parameters())
        shown = (type(module).__name__, world, device, len(chosen), n, -(-n // world))
        logger.info(
            "FSDP2: %s sharded over %d processes on %s (%d units + root, %d parameters, ~%d per rank)", *shown
        )
    return module


def _sum_gradients(module: nn.Module) -> None:
    """Every FSDP unit reduces its gradients by a plain SUM: the losses are shares of a global
    mean, so the gradients are summed, never averaged (both setters act on one unit only)."""
    for m in module.modules():
        if is_fsdp_sharded(m):
            sharded: Any = m
            sharded.set_gradient_divide_factor(1.0)
            sharded.set_force_sum_reduction_for_comms(True)


def _check_can_shard(module: nn.Module) -> None:
    """Refuse to shard without a process group, or twice."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "FSDP shards the policy over the processes of torch.distributed's default process group, "
            "which is not initialised. Launch with `torchrun --nproc_per_node=N script.py` (the "
            "trainer joins the group), or call torch.distributed.init_process_group(...) before "
            "shard_policy."
        )
    if is_fsdp_sharded(module):
        raise ValueError(
            f"{type(module).__name__} is sharded by FSDP already; call shard_policy once per policy."
        )


# ---- the backend ---------------------------------------------------------------------------------
def _local(t: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (an alias of its storage); a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _fqn(name: str) -> str:
    """A parameter's name as torch.distributed.checkpoint writes it (wrapper prefixes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class FSDPBackend:
    """The `grpo.engine.backends.Backend` of a policy sharded by `shard_policy`.

    Args:
        module: the sharded module (what `shard_policy` returned).
        params: the trainable parameters (sharded ``DTensor``s), those of ``optimizer``.
        optimizer: a torch optimizer built over ``params`` after sharding.
        scheduler: its LR schedule, or None.
        max_grad_norm: clip the global gradient norm to it (None: no clipping).
        sync: the trainer's `grpo.engine.distributed.DistributedSync` (the process group's collectives).
    """

    rescales_gradients = False
    supports_rollback = True  # grpo.update.rollback copies each rank's local shards (bitwise, tested)
    local_weights = False  # partitioned: the guard's weight and gradient checks do not apply
    lockstep_forwards = False
    name = "FSDP2"
    checkpointable = True  # gathered into one whole state on rank 0 (GRPOTrainer.state_dict)

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        max_grad_norm: float | None,
        sync: DistributedSync,
    ) -> None:
        if not is_fsdp_sharded(module):
            raise TypeError(
                f"FSDPBackend needs the module returned by shard_policy(policy, device); "
                f"{type(module).__name__} is not sharded by FSDP2. Call shard_policy before building "
                f"the optimizer."
            )
        self.module = module
        self.params = list(params)
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not {id(p) for p in self.params} <= trainable or not in_optimizer <= trainable:
            raise ValueError(
                f"the parameters given to FSDPBackend (or its optimizer's) are not the sharded "
                f"parameters of {type(module).__name__}: build the optimizer AFTER "
                f"shard_policy(...), over [p for p in module.parameters() if p.requires_grad]."
            )
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.sync = sync
        self.world_size = sync.world_size
        self.rank = sync.rank
        self.sharded_weights: ShardedWeights | None = self  # gathered for checkpoints, sharded on load
        self._loss: Tensor | None = None
        self._names = {id(p): _fqn(n) for n, p in module.named_parameters()}

    def gathered(self) -> AbstractContextManager[None]:
        """A no-op: read the full weights with `gathered_model_state_dict` or `full_state_dict`."""
        return nullcontext()

    def close(self) -> None:
        return None  # FSDP2's hooks live on the module, freed with it

    # ---- one optimizer step ----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drop the (sharded) gradients and the accumulated loss."""
        self._loss = None
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def global_sum(self, value: Tensor) -> Tensor:
        """``sum_r value_r`` over the processes (all-reduce; a new tensor)."""
        return self.sync.all_reduce_sum(value)

    def backward(self, loss: Tensor, *, last: bool) -> None:
        """``loss.backward()``: FSDP reduce-scatters (sums) this micro-batch's gradients into the
        sharded ``p.grad`` as each unit's backward ends (every micro-batch, ``last`` or not, so
        the gradients stay sharded); the loss is accumulated, detached, for the step's total."""
        loss.backward()  # type: ignore[no-untyped-call]
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def rescale_gradients(self, divisor: Tensor) -> None:
        """Divide the (already reduced) gradient shards and the accumulated loss by ``divisor``,
        which must be the same on every process (a global normaliser): the gradients were summed
        over processes during the backward. The trainer does not need it (``rescales_gradients``
        is False: the normaliser is known before the backward)."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, divisor.to(grads[0].device))
        if self._loss is not None:
            self._loss = self._loss / divisor

    def optimizer_step(self) -> OptimizerStepResult:
        """Global loss and gradient norm (one all-reduce of ``[sum_p ||g_p,r||^2, loss_r]``), then
        skip (non-finite) or clip + ``optimizer.step()`` + ``scheduler.step()``, the same on
        every process."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        local_norm = grad_norm(grads).to(self.sync.device, torch.float64)
        loss = torch.zeros((), dtype=torch.float64, device=self.sync.device)
        if self._loss is not None:
            loss = self._loss.to(self.sync.device, torch.float64)
        both = torch.stack([local_norm.square(), loss])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM)
        sum_squares, total_loss = both.tolist()
        norm = math.sqrt(sum_squares) if math.isfinite(sum_squares) else sum_squares
        dtype = grads[0].dtype if grads else torch.float32
        self._loss = None
        return apply_or_skip(self, grads, norm, total_loss, dtype)

    # ---- across processes --------------------------------------------------------------------
    def reduce_metrics(self, metrics: Mapping[str, float], counts: StepCounts) -> dict[str, float]:
        """Each metric's global value (`grpo.metrics.reduce_across_ranks`, one all-gather)."""
        return reduce_across_ranks(metrics, counts, self.sync.all_gather)

    def check_same_optimizer_steps(self, num_groups: int, mini_batch_size: int) -> None:
        """Raise on every process unless all take the same number of optimizer steps."""
        self.sync.check_same_optimizer_steps(num_groups, mini_batch_size)

    # ---- state -------------------------------------------------------------------------------
    def _index_of_names(self) -> dict[str, int]:
        """``{parameter name: index}`` in the optimizer's numbering (params of group 0, then 1, ...),
        the keys of ``optimizer.state_dict()["state"]``."""
        out: dict[str, int] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                name = self._names.get(id(p))
                if name is None:
                    raise ValueError(
                        "the optimizer holds a tensor that is not a parameter of the sharded module; "
                        "build the optimizer over the module's parameters after shard_policy."
                    )
                out[name] = len(out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}``, whole (unsharded) and on the CPU, on rank 0.

        A collective: EVERY process must call it (the moments are all-gathered); rank 0 gets the
        whole optimizer state in ``optimizer.state_dict()``'s format (integer keys in the
        optimizer's parameter order, full tensors), the other ranks ``{}`` for it (they do not
        write checkpoints). Before the first optimizer step the state is empty on every rank.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        sched = None if self.scheduler is None else self.scheduler.state_dict()
        if not self.optimizer.state:  # torch would initialise the state by a zero step; keep it empty
            return {"optimizer": self.optimizer.state_dict(), "scheduler": sched}
        full: dict[str, Any] = get_optimizer_state_dict(
            self.module, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        optimizer: dict[str, Any] = {}
        if full:  # rank 0
            index = self._index_of_names()
            unknown = [k for k in full["state"] if k not in index]
            if unknown:
                raise RuntimeError(
                    f"torch.distributed.checkpoint named parameters {unknown[:3]} that the module's "
                    f"named_parameters() does not have; cannot number the optimizer state."
                )
            groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
            optimizer = {"state": {index[k]: v for k, v in full["state"].items()}, "param_groups": groups}
        return {"optimizer": optimizer, "scheduler": sched}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (or one process's ``optimizer.state_dict()``).

        A collective: every process must call it. Rank 0's ``state`` is what is loaded: its
        optimizer state is broadcast and sharded, its scheduler state broadcast; the other ranks
        may pass the same state or ``{}``. A state that does not fit the optimizer raises
        `ValueError` on every rank.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        osd = dict(state.get("optimizer") or {})
        # rank 0 checks its state and decides the path; every rank takes it (or raises) together
        decision: list[Any] = [None, None]  # [path, scheduler state]
        named: dict[str, Any] = {}
        if self.sync.rank == 0:
            try:
                named = self._named_optimizer_state(osd) if osd.get("state") else {}
                decision = ["full" if named else "hyper-parameters", state.get("scheduler")]
            except ValueError as e:
                decision = [f"error: {e}", None]
        torch.distributed.broadcast_object_list(decision, src=0)
        path, scheduler_state = decision
        if path.startswith("error: "):
            raise ValueError(path[len("error: ") :])
        self.zero_grad()  # torch initialises an empty optimizer state by a zero step, only without grads
        if path == "hyper-parameters":  # saved before the first optimizer step
            self.optimizer.state.clear()
            self._broadcast_param_groups(osd if self.sync.rank == 0 else {})
        else:
            tuples = [{k for k, v in g.items() if isinstance(v, tuple)} for g in self.optimizer.param_groups]
            set_optimizer_state_dict(
                self.module,
                self.optimizer,
                named,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            for g, keys in zip(self.optimizer.param_groups, tuples, strict=True):
                g.update({k: tuple(g[k]) for k in keys if isinstance(g.get(k), list)})  # betas
        if self.scheduler is not None and scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)

    def _named_optimizer_state(self, osd: Mapping[str, Any]) -> dict[str, Any]:
        """``osd`` (torch's format, integer keys) keyed by parameter names, as
        torch.distributed.checkpoint loads it; scalar tensors (``step``) are copied, so the
        caller's dict never aliases the live optimizer state. Raises `ValueError` when ``osd``
        does not fit this optimizer."""
        names = {i: n for n, i in self._index_of_names().items()}
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        theirs = [len(g.get("params", ())) for g in osd.get("param_groups", ())]
        unknown = [k for k in osd["state"] if int(k) not in names]
        if mine != theirs or unknown:
            raise ValueError(
                f"the optimizer state to load has parameter groups of {theirs} tensors (state for "
                f"{len(osd['state'])} tensors), but this optimizer has groups of {mine}: it was "
                f"saved for another model or optimizer. Load a state saved for this policy."
            )

        def own(v: Any) -> Any:
            return v.clone() if isinstance(v, Tensor) and v.dim() == 0 else v

        groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in osd["param_groups"]]
        state = {names[int(k)]: {n: own(v) for n, v in st.items()} for k, st in osd["state"].items()}
        return {"state": state, "param_groups": groups}

    def _broadcast_param_groups(self, osd: Mapping[str, Any]) -> None:
        """Rank 0's param-group hyper-parameters (lr, betas, ...) on every rank."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]
        groups: list[Any] = [hyper]
        torch.distributed.broadcast_object_list(groups, src=0)
        for g, saved in zip(self.optimizer.param_groups, groups[0], strict=False):
            g.update(saved)

    def gathered_model_state_dict(self, *, rank0_only: bool = True) -> dict[str, Tensor]:
        """The full (unsharded) ``state_dict`` of the module, on the CPU (`full_state_dict`).

        A collective: every process must call it. With ``rank0_only`` (for saving) the other ranks
        get ``{}``; otherwise every rank gets the whole copy.
        """
        return full_state_dict(self.module, rank0_only=rank0_only)

    def state_dict_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: full shape}`` of the module's state dict (the names `gathered_model_state_dict`
        uses; no communication)."""
        return {_fqn(k): tuple(v.shape) for k, v in self.module.state_dict().items()}

    def state_dict_names(self, tensors: Mapping[str, Tensor]) -> dict[str, list[str]]:
        """For each of ``tensors`` (parameters of the sharded module, e.g. a policy's
        ``get_parameters()``), the module's state-dict names of it: several for a tied weight
        (``model.embed_tokens.weight`` and ``lm_head.weight``). Raises `ValueError` for a tensor
        that is not a parameter of the module."""
        names: dict[int, list[str]] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(_fqn(n))
        unknown = [k for k, t in tensors.items() if id(t) not in names]
        if unknown:
            raise ValueError(
                f"tensors {unknown[:3]} are not parameters of the sharded {type(self.module).__name__}; "
                f"under FSDP the policy's get_parameters() must return the module's own parameters."
            )
        return {k: names[id(t)] for k, t in tensors.items()}

    def model_state_problem(self, state: Mapping[str, Any], *, strict: bool = True) -> str | None:
        """Why ``state`` (full weights by state-dict name) cannot be loaded into the module, or None.
        ``strict``: every entry of the module's state dict must be there. No communication."""
        shapes = self.state_dict_shapes()
        unknown = sorted(k for k in state if k not in shapes)
        missing = sorted(k for k in shapes if k not in state) if strict else []
        wrong = [
            f"{k} {tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__} != {shapes[k]}"
            for k, v in state.items()
            if k in shapes and (not isinstance(v, Tensor) or tuple(v.shape) != shapes[k])
        ]
        if not (unknown or missing or wrong):
            return None
        return (
            f"the weights do not fit the sharded {type(self.module).__name__}: unknown {unknown[:5]}, "
            f"missing {missing[:5]}, wrong shapes {wrong[:3]}. Load weights saved for this policy."
        )

    def optimizer_state_problem(self, state: Mapping[str, Any]) -> str | None:
        """Why ``state`` (an ``optimizer.state_dict()``) cannot be loaded into this optimizer, or
        None. No communication."""
        try:
            if state.get("state"):
                self._named_optimizer_state(state)
        except (ValueError, KeyError, TypeError) as e:
            return str(e)
        return None

    # ---- the policy's weights in checkpoints (`grpo.engine.backends.ShardedWeights`) -------------
    def check_policy(self, policy: Any) -> None:
        """Refuse (on every rank alike, before any collective) a policy whose checkpoint this
        cannot map: one with a ``state_dict()`` of its own around the sharded module
        (NotImplementedError), one whose ``get_parameters()`` are not the module's (ValueError)."""
        self._policy_names(policy)

    def _policy_names(self, policy: Any) -> dict[str, list[str]] | None:
        """``policy_state`` key -> the module's state-dict names it stands for (several for a tied
        weight); None when the policy is the module itself (the keys are the names)."""
        if policy is self.module:
            return None
        if callable(getattr(policy, "state_dict", None)):
            raise NotImplementedError(
                f"under FSDP the trainer checkpoints a policy that is itself the sharded nn.Module, or "
                f"one without state_dict() whose get_parameters() returns the module's parameters (as "
                f"grpo.llm.CausalLMPolicy); {type(policy).__name__} has a state_dict() of its own "
                f"around training_module(). Checkpoint the module yourself with "
                f"trainer.backend.gathered_model_state_dict()."
            )
        raw: Any = policy.get_parameters()
        items = raw.items() if isinstance(raw, Mapping) else enumerate(raw)
        return self.state_dict_names({str(k): v for k, v in items})

    def policy_state(self, policy: Any) -> dict[str, Tensor]:
        """The policy's full weights by its own names (`grpo.state.checkpoint.policy_state`'s
        format) on rank 0, ``{}`` on the others; a collective."""
        names = self._policy_names(policy)  # before the collective: raises on every rank alike
        full = self.gathered_model_state_dict()
        if names is None or not full:
            return full
        return {k: full[n[0]] for k, n in names.items()}

    def load_policy_state(
        self, policy: Any, state: Mapping[str, Any], problem: str | None, source: str
    ) -> str | None:
        """Load a trainer state's ``policy`` weights, once every rank agrees it fits: ``problem``
        is this rank's verdict on the rest of the state (None: fits); rank 0 also checks the
        weights and the ``optimizer`` state against this module and optimizer (its problem named
        after ``source``, where the state came from). The verdicts are
        all-gathered; the first problem is returned with nothing changed, else the weights are
        broadcast from rank 0 and sharded and None is returned. A collective."""
        names = self._policy_names(policy)
        weights: dict[str, Any] = {}
        if problem is None and self.rank == 0:
            given = state["policy"]
            if names is None:
                weights = dict(given)
            elif set(given) != set(names):
                problem = (
                    f"{type(policy).__name__}.get_parameters() has tensors {sorted(names)[:8]} "
                    f"but the checkpoint has {sorted(given)[:8]}"
                )
            else:
                weights = {n: given[k] for k, ns in names.items() for n in ns}
            problem = problem or self.model_state_problem(weights, strict=names is None)
            problem = problem or self.optimizer_state_problem(state["optimizer"])
            problem = problem and f"{source}: {problem}"
        verdicts: list[str | None] = [None] * self.world_size
        torch.distributed.all_gather_object(verdicts, problem)
        first = next((v for v in verdicts if v is not None), None)
        if first is None:
            self.load_model_state_dict(weights, strict=names is None)
        return first

    def load_model_state_dict(self, state: Mapping[str, Tensor], *, strict: bool = True) -> None:
        """Load full weights (``gathered_model_state_dict``'s format) into the shards.

        A collective: every process must call it; rank 0's ``state`` is broadcast and sharded
        (the other ranks may pass the same or ``{}``). ``strict``: the names must match exactly;
        otherwise ``state`` may hold a subset (e.g. the trainable parameters only) and the rest
        keeps its values. Rank 0 checks names and shapes first: a state that does not fit raises
        `ValueError` on every rank, before anything changes.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        problem: list[str | None] = [None]
        if self.sync.rank == 0:
            problem[0] = self.model_state_problem(state, strict=strict)
        torch.distributed.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise ValueError(problem[0])
        set_model_state_dict(
            self.module,
            dict(state) if self.sync.rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict),
        )


def full_state_dict(module: nn.Module, *, rank0_only: bool = True) -> dict[str, Tensor]:
    """The full (unsharded) ``state_dict`` of a module sharded by `shard_policy`, on the CPU.

    A collective: every process must call it (each parameter is all-gathered in turn). With
    ``rank0_only`` (for saving) the other ranks get ``{}``; otherwise every rank gets the whole
    copy. The names are those of ``module.state_dict()`` (tied weights under each name).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd: dict[str, Any] = get_model_state_dict(module, options=options)
    return {k: v if rank0_only else v.detach().cpu() for k, v in sd.items()}
