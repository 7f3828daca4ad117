"""Building the trainer's engine: the backend with its optimizer and LR schedule, and the frozen
reference policy of the KL term.

Which backend runs the optimizer steps (`grpo.engine.backends`):

| config | processes | backend |
| --- | --- | --- |
| ``deepspeed`` set | any | `grpo.engine.deepspeed.DeepSpeedBackend` (ZeRO-1/2/3) |
| ``fsdp=True`` | torchrun | `grpo.engine.fsdp.FSDPBackend` (PyTorch FSDP2) |
| neither | torchrun | `grpo.engine.backends.DataParallelBackend` (the trainer's own gradient sync) |
| neither | one | `grpo.engine.backends.LocalBackend` |

A policy with no trainable tensor gets no optimizer and no backend (nothing is trained).

The reference policy of the KL term (``kl_coeff > 0``), in this order: the ``reference_policy``
passed to the trainer; else the one the policy offers through its optional hook
``policy.reference_policy()`` (`offered_reference`: `grpo.llm.CausalLMPolicy` with LoRA offers
its model with the adapter disabled, no second copy); else a frozen deep copy of the policy.
A reference may declare two optional hooks for ``GRPOConfig.reference_update_freq``:
``refresh_problem() -> str | None`` (why it cannot be refreshed; checked at construction) and
``refresh_from(policy)`` (copy the policy's weights in; used by `refresh_reference`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from grpo.advantage_estimator import advantage_dtype
from grpo.config import GRPOConfig
from grpo.engine.backends import Backend, DataParallelBackend, LocalBackend
from grpo.engine.deepspeed import (
    DeepSpeedBackend,
    copy_partitioned_weights,
    cpu_adam,
    deepspeed_config_from,
    import_deepspeed,
    offloads_optimizer,
    policy_is_partitioned,
    training_module,
)
from grpo.engine.distributed import DistributedSync, setup_distributed
from grpo.engine.lr_schedules import build_scheduler
from grpo.engine.optim import default_optimizer
from grpo.policy_base import PolicyModel, check_policy, has_method, policy_parameters
from grpo.reward_model_base import RewardModel, as_reward_model
from grpo.runtime.devices import same_device
from grpo.runtime.threads import step_threads

__all__ = [
    "BackendSetup",
    "TrainerSetup",
    "batch_size_problem",
    "check_lockstep",
    "check_refreshable",
    "checked_inputs",
    "join_processes",
    "make_backend",
    "make_reference",
    "offered_reference",
    "reference_module",
    "refresh_reference",
    "resolve_device",
    "seed_everything",
    "setup_trainer",
]


def resolve_device(name: str) -> torch.device:
    """``'auto'`` -> cuda when available else cpu; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def checked_inputs(
    config: GRPOConfig, policy: PolicyModel, reward_model: Any, reference_policy: PolicyModel | None
) -> RewardModel:
    """The constructor's arguments checked (clear errors naming what is missing); the reward as a
    `RewardModel`."""
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}.")
    check_policy(policy, "policy")
    reward = as_reward_model(reward_model, "reward_model")
    check_config = getattr(reward, "check_config", None)
    if callable(check_config):  # a reward that depends on the config (grpo.gym's length-bias warning)
        check_config(config)
    if reference_policy is not None:
        check_policy(reference_policy, "reference_policy")
    return reward


def join_processes(config: GRPOConfig) -> tuple[torch.device, DistributedSync | None]:
    """The device, and the process group under torchrun (None on one process); seeds the global
    RNGs with ``seed + rank`` so that ranks sample different actions."""
    device = resolve_device(config.device)
    if deepspeed_config_from(config.deepspeed) is not None:
        import_deepspeed()  # before the group exists (imported after, it holds the group until exit)
    sync = setup_distributed(config.distributed, device)
    rank = 0
    if sync is not None:
        device, rank = sync.device, sync.rank
    if config.seed is not None:
        seed_everything(config.seed + rank)
    return device, sync


@dataclass
class BackendSetup:
    """The trainable tensors, the optimizer and LR schedule over them, and the backend that runs
    the optimizer steps (all None / empty when the policy has nothing to train)."""

    params: list[Tensor]
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    backend: Backend | None
    reference_copy: PolicyModel | None = None  # the frozen copy for the KL term, if asked for


def make_backend(
    config: GRPOConfig,
    policy: PolicyModel,
    device: torch.device,
    sync: DistributedSync | None,
    optimizer: torch.optim.Optimizer | None,
    *,
    copy_reference: bool = False,
) -> BackendSetup:
    """Choose and build the backend (see the module docstring). ``copy_reference``: also take the
    frozen copy of the policy for the KL term, with every rank's weights equal and before FSDP
    or DeepSpeed ZeRO-3 shard them (`BackendSetup.reference_copy`)."""
    ds_config = deepspeed_config_from(config.deepspeed)  # None: no DeepSpeed
    _check_fsdp(config, ds_config, sync, optimizer)
    if sync is not None:
        sync.attach(policy_parameters(policy), policy)  # same layout on every rank; rank 0's weights
    reference_copy = _frozen_copy(policy) if copy_reference else None  # whole, before any sharding
    if config.fsdp:
        from grpo.engine.fsdp import shard_policy

        # attach() broadcast rank 0's weights already (and took the reference copy from them)
        shard_policy(policy, device, broadcast_from_rank0=False)
    params = policy_parameters(policy)
    _check_param_devices(params, device)
    opt = _make_optimizer(config, params, optimizer, ds_config)
    if opt is None:
        return BackendSetup(params, None, None, None, reference_copy)
    sched = build_scheduler(
        opt,
        config.lr_schedule,
        config.warmup_steps,
        config.total_steps,
        config.lr_min_ratio,
        adaptive=config.adaptive_lr_kl is not None,
    )
    if ds_config is not None:
        ds = DeepSpeedBackend(
            policy,
            params,
            opt,
            ds_config,
            max_grad_norm=config.max_grad_norm,
            world_size=1 if sync is None else sync.world_size,
            device=device,
            scheduler=sched,
            sync=sync,
        )
        return BackendSetup(params, opt, sched, ds, reference_copy)
    backend: Backend
    if config.fsdp:
        from grpo.engine.fsdp import FSDPBackend

        assert sync is not None
        backend = FSDPBackend(training_module(policy), params, opt, sched, config.max_grad_norm, sync)
    elif sync is not None:
        backend = DataParallelBackend(sync, params, opt, sched, config.max_grad_norm)
    else:
        backend = LocalBackend(params, opt, sched, config.max_grad_norm)
    return BackendSetup(params, opt, sched, backend, reference_copy)


def _check_fsdp(
    config: GRPOConfig,
    ds_config: dict[str, Any] | None,
    sync: DistributedSync | None,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Refuse ``fsdp=True`` where it cannot run (with DeepSpeed, on one process, a user optimizer)."""
    if not config.fsdp:
        return
    if ds_config is not None:
        raise ValueError("GRPOConfig(fsdp=True) and deepspeed=... both shard the policy; choose one.")
    if sync is None:
        raise ValueError(
            "GRPOConfig(fsdp=True) shards the policy over torch.distributed processes, but this "
            "is one process. Launch with torchrun --nproc_per_node=N, or set fsdp=False."
        )
    if optimizer is not None:
        raise ValueError(
            f"GRPOConfig(fsdp=True) replaces every parameter of the policy by a sharded DTensor, "
            f"so the optimizer given ({type(optimizer).__name__}, built over the unsharded "
            f"parameters) would update tensors that are no longer the model's. Pass "
            f"optimizer=None: the trainer builds AdamW (GRPOConfig.learning_rate, weight_decay) "
            f"over the sharded parameters."
        )


def _check_param_devices(params: Sequence[Tensor], device: torch.device) -> None:
    wrong = sorted({str(p.device) for p in params if not same_device(p.device, device)})
    if wrong:
        raise ValueError(
            f"policy parameters are on {wrong} after policy.to({str(device)!r}), but "
            f"GRPOConfig.device is {str(device)!r}. Make policy.to(device) move every "
            f"tensor that get_parameters() returns, or set GRPOConfig(device=...) to match."
        )


def _make_optimizer(
    config: GRPOConfig,
    params: Sequence[Tensor],
    optimizer: torch.optim.Optimizer | None,
    ds_config: dict[str, Any] | None,
) -> torch.optim.Optimizer | None:
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if params and not any(id(p) in held for p in params):
            raise ValueError(
                f"the optimizer ({type(optimizer).__name__}) holds none of the "
                f"{len(params)} parameters that policy.get_parameters() returns, so "
                f"training would change nothing. Build it from those tensors, e.g. "
                f"torch.optim.AdamW(policy.parameters(), lr=...), or pass optimizer=None."
            )
        return optimizer
    if not params:
        return None
    if ds_config is not None and offloads_optimizer(ds_config):  # ZeRO-Offload: Adam on the CPU
        return cpu_adam(params, config.learning_rate, config.weight_decay)
    return default_optimizer(params, config.learning_rate, config.weight_decay)


# ---- the reference policy of the KL term ----------------------------------------------------------
@dataclass(frozen=True)
class TrainerSetup:
    """Where a trainer runs and what its update steps: the device, the process group (None on
    one process), the policy and reward on the device, the trainable tensors with their optimizer
    and LR schedule, the backend (None / empty when nothing is trained), the reference policy
    of the KL term (None without one), and the numbers of each step: the advantages' dtype
    (float64 for float64 weights, so that their update is not computed from float32-rounded
    advantages; None: the rewards') and the intra-op threads (`grpo.runtime.threads.step_threads`)."""

    device: torch.device
    distributed: DistributedSync | None
    policy: PolicyModel
    reward_model: RewardModel
    params: list[Tensor]
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    backend: Backend | None
    reference_policy: PolicyModel | None
    advantage_dtype: torch.dtype | None
    step_threads: int | None


def setup_trainer(
    config: GRPOConfig,
    policy: PolicyModel,
    reward_model: Any,
    reference_policy: PolicyModel | None,
    optimizer: torch.optim.Optimizer | None,
) -> TrainerSetup:
    """The `TrainerSetup` of `GRPOTrainer`'s arguments: checked (`checked_inputs`), the processes
    joined and seeded (`join_processes`), the policy and reward moved to the device, the
    reference the policy offers (`offered_reference`: a LoRA adapter disabled, no copy) or a
    frozen copy, and the backend that owns the optimizer step (`make_backend`; it shards the
    policy when it partitions weights)."""
    reward = checked_inputs(config, policy, reward_model, reference_policy)
    device, distributed = join_processes(config)
    if distributed is not None and config.max_sampling_draws > 1:
        raise ValueError(
            f"GRPOConfig(max_sampling_draws={config.max_sampling_draws}) back-fills each process's "
            f"batch with its own number of draws, which torchrun's ranks cannot keep in step; use "
            f"max_sampling_draws=1 under torchrun."
        )
    policy, reward = _moved(policy, device), _moved(reward, device)
    reference = offered_reference(config, policy, reference_policy)
    copy_reference = config.kl_coeff > 0 and reference is None
    made = make_backend(config, policy, device, distributed, optimizer, copy_reference=copy_reference)
    groups = made.optimizer.param_groups if made.optimizer is not None else []
    weights = [*made.params, *(p for g in groups for p in g["params"])]
    return TrainerSetup(
        device=device,
        distributed=distributed,
        policy=policy,
        reward_model=reward,
        params=made.params,
        optimizer=made.optimizer,
        scheduler=made.scheduler,
        backend=made.backend,
        reference_policy=make_reference(config, policy, reference, device, made.backend, made.reference_copy),
        advantage_dtype=advantage_dtype(weights),
        step_threads=step_threads(config.num_threads, policy, weights, device),
    )


def _moved(obj: Any, device: torch.device) -> Any:
    """``obj.to(device)``, keeping ``obj`` when ``to`` returns None (moved in place)."""
    moved = obj.to(device)
    return obj if moved is None else moved


def offered_reference(
    config: GRPOConfig, policy: PolicyModel, reference_policy: PolicyModel | None
) -> PolicyModel | None:
    """The reference the trainer uses instead of a copy: ``reference_policy`` when given, else
    ``policy.reference_policy()`` when the policy has that hook, ``kl_coeff > 0`` and the hook
    returns one (e.g. a LoRA policy's disabled adapter); None means a frozen copy is taken.
    Refuses, before any weight changes, a reference that ``reference_update_freq`` cannot refresh.
    """
    reference = reference_policy
    if reference is None and config.kl_coeff > 0 and has_method(policy, "reference_policy"):
        reference = policy.reference_policy()  # type: ignore[attr-defined]
        if reference is not None:
            check_policy(reference, f"{type(policy).__name__}.reference_policy()")
    if config.kl_coeff > 0:
        check_refreshable(config, reference)
    return reference


def check_refreshable(config: GRPOConfig, reference: PolicyModel | None) -> None:
    """ValueError when ``config.reference_update_freq`` is set and ``reference`` says it cannot be
    refreshed (its optional ``refresh_problem()`` returns a reason)."""
    freq = config.reference_update_freq
    if freq is None or reference is None or not has_method(reference, "refresh_problem"):
        return
    problem = reference.refresh_problem()  # type: ignore[attr-defined]
    if problem:
        raise ValueError(
            f"GRPOConfig(reference_update_freq={freq}) copies the policy into the reference policy "
            f"every {freq} steps, but {type(reference).__name__} cannot be refreshed: {problem}."
        )


def make_reference(
    config: GRPOConfig,
    policy: PolicyModel,
    reference_policy: PolicyModel | None,
    device: torch.device,
    backend: Backend | None,
    copy_made: PolicyModel | None = None,
) -> PolicyModel | None:
    """The reference policy: ``reference_policy`` (the one given, or the policy's own from
    `offered_reference`), or a frozen copy of ``policy`` (``copy_made`` when the backend took it
    already), only when ``kl_coeff > 0``; under ZeRO-3 the copy is partitioned too."""
    if config.kl_coeff <= 0:
        if reference_policy is not None:
            import warnings

            warnings.warn(
                "reference_policy is ignored because kl_coeff=0 (no KL term); set "
                "GRPOConfig(kl_coeff=...) > 0 to use it.",
                UserWarning,
                stacklevel=3,
            )
        return None
    if reference_policy is not None:
        moved = reference_policy.to(device)
        reference = reference_policy if moved is None else moved
    else:
        reference = copy_made if copy_made is not None else _frozen_copy(policy)
    check_refreshable(config, reference)  # again: partitioning may have made it impossible
    deepspeed = _deepspeed(backend)
    module = reference_module(reference, backend)
    if deepspeed is not None and deepspeed.stage == 3 and module is not None:
        deepspeed.partition_reference(module)
    return reference


def _frozen_copy(policy: PolicyModel) -> PolicyModel:
    if policy_is_partitioned(policy):
        raise ValueError(
            f"the weights of {type(policy).__name__} are already partitioned by DeepSpeed "
            f"ZeRO-3 (a trainer built on this policy earlier partitioned them), so they cannot "
            f"be copied for the frozen KL reference. Build a fresh policy for this trainer, "
            f"pass reference_policy=..., or set GRPOConfig(kl_coeff=0)."
        )
    try:
        ref = copy.deepcopy(policy)
    except Exception as e:  # deepcopy of arbitrary user objects can fail in many ways
        raise TypeError(
            f"could not copy the policy ({type(policy).__name__}) to make the frozen reference "
            f"policy for the KL term: {e!r}. Pass reference_policy=... yourself, or set "
            f"GRPOConfig(kl_coeff=0)."
        ) from e
    for p in policy_parameters(ref):
        p.requires_grad_(False)
    ref.eval()
    return ref


def _deepspeed(backend: Backend | None) -> DeepSpeedBackend | None:
    return backend if isinstance(backend, DeepSpeedBackend) else None


def batch_size_problem(states: Any, batch_size: int) -> str | None:
    """Why a step on ``states`` (a list, tuple or Tensor of B states) is not what
    ``GRPOConfig.batch_size`` plans for, or None (B equal to it, or not sized)."""
    sized = isinstance(states, (list, tuple)) or (isinstance(states, Tensor) and states.dim() > 0)
    n = len(states) if sized else 0
    if not n or n == batch_size:
        return None
    return (
        f"step() got {n} states but GRPOConfig.batch_size={batch_size}; step() uses every state it is "
        f"given. batch_size only sets how many states train() draws per step and the arithmetic "
        f"of optimizer_steps_per_step / samples_per_step (the summary, total_steps). Warned once."
    )


def check_lockstep(
    distributed: DistributedSync | None, backend: Backend | None, num_states: Callable[[], int]
) -> None:
    """Where every forward gathers partitioned weights (``backend.lockstep_forwards``: DeepSpeed
    ZeRO-3) on several processes, all ranks must run the same forwards: raise on every rank when
    they got different numbers of states (``num_states()``; not sized: nothing to check, the
    policy check's own error follows), before any forward (a clear error instead of a hang)."""
    if distributed is None or backend is None or not backend.lockstep_forwards:
        return
    try:
        n = int(num_states())
    except TypeError:
        return
    why = "DeepSpeed ZeRO-3 gathers the weights in every forward, so all ranks must run the same forwards"
    distributed.check_same_number_of_states(n, why)


def reference_module(reference: PolicyModel | None, backend: Backend | None) -> nn.Module | None:
    """The reference policy's own module (a copy of the policy's), or None: no reference, or
    one without a module of its own (e.g. the policy with its LoRA adapter disabled)."""
    deepspeed = _deepspeed(backend)
    if reference is None:
        return None
    try:
        module = training_module(reference)
    except TypeError:
        return None
    if deepspeed is not None and module is deepspeed.module:
        return None
    return module


def _fsdp_module(policy: PolicyModel) -> nn.Module | None:
    """The policy's module when FSDP2 sharded it, else None."""
    from grpo.engine.fsdp import is_fsdp_sharded

    try:
        module = training_module(policy)
    except TypeError:
        return None
    return module if is_fsdp_sharded(module) else None


def refresh_reference(
    policy: PolicyModel, reference: PolicyModel | None, backend: Backend | None
) -> PolicyModel | None:
    """Copy ``policy``'s weights into ``reference``; returns the (possibly new) reference."""
    if reference is None:
        return None
    if has_method(reference, "refresh_from"):  # its own way (e.g. a separate LoRA reference adapter)
        reference.refresh_from(policy)  # type: ignore[attr-defined]
        return reference
    deepspeed = _deepspeed(backend)
    if deepspeed is not None and deepspeed.stage == 3:
        # both partitioned: copied module by module (every rank takes part)
        target = reference_module(reference, backend)
        if target is None:
            raise TypeError(
                f"under DeepSpeed ZeRO-3 the reference policy is refreshed through its module, "
                f"but {type(reference).__name__} has none (no training_module()). "
                f"Set reference_update_freq=None."
            )
        copy_partitioned_weights(deepspeed.module, target)
        return reference
    sharded = _fsdp_module(policy)
    if sharded is not None:  # FSDP: gather the full weights on every rank into the whole copy
        from grpo.engine.fsdp import full_state_dict

        training_module(reference).load_state_dict(full_state_dict(sharded, rank0_only=False))
        return reference
    if isinstance(reference, nn.Module) and isinstance(policy, nn.Module):
        reference.load_state_dict(policy.state_dict())
        return reference
    return _frozen_copy(policy)
