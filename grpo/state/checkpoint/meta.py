"""``state.json``: read it and check it against its schema, before anything else is looked at.

The file (at most `MAX_STATE_JSON_BYTES`) is one JSON object with exactly these keys::

    format          "grpo-checkpoint"
    version         1
    step            the step counter, an integer in [0, 2**63)
    torch_version   the torch that saved it (a string)
    config          GRPOConfig fields -> numbers, strings, booleans or null
    scalars         {"step_count": step, "non_finite_steps": count}
    policy          {"aliases": {tensor name -> stored tensor name}}
    reference       the same, or null when the trainer had no reference policy
    state_aliases   {tensor name -> stored tensor name} of state.safetensors
    tree            {"optimizer", "scheduler", "rng", "components"}: state trees (see the tree module)
    files           {file name -> size in bytes}: policy/state(/reference).safetensors

`read_meta` checks all of that, independently of any trainer; every problem is a `BadField`
naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.state.checkpoint.errors import BadField, short
from grpo.state.checkpoint.layout import FORMAT, POLICY_FILE, REFERENCE_FILE, STATE_FILE, STATE_JSON, VERSION

MAX_STATE_JSON_BYTES = 256 * 2**20
"""A larger ``state.json`` is refused before it is read (keep big state in tensors)."""
MAX_COUNT = 2**63 - 1
"""Step counters above this are refused."""
META_KEYS = frozenset(
    {
        "format",
        "version",
        "step",
        "torch_version",
        "config",
        "scalars",
        "policy",
        "reference",
        "state_aliases",
        "tree",
        "files",
    }
)
TREE_KEYS = frozenset({"optimizer", "scheduler", "rng", "components"})


def is_count(v: object) -> bool:
    """``v`` is an integer (not a bool) in [0, `MAX_COUNT`]."""
    return type(v) is int and 0 <= v <= MAX_COUNT


def _bad(field: str, problem: str) -> BadField:
    return BadField(STATE_JSON, field, problem)


def read_meta(meta_path: Path) -> dict[str, Any]:
    """``state.json`` parsed and checked against its schema (trainer-independent); raises `BadField`."""
    meta = _parse(meta_path)
    _check_top_level(meta)
    _check_config(meta["config"])
    _check_scalars(meta)
    _check_aliases(meta)
    tree = meta["tree"]
    if not isinstance(tree, dict) or set(tree) != TREE_KEYS:
        keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        raise _bad("tree", f"has the keys {short(keys)}; expected {sorted(TREE_KEYS)}")
    _check_files(meta)
    return meta


def _parse(meta_path: Path) -> dict[str, Any]:
    """The JSON object of ``meta_path``, if it exists, is not too large, parses and says `FORMAT`."""
    if not meta_path.is_file():
        raise BadField(STATE_JSON, "", "is missing")
    size = meta_path.stat().st_size
    if size > MAX_STATE_JSON_BYTES:
        raise BadField(STATE_JSON, "", f"has {size} bytes, more than the {MAX_STATE_JSON_BYTES} grpo reads")
    try:
        meta = json.loads(meta_path.read_bytes())
    except RecursionError:
        raise BadField(STATE_JSON, "", f"is nested too deeply to be a {FORMAT} manifest") from None
    except ValueError as e:
        raise BadField(STATE_JSON, "", f"is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BadField(STATE_JSON, "", f"is not a {FORMAT} manifest")
    return meta


def _check_top_level(meta: dict[str, Any]) -> None:
    """The version, the set of keys, ``step`` and ``torch_version``."""
    version = meta.get("version")
    if type(version) is not int or version != VERSION:
        raise _bad("version", f"format version {short(version)} is not supported (this grpo reads {VERSION})")
    missing, unknown = sorted(META_KEYS - set(meta)), sorted(set(meta) - META_KEYS)
    if missing or unknown:
        raise _bad("(top level)", f"keys missing {missing}, unknown {short(unknown)}")
    if not is_count(meta["step"]):
        raise _bad("step", f"is {short(meta['step'])}; expected an integer >= 0")
    if not isinstance(meta["torch_version"], str):
        raise _bad("torch_version", f"is {short(meta['torch_version'])}; expected a string")


def _check_config(cfg: object) -> None:
    """An object of plain values (numbers, strings, booleans, null)."""
    if not isinstance(cfg, dict):
        raise _bad("config", f"is {type(cfg).__name__}; expected an object of GRPOConfig fields")
    for k, v in cfg.items():
        if not (v is None or type(v) in (bool, int, float, str)):
            raise _bad(
                f"config.{k}", f"is {type(v).__name__}; config values are numbers, strings, booleans or null"
            )


def _check_scalars(meta: dict[str, Any]) -> None:
    """``step_count`` and ``non_finite_steps``, counts, ``step_count`` equal to ``step``."""
    scalars = meta["scalars"]
    if not isinstance(scalars, dict) or set(scalars) != {"step_count", "non_finite_steps"}:
        keys = sorted(scalars) if isinstance(scalars, dict) else type(scalars).__name__
        raise _bad("scalars", f"has the keys {short(keys)}; expected ['non_finite_steps', 'step_count']")
    for k, v in scalars.items():
        if not is_count(v):
            raise _bad(
                f"scalars.{k}", f"is {short(v)} ({type(v).__name__}); expected an integer in [0, 2**63)"
            )
    if scalars["step_count"] != meta["step"]:
        raise _bad("scalars.step_count", f"is {scalars['step_count']} but step is {meta['step']}")


def _check_aliases(meta: dict[str, Any]) -> None:
    """``policy`` and ``reference`` (``{"aliases": {...}}``; the reference's may be null) and
    ``state_aliases``."""

    def aliases(value: object, field: str) -> None:
        if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
            raise _bad(field, f"is {short(value)}; expected an object tensor name -> tensor name")

    for role in ("policy", "reference"):
        block = meta[role]
        if block is None and role == "reference":
            continue
        if not isinstance(block, dict) or set(block) != {"aliases"}:
            raise _bad(
                role,
                f"is {short(block)}; expected {{'aliases': {{...}}}}"
                + (" or null" if role == "reference" else ""),
            )
        aliases(block["aliases"], f"{role}.aliases")
    aliases(meta["state_aliases"], "state_aliases")


def _check_files(meta: dict[str, Any]) -> None:
    """``files``: exactly the files this checkpoint needs, each with a size."""
    files = meta["files"]
    if not isinstance(files, dict):
        raise _bad("files", f"is {type(files).__name__}; expected an object file name -> size")
    need = {POLICY_FILE, STATE_FILE} | ({REFERENCE_FILE} if meta["reference"] is not None else set())
    if set(files) != need:
        raise _bad("files", f"lists {short(sorted(files))}; this checkpoint needs exactly {sorted(need)}")
    for name, size in files.items():
        if not is_count(size):
            raise _bad(f"files.{name}", f"is {short(size)}; expected a size in bytes")
