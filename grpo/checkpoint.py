"""Checkpoints that are safe to load and resume a run exactly.

A checkpoint is a directory ``<root>/step-XXXXXXXX/`` holding

* ``policy.safetensors`` — the policy's weights (and ``reference.safetensors`` when the trainer
  has a reference policy);
* ``state.safetensors`` — every other tensor: optimizer state, scheduler tensors, RNG states,
  running statistics of stateful components;
* ``state.json`` — everything that is not a tensor (the config, step counters, the optimizer's
  ``param_groups``, Python / NumPy RNG states, the structure of each state dict with tensors
  replaced by ``{"__tensor__": key}`` references) and a manifest of the files with their sizes.

Guarantees (tests in ``tests/test_checkpoint.py``, list in ``docs/reliability.md``):

* **Nothing is unpickled.** Tensors go through ``safetensors`` and the rest through JSON; loading
  calls neither ``pickle`` nor ``torch.load``. A file that is not valid safetensors/JSON is
  refused with `CheckpointError`.
* **Atomic.** A checkpoint is written in a temporary directory ``<root>/.tmp-*`` (files fsynced),
  then renamed to ``step-XXXXXXXX`` in one ``os.replace``. Only after that is the ``latest``
  pointer (a text file with the directory name) replaced, again atomically. A process killed at
  any moment leaves either the previous checkpoints or the new complete one; leftovers named
  ``.tmp-*`` are ignored by the loader and removed by the next save.
* **Newest complete wins.** `find_latest_checkpoint` scans ``step-*`` directories newest first and
  returns the first whose manifest checks (``state.json`` parses, every listed file exists with
  its recorded size). ``latest`` is a convenience for people and tools.
* **Keep last K.** Older checkpoints are renamed to ``.tmp-*`` before they are deleted, so a
  half-deleted checkpoint never carries a ``step-*`` name.

One process writes to one root at a time.

Policies that are not ``nn.Module``s save through this hook (first that applies):

1. methods ``state_dict() -> Mapping[str, Tensor]`` and ``load_state_dict(mapping)``;
2. otherwise the tensors of ``get_parameters()`` (a mapping or an iterable), restored by copying
   in place (``tensor.copy_``) so that an optimizer holding them stays valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CheckpointError",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_policy_state",
    "policy_state",
    "read_checkpoint_config",
    "save_checkpoint",
]

FORMAT = "grpo-checkpoint"
VERSION = 1
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
STATE_JSON = "state.json"
POLICY_FILE = "policy.safetensors"
REFERENCE_FILE = "reference.safetensors"
STATE_FILE = "state.safetensors"


class Restorable(Protocol):
    """What `load_checkpoint` needs of a trainer (`grpo.trainer.GRPOTrainer` has it)."""

    config: Any

    def load_state_dict(self, state: Any, *, source: str = ...) -> None: ...

    def stateful_components(self) -> dict[str, Any]: ...


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, not in grpo's format, or does not fit the trainer."""


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - safetensors is a core dependency
        raise ImportError("grpo checkpoints need safetensors: pip install 'safetensors>=0.4'") from e
    return st


# ---- state trees: tensors -> safetensors keys, the rest -> JSON ------------------------------
class _TensorTable:
    """Collects tensors under unique keys, deduplicating identical views (tied weights)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.aliases: dict[str, str] = {}
        self._by_view: dict[tuple[Any, ...], str] = {}
        self._storages: set[int] = set()

    def add(self, key: str, t: Tensor) -> str:
        t = t.detach()
        view = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if t.numel() > 0 and view in self._by_view:
            self.aliases[key] = self._by_view[view]
            return key
        cpu = t.to("cpu").contiguous()
        ptr = cpu.untyped_storage().data_ptr()
        if cpu.numel() > 0 and ptr in self._storages:
            cpu = cpu.clone()  # shares memory with another saved tensor: safetensors needs it separate
            ptr = cpu.untyped_storage().data_ptr()
        if cpu.numel() > 0:
            self._storages.add(ptr)
            self._by_view[view] = key
        self.tensors[key] = cpu
        return key


def _encode(obj: Any, table: _TensorTable, key: str) -> Any:
    """A JSON-able tree for ``obj``; tensors go to ``table`` and become ``{"__tensor__": key}``."""
    if isinstance(obj, Tensor):
        return {"__tensor__": table.add(key, obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, table, f"{key}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, table, f"{key}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj):
            if any(k.startswith("__") and k.endswith("__") for k in obj):
                return {"__items__": [[k, _encode(v, table, f"{key}.{k}")] for k, v in obj.items()]}
            return {k: _encode(v, table, f"{key}.{k}") for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, bool)) and k is not None:
                raise CheckpointError(f"cannot save {key}: dict key {k!r} of type {type(k).__name__}")
            items.append([k, _encode(v, table, f"{key}.{k}")])
        return {"__items__": items}
    raise CheckpointError(
        f"cannot save {key}: a value of type {type(obj).__name__} ({obj!r:.80}) is neither a tensor nor "
        f"plain data (numbers, strings, lists, dicts). grpo checkpoints store tensors in safetensors and "
        f"the rest in JSON, never pickles: make the state_dict() of this object return plain data."
    )


def _decode(obj: Any, tensors: Mapping[str, Tensor], aliases: Mapping[str, str]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, aliases) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        key = str(obj["__tensor__"])
        key = aliases.get(key, key)
        if key not in tensors:
            raise CheckpointError(f"tensor {key!r} is referenced in state.json but missing from the tensors")
        return tensors[key]
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors, aliases) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {k: _decode(v, tensors, aliases) for k, v in obj["__items__"]}
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
    if "__dtype__" in obj:
        dt = getattr(torch, str(obj["__dtype__"]), None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointError(f"unknown dtype {obj['__dtype__']!r} in state.json")
        return dt
    return {k: _decode(v, tensors, aliases) for k, v in obj.items()}


# ---- policy weights: nn.Module, the state_dict hook, or get_parameters() ----------------------
def _has_state_dict(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def policy_state(policy: object, role: str = "policy") -> dict[str, Tensor]:
    """The tensors that define ``policy``: ``state_dict()`` if it has the pair of methods, else
    ``get_parameters()`` (keys = names of a mapping, or ``"0"``, ``"1"``... for an iterable)."""
    if _has_state_dict(policy):
        raw: Any = policy.state_dict()  # type: ignore[attr-defined]
        where = f"{type(policy).__name__}.state_dict()"
    else:
        raw = policy.get_parameters()  # type: ignore[attr-defined]
        where = f"{type(policy).__name__}.get_parameters()"
        if not isinstance(raw, Mapping):
            raw = {str(i): t for i, t in enumerate(raw)}
    if not isinstance(raw, Mapping):
        raise CheckpointError(
            f"{role} {where} returned {type(raw).__name__}; expected a mapping name -> Tensor."
        )
    out: dict[str, Tensor] = {}
    for k, v in raw.items():
        if not isinstance(v, Tensor):
            raise CheckpointError(
                f"{role} {where} holds {k!r} of type {type(v).__name__}; checkpoints store tensors only. "
                f"Return only tensors (keep other state in the object's constructor)."
            )
        out[str(k)] = v
    return out


def load_policy_state(policy: object, tensors: Mapping[str, Tensor], role: str = "policy") -> None:
    """Restore what `policy_state` saved (``load_state_dict``, or in-place copies into parameters)."""
    if _has_state_dict(policy):
        try:
            result = policy.load_state_dict(dict(tensors))  # type: ignore[attr-defined]
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{role} {type(policy).__name__}.load_state_dict refused the checkpoint's weights: {e}. "
                f"Build the {role} with the same architecture as the run that saved it."
            ) from e
        del result
        return
    raw: Any = policy.get_parameters()  # type: ignore[attr-defined]
    current: dict[str, Tensor] = (
        {str(k): v for k, v in raw.items()}
        if isinstance(raw, Mapping)
        else {str(i): t for i, t in enumerate(raw)}
    )
    if set(current) != set(tensors):
        raise CheckpointError(
            f"{role} {type(policy).__name__}.get_parameters() has tensors {sorted(current)[:8]} but the "
            f"checkpoint has {sorted(tensors)[:8]}; build the {role} like the run that saved it."
        )
    with torch.no_grad():
        for k, dst in current.items():
            src = tensors[k]
            if src.shape != dst.shape:
                raise CheckpointError(
                    f"{role} tensor {k!r} has shape {tuple(dst.shape)} but the checkpoint has "
                    f"{tuple(src.shape)}."
                )
            dst.copy_(src)


# ---- RNG streams ---------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    """The process-global RNG streams (Python, NumPy, torch CPU and CUDA)."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np.asarray(np_state["state"]["key"]).tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"the checkpoint holds CUDA RNG states for {len(cuda)} device(s) but this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; CUDA sampling will not "
                f"continue exactly as in the saved run.",
                RuntimeWarning,
                stacklevel=4,
            )


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync directories
        _fsync_file(path)


def _write_tensors(path: Path, table: _TensorTable, metadata: dict[str, str] | None = None) -> None:
    _safetensors().save_file(table.tensors, str(path), metadata=metadata)
    _fsync_file(path)


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX) :])
    except ValueError:
        return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """``step-*`` directories under ``root``, oldest first (complete or not; see `verify`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def _manifest_problem(path: Path) -> str | None:
    """None if ``path`` is a complete grpo checkpoint, else what is wrong with it."""
    meta_path = path / STATE_JSON
    if not meta_path.is_file():
        return f"{STATE_JSON} is missing"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{STATE_JSON} is not valid JSON ({e})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"{STATE_JSON} is not a {FORMAT} manifest"
    if meta.get("version") != VERSION:
        return f"format version {meta.get('version')!r} is not supported (this grpo reads {VERSION})"
    for name, size in meta.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
    return None


def find_latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one), else None."""
    root = Path(root)
    if (root / STATE_JSON).is_file():
        return root if _manifest_problem(root) is None else None
    for path in reversed(list_checkpoints(root)):
        if _manifest_problem(path) is None:
            return path
    return None


def _resolve(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if (p / STATE_JSON).is_file():
        problem = _manifest_problem(p)
        if problem is not None:
            raise CheckpointError(f"{p} is not a complete grpo checkpoint: {problem}.")
        return p
    found = find_latest_checkpoint(p)
    if found is None:
        seen = [c.name for c in list_checkpoints(p)]
        raise CheckpointError(
            f"no complete grpo checkpoint in {p} (step directories seen: {seen[-5:]}). Pass the directory "
            f"given to save_checkpoint(), or one of its step-XXXXXXXX subdirectories."
        )
    return found


def _clean_temps(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def save_checkpoint(
    state: Mapping[str, Any],
    config: Mapping[str, Any],
    root: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
) -> Path:
    """Write a trainer's ``state`` (`grpo.trainer_state`) and ``config`` (``GRPOConfig.to_dict()``)
    to ``<root>/step-<step_count>/`` atomically with the process-global RNG streams, update
    ``latest``, keep the last K. Returns the path of the new checkpoint. ``keep_last=None`` keeps
    every checkpoint."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_temps(root)
    step = int(state["step_count"])
    name = f"{PREFIX}{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=root))

    files: dict[str, int] = {}
    pol = _TensorTable()
    for k, v in state["policy"].items():
        pol.add(k, v)
    _write_tensors(tmp / POLICY_FILE, pol)
    files[POLICY_FILE] = (tmp / POLICY_FILE).stat().st_size
    ref_aliases: dict[str, str] | None = None
    if state["reference_policy"] is not None:
        ref = _TensorTable()
        for k, v in state["reference_policy"].items():
            ref.add(k, v)
        _write_tensors(tmp / REFERENCE_FILE, ref)
        files[REFERENCE_FILE] = (tmp / REFERENCE_FILE).stat().st_size
        ref_aliases = ref.aliases

    table = _TensorTable()
    rest = {
        "optimizer": state["optimizer"],
        "scheduler": state["scheduler"],
        "rng": {**_rng_state(), "generators": {"_generator": state["generator"]}},
        "components": state["components"],
    }
    tree = _encode(rest, table, "state")
    _write_tensors(tmp / STATE_FILE, table)
    files[STATE_FILE] = (tmp / STATE_FILE).stat().st_size

    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "torch_version": torch.__version__,
        "config": _encode(dict(config), _TensorTable(), "config"),
        "scalars": {"step_count": step, "non_finite_steps": int(state["non_finite_steps"])},
        "policy": {"aliases": pol.aliases},
        "reference": None if ref_aliases is None else {"aliases": ref_aliases},
        "state_aliases": table.aliases,
        "tree": tree,
        "files": files,
    }
    (tmp / STATE_JSON).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    _fsync_file(tmp / STATE_JSON)
    _fsync_dir(tmp)

    final = root / name
    if final.exists():  # the same step saved again: move the old one out of the way first
        old = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-", dir=root))
        os.replace(final, old / name)
    os.replace(tmp, final)
    _fsync_dir(root)

    pointer = root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    pointer.write_text(name + "\n", encoding="utf-8")
    _fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)

    if keep_last is not None:
        for stale in list_checkpoints(root)[:-keep_last]:
            trash = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}del-", dir=root))
            os.replace(stale, trash / stale.name)
            shutil.rmtree(trash, ignore_errors=True)
    _clean_temps(root)
    return final


def _load_tensors(path: Path) -> dict[str, Tensor]:
    try:
        tensors: dict[str, Tensor] = _safetensors().load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(
            f"{path} is not a valid safetensors file ({type(e).__name__}: {e}). grpo loads tensors only "
            f"through safetensors and never unpickles; the checkpoint is corrupt or was tampered with."
        ) from e
    return tensors


def read_checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``GRPOConfig`` fields stored in the newest complete checkpoint at ``path``."""
    ckpt = _resolve(path)
    meta = json.loads((ckpt / STATE_JSON).read_text(encoding="utf-8"))
    config: dict[str, Any] = _decode(meta["config"], {}, {})
    return config


def load_checkpoint(trainer: Restorable, path: str | os.PathLike[str]) -> Path:
    """Restore ``trainer`` from the checkpoint at ``path`` (a root: its newest complete checkpoint).

    Everything is read into the trainer's state dict (`grpo.trainer_state`) and checked by
    ``trainer.load_state_dict`` before anything of the trainer changes; then the process-global
    RNG streams are restored.
    """
    ckpt = _resolve(path)
    meta = json.loads((ckpt / STATE_JSON).read_text(encoding="utf-8"))
    policy_t = _load_tensors(ckpt / POLICY_FILE)
    for k, v in meta["policy"]["aliases"].items():
        policy_t[k] = policy_t[v]
    ref_t = None
    if meta.get("reference") is not None:
        ref_t = _load_tensors(ckpt / REFERENCE_FILE)
        for k, v in meta["reference"]["aliases"].items():
            ref_t[k] = ref_t[v]
    state_t = _load_tensors(ckpt / STATE_FILE)
    tree = _decode(meta["tree"], state_t, meta.get("state_aliases", {}))
    scalars = meta["scalars"]
    rng = tree["rng"]
    state = {
        "step_count": scalars.get("step_count"),
        "non_finite_steps": scalars.get("non_finite_steps", 0),
        "policy": policy_t,
        "reference_policy": ref_t,
        "optimizer": tree["optimizer"],
        "scheduler": tree["scheduler"],
        "generator": rng.get("generators", {}).get("_generator"),
        "components": tree["components"],
    }
    saved_cfg = meta["config"]
    now_cfg = _encode(trainer.config.to_dict(), _TensorTable(), "config")
    differ = sorted(k for k in set(saved_cfg) | set(now_cfg) if saved_cfg.get(k) != now_cfg.get(k))
    trainer.load_state_dict(state, source=str(ckpt))
    if differ:
        warnings.warn(
            f"loading {ckpt} into a trainer whose config differs in {differ} "
            f"(saved: {[saved_cfg.get(k) for k in differ]}, now: {[now_cfg.get(k) for k in differ]}); "
            f"the run will not continue exactly as the saved one.",
            UserWarning,
            stacklevel=3,
        )
    _set_rng_state(rng)
    return ckpt
