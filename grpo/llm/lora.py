"""LoRA (PEFT) helpers: the separate frozen reference adapter, adapter switching, and LoRA configs
compared, merged and padded for `grpo.llm.checkpoint`.

The reference policy of a LoRA run is, by default, the policy's own model with its adapter
disabled (`grpo.llm.DisabledAdapterReference`: the base weights, no second copy). The option
``CausalLMPolicy(..., use_separate_reference_adapter=True)`` keeps a second adapter named
``"reference"`` in the same PEFT model instead: frozen, initialised as a copy of the actor adapter,
used by switching the active adapter for the reference forward (`SeparateAdapterReference`), and
refreshed from the actor adapter every ``GRPOConfig.reference_update_freq`` steps. Its memory is
one more adapter (``r * (d_in + d_out)`` per targeted layer), never a second base model.

A LoRA update is ``W + s * B @ A`` with ``A`` (r, d_in), ``B`` (d_out, r) and the scaling
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). `pad_lora_pair` writes a
rank-``r_c`` pair into a rank-``r >= r_c`` pair so that the product is unchanged:
``A' = [A_c; A_fill]``, ``B' = [B_c * s_c / s, 0]`` gives ``s * B' @ A' = s_c * B_c @ A_c``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.llm._deps import require
from grpo.policy_base import EntropyRequest, PolicyOutput

__all__ = [
    "IGNORED_LORA_FIELDS",
    "REFERENCE_ADAPTER",
    "SeparateAdapterReference",
    "active_adapter",
    "adapter_parameters",
    "add_reference_adapter",
    "base_model_state_dict",
    "copy_adapter",
    "lora_config_differences",
    "lora_scaling",
    "merged_lora_config",
    "pad_lora_pair",
]

REFERENCE_ADAPTER = "reference"

# LoraConfig fields that do not change what a saved adapter computes or how its tensors are shaped
IGNORED_LORA_FIELDS = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "init_lora_weights",
        "runtime_config",
        "task_type",
        "peft_version",
        "auto_mapping",
        "megatron_config",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "kasa_config",
        "monteclora_config",
    }
)
# fields merged as a union of names by `merged_lora_config`
UNION_FIELDS = ("target_modules", "modules_to_save")


class AdapterPolicy(Protocol):
    """What `SeparateAdapterReference` uses of `grpo.llm.CausalLMPolicy`."""

    model: Any
    is_peft: bool

    def generate_actions(self, states: Sequence[Any], num_actions_per_state: int, **kwargs: Any) -> Any: ...

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Any],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput: ...

    @property
    def is_partitioned(self) -> bool: ...


# ---- adapters in one PEFT model ----------------------------------------------------------------
@contextlib.contextmanager
def active_adapter(model: Any, name: str) -> Iterator[None]:
    """Run the block with adapter ``name`` active and the model in eval mode; the previous active
    adapter, the training mode and every parameter's ``requires_grad`` flag are restored after
    (PEFT's ``set_adapter`` marks the adapter it activates trainable)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    previous = model.active_adapter
    training = bool(model.training)
    model.set_adapter(name)
    model.eval()
    try:
        yield
    finally:
        model.set_adapter(previous)
        model.train(training)
        for p, flag in flags:
            p.requires_grad_(flag)


def adapter_parameters(model: Any, name: str) -> dict[str, Tensor]:
    """The parameters of adapter ``name`` of a PEFT model, by their full names (the PEFT names
    carry the adapter name as one dotted component, e.g. ``...q_proj.lora_A.reference.weight``)."""
    return {n: p for n, p in model.named_parameters() if name in n.split(".")}


def base_model_state_dict(model: Any) -> dict[str, Tensor]:
    """The base model's weights of a PEFT (LoRA) model under the base checkpoint's names, as
    ``unload()`` would leave them but without copying the model: adapter tensors (``lora_*``) and
    the trainable ``modules_to_save`` copies left out, ``.base_layer.`` / ``.original_module.``
    dropped from the names. ``base.save_pretrained(dir, state_dict=...)`` then writes a checkpoint
    ``from_pretrained`` loads as the plain base model."""
    state: dict[str, Tensor] = {}
    for name, tensor in model.get_base_model().state_dict().items():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        state[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = tensor
    return state


def copy_adapter(model: Any, source: str, target: str) -> None:
    """Copy adapter ``source``'s weights into adapter ``target`` of the same PEFT model (same
    config), in place and without gradient."""
    utils = require("peft.utils")
    state = utils.get_peft_model_state_dict(model, adapter_name=source)
    with torch.no_grad():
        result = utils.set_peft_model_state_dict(model, state, adapter_name=target)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise RuntimeError(
            f"copying adapter {source!r} into {target!r}: PEFT did not place {unexpected[:4]}; the "
            f"two adapters must have the same LoRA config."
        )


def add_reference_adapter(model: Any, name: str = REFERENCE_ADAPTER) -> None:
    """Add adapter ``name`` to the PEFT ``model``: the active adapter's config, frozen
    (``requires_grad=False``), its weights a copy of the active adapter's. The active adapter and
    its trainable flags are unchanged."""
    source = model.active_adapter
    if not isinstance(source, str):
        raise TypeError(f"the PEFT model has several active adapters {source}; activate one first.")
    if name == source or name in model.peft_config:
        raise ValueError(
            f"the PEFT model has an adapter named {name!r} already ({sorted(model.peft_config)}); "
            f"the separate reference adapter needs that name free."
        )
    flags = [(p, p.requires_grad) for p in model.parameters()]
    config = copy.deepcopy(model.peft_config[source])
    config.inference_mode = True
    model.add_adapter(name, config)
    model.set_adapter(source)
    for p, flag in flags:
        p.requires_grad_(flag)
    for p in adapter_parameters(model, name).values():
        p.requires_grad_(False)
    copy_adapter(model, source, name)


class SeparateAdapterReference:
    """The reference policy of a LoRA run held as a second, frozen adapter of the same model.

    Each call runs the shared model with the reference adapter active (`active_adapter`), in
    eval mode and without gradient. `get_parameters` returns the reference adapter's (frozen)
    tensors, so trainer checkpoints save and restore them; `refresh_from` copies the actor
    adapter into it (``GRPOConfig.reference_update_freq``). ``train``/``eval``/``to`` leave the
    shared model alone (the policy moves it).
    """

    def __init__(self, policy: AdapterPolicy, adapter: str = REFERENCE_ADAPTER) -> None:
        if not policy.is_peft or adapter not in getattr(policy.model, "peft_config", {}):
            raise TypeError(
                f"SeparateAdapterReference needs a PEFT model with an adapter named {adapter!r}; "
                f"build the policy with CausalLMPolicy(peft_model, tokenizer, "
                f"use_separate_reference_adapter=True)."
            )
        self.policy = policy
        self.adapter = adapter
        self.actor_adapter: str = policy.model.active_adapter

    def generate_actions(self, states: Sequence[Any], num_actions_per_state: int, **kwargs: Any) -> Any:
        with active_adapter(self.policy.model, self.adapter), torch.no_grad():
            return self.policy.generate_actions(states, num_actions_per_state, **kwargs)

    def get_log_probabilities(self, states: Any, actions: Sequence[Any]) -> PolicyOutput:
        return self.evaluate_actions(states, actions)

    def evaluate_actions(
        self,
        states: Any,
        actions: Sequence[Any],
        *,
        group_size: int = 1,
        with_entropy: EntropyRequest = False,
    ) -> PolicyOutput:
        with active_adapter(self.policy.model, self.adapter), torch.no_grad():
            return self.policy.evaluate_actions(
                states, actions, group_size=group_size, with_entropy=with_entropy
            )

    def get_parameters(self) -> dict[str, Tensor]:
        """The reference adapter's tensors (frozen: nothing here is trained)."""
        return adapter_parameters(self.policy.model, self.adapter)

    def refresh_problem(self) -> str | None:
        """Why `refresh_from` cannot run now (None: it can)."""
        if self.policy.is_partitioned:
            return (
                "the model's weights are partitioned (DeepSpeed ZeRO-3 or FSDP), and the separate "
                "reference adapter is refreshed by copying local tensors, which is not supported there"
            )
        return None

    def refresh_from(self, policy: Any) -> None:
        """Copy the actor adapter's weights into the reference adapter (``policy`` must be the
        policy this reference belongs to)."""
        if policy is not self.policy:
            raise ValueError(
                "SeparateAdapterReference.refresh_from got another policy than the one whose model "
                "holds the reference adapter; refresh it from its own policy."
            )
        copy_adapter(self.policy.model, self.actor_adapter, self.adapter)

    def train(self) -> SeparateAdapterReference:
        return self

    def eval(self) -> SeparateAdapterReference:
        return self

    def to(self, device: Any) -> SeparateAdapterReference:
        return self


# ---- LoRA configs: compare, merge, pad ---------------------------------------------------------
def _as_names(value: Any) -> Any:
    """A collection of module names as a sorted list (a string, e.g. a regex, as it is)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return sorted(str(v) for v in value)
    return value


def lora_config_differences(
    current: Mapping[str, Any], checkpoint: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """The LoRA config fields whose values differ: name -> (current, checkpoint). Fields in
    `IGNORED_LORA_FIELDS` are skipped; name collections compare as sets; a field missing on one
    side counts as equal when the other side has its default None/empty value."""
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(current) | set(checkpoint)):
        if key in IGNORED_LORA_FIELDS:
            continue
        a, b = _as_names(current.get(key)), _as_names(checkpoint.get(key))
        one_sided = key not in current or key not in checkpoint
        if one_sided and (a if key in current else b) in (None, [], {}, False):
            continue
        if a != b:
            out[key] = (a, b)
    return out


def merged_lora_config(
    current: Mapping[str, Any], checkpoint: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The config both adapters fit in, and the differing fields where the current value won.

    ``r`` -> max of the two; ``target_modules`` / ``modules_to_save`` -> the union of the names
    (ValueError when a side gives a pattern string, which has no union); any other differing field
    -> the current value.
    """
    merged = dict(current)
    current_won: list[str] = []
    for key, (a, b) in lora_config_differences(current, checkpoint).items():
        if key == "r":
            merged["r"] = max(int(a), int(b))
        elif key in UNION_FIELDS:
            if isinstance(a, str) or isinstance(b, str):
                raise ValueError(
                    f"merge_lora_configs: {key} is {a!r} here and {b!r} in the checkpoint; a pattern "
                    f"string has no union with a list of names. Give {key} as a list of module names "
                    f"on both sides (the saved config of a PEFT model lists the names it matched)."
                )
            merged[key] = sorted(set(a or []) | set(b or []))
        else:
            current_won.append(key)
    return merged, current_won


def lora_scaling(config: Mapping[str, Any], rank: int) -> float:
    """``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``, at rank ``rank``."""
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def pad_lora_pair(
    a_ckpt: Tensor, b_ckpt: Tensor, a_fill: Tensor, b_shape: Sequence[int], ratio: float
) -> tuple[Tensor, Tensor]:
    """A rank-``r_c`` LoRA pair written into rank ``r`` (``r >= r_c``), the product unchanged.

    Shapes: a_ckpt (r_c, d_in), b_ckpt (d_out, r_c), a_fill (r, d_in) (rows ``r_c:`` of A come
    from it, so every rank slot keeps a gradient), b_shape (d_out, r). ``ratio = s_c / s``:
    ``A' = [a_ckpt; a_fill[r_c:]]``, ``B' = [b_ckpt * ratio, 0]``, so
    ``s * B' @ A' = s_c * b_ckpt @ a_ckpt``. Returns (A' (r, d_in), B' (d_out, r)) in
    ``a_fill``'s dtype.
    """
    rc, r = a_ckpt.shape[0], a_fill.shape[0]
    if rc > r or b_ckpt.shape[1] != rc or tuple(b_shape)[1] != r:
        raise ValueError(
            f"pad_lora_pair: ranks do not fit: A {tuple(a_ckpt.shape)} / B {tuple(b_ckpt.shape)} "
            f"into A {tuple(a_fill.shape)} / B {tuple(b_shape)}."
        )
    a = a_fill.detach().clone()
    a[:rc] = a_ckpt.to(a.dtype)
    b = torch.zeros(tuple(b_shape), dtype=a.dtype, device=a.device)
    b[:, :rc] = b_ckpt.to(a.dtype) * ratio
    return a, b
