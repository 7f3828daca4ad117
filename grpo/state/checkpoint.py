"""Checkpoints that are safe to load and resume a run exactly.

A checkpoint is a directory ``<root>/step-XXXXXXXX/`` holding

* ``policy.safetensors`` — the policy's weights (and ``reference.safetensors`` when the trainer
  has a reference policy);
* ``state.safetensors`` — every other tensor: optimizer state, scheduler tensors, RNG states,
  running statistics of stateful components;
* ``state.json`` — everything that is not a tensor (the config, step counters, the optimizer's
  ``param_groups``, Python / NumPy RNG states, the structure of each state dict with tensors
  replaced by ``{"__tensor__": key}`` references) and a manifest of the files with their sizes.

Guarantees (tests in ``tests/test_checkpoint.py`` and ``tests/test_checkpoint_tampering.py``, list
in ``docs/reliability.md``):

* **Nothing is unpickled.** Tensors go through ``safetensors`` and the rest through JSON; loading
  calls neither ``pickle`` nor ``torch.load``. A file that is not valid safetensors/JSON is
  refused with `CheckpointError`.
* **A checkpoint is untrusted input.** Every value is checked before anything changes, and every
  problem is one `CheckpointError` naming the file and the field: ``state.json`` against its
  schema (keys, types, ranges, nesting depth, size), each safetensors header (names, dtypes,
  shapes) against the live trainer before any tensor is read, and the decoded state against the
  live trainer (`grpo.state.trainer_state`). Allocations are bounded by the live trainer's sizes and
  the bytes present in the files, never by a size written in JSON. No path written in a
  checkpoint is opened (`resume_config`).
* **Atomic.** A checkpoint is written in a temporary directory ``<root>/.tmp-*`` (files fsynced),
  then renamed to ``step-XXXXXXXX`` in one ``os.replace``. Only after that is the ``latest``
  pointer (a text file with the directory name) replaced, again atomically. A process killed at
  any moment leaves either the previous checkpoints or the new complete one; leftovers named
  ``.tmp-*`` are ignored by the loader and removed by the next save.
* **Newest complete wins.** `find_latest_checkpoint` scans ``step-*`` directories newest first and
  returns the first whose manifest checks (``state.json`` parses and fits its schema, every
  listed file exists with its recorded size, every safetensors header parses and holds the
  tensors ``state.json`` refers to); each one skipped is named in a `RuntimeWarning`. ``latest``
  is a convenience for people and tools.
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
import math
import os
import random
import reprlib
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
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
    "resume_config",
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

MAX_STATE_JSON_BYTES = 256 * 2**20
"""A larger ``state.json`` is refused before it is read (keep big state in tensors)."""
MAX_DEPTH = 64
"""JSON nesting deeper than this is refused (grpo's own trees are < 10 deep)."""
MAX_COUNT = 2**63 - 1
"""Step counters above this are refused."""
PATH_FIELDS: dict[str, tuple[str, ...]] = {"deepspeed": ("auto", "off")}
"""GRPOConfig fields whose other values are file paths, with the values that are not paths.
`resume_config` refuses a checkpoint whose config holds a path in one of them."""

_META_KEYS = frozenset(
    {"format", "version", "step", "torch_version", "config", "scalars", "policy", "reference",
     "state_aliases", "tree", "files"}
)  # fmt: skip
_TREE_KEYS = frozenset({"optimizer", "scheduler", "rng", "components"})
_RNG_KEYS = frozenset({"python", "numpy", "torch", "cuda", "generators"})
_GENERATORS = frozenset({"_generator"})  # the on-disk name (grpo 0.1's attribute)
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
    "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}  # fmt: skip
_NP_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
     "float32", "float64", "complex64", "complex128"}
)  # fmt: skip


class Restorable(Protocol):
    """What `load_checkpoint` needs of a trainer (`grpo.trainer.GRPOTrainer` has it).

    Optional, used when present to check tensors before they are read: ``policy``,
    ``reference_policy`` (or ``_weight_specs(role)``), ``optimizer`` and ``_generator``."""

    config: Any

    def load_state_dict(self, state: Any, *, source: str = ...) -> None: ...

    def stateful_components(self) -> dict[str, Any]: ...


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, malformed, not in grpo's format, or does not fit the
    trainer. The message names the file and the field."""


class CheckpointDir(str):
    """The ``source`` `load_checkpoint` gives ``load_state_dict``: a checkpoint directory, so that
    its errors can name the file holding a field (`in_file`)."""


def in_file(source: str, file: str) -> str:
    """``source/file`` when ``source`` is a `CheckpointDir`, else ``source`` (a state dict)."""
    return os.path.join(source, file) if isinstance(source, CheckpointDir) else source


class _Bad(Exception):
    """A problem of one field of one file of a checkpoint (relative: `at` adds the directory)."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(file, field, problem)
        self.file, self.field, self.problem = file, field, problem

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.problem}" if self.field else f"{self.file} {self.problem}"

    def at(self, ckpt: Path) -> CheckpointError:
        where = ckpt / self.file
        msg = f"{where}: {self.field}: {self.problem}" if self.field else f"{where} {self.problem}"
        return CheckpointError(msg if msg.endswith(".") else msg + ".")


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - safetensors is a core dependency
        raise ImportError("grpo checkpoints need safetensors: pip install 'safetensors>=0.4'") from e
    return st


def _is_count(v: object) -> bool:
    return type(v) is int and 0 <= v <= MAX_COUNT


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 300
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3


def _short(v: object, n: int = 60) -> str:
    """``repr(v)`` cut to ``n`` characters, without building the repr of a huge value first."""
    r = _REPR.repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


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


_MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__", "__dtype__")
TensorFn = Callable[[str, tuple[Any, ...]], Any]
"""Resolves a ``{"__tensor__": key}`` reference found at a tree path."""


def _torch_dtypes() -> dict[str, torch.dtype]:
    """``"float32"`` -> ``torch.float32`` for every dtype torch defines (names as `_encode` writes)."""
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _field(path: tuple[Any, ...]) -> str:
    return ".".join(["tree", *(str(p) for p in path)])


def _decode(obj: Any, tensor: TensorFn, path: tuple[Any, ...] = (), depth: int = 0) -> Any:
    """The value `_encode` made ``obj`` from; every malformed part raises `_Bad` naming its path.

    Only plain data, tensors (through ``tensor``), tuples, dicts, numeric NumPy arrays and torch
    dtypes come out: nothing is looked up by a name read from the file except in fixed tables."""

    def bad(problem: str, at: tuple[Any, ...] = path) -> _Bad:
        return _Bad(STATE_JSON, _field(at), problem)

    if depth > MAX_DEPTH:
        raise bad(f"is nested deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, tensor, (*path, i), depth + 1) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):  # pragma: no cover - json.loads makes nothing else
        raise bad(f"is a {type(obj).__name__}")
    marked = [k for k in obj if k.startswith("__") and k.endswith("__")]
    if not marked:
        return {k: _decode(v, tensor, (*path, k), depth + 1) for k, v in obj.items()}
    kind = marked[0]
    allowed = {"__ndarray__", "dtype"} if kind == "__ndarray__" else {kind}
    if len(marked) != 1 or kind not in _MARKERS or set(obj) != allowed:
        raise bad(
            f"has the keys {_short(sorted(obj))}; a grpo state tree marks a value with exactly one of "
            f"{list(_MARKERS)} (with 'dtype' beside '__ndarray__')"
        )
    v = obj[kind]
    if kind == "__tensor__":
        if not isinstance(v, str):
            raise bad(f"refers to the tensor {_short(v)}; expected the name of a tensor (a string)")
        return tensor(v, path)
    if kind == "__dtype__":
        dtypes = _torch_dtypes()
        if not isinstance(v, str) or v not in dtypes:
            raise bad(f"names the dtype {_short(v)}, which is not a torch dtype")
        return dtypes[v]
    if kind == "__ndarray__":
        dt = obj["dtype"]
        if not isinstance(dt, str) or dt not in _NP_DTYPES:
            raise bad(f"is an array of dtype {_short(dt)}; grpo reads arrays of {sorted(_NP_DTYPES)} only")
        try:
            return np.asarray(v, dtype=np.dtype(dt))
        except (ValueError, TypeError, OverflowError) as e:
            raise bad(f"is not an array of {dt} ({e})") from None
    if not isinstance(v, list):
        raise bad(f"holds {type(v).__name__} under {kind!r}; expected a list")
    if kind == "__tuple__":
        return tuple(_decode(x, tensor, (*path, i), depth + 1) for i, x in enumerate(v))
    out: dict[Any, Any] = {}  # "__items__": [[key, value], ...]
    for i, item in enumerate(v):
        if not (isinstance(item, list) and len(item) == 2):
            raise bad(f"item {i} is {_short(item)}; expected a [key, value] pair")
        k, x = item
        if not (k is None or isinstance(k, (str, int, bool))):
            raise bad(f"item {i} has the key {_short(k)}; keys are strings, integers, booleans or null")
        if k in out:
            raise bad(f"has the key {k!r} twice")
        out[k] = _decode(x, tensor, (*path, k), depth + 1)
    return out


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


def _words(v: object, n: int) -> bool:
    """``v`` is a list/tuple of ``n`` integers in [0, 2**32)."""
    return isinstance(v, (list, tuple)) and len(v) == n and all(type(x) is int and 0 <= x < 2**32 for x in v)


def _check_rng(rng: Any) -> None:
    """Raise `_Bad` unless ``rng`` (the decoded ``tree.rng``) holds well-formed RNG states."""
    if not isinstance(rng, dict) or set(rng) != _RNG_KEYS:
        keys = sorted(map(str, rng)) if isinstance(rng, dict) else type(rng).__name__
        raise _Bad(STATE_JSON, "tree.rng", f"has the keys {_short(keys)}; expected {sorted(_RNG_KEYS)}")
    py = rng["python"]
    version = random.Random().getstate()[0]
    if not (
        isinstance(py, (list, tuple))
        and len(py) == 3
        and type(py[0]) is int
        and py[0] == version
        and _words(py[1], 625)
        and py[1][-1] <= 624
        and (py[2] is None or (type(py[2]) is float and math.isfinite(py[2])))
    ):
        raise _Bad(
            STATE_JSON,
            "tree.rng.python",
            f"is not a state of Python's random module (expected ({version}, 624 words in [0, 2**32) "
            f"and a position in [0, 624], a float or null)); got {_short(py)}",
        )
    n = rng["numpy"]
    if not (
        isinstance(n, dict)
        and set(n) == {"bit_generator", "key", "pos", "has_gauss", "gauss"}
        and n["bit_generator"] == "MT19937"
        and _words(n["key"], 624)
        and type(n["pos"]) is int
        and 0 <= n["pos"] <= 624
        and type(n["has_gauss"]) is int
        and n["has_gauss"] in (0, 1)
        and type(n["gauss"]) in (int, float)
        and math.isfinite(n["gauss"])
    ):
        raise _Bad(
            STATE_JSON,
            "tree.rng.numpy",
            f"is not a NumPy MT19937 state (bit_generator 'MT19937', key: 624 words in [0, 2**32), "
            f"pos in [0, 624], has_gauss 0 or 1, gauss a number); got {_short(n)}",
        )
    t = rng["torch"]
    live = torch.get_rng_state()
    if not (isinstance(t, Tensor) and t.dtype == torch.uint8 and t.shape == live.shape):
        raise _Bad(
            STATE_FILE,
            "tree.rng.torch",
            f"is {_kind(t)}; expected torch's CPU RNG state, a uint8 tensor of shape {tuple(live.shape)}",
        )
    try:
        torch.Generator().set_state(t)
    except (RuntimeError, ValueError) as e:
        raise _Bad(STATE_FILE, "tree.rng.torch", f"is not a valid torch RNG state ({e})") from None
    cuda = rng["cuda"]
    if cuda is not None:
        ok = isinstance(cuda, list) and all(
            isinstance(c, Tensor) and c.dtype == torch.uint8 and c.dim() == 1 for c in cuda
        )
        if ok and torch.cuda.is_available():
            shapes = [
                torch.cuda.get_rng_state(i).shape for i in range(min(len(cuda), torch.cuda.device_count()))
            ]
            ok = all(c.shape == s for c, s in zip(cuda, shapes, strict=False))
        if not ok:
            raise _Bad(
                STATE_FILE, "tree.rng.cuda", "is not a list of CUDA RNG states (uint8 vectors) or null"
            )
    gens = rng["generators"]
    if not isinstance(gens, dict) or set(gens) != _GENERATORS:
        names = sorted(map(str, gens)) if isinstance(gens, dict) else type(gens).__name__
        raise _Bad(
            STATE_JSON,
            "tree.rng.generators",
            f"holds RNG states for the generators {_short(names)} but the trainer has {sorted(_GENERATORS)}",
        )


def _kind(v: object) -> str:
    """``v``'s type (and a tensor's shape and dtype) for messages."""
    if isinstance(v, Tensor):
        return f"a {str(v.dtype).removeprefix('torch.')} tensor of shape {tuple(v.shape)}"
    return f"{type(v).__name__} {_short(v)}"


def _set_rng_state(state: Mapping[str, Any]) -> None:
    """Set the process-global RNG streams to ``state`` (checked by `_check_rng`)."""
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


def capture_rng() -> tuple[Any, ...]:
    """The process-global RNG streams, for `restore_rng` (a failed load puts them back)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(saved: tuple[Any, ...]) -> None:
    py, np_state, cpu, cuda = saved
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


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


# ---- reading: state.json's schema, safetensors headers, the newest complete checkpoint ----------
def _read_meta(meta_path: Path) -> dict[str, Any]:
    """``state.json`` parsed and checked against its schema (trainer-independent); raises `_Bad`."""

    def bad(field: str, problem: str) -> _Bad:
        return _Bad(STATE_JSON, field, problem)

    if not meta_path.is_file():
        raise _Bad(STATE_JSON, "", "is missing")
    size = meta_path.stat().st_size
    if size > MAX_STATE_JSON_BYTES:
        raise _Bad(STATE_JSON, "", f"has {size} bytes, more than the {MAX_STATE_JSON_BYTES} grpo reads")
    try:
        meta = json.loads(meta_path.read_bytes())
    except RecursionError:
        raise _Bad(STATE_JSON, "", f"is nested too deeply to be a {FORMAT} manifest") from None
    except ValueError as e:
        raise _Bad(STATE_JSON, "", f"is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _Bad(STATE_JSON, "", f"is not a {FORMAT} manifest")
    version = meta.get("version")
    if type(version) is not int or version != VERSION:
        raise bad("version", f"format version {_short(version)} is not supported (this grpo reads {VERSION})")
    missing, unknown = sorted(_META_KEYS - set(meta)), sorted(set(meta) - _META_KEYS)
    if missing or unknown:
        raise bad("(top level)", f"keys missing {missing}, unknown {_short(unknown)}")
    if not _is_count(meta["step"]):
        raise bad("step", f"is {_short(meta['step'])}; expected an integer >= 0")
    if not isinstance(meta["torch_version"], str):
        raise bad("torch_version", f"is {_short(meta['torch_version'])}; expected a string")

    cfg = meta["config"]
    if not isinstance(cfg, dict):
        raise bad("config", f"is {type(cfg).__name__}; expected an object of GRPOConfig fields")
    for k, v in cfg.items():
        if not (v is None or type(v) in (bool, int, float, str)):
            raise bad(
                f"config.{k}", f"is {type(v).__name__}; config values are numbers, strings, booleans or null"
            )

    scalars = meta["scalars"]
    if not isinstance(scalars, dict) or set(scalars) != {"step_count", "non_finite_steps"}:
        keys = sorted(scalars) if isinstance(scalars, dict) else type(scalars).__name__
        raise bad("scalars", f"has the keys {_short(keys)}; expected ['non_finite_steps', 'step_count']")
    for k, v in scalars.items():
        if not _is_count(v):
            raise bad(
                f"scalars.{k}", f"is {_short(v)} ({type(v).__name__}); expected an integer in [0, 2**63)"
            )
    if scalars["step_count"] != meta["step"]:
        raise bad("scalars.step_count", f"is {scalars['step_count']} but step is {meta['step']}")

    def aliases(value: object, field: str) -> None:
        if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
            raise bad(field, f"is {_short(value)}; expected an object tensor name -> tensor name")

    for role in ("policy", "reference"):
        block = meta[role]
        if block is None and role == "reference":
            continue
        if not isinstance(block, dict) or set(block) != {"aliases"}:
            raise bad(
                role,
                f"is {_short(block)}; expected {{'aliases': {{...}}}}"
                + (" or null" if role == "reference" else ""),
            )
        aliases(block["aliases"], f"{role}.aliases")
    aliases(meta["state_aliases"], "state_aliases")
    tree = meta["tree"]
    if not isinstance(tree, dict) or set(tree) != _TREE_KEYS:
        keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        raise bad("tree", f"has the keys {_short(keys)}; expected {sorted(_TREE_KEYS)}")

    files = meta["files"]
    if not isinstance(files, dict):
        raise bad("files", f"is {type(files).__name__}; expected an object file name -> size")
    need = {POLICY_FILE, STATE_FILE} | ({REFERENCE_FILE} if meta["reference"] is not None else set())
    if set(files) != need:
        raise bad("files", f"lists {_short(sorted(files))}; this checkpoint needs exactly {sorted(need)}")
    for name, size in files.items():
        if not _is_count(size):
            raise bad(f"files.{name}", f"is {_short(size)}; expected a size in bytes")
    return meta


def _not_safetensors(e: BaseException) -> str:
    why = " ".join(str(e).split())[:300]
    return (
        f"is not a valid safetensors file ({type(e).__name__}: {why}). grpo loads tensors only through "
        f"safetensors and never unpickles; the checkpoint is corrupt or was tampered with."
    )


Header = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@contextlib.contextmanager
def _open_tensors(path: Path) -> Iterator[tuple[Any, Header]]:
    """An open safetensors file and its header (name -> dtype, shape); nothing is read yet."""
    name = path.name
    try:
        handle = _safetensors().safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise _Bad(name, "", _not_safetensors(e)) from None
    with handle as f:
        header: Header = {}
        try:
            names: list[str] = f.keys()  # a safe_open handle, not a dict
            entries = [(k, f.get_slice(k)) for k in names]
            raw = [(k, s.get_dtype(), tuple(s.get_shape())) for k, s in entries]
        except Exception as e:
            raise _Bad(name, "", _not_safetensors(e)) from None
        for k, dt, shape in raw:
            torch_name = _ST_DTYPES.get(dt)
            dtype = getattr(torch, torch_name, None) if torch_name else None
            if not isinstance(dtype, torch.dtype):
                raise _Bad(name, repr(k), f"has the dtype {_short(dt)}, which grpo does not load")
            header[k] = (dtype, tuple(int(n) for n in shape))
        yield f, header


def _get_tensor(f: Any, key: str, file: str) -> Tensor:
    try:
        t: Tensor = f.get_tensor(key)
    except Exception as e:
        raise _Bad(file, repr(key), f"cannot be read ({type(e).__name__}: {_short(str(e), 200)})") from None
    return t


def _check_aliases(aliases: Mapping[str, str], header: Header, file: str, field: str) -> None:
    for k, v in aliases.items():
        if k in header:
            raise _Bad(STATE_JSON, f"{field}.{k}", f"is an alias but {file} also holds a tensor {k!r}")
        if v not in header:
            raise _Bad(STATE_JSON, f"{field}.{k}", f"is an alias of {_short(v)}, which {file} does not hold")


def _check_complete(path: Path) -> dict[str, Any]:
    """The checked ``state.json`` of the checkpoint at ``path``; raises `_Bad` if it is incomplete
    or malformed: schema, file sizes, safetensors headers, tensor references."""
    meta = _read_meta(path / STATE_JSON)
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise _Bad(name, "", "is missing")
        actual = f.stat().st_size
        if actual != size:
            raise _Bad(name, "", f"has {actual} bytes, the manifest says {size}")
    headers: dict[str, Header] = {}
    for name in meta["files"]:
        with _open_tensors(path / name) as (_, header):
            headers[name] = header
    _check_aliases(meta["policy"]["aliases"], headers[POLICY_FILE], POLICY_FILE, "policy.aliases")
    if meta["reference"] is not None:
        _check_aliases(
            meta["reference"]["aliases"], headers[REFERENCE_FILE], REFERENCE_FILE, "reference.aliases"
        )
    state_header, state_aliases = headers[STATE_FILE], meta["state_aliases"]
    _check_aliases(state_aliases, state_header, STATE_FILE, "state_aliases")

    def exists(key: str, at: tuple[Any, ...]) -> None:
        if state_aliases.get(key, key) not in state_header:
            raise _Bad(
                STATE_JSON,
                _field(at),
                f"refers to the tensor {_short(key)}, which {STATE_FILE} does not hold",
            )

    _decode(meta["tree"], exists)
    return meta


def _manifest_problem(path: Path) -> str | None:
    """None if ``path`` is a complete, well-formed grpo checkpoint, else what is wrong with it."""
    try:
        _check_complete(path)
    except _Bad as e:
        return str(e)
    except OSError as e:
        return f"cannot be read ({e})"
    return None


def _newest_complete(root: Path, stacklevel: int) -> tuple[tuple[Path, dict[str, Any]] | None, list[str]]:
    """The newest complete checkpoint under ``root`` with its manifest (or None), and the problems
    of the newer ones skipped (each also a `RuntimeWarning`)."""
    skipped: list[str] = []
    for path in reversed(list_checkpoints(root)):
        try:
            return (path, _check_complete(path)), skipped
        except _Bad as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot be read ({e})"
        skipped.append(f"{path.name}: {problem}")
        warnings.warn(
            f"skipping the checkpoint {path}: {problem.rstrip('.')}. Looking for an older complete one.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    return None, skipped


def find_latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one), else None.
    Newer ``step-*`` directories that are incomplete or malformed are skipped with a
    `RuntimeWarning` saying what is wrong with each."""
    root = Path(root)
    if (root / STATE_JSON).is_file():
        problem = _manifest_problem(root)
        if problem is not None:
            warnings.warn(
                f"{root} is not a complete grpo checkpoint: {problem}", RuntimeWarning, stacklevel=2
            )
        return root if problem is None else None
    found, _ = _newest_complete(root, stacklevel=3)
    return None if found is None else found[0]


def _resolve_meta(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``path`` names (a checkpoint, or a root: its newest complete one) and its
    checked manifest; `CheckpointError` if there is none."""
    p = Path(path)
    if (p / STATE_JSON).is_file():
        try:
            return p, _check_complete(p)
        except (_Bad, OSError) as e:
            raise CheckpointError(f"{p} is not a complete grpo checkpoint: {str(e).rstrip('.')}.") from None
    found, skipped = _newest_complete(p, stacklevel=5)
    if found is None:
        seen = [c.name for c in list_checkpoints(p)]
        why = f"; the newest, {skipped[0]}" if skipped else ""
        raise CheckpointError(
            f"no complete grpo checkpoint in {p} (step directories seen: {seen[-5:]}{why}). Pass the "
            f"directory given to save_checkpoint(), or one of its step-XXXXXXXX subdirectories."
        )
    return found


def _resolve(path: str | os.PathLike[str]) -> Path:
    return _resolve_meta(path)[0]


def _clean_temps(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def save_checkpoint(
    state: Mapping[str, Any] | Any,
    config: Mapping[str, Any] | str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    keep_last: int | None = None,
) -> Path:
    """Write a trainer's ``state`` (`grpo.state.trainer_state`) and ``config`` (``GRPOConfig.to_dict()``)
    to ``<root>/step-<step_count>/`` atomically with the process-global RNG streams, update
    ``latest``, keep the last K. Returns the path of the new checkpoint. ``keep_last=None`` keeps
    every checkpoint.

    The earlier form ``save_checkpoint(trainer, root)`` still works (deprecated: it calls
    ``trainer.save_checkpoint(root)``)."""
    if not isinstance(state, Mapping):
        warnings.warn(
            "grpo.state.checkpoint.save_checkpoint(trainer, root) is deprecated; call "
            "trainer.save_checkpoint(root), or save_checkpoint(trainer.state_dict(), "
            "trainer.config.to_dict(), root).",
            DeprecationWarning,
            stacklevel=2,
        )
        saved: Path = state.save_checkpoint(config, keep_last=keep_last)
        return saved
    if root is None or not isinstance(config, Mapping):
        raise TypeError("save_checkpoint(state, config, root): give the trainer's config dict and a root.")
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


def read_checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``GRPOConfig`` fields stored in the newest complete checkpoint at ``path`` (plain
    values, checked to be numbers, strings, booleans or null; nothing in them is opened)."""
    return dict(_resolve_meta(path)[1]["config"])


def _device_problem(device: object) -> str | None:
    """Why this machine cannot run a trainer on ``device`` (a saved config's), or None."""
    if not isinstance(device, str):
        return None  # GRPOConfig says what is wrong
    if device == "cuda" or device.startswith("cuda:"):
        index = device[5:] or "0"
        if not (index.isdigit() and len(index) < 6):
            return "is not a device name"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index) >= count:
            return f"names a CUDA device, but this machine has {count}"
    if device == "mps" and not torch.backends.mps.is_available():
        return "names Apple's MPS device, which this machine lacks"
    return None


def resume_config(path: str | os.PathLike[str], *, device: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `GRPOTrainer.from_checkpoint` loads (``path`` or its newest complete one) and
    the ``GRPOConfig`` fields to build its trainer with.

    A checkpoint is untrusted input, so no path written in it is opened: a config whose
    path-valued field (`PATH_FIELDS`: ``deepspeed``) holds anything but its non-path values
    (``'auto'``, ``'off'``) is refused with `CheckpointError` naming the field. Checkpoints are
    never saved under DeepSpeed, so a genuine one holds no such path. ``device`` replaces the
    saved ``device`` (load a CUDA run's checkpoint on a CPU machine with ``device='cpu'``);
    without it a saved device this machine lacks is refused, naming the override.
    """
    ckpt, meta = _resolve_meta(path)
    cfg = dict(meta["config"])
    where = ckpt / STATE_JSON
    for name, plain in PATH_FIELDS.items():
        if name in cfg and cfg[name] not in plain:
            raise CheckpointError(
                f"{where}: config.{name}={_short(cfg[name], 300)}: any value but {list(plain)} is the path "
                f"of a file to read, and from_checkpoint never opens a path written in a checkpoint (a "
                f"checkpoint is untrusted input; one saved by grpo never holds a path here, since "
                f"checkpoints are not saved under DeepSpeed). If you trust it, build the trainer "
                f"yourself (GRPOConfig(**read_checkpoint_config(path))) and call load_checkpoint(path)."
            )
    if device is not None:
        cfg["device"] = device
    else:
        problem = _device_problem(cfg.get("device"))
        if problem is not None:
            raise CheckpointError(
                f"{where}: config.device={_short(cfg.get('device'))}: {problem}. Pass "
                f"from_checkpoint(..., device='cpu') (or another device this machine has) to load it here."
            )
    return ckpt, cfg


def _weight_specs(trainer: Restorable, role: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
    """name -> (shape, dtype) of the live ``policy`` / ``reference_policy``, when the trainer says."""
    specs = getattr(trainer, "_weight_specs", None)
    if not callable(specs):
        return None
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = specs(role)
    return found


def _read_weights(
    ckpt: Path,
    file: str,
    aliases: Mapping[str, str],
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None,
    role: str,
) -> dict[str, Tensor]:
    """The tensors of ``file``, checked against the live model's names, shapes and dtypes
    (``specs``) from the header before any is read."""
    with _open_tensors(ckpt / file) as (f, header):
        names = set(header) | set(aliases)
        if specs is not None:
            missing, extra = sorted(set(specs) - names), sorted(names - set(specs))
            if missing or extra:
                raise _Bad(
                    file,
                    "tensors",
                    f"the {role} has {missing[:5]} that the checkpoint lacks and the checkpoint has "
                    f"{_short(extra[:5], 200)} that the {role} lacks; build the {role} like the run that "
                    f"saved it.",
                )
            for name in sorted(names):
                dtype, shape = header[aliases.get(name, name)]
                want_shape, want_dtype = specs[name]
                if shape != tuple(want_shape) or dtype != want_dtype:
                    raise _Bad(
                        file,
                        repr(name),
                        f"is {str(dtype).removeprefix('torch.')} of shape {shape}; the {role}'s is "
                        f"{str(want_dtype).removeprefix('torch.')} of shape {tuple(want_shape)}",
                    )
        out = {k: _get_tensor(f, k, file) for k in header}
    for k, v in aliases.items():
        out[k] = out[v]
    return out


Bound = Callable[[tuple[Any, ...]], "int | None"]


def _bounds(trainer: Restorable) -> Bound:
    """The most bytes a tensor at a tree path may have for this trainer (None: the file bounds it).

    Optimizer state of parameter ``i``: 8 bytes per element of parameter ``i`` plus 64 (a float64
    moment, a scalar step); RNG states: the live sizes; a tensor where the trainer keeps none: 0."""
    sizes: list[int] = []
    opt = getattr(trainer, "optimizer", None)
    if isinstance(opt, torch.optim.Optimizer):
        sizes = [8 * p.numel() + 64 for g in opt.param_groups for p in g["params"]]
    rng_bytes = torch.get_rng_state().numel()
    gen = getattr(trainer, "generator", None)
    gen_bytes = gen.get_state().numel() if isinstance(gen, torch.Generator) else rng_bytes

    def bound(path: tuple[Any, ...]) -> int | None:
        if path[:2] == ("optimizer", "state") and opt is not None:
            pid = path[2] if len(path) > 2 else None
            if type(pid) is int and 0 <= pid < len(sizes):
                return sizes[pid]
            raise _Bad(
                STATE_JSON,
                _field(path[:3]),
                f"is state for the parameter {_short(pid)}, but the optimizer has the parameters "
                f"0..{len(sizes) - 1}",
            )
        if path == ("rng", "torch"):
            return rng_bytes
        if path == ("rng", "generators", "_generator"):
            return gen_bytes
        if path[:2] == ("rng", "generators") and len(path) > 2:
            raise _Bad(
                STATE_JSON,
                _field(path[:3]),
                f"is the RNG state of a generator {_short(path[2])} that the trainer lacks (it has "
                f"{sorted(_GENERATORS)})",
            )
        if path[:2] == ("rng", "cuda"):
            return 1024
        if path[:1] == ("rng",) or path[:2] == ("optimizer", "param_groups"):
            return 0
        return None

    return bound


def _read_tree(ckpt: Path, meta: Mapping[str, Any], bound: Bound) -> dict[str, Any]:
    """``state.json``'s tree with its tensors read from ``state.safetensors``: each one checked
    against ``bound`` from the header before it is read, and copied (the trainer owns it)."""
    aliases: Mapping[str, str] = meta["state_aliases"]
    with _open_tensors(ckpt / STATE_FILE) as (f, header):
        cache: dict[str, Tensor] = {}

        def load(key: str, path: tuple[Any, ...]) -> Tensor:
            target = aliases.get(key, key)
            if target not in header:
                raise _Bad(
                    STATE_JSON,
                    _field(path),
                    f"refers to the tensor {_short(key)}, which {STATE_FILE} does not hold",
                )
            dtype, shape = header[target]
            limit = bound(path)
            nbytes = math.prod(shape) * dtype.itemsize
            if limit is not None and nbytes > limit:
                room = (
                    f"this trainer holds at most {limit} bytes there"
                    if limit
                    else "this trainer holds no tensor there"
                )
                raise _Bad(
                    STATE_FILE,
                    _field(path),
                    f"is a {str(dtype).removeprefix('torch.')} tensor of shape {shape} ({nbytes} bytes); "
                    f"{room}",
                )
            if target not in cache:
                cache[target] = _get_tensor(f, target, STATE_FILE).clone()
            return cache[target]

        tree: dict[str, Any] = _decode(meta["tree"], load)
    return tree


def load_checkpoint(trainer: Restorable, path: str | os.PathLike[str]) -> Path:
    """Restore ``trainer`` from the checkpoint at ``path`` (a root: its newest complete checkpoint,
    skipping newer malformed ones with a warning).

    Everything is checked before anything changes: ``state.json`` against its schema, the tensor
    headers against the live trainer (before any tensor is read), the RNG states, then the whole
    state by ``trainer.load_state_dict`` (`grpo.state.trainer_state`). A problem raises one
    `CheckpointError` naming the file and the field, and leaves the trainer, its policy and the
    process-global RNG streams as they were.
    """
    ckpt, meta = _resolve_meta(path)
    try:
        policy_t = _read_weights(
            ckpt, POLICY_FILE, meta["policy"]["aliases"], _weight_specs(trainer, "policy"), "policy"
        )
        ref_t: dict[str, Tensor] | None = None
        if meta["reference"] is not None:
            if getattr(trainer, "reference_policy", True) is None:
                ref_t = {}  # not read: load_state_dict says that this trainer has no reference
            else:
                specs = _weight_specs(trainer, "reference_policy")
                ref_t = _read_weights(
                    ckpt, REFERENCE_FILE, meta["reference"]["aliases"], specs, "reference_policy"
                )
        tree = _read_tree(ckpt, meta, _bounds(trainer))
        rng = tree["rng"]
        _check_rng(rng)
    except _Bad as e:
        raise e.at(ckpt) from None
    scalars = meta["scalars"]
    state = {
        "step_count": scalars["step_count"],
        "non_finite_steps": scalars["non_finite_steps"],
        "policy": policy_t,
        "reference_policy": ref_t,
        "optimizer": tree["optimizer"],
        "scheduler": tree["scheduler"],
        "generator": rng["generators"]["_generator"],
        "components": tree["components"],
    }
    saved_cfg = meta["config"]
    now_cfg = _encode(trainer.config.to_dict(), _TensorTable(), "config")
    differ = sorted(k for k in set(saved_cfg) | set(now_cfg) if saved_cfg.get(k) != now_cfg.get(k))
    before = capture_rng()
    try:
        _set_rng_state(rng)  # checked by _check_rng: not expected to fail
    except Exception as e:
        restore_rng(before)
        raise CheckpointError(
            f"{ckpt / STATE_JSON}: tree.rng: cannot be set ({type(e).__name__}: {e})."
        ) from e
    try:
        trainer.load_state_dict(state, source=CheckpointDir(ckpt))
    except BaseException:
        restore_rng(before)
        raise
    if differ:
        saved_values = [_short(saved_cfg.get(k)) for k in differ]
        warnings.warn(
            f"loading {ckpt} into a trainer whose config differs in {differ} "
            f"(saved: {saved_values}, now: {[now_cfg.get(k) for k in differ]}); "
            f"the run will not continue exactly as the saved one.",
            UserWarning,
            stacklevel=3,
        )
    return ckpt
