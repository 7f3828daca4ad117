"""Tensors to safetensors files and back, checked before anything is read.

Writing: a `TensorTable` collects the tensors of one file under unique names (CPU, contiguous);
a tensor that is the same view as one already collected (tied weights) is not stored twice but
recorded as an alias, name -> stored name, which ``state.json`` keeps (``policy.aliases``,
``reference.aliases``, ``state_aliases``). `write_tensors` writes and fsyncs the file.

Reading: `open_tensors` parses a file's header (name -> dtype, shape) and refuses unknown dtypes
without reading a tensor; `read_weights` checks the header against the live model's names, shapes
and dtypes (`WeightSpecs`) before reading, and `read_tree` reads the tensors ``state.json``'s tree
refers to, each checked against a size `Bound` first. Nothing is unpickled: every tensor goes
through ``safetensors``, and any problem is a `BadField`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo.state.checkpoint.errors import BadField, short
from grpo.state.checkpoint.files import fsync_file
from grpo.state.checkpoint.layout import STATE_FILE, STATE_JSON
from grpo.state.checkpoint.tree import decode, tree_field

ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
"""safetensors dtype names -> the torch dtypes grpo loads."""

Header = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""A safetensors file's header: tensor name -> (dtype, shape)."""
WeightSpecs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""A live model's tensors: name -> (shape, dtype)."""
Bound = Callable[[tuple[Any, ...]], "int | None"]
"""The most bytes a tensor at a tree path may have (None: only the file bounds it)."""


def safetensors() -> Any:
    """The ``safetensors.torch`` module."""
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - safetensors is a core dependency
        raise ImportError("grpo checkpoints need safetensors: pip install 'safetensors>=0.4'") from e
    return st


class TensorTable:
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


def write_tensors(path: Path, table: TensorTable, metadata: dict[str, str] | None = None) -> None:
    """Write ``table``'s tensors to the safetensors file ``path`` and fsync it."""
    safetensors().save_file(table.tensors, str(path), metadata=metadata)
    fsync_file(path)


def not_safetensors(e: BaseException) -> str:
    """The problem of a file whose header safetensors refused with ``e``."""
    why = " ".join(str(e).split())[:300]
    return (
        f"is not a valid safetensors file ({type(e).__name__}: {why}). grpo loads tensors only through "
        f"safetensors and never unpickles; the checkpoint is corrupt or was tampered with."
    )


@contextlib.contextmanager
def open_tensors(path: Path) -> Iterator[tuple[Any, Header]]:
    """An open safetensors file and its header (name -> dtype, shape); nothing is read yet."""
    name = path.name
    try:
        handle = safetensors().safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise BadField(name, "", not_safetensors(e)) from None
    with handle as f:
        header: Header = {}
        try:
            names: list[str] = f.keys()  # a safe_open handle, not a dict
            entries = [(k, f.get_slice(k)) for k in names]
            raw = [(k, s.get_dtype(), tuple(s.get_shape())) for k, s in entries]
        except Exception as e:
            raise BadField(name, "", not_safetensors(e)) from None
        for k, dt, shape in raw:
            torch_name = ST_DTYPES.get(dt)
            dtype = getattr(torch, torch_name, None) if torch_name else None
            if not isinstance(dtype, torch.dtype):
                raise BadField(name, repr(k), f"has the dtype {short(dt)}, which grpo does not load")
            header[k] = (dtype, tuple(int(n) for n in shape))
        yield f, header


def get_tensor(f: Any, key: str, file: str) -> Tensor:
    """Read the tensor ``key`` of the open safetensors file ``f`` (named ``file`` in messages)."""
    try:
        t: Tensor = f.get_tensor(key)
    except Exception as e:
        raise BadField(
            file, repr(key), f"cannot be read ({type(e).__name__}: {short(str(e), 200)})"
        ) from None
    return t


def check_aliases(aliases: Mapping[str, str], header: Header, file: str, field: str) -> None:
    """Raise `BadField` unless each alias names a tensor ``file`` holds and shadows none."""
    for k, v in aliases.items():
        if k in header:
            raise BadField(STATE_JSON, f"{field}.{k}", f"is an alias but {file} also holds a tensor {k!r}")
        if v not in header:
            raise BadField(
                STATE_JSON, f"{field}.{k}", f"is an alias of {short(v)}, which {file} does not hold"
            )


def read_weights(
    ckpt: Path, file: str, aliases: Mapping[str, str], specs: WeightSpecs | None, role: str
) -> dict[str, Tensor]:
    """The tensors of ``file``, checked against the live model's names, shapes and dtypes
    (``specs``) from the header before any is read."""
    with open_tensors(ckpt / file) as (f, header):
        if specs is not None:
            _check_specs(header, aliases, specs, file, role)
        out = {k: get_tensor(f, k, file) for k in header}
    for k, v in aliases.items():
        out[k] = out[v]
    return out


def _check_specs(
    header: Header, aliases: Mapping[str, str], specs: WeightSpecs, file: str, role: str
) -> None:
    """Raise `BadField` unless ``file`` holds (directly or as aliases) exactly ``specs``' tensors,
    each of its shape and dtype."""
    names = set(header) | set(aliases)
    missing, extra = sorted(set(specs) - names), sorted(names - set(specs))
    if missing or extra:
        raise BadField(
            file,
            "tensors",
            f"the {role} has {missing[:5]} that the checkpoint lacks and the checkpoint has "
            f"{short(extra[:5], 200)} that the {role} lacks; build the {role} like the run that "
            f"saved it.",
        )
    for name in sorted(names):
        dtype, shape = header[aliases.get(name, name)]
        want_shape, want_dtype = specs[name]
        if shape != tuple(want_shape) or dtype != want_dtype:
            raise BadField(
                file,
                repr(name),
                f"is {str(dtype).removeprefix('torch.')} of shape {shape}; the {role}'s is "
                f"{str(want_dtype).removeprefix('torch.')} of shape {tuple(want_shape)}",
            )


def read_tree(ckpt: Path, meta: Mapping[str, Any], bound: Bound) -> dict[str, Any]:
    """``state.json``'s tree with its tensors read from ``state.safetensors``: each one checked
    against ``bound`` from the header before it is read, and copied (the trainer owns it)."""
    aliases: Mapping[str, str] = meta["state_aliases"]
    with open_tensors(ckpt / STATE_FILE) as (f, header):
        cache: dict[str, Tensor] = {}

        def load(key: str, path: tuple[Any, ...]) -> Tensor:
            target = aliases.get(key, key)
            if target not in header:
                raise BadField(
                    STATE_JSON,
                    tree_field(path),
                    f"refers to the tensor {short(key)}, which {STATE_FILE} does not hold",
                )
            _check_bound(header[target], bound(path), path)
            if target not in cache:
                cache[target] = get_tensor(f, target, STATE_FILE).clone()
            return cache[target]

        tree: dict[str, Any] = decode(meta["tree"], load)
    return tree


def _check_bound(
    entry: tuple[torch.dtype, tuple[int, ...]], limit: int | None, path: tuple[Any, ...]
) -> None:
    """Raise `BadField` if the tensor ``entry`` (dtype, shape) at ``path`` has more than ``limit`` bytes."""
    dtype, shape = entry
    nbytes = math.prod(shape) * dtype.itemsize
    if limit is not None and nbytes > limit:
        room = (
            f"this trainer holds at most {limit} bytes there"
            if limit
            else "this trainer holds no tensor there"
        )
        raise BadField(
            STATE_FILE,
            tree_field(path),
            f"is a {str(dtype).removeprefix('torch.')} tensor of shape {shape} ({nbytes} bytes); {room}",
        )
