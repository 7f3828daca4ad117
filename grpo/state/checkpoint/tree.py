"""State trees as JSON: tensors become references, everything else plain data.

`encode` turns a state (nested dicts, lists, tuples, numbers, strings, tensors, NumPy values,
torch dtypes) into JSON-able data: each tensor is handed to a sink under a dotted key
(``state.optimizer.state.0.exp_avg``) and replaced by ``{"__tensor__": key}``; a tuple becomes
``{"__tuple__": [...]}``, a dict with non-string (or ``__dunder__``) keys
``{"__items__": [[key, value], ...]}``, a NumPy array ``{"__ndarray__": [...], "dtype": name}``,
a torch dtype ``{"__dtype__": name}``. `decode` undoes it, checking every part (`BadField` naming
the path ``tree.<key>.<key>...``); it looks nothing up by a name read from the file except in
fixed tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.state.checkpoint.errors import BadField, CheckpointError, short
from grpo.state.checkpoint.layout import STATE_JSON

MAX_DEPTH = 64
"""JSON nesting deeper than this is refused (grpo's own trees are < 10 deep)."""
MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__", "__dtype__")
NP_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
"""The NumPy dtypes `decode` makes arrays of."""

TensorSink = Callable[[str, Tensor], str]
"""Takes a tensor met at a dotted key and returns the key its ``{"__tensor__": key}`` names."""
TensorFn = Callable[[str, tuple[Any, ...]], Any]
"""Resolves a ``{"__tensor__": key}`` reference found at a tree path."""


def encode(obj: Any, add: TensorSink, key: str) -> Any:
    """A JSON-able tree for ``obj``; tensors go to ``add`` and become ``{"__tensor__": key}``."""
    if isinstance(obj, Tensor):
        return {"__tensor__": add(key, obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, add, f"{key}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, add, f"{key}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        return _encode_mapping(obj, add, key)
    raise CheckpointError(
        f"cannot save {key}: a value of type {type(obj).__name__} ({obj!r:.80}) is neither a tensor nor "
        f"plain data (numbers, strings, lists, dicts). grpo checkpoints store tensors in safetensors and "
        f"the rest in JSON, never pickles: make the state_dict() of this object return plain data."
    )


def _encode_mapping(obj: Mapping[Any, Any], add: TensorSink, key: str) -> Any:
    """A JSON object for a dict of plain string keys, else ``{"__items__": [[key, value], ...]}``."""
    if all(isinstance(k, str) for k in obj):
        if any(k.startswith("__") and k.endswith("__") for k in obj):
            return {"__items__": [[k, encode(v, add, f"{key}.{k}")] for k, v in obj.items()]}
        return {k: encode(v, add, f"{key}.{k}") for k, v in obj.items()}
    items = []
    for k, v in obj.items():
        if not isinstance(k, (str, int, bool)) and k is not None:
            raise CheckpointError(f"cannot save {key}: dict key {k!r} of type {type(k).__name__}")
        items.append([k, encode(v, add, f"{key}.{k}")])
    return {"__items__": items}


def torch_dtypes() -> dict[str, torch.dtype]:
    """``"float32"`` -> ``torch.float32`` for every dtype torch defines (names as `encode` writes)."""
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def tree_field(path: tuple[Any, ...]) -> str:
    """The field a tree path is named by in messages: ``tree.optimizer.state.0``."""
    return ".".join(["tree", *(str(p) for p in path)])


def decode(obj: Any, tensor: TensorFn, path: tuple[Any, ...] = (), depth: int = 0) -> Any:
    """The value `encode` made ``obj`` from; every malformed part raises `BadField` naming its path.

    Only plain data, tensors (through ``tensor``), tuples, dicts, numeric NumPy arrays and torch
    dtypes come out: nothing is looked up by a name read from the file except in fixed tables."""
    if depth > MAX_DEPTH:
        raise _bad(path, f"is nested deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode(v, tensor, (*path, i), depth + 1) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):  # pragma: no cover - json.loads makes nothing else
        raise _bad(path, f"is a {type(obj).__name__}")
    marked = [k for k in obj if k.startswith("__") and k.endswith("__")]
    if not marked:
        return {k: decode(v, tensor, (*path, k), depth + 1) for k, v in obj.items()}
    marker = marked[0]
    allowed = {"__ndarray__", "dtype"} if marker == "__ndarray__" else {marker}
    if len(marked) != 1 or marker not in MARKERS or set(obj) != allowed:
        raise _bad(
            path,
            f"has the keys {short(sorted(obj))}; a grpo state tree marks a value with exactly one of "
            f"{list(MARKERS)} (with 'dtype' beside '__ndarray__')",
        )
    v = obj[marker]
    if marker == "__tensor__":
        if not isinstance(v, str):
            raise _bad(path, f"refers to the tensor {short(v)}; expected the name of a tensor (a string)")
        return tensor(v, path)
    if marker == "__dtype__":
        return _decode_dtype(v, path)
    if marker == "__ndarray__":
        return _decode_array(v, obj["dtype"], path)
    if not isinstance(v, list):
        raise _bad(path, f"holds {type(v).__name__} under {marker!r}; expected a list")
    if marker == "__tuple__":
        return tuple(decode(x, tensor, (*path, i), depth + 1) for i, x in enumerate(v))
    return _decode_items(v, tensor, path, depth)


def _bad(path: tuple[Any, ...], problem: str) -> BadField:
    return BadField(STATE_JSON, tree_field(path), problem)


def _decode_dtype(v: object, path: tuple[Any, ...]) -> torch.dtype:
    dtypes = torch_dtypes()
    if not isinstance(v, str) or v not in dtypes:
        raise _bad(path, f"names the dtype {short(v)}, which is not a torch dtype")
    return dtypes[v]


def _decode_array(v: object, dt: object, path: tuple[Any, ...]) -> np.ndarray[Any, Any]:
    if not isinstance(dt, str) or dt not in NP_DTYPES:
        raise _bad(path, f"is an array of dtype {short(dt)}; grpo reads arrays of {sorted(NP_DTYPES)} only")
    try:
        return np.asarray(v, dtype=np.dtype(dt))
    except (ValueError, TypeError, OverflowError) as e:
        raise _bad(path, f"is not an array of {dt} ({e})") from None


def _decode_items(items: list[Any], tensor: TensorFn, path: tuple[Any, ...], depth: int) -> dict[Any, Any]:
    """The dict of an ``{"__items__": [[key, value], ...]}`` (keys: str, int, bool or null, unique)."""
    out: dict[Any, Any] = {}
    for i, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 2):
            raise _bad(path, f"item {i} is {short(item)}; expected a [key, value] pair")
        k, x = item
        if not (k is None or isinstance(k, (str, int, bool))):
            raise _bad(path, f"item {i} has the key {short(k)}; keys are strings, integers, booleans or null")
        if k in out:
            raise _bad(path, f"has the key {k!r} twice")
        out[k] = decode(x, tensor, (*path, k), depth + 1)
    return out
