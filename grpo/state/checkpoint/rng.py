"""The process-global RNG streams in a checkpoint: capture, check, set, put back.

A checkpoint's ``tree.rng`` holds (`RNG_KEYS`)::

    python      random.getstate(): (version, 625 words in [0, 2**32) ending in a position <= 624,
                the cached gauss or null)
    numpy       the legacy MT19937 state: {"bit_generator": "MT19937", "key": 624 words, "pos",
                "has_gauss", "gauss"}
    torch       torch.get_rng_state(): a uint8 tensor (in state.safetensors)
    cuda        torch.cuda.get_rng_state_all() (uint8 vectors), or null without CUDA
    generators  {"_generator": the trainer's torch.Generator state}  (`GENERATORS`)

`check_rng` checks a decoded ``tree.rng`` before `set_rng_state` changes anything; `capture_rng` /
`restore_rng` put the streams back when a load fails after setting them.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.state.checkpoint.errors import BadField, kind, short
from grpo.state.checkpoint.layout import STATE_FILE, STATE_JSON

RNG_KEYS = frozenset({"python", "numpy", "torch", "cuda", "generators"})
GENERATORS = frozenset({"_generator"})
"""The generators a trainer keeps, by their on-disk names (grpo 0.1's attribute)."""


def rng_state() -> dict[str, Any]:
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


def check_rng(rng: Any) -> None:
    """Raise `BadField` unless ``rng`` (the decoded ``tree.rng``) holds well-formed RNG states."""
    if not isinstance(rng, dict) or set(rng) != RNG_KEYS:
        keys = sorted(map(str, rng)) if isinstance(rng, dict) else type(rng).__name__
        raise BadField(STATE_JSON, "tree.rng", f"has the keys {short(keys)}; expected {sorted(RNG_KEYS)}")
    _check_python(rng["python"])
    _check_numpy(rng["numpy"])
    _check_torch(rng["torch"])
    _check_cuda(rng["cuda"])
    gens = rng["generators"]
    if not isinstance(gens, dict) or set(gens) != GENERATORS:
        names = sorted(map(str, gens)) if isinstance(gens, dict) else type(gens).__name__
        raise BadField(
            STATE_JSON,
            "tree.rng.generators",
            f"holds RNG states for the generators {short(names)} but the trainer has {sorted(GENERATORS)}",
        )


def _check_python(py: Any) -> None:
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
        raise BadField(
            STATE_JSON,
            "tree.rng.python",
            f"is not a state of Python's random module (expected ({version}, 624 words in [0, 2**32) "
            f"and a position in [0, 624], a float or null)); got {short(py)}",
        )


def _check_numpy(n: Any) -> None:
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
        raise BadField(
            STATE_JSON,
            "tree.rng.numpy",
            f"is not a NumPy MT19937 state (bit_generator 'MT19937', key: 624 words in [0, 2**32), "
            f"pos in [0, 624], has_gauss 0 or 1, gauss a number); got {short(n)}",
        )


def _check_torch(t: Any) -> None:
    live = torch.get_rng_state()
    if not (isinstance(t, Tensor) and t.dtype == torch.uint8 and t.shape == live.shape):
        raise BadField(
            STATE_FILE,
            "tree.rng.torch",
            f"is {kind(t)}; expected torch's CPU RNG state, a uint8 tensor of shape {tuple(live.shape)}",
        )
    try:
        torch.Generator().set_state(t)
    except (RuntimeError, ValueError) as e:
        raise BadField(STATE_FILE, "tree.rng.torch", f"is not a valid torch RNG state ({e})") from None


def _check_cuda(cuda: Any) -> None:
    if cuda is None:
        return
    ok = isinstance(cuda, list) and all(
        isinstance(c, Tensor) and c.dtype == torch.uint8 and c.dim() == 1 for c in cuda
    )
    if ok and torch.cuda.is_available():
        shapes = [torch.cuda.get_rng_state(i).shape for i in range(min(len(cuda), torch.cuda.device_count()))]
        ok = all(c.shape == s for c, s in zip(cuda, shapes, strict=False))
    if not ok:
        raise BadField(
            STATE_FILE, "tree.rng.cuda", "is not a list of CUDA RNG states (uint8 vectors) or null"
        )


def set_rng_state(state: Mapping[str, Any], *, stacklevel: int = 2) -> None:
    """Set the process-global RNG streams to ``state`` (checked by `check_rng`). CUDA states for
    another number of devices than this process sees are skipped with a `RuntimeWarning` (at
    ``stacklevel`` as seen from this function's caller)."""
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
                stacklevel=stacklevel + 1,
            )


def capture_rng() -> tuple[Any, ...]:
    """The process-global RNG streams, for `restore_rng` (a failed load puts them back)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(saved: tuple[Any, ...]) -> None:
    """Put back the RNG streams `capture_rng` returned."""
    py, np_state, cpu, cuda = saved
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
