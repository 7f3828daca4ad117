"""DeepSpeed ZeRO for `GRPOTrainer`: the backward pass and the optimizer step go through a
DeepSpeed engine, which partitions the optimizer state (stage 1), the gradients (stage 2) and the
weights (stage 3) over the data-parallel processes.

Turned on by ``GRPOConfig(deepspeed=...)``: a path to a DeepSpeed JSON config, or ``"auto"`` (the
default), which follows ``accelerate launch`` — when accelerate was configured for DeepSpeed it
exports ``ACCELERATE_USE_DEEPSPEED=true`` and ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` (or the ZeRO
stage, offload, clipping and mixed-precision settings as variables), and those are read here.
Nothing changes in the training script. Needs the ``deepspeed`` extra (`grpo.runtime.extras.install_hint`).

The update is the same as without DeepSpeed (tested against one process on the global batch):

* each process's loss is its share of the global mean (``sum_{i in rank} mask * l / C`` with the
  all-reduced count ``C``, see `grpo.engine.distributed`); DeepSpeed *averages* gradients over the W
  processes, so the loss is multiplied by W before ``engine.backward``: the reduced gradient is
  ``sum_r grad(loss_r)``, the gradient of the single-process loss;
* micro-batches accumulate locally: the trainer marks the last micro-batch of each optimizer step
  as DeepSpeed's accumulation boundary (``engine.set_gradient_accumulation_boundary``) and calls
  ``engine.step()`` once per optimizer step; DeepSpeed's own ``gradient_accumulation_steps`` is 1.
  The trainer runs the module's forward itself (not ``engine.forward``), so before each backward
  it does what ``engine.forward`` would first: ``optimizer.clear_backward_seen_flag()`` (ZeRO-3
  counts micro-batches there, to add rather than overwrite gradient partitions);
* clipping is DeepSpeed's ``gradient_clipping``, set from ``GRPOConfig.max_grad_norm``;
* a non-finite step is skipped by DeepSpeed's overflow check (a non-finite gradient norm discards
  the step and clears the gradients, on every rank since the norm is global). A non-finite loss
  with finite gradients (a NaN in a masked-out term) is made visible to that check by scaling the
  boundary micro-batch's loss by NaN, so the step is skipped as without DeepSpeed. With bf16 the
  check is switched on (``bf16.check_grad_overflow``) unless the config says otherwise; stage 3
  skips a step whose global gradient norm is not finite in any precision.

ZeRO-3 (weights partitioned; a module's full weights are gathered only while it runs): every
forward all-gathers, so all ranks must run the same forwards (`GRPOTrainer` checks that they got
the same number of states). `is_partitioned` tells whether a module is partitioned;
`DeepSpeedBackend.gathered` (`GRPOTrainer.gathered_weights`) gives the full weights for reading;
`gathered_state_dict` gives the full state dict for saving (`grpo.llm.CausalLMPolicy.
save_pretrained` uses it). The frozen KL reference copy is partitioned too
(`DeepSpeedBackend.partition_reference`) and refreshed by `copy_partitioned_weights`.

Limits: stage 0 is plain data parallelism, which the trainer does itself (no DeepSpeed needed).
The optimizer and LR schedule are the trainer's (``GRPOConfig.learning_rate``, ``lr_schedule``,
or ``optimizer=``); a config with ``"optimizer"`` or ``"scheduler"`` sections is refused. When a
later optimizer step of a multi-step update (several epochs or mini-batches) is skipped, the
earlier steps of that update stand (the rollback of the whole update needs the partitioned
optimizer state). ``GRPOTrainer.save_checkpoint`` is refused (the optimizer state is
partitioned); save the model with the policy's own ``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo.engine.backends import OptimizerStepResult, ShardedWeights
from grpo.engine.distributed import DistributedSync
from grpo.metrics import StepCounts, reduce_across_ranks
from grpo.runtime.extras import install_hint

__all__ = [
    "DeepSpeedBackend",
    "copy_partitioned_weights",
    "cpu_adam",
    "deepspeed_config_from",
    "gathered_state_dict",
    "import_deepspeed",
    "is_partitioned",
    "model_hidden_size",
    "offloads_optimizer",
    "policy_is_partitioned",
    "prepare_deepspeed_config",
    "training_module",
]

_TRUE = ("1", "true", "yes")
logger = logging.getLogger(__name__)


def deepspeed_config_from(spec: str) -> dict[str, Any] | None:
    """The DeepSpeed config that ``GRPOConfig.deepspeed == spec`` asks for, or None for none.

    ``"off"`` -> None. ``"auto"`` -> None unless launched by ``accelerate launch`` with DeepSpeed
    (``ACCELERATE_USE_DEEPSPEED=true``); then the JSON file in ``ACCELERATE_DEEPSPEED_CONFIG_FILE``,
    or a config built from ``ACCELERATE_DEEPSPEED_ZERO_STAGE``,
    ``ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE``, ``ACCELERATE_GRADIENT_CLIPPING`` and
    ``ACCELERATE_MIXED_PRECISION``. Anything else is the path of a DeepSpeed JSON config.
    """
    if spec == "off":
        return None
    if spec == "auto":
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in _TRUE:
            return None
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path:
            return _read(path, "ACCELERATE_DEEPSPEED_CONFIG_FILE")
        zero: dict[str, Any] = {"stage": int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}
        offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        if offload != "none":
            zero["offload_optimizer"] = {"device": offload}
        # "auto": prepare_deepspeed_config maps them from ACCELERATE_MIXED_PRECISION
        cfg: dict[str, Any] = {
            "zero_optimization": zero,
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
        }
        clip = os.environ.get("ACCELERATE_GRADIENT_CLIPPING")
        if clip:
            cfg["gradient_clipping"] = float(clip)
        return cfg
    return _read(spec, "GRPOConfig.deepspeed")


def _read(path: str, what: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"{what} names the DeepSpeed config {str(p)!r}, which is not a file (relative paths are "
            f"read from the working directory {os.getcwd()!r}). Give the path of a DeepSpeed JSON "
            f"config, e.g. examples/configs/deepspeed_zero2.json."
        )
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"the DeepSpeed config {str(p)!r} ({what}) is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(
            f"the DeepSpeed config {str(p)!r} must hold a JSON object, got {type(cfg).__name__}."
        )
    return cfg


def _mixed_precision() -> str:
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()


# zero_optimization keys whose "auto" follows the model's hidden size H, as accelerate (and the
# Hugging Face Trainer) fill them: key -> value for H
_HIDDEN_SIZE_AUTO: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def prepare_deepspeed_config(
    raw: Mapping[str, Any],
    *,
    max_grad_norm: float | None,
    world_size: int,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """``raw`` with the trainer's settings filled in and checked (a new dict; ``raw`` is unchanged).

    * ``zero_optimization.stage`` must be 1, 2 or 3 (see the module docstring for 0);
    * ``gradient_clipping``: ``"auto"`` or absent -> ``max_grad_norm`` (0 = off when None); a number
      must equal it;
    * ``gradient_accumulation_steps``: ``"auto"``, absent or 1 (the trainer accumulates
      micro-batches itself, ``GRPOConfig.micro_batch_size``);
    * ``train_micro_batch_size_per_gpu`` = 1 and ``train_batch_size`` = ``world_size``: DeepSpeed
      only counts samples with them; the trainer decides what one step holds;
    * ``bf16.enabled`` / ``fp16.enabled`` ``"auto"`` -> accelerate's mixed precision
      (``ACCELERATE_MIXED_PRECISION``), else off; with bf16, ``bf16.check_grad_overflow`` defaults
      to true (a non-finite step is skipped);
    * ``"auto"`` ``reduce_bucket_size``, ``stage3_prefetch_bucket_size`` and
      ``stage3_param_persistence_threshold`` follow the model's ``hidden_size`` H as accelerate
      fills them (H², 0.9·H², 10·H) when it is known (`model_hidden_size`); other ``"auto"``
      values inside ``zero_optimization`` (and these without H) take DeepSpeed's defaults.
    """
    cfg: dict[str, Any] = json.loads(json.dumps(dict(raw)))  # a deep copy of plain JSON data
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ValueError(
                f"the DeepSpeed config has a {section!r} section, but the trainer owns the optimizer "
                f"and the learning-rate schedule (GRPOConfig.learning_rate, weight_decay, lr_schedule, "
                f"warmup_steps, or GRPOTrainer(optimizer=...)). Remove the {section!r} section."
            )
    _fill_zero_section(cfg, hidden_size)
    _fill_clipping_and_batch(cfg, max_grad_norm, world_size)
    _fill_precision(cfg)
    cfg.setdefault("steps_per_print", 10**9)  # DeepSpeed's periodic log lines: off
    return cfg


def _fill_zero_section(cfg: dict[str, Any], hidden_size: int | None) -> None:
    """Check ``zero_optimization.stage`` (1, 2 or 3) and fill its ``"auto"`` values."""
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ValueError(f"the DeepSpeed config's zero_optimization must be an object, got {zero!r}.")
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise ValueError(
            f"the DeepSpeed config asks for zero_optimization.stage={stage!r}; GRPOTrainer supports "
            f"stages 1, 2 and 3. For plain data parallelism (stage 0) leave DeepSpeed out "
            f"(GRPOConfig(deepspeed='off')): the trainer reduces gradients itself under torchrun or "
            f"accelerate launch."
        )
    for key, value in list(zero.items()):
        if value == "auto":
            fill = _HIDDEN_SIZE_AUTO.get(key)
            if fill is not None and hidden_size is not None:
                zero[key] = fill(int(hidden_size))
            else:
                del zero[key]
    cfg["zero_optimization"] = zero


def _fill_clipping_and_batch(cfg: dict[str, Any], max_grad_norm: float | None, world_size: int) -> None:
    """``gradient_clipping`` from ``max_grad_norm``; accumulation and batch sizes the trainer's."""
    want_clip = 0.0 if max_grad_norm is None else float(max_grad_norm)
    clip = cfg.get("gradient_clipping", "auto")
    if clip == "auto":
        cfg["gradient_clipping"] = want_clip
    elif not isinstance(clip, (int, float)) or float(clip) != want_clip:
        raise ValueError(
            f"the DeepSpeed config sets gradient_clipping={clip!r} but GRPOConfig.max_grad_norm is "
            f'{max_grad_norm!r}; one value must rule. Set gradient_clipping to "auto" (or remove '
            f"it) to use max_grad_norm, or set max_grad_norm={clip!r}."
        )
    gas = cfg.get("gradient_accumulation_steps", "auto")
    if gas not in ("auto", 1):
        raise ValueError(
            f"the DeepSpeed config sets gradient_accumulation_steps={gas!r}; the trainer accumulates "
            f"micro-batches itself (GRPOConfig.micro_batch_size; one optimizer step per "
            f'mini-batch). Set it to "auto" or 1.'
        )
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["train_batch_size"] = world_size


def _fill_precision(cfg: dict[str, Any]) -> None:
    """``bf16`` / ``fp16`` ``"auto"`` -> accelerate's mixed precision, else off."""
    mixed = _mixed_precision()
    for precision in ("bf16", "fp16"):
        settings = cfg.get(precision)
        if settings is None:
            continue
        if not isinstance(settings, dict):
            raise ValueError(f"the DeepSpeed config's {precision} must be an object, got {settings!r}.")
        if settings.get("enabled", "auto") == "auto":
            settings["enabled"] = mixed == precision
    bf16 = cfg.get("bf16")
    if isinstance(bf16, dict) and bf16.get("enabled"):
        bf16.setdefault("check_grad_overflow", True)


def import_deepspeed() -> Any:
    """The ``deepspeed`` module (and its Adam ops), or an ImportError that says how to install it.

    Import it before the process group exists: imported after, it keeps the group referenced
    until interpreter exit (see `grpo.engine.distributed.shutdown`); the trainer does so."""
    try:
        import deepspeed  # type: ignore[import-untyped,import-not-found,unused-ignore]
        import deepspeed.ops.adam  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as e:
        raise ImportError(
            f"GRPOConfig.deepspeed asks for DeepSpeed, which is not installed. Install it with "
            f"{install_hint('deepspeed')}, or set GRPOConfig(deepspeed='off')."
        ) from e
    return deepspeed


def offloads_optimizer(config: Mapping[str, Any]) -> bool:
    """True when ``config`` moves the optimizer to the CPU (or NVMe): ZeRO-Offload
    (``zero_optimization.offload_optimizer.device`` other than ``"none"``)."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return isinstance(offload, dict) and offload.get("device", "none") not in ("none", None)


def cpu_adam(params: Sequence[Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The trainer's default optimizer under ZeRO-Offload: DeepSpeed's ``DeepSpeedCPUAdam`` in
    AdamW mode (decoupled weight decay, betas (0.9, 0.999), eps 1e-8, as ``torch.optim.AdamW``),
    which steps the offloaded fp32 partitions on the CPU with vectorised C++ (JIT-built on first
    use). DeepSpeed refuses a plain torch optimizer with offload."""
    adam = import_deepspeed().ops.adam.DeepSpeedCPUAdam
    opt: torch.optim.Optimizer = adam(params, lr=lr, weight_decay=weight_decay, adamw_mode=True)
    return opt


def training_module(
    policy: Any,
    *,
    needs: str = "DeepSpeed trains an nn.Module",
    way_out: str = "set GRPOConfig(deepspeed='off')",
) -> nn.Module:
    """The ``nn.Module`` that holds the policy's trainable parameters (handed to DeepSpeed or FSDP).

    ``policy.training_module()`` when the policy defines it (`grpo.llm.CausalLMPolicy` returns its
    Hugging Face model), else the policy itself when it is an ``nn.Module``; otherwise a
    `TypeError` saying who ``needs`` the module and the ``way_out``.
    """
    fn = getattr(type(policy), "training_module", None)
    module: object = fn(policy) if callable(fn) else policy
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{needs}, but {type(policy).__name__} is not one and has no training_module() method "
            f"returning the nn.Module that holds its parameters. Add that method, or {way_out}."
        )
    return module


def is_partitioned(module: nn.Module) -> bool:
    """True when ``module``'s parameters are partitioned over the processes by DeepSpeed ZeRO-3
    (each holds a shard; the full tensor exists only while its module runs). Does not import
    DeepSpeed: ZeRO-3 parameters carry a ``ds_id``."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def policy_is_partitioned(policy: Any) -> bool:
    """`is_partitioned` for a policy's module (`training_module`); False when it has none."""
    try:
        module = training_module(policy)
    except TypeError:
        return False
    return is_partitioned(module)


def gathered_state_dict(module: nn.Module) -> dict[str, Tensor] | None:
    """The full ``state_dict()`` of a ZeRO-3 ``module``, on CPU, on rank 0; None on the other ranks.

    Every process must call it: each submodule's parameters are all-gathered in turn (at most one
    submodule's full weights at a time besides the result). Tied parameters stay one tensor under
    all their names, as ``save_pretrained`` expects. Buffers are not partitioned and are copied.
    """
    deepspeed = import_deepspeed()
    rank0 = torch.distributed.get_rank() == 0
    gathered: dict[int, Tensor] = {}  # id(parameter) -> full CPU copy (rank 0; tied weights share it)
    seen: set[int] = set()
    names: dict[str, int] = {}
    for prefix, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False))
        todo = [p for _, p in own if id(p) not in seen]
        for name, p in own:
            names[f"{prefix}.{name}" if prefix else name] = id(p)
        if not todo:
            continue
        seen.update(id(p) for p in todo)
        with deepspeed.zero.GatheredParameters(todo, modifier_rank=None):
            if rank0:
                gathered.update((id(p), p.detach().to("cpu", copy=True)) for p in todo)
    state = module.state_dict()  # on every rank, in case a hook of DeepSpeed's synchronises
    if not rank0:
        return None
    return {key: gathered[names[key]] if key in names else v.detach().cpu() for key, v in state.items()}


def copy_partitioned_weights(source: nn.Module, target: nn.Module) -> None:
    """``target``'s weights and buffers := ``source``'s, both partitioned by ZeRO-3 and of the same
    structure (the policy and its reference copy). Every process must call it: one submodule at
    a time, the source's weights are gathered, copied into the gathered target's, and rank 0's
    copy is partitioned again (DeepSpeed's ``GatheredParameters(modifier_rank=0)``)."""
    deepspeed = import_deepspeed()
    sources = dict(source.named_modules())
    for name, sub in target.named_modules():
        own = list(sub.named_parameters(recurse=False))
        if not own:
            continue
        match = sources.get(name)
        theirs = dict(match.named_parameters(recurse=False)) if match is not None else {}
        missing = [n for n, p in own if n not in theirs or theirs[n].ds_shape != p.ds_shape]
        if missing:
            raise ValueError(
                f"cannot copy the policy into the reference: the reference's {name or '<root>'}."
                f"{missing[0]} has no counterpart of the same shape in the policy. The reference "
                f"must have the policy's architecture."
            )
        with (
            deepspeed.zero.GatheredParameters([theirs[n] for n, _ in own], modifier_rank=None),
            deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0),
            torch.no_grad(),
        ):
            for n, p in own:
                p.data.copy_(theirs[n].data)
    with torch.no_grad():
        their_buffers = dict(source.named_buffers())
        for name, buf in target.named_buffers():
            if name in their_buffers:
                buf.copy_(their_buffers[name])


def model_hidden_size(module: nn.Module) -> int | None:
    """The hidden size of a Hugging Face model (``config.hidden_size``, or the largest of
    ``config.hidden_sizes``), None for other modules. Sizes DeepSpeed's buckets ("auto")."""
    cfg = getattr(module, "config", None)
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int):
        return size
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
        return int(max(sizes))
    return None


def _join_process_group(world_size: int, device: torch.device) -> None:
    """DeepSpeed needs a process group: with one process and none initialised, make a 1-process one
    (an in-memory store: no port; ``LOCAL_RANK`` defaults to 0 as DeepSpeed requires it); refuse a
    group larger than the trainer's view (``GRPOConfig(distributed='off')`` under a launcher)."""
    dist = torch.distributed
    if world_size == 1:
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts that a launcher set it
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"DeepSpeed would train over the {dist.get_world_size()} processes of the process "
                f"group, but the trainer trains alone (GRPOConfig(distributed='off')). Use "
                f"distributed='auto' to train data-parallel, or deepspeed='off'."
            )
        return
    if world_size != 1:  # pragma: no cover - the trainer joined the group when world_size > 1
        raise RuntimeError("internal error: several processes but no process group")
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


class DeepSpeedBackend:
    """A DeepSpeed engine over the policy's module and the trainer's optimizer.

    Args:
        policy: the policy (see `training_module`); its trainable parameters must be exactly the
            module's (``policy.get_parameters()`` with ``requires_grad``).
        params: the trainer's parameters (``policy_parameters(policy)``).
        optimizer: the trainer's torch optimizer over ``params``; DeepSpeed wraps it.
        config: a DeepSpeed config (`prepare_deepspeed_config` is applied to it).
        max_grad_norm: ``GRPOConfig.max_grad_norm``.
        world_size: data-parallel processes (the trainer's; 1 = one process).
        device: the trainer's device.
    """

    def __init__(
        self,
        policy: Any,
        params: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        config: Mapping[str, Any],
        *,
        max_grad_norm: float | None,
        world_size: int,
        device: torch.device,
        scheduler: Any = None,
        sync: DistributedSync | None = None,
    ) -> None:
        deepspeed = import_deepspeed()
        self.scheduler = scheduler
        self.sync = sync
        self._loss: Tensor | None = None  # the optimizer step's loss so far (this rank)
        self._step_loss = math.nan  # the global loss of the last optimizer step
        module = training_module(policy)
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        if trainable != {id(p) for p in params}:
            raise ValueError(
                f"DeepSpeed trains the parameters of {type(module).__name__} that require grad "
                f"({len(trainable)} tensors), but policy.get_parameters() gives {len(params)} "
                f"trainable tensors that are not the same set. Make get_parameters() return "
                f"exactly the module's trainable parameters."
            )
        self.config = prepare_deepspeed_config(
            config, max_grad_norm=max_grad_norm, world_size=world_size, hidden_size=model_hidden_size(module)
        )
        _join_process_group(world_size, device)
        self.world_size = world_size
        self.stage = int(self.config["zero_optimization"]["stage"])
        self.name = f"DeepSpeed ZeRO-{self.stage}"
        self.lockstep_forwards = self.stage == 3  # each forward all-gathers the partitioned weights
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=self.config)
        self.engine: Any = engine
        self.module: nn.Module = engine.module  # the policy's module (kept after `close`)
        self.reference_engine: Any = None  # ZeRO-3: the frozen reference, partitioned too
        if torch.distributed.get_rank() == 0:
            logger.info(
                "DeepSpeed ZeRO-%d on %d process(es): backward and optimizer step through DeepSpeed "
                "%s (gradient_clipping=%s, bf16=%s)",
                self.stage,
                world_size,
                deepspeed.__version__,
                self.config["gradient_clipping"],
                bool((self.config.get("bf16") or {}).get("enabled")),
            )

    # ---- the Backend protocol (grpo.engine.backends) ----------------------------------------------------
    rescales_gradients = False  # DeepSpeed reduces (and partitions) gradients in its backward
    supports_rollback = False  # the optimizer state is partitioned over the processes
    local_weights = False  # partitioned: the guard's weight and gradient checks do not apply
    checkpointable = False  # the optimizer state stays partitioned over the processes
    sharded_weights: ShardedWeights | None = None  # the trainer's checkpoints are refused

    def global_sum(self, value: Tensor) -> Tensor:
        return value.detach().clone() if self.sync is None else self.sync.all_reduce_sum(value)

    def backward(self, loss: Tensor, *, last: bool) -> None:
        """Backward of one micro-batch's ``loss`` (this rank's share of the global mean). At the
        last micro-batch of the optimizer step, first decide on the step's global loss (one
        all-reduce): a non-finite one poisons the gradients so that DeepSpeed skips the step."""
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        poison = False
        if last:
            total = self.global_sum(self._loss.reshape(1)).reshape(())
            self._step_loss = float(total)
            poison = not math.isfinite(self._step_loss)
            self._loss = None
        self._backward(loss, boundary=last, poison=poison)

    def rescale_gradients(self, divisor: Tensor) -> None:
        raise NotImplementedError(
            "DeepSpeed reduces gradients in its backward; the plan never defers the normaliser."
        )

    def optimizer_step(self) -> OptimizerStepResult:
        norm, applied = self.step()
        if applied and self.scheduler is not None:
            self.scheduler.step()
        return OptimizerStepResult(norm, self._step_loss, applied)

    def reduce_metrics(self, metrics: Mapping[str, float], counts: StepCounts) -> dict[str, float]:
        if self.sync is None:
            return dict(metrics)
        return reduce_across_ranks(metrics, counts, self.sync.all_gather)

    def check_same_optimizer_steps(self, num_groups: int, mini_batch_size: int) -> None:
        if self.sync is not None:
            self.sync.check_same_optimizer_steps(num_groups, mini_batch_size)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "the optimizer state is partitioned by DeepSpeed; trainer checkpoints are refused."
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError(
            "the optimizer state is partitioned by DeepSpeed; trainer checkpoints are refused."
        )

    # ---- the engine ------------------------------------------------------------------------------
    def _backward(self, loss: Tensor, *, boundary: bool, poison: bool = False) -> None:
        """``engine.backward`` of one micro-batch's ``loss``.

        ``boundary``: the last micro-batch of the optimizer step (DeepSpeed reduces then).
        ``poison``: the step's global loss is not finite; make the gradients non-finite too, so
        DeepSpeed's overflow check skips the step.
        """
        # What engine.forward does first (the trainer calls the module itself): a new micro-batch,
        # so ZeRO-3 accumulates into the gradient partitions instead of overwriting them.
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if callable(clear):
            clear()
        self.engine.set_gradient_accumulation_boundary(boundary)
        scaled = loss * self.world_size  # DeepSpeed averages over ranks; the losses are shares of a sum
        if poison:
            scaled = scaled * math.nan
        self.engine.backward(scaled, scale_wrt_gas=False)

    def step(self) -> tuple[float, bool]:
        """``engine.step()``: reduce, clip, update. Returns (global gradient norm before clipping,
        whether the update was applied)."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        value = math.nan if norm is None else float(norm)
        return value, bool(self.engine.was_step_applied())

    def partition_reference(self, module: nn.Module) -> None:
        """ZeRO-3: partition the frozen reference ``module`` over the processes as well (an
        optimizer-less DeepSpeed engine with the same ZeRO and precision settings), so that it
        costs 1/W of a model per process instead of a full copy. Its forwards then all-gather like
        the policy's; `copy_partitioned_weights` refreshes it."""
        if self.stage != 3:
            raise ValueError("partition_reference is for ZeRO stage 3 only.")
        zero = {k: v for k, v in self.config["zero_optimization"].items() if not k.startswith("offload_opt")}
        cfg = {**self.config, "zero_optimization": zero}
        engine, *_ = import_deepspeed().initialize(model=module, config=cfg)
        engine.eval()
        self.reference_engine = engine

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Within the block the module's parameters (and a partitioned reference's) hold their
        full values on every rank (ZeRO-3 partitions them between forwards); a no-op for stages 1
        and 2. Every rank must enter it (it all-gathers). Read-only: changes made inside are
        discarded."""
        if self.stage != 3:
            yield
            return
        params = list(self.module.parameters())
        if self.reference_engine is not None:
            params += list(self.reference_engine.module.parameters())
        with import_deepspeed().zero.GatheredParameters(params, modifier_rank=None):
            yield

    def zero_grad(self) -> None:
        """Clear the module's gradients (DeepSpeed clears its own buffers after each step)."""
        self._loss = None
        self.engine.zero_grad()

    def close(self) -> None:
        """Release what DeepSpeed keeps outside this object, so that the engines, the policy and
        the process groups they hold are freed while the interpreter still runs.

        ``engine.destroy()`` removes most of the engines' hooks (the module's forward hooks, which
        reference the engine, are removed here); ZeRO-3 also leaves its top module on the
        module-global ``FWD_MODULE_STACK`` of ``deepspeed.runtime.zero.parameter_offload``, and
        ``deepspeed.utils.groups`` keeps the world group. Anything still alive at exit is freed
        during interpreter finalisation, where gloo's threads can abort a process after all its
        work is done (SIGABRT, "terminate called without an active exception"). The backend is
        unusable afterwards; closing twice is a no-op.
        """
        engines = [e for e in (self.engine, self.reference_engine) if e is not None]
        if not engines:
            return
        from deepspeed.runtime.zero import parameter_offload  # type: ignore[import-untyped,import-not-found,unused-ignore]
        from deepspeed.utils import groups  # type: ignore[import-untyped,import-not-found,unused-ignore]

        modules = {id(e.module) for e in engines}
        for engine in engines:
            engine.destroy()
            for hook in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
                handle = getattr(engine, hook, None)  # on the module: they would keep the engine alive
                if handle is not None:
                    handle.remove()
        stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
        stack[:] = [m for m in stack if id(m) not in modules]
        if hasattr(groups, "_WORLD_GROUP"):
            groups._WORLD_GROUP = None
        self.engine = self.reference_engine = None
        self._loss = None
