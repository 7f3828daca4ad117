"""Model checkpoints of the LLM path: the LoRA adapter only (PEFT format) or the whole model.

`save_llm_checkpoint` writes, for a LoRA policy, the actor adapter in PEFT's ``save_pretrained``
format (``adapter_model.safetensors`` + ``adapter_config.json``, loadable by
``PeftModel.from_pretrained``), for any other policy the whole model (``model.safetensors``, as
``AutoModelForCausalLM.from_pretrained`` reads it); the tokenizer and ``grpo_llm_checkpoint.json``
(kind, adapter name, trainer step) go with it. Optimizer and scheduler state are not written here:
``GRPOTrainer.train(checkpoint_dir=...)`` checkpoints hold them (`grpo.state.checkpoint`).

`load_llm_checkpoint` loads one into a live policy, in place. Everything read from disk is
untrusted: tensors come from safetensors only (no pickle), the JSON files are checked, and every
tensor's name, shape and dtype are checked against the live model before any weight changes.

LoRA-config reconciliation: when the checkpoint's LoRA config differs from the live adapter's,
loading raises ValueError naming the differing fields, unless ``merge_lora_configs=True``:

* ``r`` -> ``max(current, checkpoint)``; a smaller-rank checkpoint is padded into the top-left
  rank slice (`grpo.llm.lora.pad_lora_pair`, B rescaled by ``s_ckpt / s_live`` so the adapter
  computes exactly the checkpoint's update, the other rank slots keep their A rows and get B = 0);
* ``target_modules`` / ``modules_to_save`` -> the union (modules only the live config targets get
  B = 0: no update until trained);
* any other differing field -> the current value, with a warning.

When the merged config needs a larger adapter (r or the module lists grow), the live adapter is
rebuilt (PEFT ``delete_adapter`` / ``add_adapter``), which replaces its parameter tensors; load
before building the `GRPOTrainer` (passing a trainer then raises ValueError before any change).
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from grpo.llm._deps import require
from grpo.llm.lora import (
    adapter_parameters,
    copy_adapter,
    lora_config_differences,
    lora_scaling,
    merged_lora_config,
    pad_lora_pair,
)

__all__ = ["META_FILE", "LoadedCheckpoint", "load_llm_checkpoint", "save_llm_checkpoint"]

logger = logging.getLogger(__name__)

META_FILE = "grpo_llm_checkpoint.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_WEIGHTS = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 16 * 2**20


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_llm_checkpoint` did.

    Attributes:
        kind: ``"lora"`` (an adapter) or ``"full"`` (the whole model).
        path: the directory read.
        rebuilt: True when the live adapter was rebuilt with the merged config (new tensors).
        merged: the LoRA fields reconciled, name -> (current, checkpoint) before the merge.
        current_won: the reconciled fields where the current value was kept (warned).
        step: the trainer step recorded at save time, or None.
    """

    kind: Literal["lora", "full"]
    path: Path
    rebuilt: bool = False
    merged: Mapping[str, tuple[Any, Any]] | None = None
    current_won: tuple[str, ...] = ()
    step: int | None = None


def _policy_of(obj: Any) -> tuple[Any, Any]:
    """(policy, trainer or None) of a `grpo.llm.CausalLMPolicy` or a `GRPOTrainer` holding one."""
    policy, trainer = obj, None
    if hasattr(obj, "policy") and hasattr(obj, "step_count"):
        policy, trainer = obj.policy, obj
    if not (hasattr(policy, "model") and hasattr(policy, "is_peft")):
        raise TypeError(
            f"expected a grpo.llm.CausalLMPolicy or a GRPOTrainer training one, got "
            f"{type(policy).__name__}; other policies are checkpointed by GRPOTrainer.save_checkpoint."
        )
    return policy, trainer


# ---- saving ------------------------------------------------------------------------------------
def save_llm_checkpoint(policy_or_trainer: Any, path: str | Path, *, save_tokenizer: bool = True) -> Path:
    """Write the policy's model to directory ``path`` (created) and return it: a LoRA policy's
    actor adapter only (PEFT format, safetensors; the separate reference adapter is not written),
    any other policy's whole model (safetensors); the tokenizer (``save_tokenizer``) and
    ``grpo_llm_checkpoint.json``. Given a trainer, its ``step_count`` is recorded.

    With partitioned weights (DeepSpeed ZeRO-3, FSDP) every process must call it; rank 0 writes
    (`grpo.llm.CausalLMPolicy.save_pretrained`, which then writes every adapter).
    """
    policy, trainer = _policy_of(policy_or_trainer)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = policy.model
    if policy.is_partitioned:
        policy.save_pretrained(str(out))
    elif policy.is_peft:
        model.save_pretrained(str(out), safe_serialization=True, selected_adapters=[model.active_adapter])
        if save_tokenizer:
            policy.tokenizer.save_pretrained(str(out))
    else:
        policy.save_pretrained(str(out)) if save_tokenizer else model.save_pretrained(str(out))
    meta = {
        "format": 1,
        "kind": "lora" if policy.is_peft else "full",
        "adapter": model.active_adapter if policy.is_peft else None,
        "step": None if trainer is None else int(trainer.step_count),
    }
    if not policy.is_partitioned or _is_main_process():
        (out / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    logger.info("saved %s checkpoint to %s", meta["kind"], out)
    return out


def _is_main_process() -> bool:
    from grpo.engine.distributed import is_main_process

    return is_main_process()


# ---- reading untrusted files -------------------------------------------------------------------
def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from ``file`` (size-capped), or ValueError naming the file."""
    if not file.is_file():
        raise ValueError(f"{file} is missing.")
    if file.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"{file} is {file.stat().st_size} bytes, over the {MAX_JSON_BYTES}-byte cap.")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}.")
    return data


def _read_tensors(file: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors ``file`` (no pickle), each a floating-point tensor."""
    st = require("safetensors.torch", extra="llm")
    if not file.is_file():
        raise ValueError(f"{file} is missing.")
    try:
        tensors: dict[str, Tensor] = st.load_file(str(file), device="cpu")
    except Exception as e:  # a truncated or forged file: safetensors raises its own errors
        raise ValueError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from e
    return tensors


def _read_full_weights(directory: Path) -> dict[str, Tensor]:
    """``model.safetensors``, or the shards listed by ``model.safetensors.index.json`` (file names
    without any directory part)."""
    if (directory / MODEL_WEIGHTS).is_file():
        return _read_tensors(directory / MODEL_WEIGHTS)
    index = _read_json(directory / MODEL_INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{directory / MODEL_INDEX} has no weight_map object.")
    shards = sorted({str(v) for v in weight_map.values()})
    bad = [s for s in shards if Path(s).name != s or not s.endswith(".safetensors")]
    if bad:
        raise ValueError(
            f"{directory / MODEL_INDEX} names shard files outside the directory or not safetensors: {bad[:3]}"
        )
    out: dict[str, Tensor] = {}
    for shard in shards:
        out.update(_read_tensors(directory / shard))
    return out


def _check_against(
    given: Mapping[str, Tensor], live: Mapping[str, Tensor], where: Path, *, allow_missing: set[str]
) -> None:
    """ValueError unless ``given`` has the names of ``live`` (less ``allow_missing``), each with
    the live shape and a floating dtype where the live tensor is floating."""
    unexpected = sorted(set(given) - set(live))
    missing = sorted(set(live) - set(given) - allow_missing)
    if unexpected or missing:
        raise ValueError(
            f"{where}: the tensor names do not match the live model: unexpected {unexpected[:5]}, "
            f"missing {missing[:5]} ({len(unexpected)} / {len(missing)} in all). Load it into a "
            f"model of the same architecture (and LoRA config) as the one that saved it."
        )
    for name, t in given.items():
        ref = live[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the live model's has "
                f"{tuple(ref.shape)}."
            )
        if ref.is_floating_point() != t.is_floating_point():
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {t.dtype}, the live model's is {ref.dtype}."
            )


# ---- loading -----------------------------------------------------------------------------------
def load_llm_checkpoint(
    policy_or_trainer: Any,
    path: str | Path,
    *,
    merge_lora_configs: bool = False,
    copy_to_reference: bool = True,
) -> LoadedCheckpoint:
    """Load a `save_llm_checkpoint` directory (or any PEFT adapter / safetensors HF model
    directory) into the live policy, in place.

    A LoRA policy reads an adapter (see the module docstring for ``merge_lora_configs``); with
    a separate reference adapter (``use_separate_reference_adapter=True``) the loaded adapter is
    copied into it too when ``copy_to_reference`` (the loaded stage becomes the next stage's
    reference). Any other policy reads the whole model. Raises ValueError (a mismatch, a bad
    file) or TypeError (a LoRA checkpoint for a model without adapter, and the reverse) before
    any weight changes.
    """
    policy, trainer = _policy_of(policy_or_trainer)
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"load_llm_checkpoint: {directory} is not a directory.")
    step = _saved_step(directory)
    is_adapter = (directory / ADAPTER_CONFIG).is_file()
    if is_adapter != bool(policy.is_peft):
        what = "a LoRA adapter" if is_adapter else "a whole model (no adapter_config.json)"
        fix = (
            "wrap the base model with peft.get_peft_model(model, LoraConfig(...)) first"
            if is_adapter
            else "load it with AutoModelForCausalLM.from_pretrained(path) and wrap that in a PEFT model"
        )
        raise TypeError(
            f"{directory} holds {what} but the policy's model is "
            f"{'a PEFT' if policy.is_peft else 'not a PEFT'} model; {fix}."
        )
    if not is_adapter:
        _load_full(policy.model, directory)
        return LoadedCheckpoint("full", directory, step=step)
    result = _load_adapter(policy, directory, merge_lora_configs, trainer is not None, copy_to_reference)
    reference = getattr(policy, "reference_adapter", None)
    if copy_to_reference and reference is not None:
        copy_adapter(policy.model, policy.model.active_adapter, reference)
    return LoadedCheckpoint("lora", directory, result.rebuilt, result.merged, result.current_won, step)


def _saved_step(directory: Path) -> int | None:
    if not (directory / META_FILE).is_file():
        return None
    step = _read_json(directory / META_FILE).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _load_full(model: Any, directory: Path) -> None:
    """The whole model's weights from safetensors, checked, into ``model`` (tied weights that
    ``save_pretrained`` left out may be missing)."""
    given = _read_full_weights(directory)
    live = model.state_dict()
    by_storage: dict[int, list[str]] = {}
    for name, t in live.items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    tied = {n for names in by_storage.values() if any(x in given for x in names) for n in names}
    _check_against(given, live, directory, allow_missing=tied)
    with torch.no_grad():
        model.load_state_dict(given, strict=False)


# ---- loading a LoRA adapter --------------------------------------------------------------------
@dataclass(frozen=True)
class _AdapterLoad:
    rebuilt: bool = False
    merged: Mapping[str, tuple[Any, Any]] | None = None
    current_won: tuple[str, ...] = ()


def _read_lora_config(file: Path) -> dict[str, Any]:
    """The checkpoint's LoRA config (``adapter_config.json``), its key fields checked."""
    cfg = _read_json(file)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(
            f"{file}: peft_type is {cfg.get('peft_type')!r}; only LoRA adapters ('LORA') load here."
        )
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{file}: r={r!r} must be an integer >= 1.")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{file}: lora_alpha={alpha!r} must be a number > 0.")
    targets = cfg.get("target_modules")
    if not (
        targets is None
        or isinstance(targets, str)
        or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        raise ValueError(f"{file}: target_modules={targets!r} must be a list of names, a string or null.")
    return cfg


def _load_adapter(
    policy: Any, directory: Path, merge: bool, has_trainer: bool, copy_to_reference: bool
) -> _AdapterLoad:
    """The checkpoint's adapter into the policy's active adapter (reconciled when ``merge``)."""
    peft_utils = require("peft.utils")
    model = policy.model
    name = model.active_adapter
    ckpt_cfg = _read_lora_config(directory / ADAPTER_CONFIG)
    live_cfg = model.peft_config[name].to_dict()
    diffs = lora_config_differences(live_cfg, ckpt_cfg)
    tensors = _read_tensors(directory / ADAPTER_WEIGHTS)
    if not diffs:
        live = peft_utils.get_peft_model_state_dict(model, adapter_name=name)
        _check_against(tensors, live, directory / ADAPTER_WEIGHTS, allow_missing=set())
        _set_adapter_state(model, tensors, name)
        return _AdapterLoad()
    if not merge:
        listed = "; ".join(f"{k}: {a!r} here, {b!r} in the checkpoint" for k, (a, b) in diffs.items())
        raise ValueError(
            f"{directory}: the checkpoint's LoRA config differs from the live adapter's ({listed}). "
            f"Build the adapter with the checkpoint's config, or pass merge_lora_configs=True "
            f"(r -> max, target_modules/modules_to_save -> union, other fields: the current value)."
        )
    merged, current_won = merged_lora_config(live_cfg, ckpt_cfg)
    _check_mergeable(model, tensors, ckpt_cfg, directory)
    rebuild = any(
        lora_config_differences({k: live_cfg.get(k)}, {k: merged.get(k)})
        for k in ("r", "target_modules", "modules_to_save")
    )
    _check_rebuild(policy, rebuild, has_trainer, copy_to_reference, live_cfg, merged)
    if current_won:
        shown = ", ".join(f"{k}={diffs[k][0]!r} (checkpoint: {diffs[k][1]!r})" for k in current_won)
        warnings.warn(
            f"merge_lora_configs: the live adapter's values were kept for {shown}; the loaded "
            f"weights are rescaled so the adapter still computes the checkpoint's update.",
            UserWarning,
            stacklevel=3,
        )
    if rebuild:
        _rebuild_adapters(model, name, merged)
    _set_adapter_state(model, _merged_state(model, name, tensors, ckpt_cfg), name)
    return _AdapterLoad(rebuild, diffs, tuple(current_won))


def _check_rebuild(
    policy: Any,
    rebuild: bool,
    has_trainer: bool,
    copy_to_reference: bool,
    live: Mapping[str, Any],
    merged: Mapping[str, Any],
) -> None:
    """Refuse a rebuild of the adapters that would leave an optimizer on the old tensors, or
    lose the separate reference adapter's weights (rebuilt fresh and not copied into)."""
    if not rebuild:
        return
    grows = (
        f"r {live.get('r')} -> {merged.get('r')}, target_modules "
        f"{sorted(live.get('target_modules') or [])} -> {sorted(merged.get('target_modules') or [])}"
    )
    if has_trainer:
        raise ValueError(
            f"merge_lora_configs needs a larger live adapter ({grows}), which replaces its tensors, "
            f"but a trainer was given whose optimizer holds the old ones. Call "
            f"load_llm_checkpoint(policy, path, merge_lora_configs=True) before building the GRPOTrainer."
        )
    if getattr(policy, "reference_adapter", None) is not None and not copy_to_reference:
        raise ValueError(
            f"merge_lora_configs needs a larger live adapter ({grows}), which rebuilds the separate "
            f"reference adapter too; with copy_to_reference=False its weights would be lost. Pass "
            f"copy_to_reference=True (the loaded adapter becomes the reference)."
        )


def _module_of(model: Any, prefix: str) -> Any:
    """The module ``prefix`` (a state-dict key's module path) of the PEFT model, or None."""
    try:
        return model.get_submodule(prefix)
    except AttributeError:
        return None


def _check_mergeable(
    model: Any, tensors: Mapping[str, Tensor], cfg: Mapping[str, Any], directory: Path
) -> None:
    """The checkpoint's tensors are Linear LoRA pairs of rank ``cfg['r']`` that fit the live
    model's layers (checked before any weight changes)."""
    where = directory / ADAPTER_WEIGHTS
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_dora"):
        raise ValueError(
            f"{directory}: merge_lora_configs supports plain LoRA with one r and lora_alpha; this "
            f"checkpoint uses rank_pattern / alpha_pattern / DoRA. Build the live adapter with the "
            f"checkpoint's config and load without merging."
        )
    r = int(cfg["r"])
    for key, t in tensors.items():
        role = key.rsplit(".", 2)[-2:] if key.count(".") >= 2 else []
        if role not in (["lora_A", "weight"], ["lora_B", "weight"]):
            raise ValueError(
                f"{where}: tensor {key!r} is not a Linear LoRA weight (lora_A/lora_B); "
                f"merge_lora_configs supports only those."
            )
        prefix = key.rsplit(".", 2)[0]
        pair = f"{prefix}.lora_{'B' if role[0] == 'lora_A' else 'A'}.weight"
        module = _module_of(model, prefix)
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if pair not in tensors:
            raise ValueError(f"{where}: {key!r} has no partner {pair!r} in the file.")
        if not isinstance(base, torch.nn.Linear):
            raise ValueError(
                f"{where}: {key!r} belongs to {prefix!r}, which is not an nn.Linear layer of the "
                f"live model ({type(base).__name__}); load it into the architecture that saved it."
            )
        want = (r, base.in_features) if role[0] == "lora_A" else (base.out_features, r)
        if tuple(t.shape) != want or not t.is_floating_point():
            raise ValueError(
                f"{where}: tensor {key!r} is {t.dtype} {tuple(t.shape)}; a rank-{r} LoRA weight "
                f"of {prefix!r} is floating-point {want}."
            )


def _rebuild_adapters(model: Any, active: str, merged: Mapping[str, Any]) -> None:
    """Every adapter of the PEFT model rebuilt with the merged r / target_modules /
    modules_to_save (fresh LoRA init); ``active`` trainable and active, the others frozen."""
    configs = {}
    for n, old in model.peft_config.items():
        cfg = copy.deepcopy(old)
        for k in ("r", "target_modules", "modules_to_save"):
            value = merged.get(k)
            setattr(cfg, k, set(value) if isinstance(value, list) and k == "target_modules" else value)
        cfg.inference_mode = n != active
        configs[n] = cfg
    for n in list(configs):
        model.delete_adapter(n)
    model.add_adapter(active, configs.pop(active))
    for n, cfg in configs.items():
        model.add_adapter(n, cfg)
    model.set_adapter(active)
    for n in configs:
        for p in adapter_parameters(model, n).values():
            p.requires_grad_(False)


def _merged_state(
    model: Any, name: str, tensors: Mapping[str, Tensor], cfg: Mapping[str, Any]
) -> dict[str, Tensor]:
    """The live adapter's state with the checkpoint's pairs padded in (`pad_lora_pair`); pairs the
    checkpoint lacks keep A and get B = 0."""
    live = require("peft.utils").get_peft_model_state_dict(model, adapter_name=name)
    state = {k: v.detach().clone() for k, v in live.items()}
    for key in live:
        if not key.endswith(".lora_A.weight"):
            continue
        prefix = key[: -len(".lora_A.weight")]
        b_key = f"{prefix}.lora_B.weight"
        if key not in tensors:
            state[b_key] = torch.zeros_like(live[b_key])
            continue
        a_c = tensors[key]
        ratio = lora_scaling(cfg, a_c.shape[0]) / float(model.get_submodule(prefix).scaling[name])
        state[key], state[b_key] = pad_lora_pair(a_c, tensors[b_key], live[key], live[b_key].shape, ratio)
    return state


def _set_adapter_state(model: Any, state: Mapping[str, Tensor], name: str) -> None:
    peft_utils = require("peft.utils")
    with torch.no_grad():
        result = peft_utils.set_peft_model_state_dict(model, dict(state), adapter_name=name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise RuntimeError(f"PEFT did not place the adapter tensors {unexpected[:4]} (adapter {name!r}).")
