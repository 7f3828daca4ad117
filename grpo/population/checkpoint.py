"""Population checkpoints on disk: layout, atomic publication, and the checks of ``population.json``.

A checkpoint root holds one directory per saved generation::

    <root>/
        gen-00000003/                 the population after 3 generations, complete or absent
            population.json           generation, step, seed, the selection RNG's state, each
                                      slot's hyperparameters / fitness history / samples / env
                                      steps (training, evaluation), and the
                                      history (`grpo.population.lineage.GenerationRecord`)
            member-0/step-XXXXXXXX/   slot 0's trainer checkpoint (`grpo.state.checkpoint`: weights,
                                      optimizer, scheduler, generator, and the slot's own RNG streams)
            member-1/...
        .tmp-gen-*                    an interrupted save: ignored, removed by the next save

A save writes everything into ``.tmp-gen-XXXXXXXX`` (files fsynced), then renames it to
``gen-XXXXXXXX`` in one ``os.replace``: a process killed at any moment leaves the previous
generations or the new complete one. `find_latest_generation` takes the newest ``gen-*`` whose
``population.json`` passes `population_state_problem`.

``population.json`` is untrusted input: its size is bounded, it is parsed as JSON (nothing is
unpickled), and every value is checked against the live population (size, declared
hyperparameters and their ranges, counts, the RNG state) before anything changes. The member
checkpoints are checked by `grpo.state.checkpoint.load_checkpoint`.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo.population.hyperparameters import HyperparameterConfig
from grpo.state.checkpoint import CheckpointError
from grpo.state.checkpoint.files import fsync_dir, fsync_file

__all__ = [
    "FORMAT",
    "GEN_PREFIX",
    "POPULATION_JSON",
    "find_latest_generation",
    "member_dir",
    "population_state_problem",
    "publish_generation",
    "read_population_json",
    "temp_generation_dir",
    "write_population_json",
]

FORMAT = "grpo-population"
VERSION = 1
POPULATION_JSON = "population.json"
GEN_PREFIX = "gen-"
TMP_PREFIX = ".tmp-gen-"
MAX_JSON_BYTES = 32 * 2**20
MAX_COUNT = 2**63 - 1


def generation_name(generation: int) -> str:
    return f"{GEN_PREFIX}{generation:08d}"


def member_dir(gen_dir: Path, index: int) -> Path:
    """Where slot ``index``'s trainer checkpoint lives in a generation's directory."""
    return gen_dir / f"member-{index}"


def temp_generation_dir(root: Path, generation: int, *, fresh: bool) -> Path:
    """``<root>/.tmp-gen-XXXXXXXX`` (created; with ``fresh`` emptied of an earlier attempt first)."""
    tmp = root / f"{TMP_PREFIX}{generation:08d}"
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    return tmp


def write_population_json(gen_dir: Path, state: Mapping[str, Any]) -> None:
    """Write ``population.json`` (fsynced)."""
    path = gen_dir / POPULATION_JSON
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **state}, indent=1))
    fsync_file(path)


def publish_generation(tmp: Path, root: Path, generation: int, keep_last: int | None) -> Path:
    """Rename ``tmp`` to ``gen-XXXXXXXX`` atomically; keep the newest ``keep_last`` generations
    (older ones are renamed to ``.tmp-gen-*`` before they are deleted); remove leftovers."""
    final = root / generation_name(generation)
    if final.exists():  # a generation saved again (a resumed run): replace it whole
        doomed = root / f"{TMP_PREFIX}old-{generation:08d}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(final, doomed)
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(root)
    gens = sorted(p for p in root.iterdir() if p.is_dir() and _gen_of(p) is not None)
    if keep_last is not None:
        for old in gens[:-keep_last]:
            doomed = root / f"{TMP_PREFIX}del-{old.name}"
            os.replace(old, doomed)
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
    return final


def _gen_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(GEN_PREFIX) or not name[len(GEN_PREFIX) :].isdigit():
        return None
    return int(name[len(GEN_PREFIX) :])


def find_latest_generation(root: str | os.PathLike[str], hp_config: HyperparameterConfig, size: int) -> Path:
    """The newest ``gen-*`` directory under ``root`` whose ``population.json`` checks (each one
    skipped is named in a `RuntimeWarning`), or ``root`` itself when it is such a directory."""
    root = Path(root)
    if _gen_of(root) is not None and (root / POPULATION_JSON).is_file():
        return root
    if not root.is_dir():
        raise CheckpointError(f"{root}: no population checkpoint directory here.")
    gens = sorted((g, p) for p in root.iterdir() if p.is_dir() and (g := _gen_of(p)) is not None)
    for _, path in reversed(gens):
        try:
            read_population_json(path, hp_config, size)
        except CheckpointError as e:
            warnings.warn(f"skipping the population checkpoint {path}: {e}", RuntimeWarning, stacklevel=2)
            continue
        return path
    raise CheckpointError(
        f"{root}: holds no complete population checkpoint (gen-XXXXXXXX/{POPULATION_JSON})."
    )


def read_population_json(gen_dir: Path, hp_config: HyperparameterConfig, size: int) -> dict[str, Any]:
    """``population.json`` of ``gen_dir``, parsed and checked (`population_state_problem`)."""
    path = gen_dir / POPULATION_JSON
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: larger than {MAX_JSON_BYTES} bytes; not a population state.")
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({type(e).__name__}: {e}).") from None
    problem = population_state_problem(state, hp_config, size)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}.")
    return dict(state)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_COUNT) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_float(v: Any, *, nan: bool = False) -> bool:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    return ok and (math.isfinite(v) or (nan and v != v))


def population_state_problem(state: Any, hp_config: HyperparameterConfig, size: int) -> str | None:
    """Why ``state`` (parsed ``population.json``) cannot be this population's, or None."""
    keys = {"format", "version", "generation", "step", "seed", "rng", "members", "history"}
    if not isinstance(state, dict) or set(state) != keys:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        return f"has the keys {got}; expected {sorted(keys)}"
    if state["format"] != FORMAT or state["version"] != VERSION:
        return f"format {state['format']!r} version {state['version']!r}; expected {FORMAT!r} {VERSION}"
    for k in ("generation", "step", "seed"):
        if not _is_int(state[k], lo=-MAX_COUNT if k == "seed" else 0):
            return f"{k}: must be an integer, got {state[k]!r}"
    problem = _rng_problem(state["rng"])
    if problem is not None:
        return f"rng: {problem}"
    members = state["members"]
    if not isinstance(members, list) or len(members) != size:
        n = len(members) if isinstance(members, list) else type(members).__name__
        return f"members: holds {n} members; this population has {size}"
    for i, m in enumerate(members):
        problem = _member_problem(m, i, hp_config, state["generation"])
        if problem is not None:
            return f"members[{i}]: {problem}"
    history = state["history"]
    if not isinstance(history, list) or len(history) != state["generation"]:
        return f"history: must list {state['generation']} generations"
    for g, r in enumerate(history):
        problem = _record_problem(r, g, hp_config, size)
        if problem is not None:
            return f"history[{g}]: {problem}"
    return None


def _rng_problem(rng: Any) -> str | None:
    if not (isinstance(rng, list) and len(rng) == 3 and rng[0] == 3 and isinstance(rng[1], list)):
        return "must be [3, [625 integers], null or a number] (random.Random.getstate())"
    ints = rng[1]
    if len(ints) != 625 or not all(_is_int(x, hi=2**32 - 1) for x in ints) or ints[-1] > 624:
        return "its state must be 624 integers in [0, 2**32) and a position <= 624"
    if rng[2] is not None and not _is_float(rng[2]):
        return "gauss_next must be null or a finite number"
    try:
        random.Random().setstate((3, tuple(ints), rng[2]))
    except (TypeError, ValueError) as e:
        return f"is not a valid random.Random state ({e})"
    return None


def _hp_problem(hp: Any, hp_config: HyperparameterConfig) -> str | None:
    if not isinstance(hp, dict):
        return f"hyperparameters: {type(hp).__name__}, expected a mapping"
    try:
        hp_config.check(hp, "hyperparameters")
    except ValueError as e:
        return str(e)
    return None


def _member_problem(m: Any, i: int, hp_config: HyperparameterConfig, generation: int) -> str | None:
    keys, costs = {"index", "hp", "fitness", "samples"}, {"train_env_steps", "eval_env_steps"}
    if not isinstance(m, dict) or set(m) not in (keys, keys | costs):  # costs: absent before grpo 0.3
        return "must be {index, hp, fitness, samples[, train_env_steps, eval_env_steps]}"
    if any(not _is_int(m[k]) for k in costs & set(m)):
        return "train_env_steps, eval_env_steps: must be integers >= 0"
    if m["index"] != i:
        return f"index is {m['index']!r}; expected {i}"
    fit = m["fitness"]
    if not isinstance(fit, list) or len(fit) != generation or not all(_is_float(f, nan=True) for f in fit):
        return f"fitness: must be {generation} numbers (one per generation)"
    if not _is_int(m["samples"]):
        return f"samples: must be an integer >= 0, got {m['samples']!r}"
    return _hp_problem(m["hp"], hp_config)


def _record_problem(r: Any, g: int, hp_config: HyperparameterConfig, size: int) -> str | None:
    keys = {"generation", "fitness", "elite", "parents", "mutations", "hyperparameters", "samples"}
    if not isinstance(r, dict) or set(r) != keys:
        return f"must have the keys {sorted(keys)}"
    if r["generation"] != g:
        return f"generation is {r['generation']!r}; expected {g}"
    lists = ("fitness", "parents", "mutations", "hyperparameters", "samples")
    if any(not isinstance(r[k], list) or len(r[k]) != size for k in lists):
        return f"{', '.join(lists)} must each list {size} slots"
    if not all(_is_float(f, nan=True) for f in r["fitness"]):
        return "fitness: must be numbers"
    if r["elite"] is not None and not _is_int(r["elite"], hi=size - 1):
        return f"elite: must be null or a slot in [0, {size})"
    if not all(_is_int(p, hi=size - 1) for p in r["parents"]) or not all(_is_int(s) for s in r["samples"]):
        return f"parents must be slots in [0, {size}) and samples integers >= 0"
    for m in r["mutations"]:
        ok = isinstance(m, dict) and set(m) == {"name", "old", "new"}
        ok = ok and (m["name"] is None or m["name"] in hp_config)
        none = ok and m["name"] is None and m["old"] is None and m["new"] is None
        if not none and (not ok or m["name"] is None or not all(_is_float(m[k]) for k in ("old", "new"))):
            return "mutations: each must be {name: a declared hyperparameter or null, old, new}"
    for hp in r["hyperparameters"]:
        problem = _hp_problem(hp, hp_config)
        if problem is not None:
            return problem
    return None
