"""Checks of a trainer state read from disk against the live trainer (`grpo.state.trainer_state`).

Each ``*_problem`` function returns None when the value fits, else what is wrong (for a
`grpo.state.checkpoint.CheckpointError` naming the file and the field). Nothing here changes anything;
sizes come from the live trainer, never from the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from grpo.state.checkpoint.errors import kind, short
from grpo.state.checkpoint.layout import STATE_FILE, STATE_JSON


def weights_problem(current: Mapping[str, Any], given: Any) -> str | None:
    """Why ``given`` (name -> Tensor) does not fit ``current``'s names and shapes, or None."""
    if not isinstance(given, Mapping) or set(given) != set(current):
        keys = sorted(given)[:8] if isinstance(given, Mapping) else type(given).__name__
        return f"the model has tensors {sorted(current)[:8]} but the checkpoint has {keys}"
    wrong = [k for k, v in given.items() if not isinstance(v, torch.Tensor) or v.shape != current[k].shape]
    return f"tensors {wrong[:5]} have other shapes than the model's" if wrong else None


# ---- checks of a state against the live trainer (before anything changes) ---------------------
_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
"""Optimizer group entries that choose a kernel for this machine: the live optimizer's are kept."""
_NON_NEGATIVE = frozenset(
    {
        "lr",
        "initial_lr",
        "eps",
        "weight_decay",
        "momentum",
        "dampening",
        "lr_decay",
        "rho",
        "alpha",
        "initial_accumulator_value",
        "max_lr",
        "min_lr",
    }
)


def is_number(v: object) -> bool:
    return type(v) in (int, float) and math.isfinite(v)  # type: ignore[arg-type]


def single_device(policy: Any) -> torch.device | None:
    """The one device of an ``nn.Module`` policy's tensors (to move it back after a failed
    `from_checkpoint`), else None."""
    if not isinstance(policy, torch.nn.Module):
        return None
    devices = {t.device for t in [*policy.parameters(), *policy.buffers()]}
    return devices.pop() if len(devices) == 1 else None


def with_live_flags(saved: Mapping[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``saved`` with each group's implementation flags (fused, foreach, ...) taken from the live
    optimizer: they pick kernels for this machine's devices, not numbers of the run."""
    groups = [
        {**g, **{k: live[k] for k in _IMPLEMENTATION_FLAGS if k in live}}
        for g, live in zip(saved["param_groups"], opt.param_groups, strict=True)
    ]
    return {"state": saved["state"], "param_groups": groups}


def tensors_problem(live: Mapping[str, torch.Tensor], given: Any, role: str) -> tuple[str, str] | None:
    """(field, problem) if ``given`` (name -> Tensor) does not have ``live``'s names, shapes and
    dtypes, or holds NaN."""
    if not isinstance(given, Mapping):
        return role, f"is {type(given).__name__}; expected a mapping name -> Tensor"
    missing, extra = sorted(set(live) - set(given)), sorted(map(str, set(given) - set(live)))
    if missing or extra:
        return role, (
            f"the {role} has {missing[:5]} that the state lacks and the state has {short(extra[:5], 200)} "
            f"that the {role} lacks; build the {role} like the run that saved it"
        )
    for k, cur in live.items():
        v = given[k]
        if not isinstance(v, torch.Tensor) or v.shape != cur.shape or v.dtype != cur.dtype:
            return f"{role}[{k!r}]", f"is {kind(v)}; the {role}'s is {kind(cur)}"
        if (v.is_floating_point() or v.is_complex()) and bool(torch.isnan(v).any()):
            return f"{role}[{k!r}]", "holds NaN"
    return None


def same_kind(v: Any, live: Any) -> str | None:
    """Why ``v`` does not have the structure of ``live`` (same keys, lengths, types, tensor shapes
    and dtypes; finite numbers where ``live`` has a float), or None."""
    if isinstance(live, (list, tuple)):
        if not isinstance(v, (list, tuple)) or len(v) != len(live):
            return f"is {short(v)}; expected {len(live)} items like {short(live)}"
        for i, (x, y) in enumerate(zip(v, live, strict=True)):
            problem = same_kind(x, y)
            if problem is not None:
                return f"item {i} {problem}"
        return None
    if isinstance(live, Mapping):
        if not isinstance(v, Mapping) or set(v) != set(live):
            keys = sorted(map(str, v)) if isinstance(v, Mapping) else type(v).__name__
            return f"has the keys {short(keys)}; expected {short(sorted(map(str, live)))}"
        for k in live:
            problem = same_kind(v[k], live[k])
            if problem is not None:
                return f"[{k!r}] {problem}"
        return None
    if isinstance(live, bool):
        ok = type(v) is bool
    elif isinstance(live, int):
        ok = type(v) is int
    elif isinstance(live, float):
        ok = is_number(v)
    elif isinstance(live, str):
        ok = isinstance(v, str)
    elif live is None:
        ok = v is None
    elif isinstance(live, torch.Tensor):
        ok = isinstance(v, torch.Tensor) and v.shape == live.shape and v.dtype == live.dtype
        if ok and v.is_floating_point():
            ok = bool(torch.isfinite(v).all())
    else:
        ok = type(v) is type(live)
    return None if ok else f"is {kind(v)}; expected {kind(live)}"


def hyper_problem(key: str, v: Any, live: Any) -> str | None:
    """Why ``v`` cannot be the value of the optimizer group entry ``key`` whose live value is
    ``live``, or None: numbers finite (>= 0 for lr, eps, weight_decay...; betas in [0, 1)),
    implementation flags a bool or None, other flags and names equal to the live ones."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        if key in _IMPLEMENTATION_FLAGS:
            return None if v is None or isinstance(v, bool) else f"is {kind(v)}; expected true, false or null"
        if type(v) is not type(live) or v != live:
            return f"is {short(v)}; this optimizer's is {live!r}: build it like the run that saved it"
        return None
    if isinstance(live, (int, float)):
        if not is_number(v):
            return f"is {kind(v)}; expected a finite number"
        return f"is {v}; expected a number >= 0" if key in _NON_NEGATIVE and v < 0 else None
    if isinstance(live, (list, tuple)):
        if not isinstance(v, (list, tuple)) or len(v) != len(live):
            return f"is {short(v)}; this optimizer's is {short(live)}"
        for i, (x, y) in enumerate(zip(v, live, strict=True)):
            problem = hyper_problem(key, x, y)
            if problem is not None:
                return f"item {i} {problem}"
        if key == "betas" and not all(0 <= x < 1 for x in v):
            return f"is {short(v)}; betas are in [0, 1)"
        return None
    return same_kind(v, live)


def like_param(v: Any, p: torch.Tensor, nonnegative: bool) -> str | None:
    if not isinstance(v, torch.Tensor) or v.shape != p.shape or v.dtype != p.dtype:
        return f"is {kind(v)}; expected a tensor like its parameter, {kind(p.detach())}"
    if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all()):
        return "holds NaN or inf"
    if nonnegative and bool((v < 0).any()):
        return "holds negative values (a second moment is >= 0)"
    return None


def param_state_problem(
    opt: torch.optim.Optimizer, group: Mapping[str, Any], p: torch.Tensor, s: Mapping[Any, Any]
) -> tuple[str, str, str] | None:
    """(file, key, problem) if ``s`` cannot be ``opt``'s state for the parameter ``p``."""
    name = type(opt).__name__
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        want = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
        if set(s) != want:
            return STATE_JSON, "", f"has the keys {short(sorted(map(str, s)))}; {name} keeps {sorted(want)}"
        for k in sorted(want):
            v = s[k]
            if k == "step":
                if not (isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()):
                    return STATE_FILE, k, f"is {kind(v)}; expected a 0-d floating-point tensor"
                if not (math.isfinite(float(v)) and float(v) >= 0):
                    return STATE_FILE, k, f"is {float(v)}; expected a finite count >= 0"
                continue
            problem = like_param(v, p, nonnegative=k != "exp_avg")
            if problem is not None:
                return STATE_FILE, k, problem
        return None
    if isinstance(opt, torch.optim.SGD):
        if not set(s) <= {"momentum_buffer"}:
            return (
                STATE_JSON,
                "",
                f"has the keys {short(sorted(map(str, s)))}; SGD keeps ['momentum_buffer']",
            )
        buf = s.get("momentum_buffer")
        problem = None if buf is None else like_param(buf, p, nonnegative=False)
        return None if problem is None else (STATE_FILE, "momentum_buffer", problem)
    live = opt.state.get(p)
    if live:  # another optimizer that has state for this parameter: the same structure
        if set(s) != set(live):
            return STATE_JSON, "", f"has the keys {short(sorted(map(str, s)))}; {name} keeps {sorted(live)}"
        for k, v in s.items():
            problem = same_kind(v, live[k])
            if problem is not None:
                return STATE_FILE, str(k), problem
        return None
    for k, v in s.items():  # another optimizer before its first step: scalars or like the parameter
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                ok = not v.is_floating_point() or math.isfinite(float(v))
                problem = None if ok else "is not finite"
            else:
                problem = like_param(v, p, nonnegative=False)
        else:
            ok = v is None or isinstance(v, bool) or is_number(v)
            problem = None if ok else f"is {kind(v)}; expected a tensor, a finite number or null"
        if problem is not None:
            return STATE_FILE, str(k), problem
    return None


def optimizer_problem(opt: torch.optim.Optimizer, saved: Any) -> tuple[str, str, str] | None:
    """(file, field, problem) if ``saved`` cannot be ``opt``'s state dict: param_groups (count,
    keys, parameter ids, hyper-parameters) against the live ones, each parameter's state against
    the parameter, no two state tensors sharing memory."""
    live = opt.state_dict()
    if not isinstance(saved, Mapping) or set(saved) != set(live):
        keys = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        return (
            STATE_JSON,
            "optimizer",
            f"has the keys {short(keys)}; torch's optimizer state has {sorted(live)}",
        )
    groups, live_groups = saved["param_groups"], live["param_groups"]
    problem = param_groups_problem(opt, groups, live_groups)
    if problem is not None:
        return problem
    params = {
        pid: (p, g)
        for g, lg, pg in zip(groups, live_groups, opt.param_groups, strict=True)
        for pid, p in zip(lg["params"], pg["params"], strict=True)
    }
    return optimizer_state_problem(opt, saved["state"], params)


def param_groups_problem(
    opt: torch.optim.Optimizer, groups: Any, live_groups: list[dict[str, Any]]
) -> tuple[str, str, str] | None:
    """(file, field, problem) if the saved ``groups`` are not ``opt``'s ``live_groups`` (its
    ``state_dict()``'s): as many groups, each with the same keys and parameter ids, and
    hyper-parameters that fit (`hyper_problem`)."""
    if not isinstance(groups, (list, tuple)) or len(groups) != len(live_groups):
        n = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
        return (
            STATE_JSON,
            "optimizer.param_groups",
            (f"holds {n} groups; the optimizer ({type(opt).__name__}) has {len(live_groups)}"),
        )
    for i, (g, lg) in enumerate(zip(groups, live_groups, strict=True)):
        field = f"optimizer.param_groups[{i}]"
        if not isinstance(g, Mapping) or set(g) != set(lg):
            keys = sorted(map(str, g)) if isinstance(g, Mapping) else type(g).__name__
            return STATE_JSON, field, f"has the keys {short(keys)}; the optimizer's group has {sorted(lg)}"
        ids = g["params"]
        if (
            not isinstance(ids, (list, tuple))
            or any(type(x) is not int for x in ids)
            or list(ids) != lg["params"]
        ):
            return (
                STATE_JSON,
                f"{field}.params",
                (
                    f"names the parameters {short(ids)}; the optimizer's group holds "
                    f"{short(lg['params'])}: "
                    f"build the optimizer over the same parameters, in the same order"
                ),
            )
        for k, v in g.items():
            if k != "params":
                problem = hyper_problem(k, v, lg[k])
                if problem is not None:
                    return STATE_JSON, f"{field}.{k}", problem
    return None


def optimizer_state_problem(
    opt: torch.optim.Optimizer, state: Any, params: Mapping[int, tuple[torch.Tensor, Mapping[str, Any]]]
) -> tuple[str, str, str] | None:
    """(file, field, problem) if the saved ``state`` (parameter id -> state) does not fit ``params``
    (id -> the parameter and its saved group): known ids, each state fitting its parameter
    (`param_state_problem`), no two tensors sharing memory."""
    if not isinstance(state, Mapping):
        return (
            STATE_JSON,
            "optimizer.state",
            f"is {type(state).__name__}; expected a mapping parameter id -> state",
        )
    storages: set[int] = set()
    for pid, s in state.items():
        field = f"optimizer.state[{pid!r}]"
        if type(pid) is not int or pid not in params:
            return (
                STATE_JSON,
                field,
                f"is state for a parameter the optimizer does not have (ids 0..{len(params) - 1})",
            )
        if not isinstance(s, Mapping):
            return STATE_JSON, field, f"is {kind(s)}; expected a mapping"
        p, group = params[pid]
        found = param_state_problem(opt, group, p, s)
        if found is not None:
            file, key, problem = found
            return file, f"{field}.{key}" if key else field, problem
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.numel() > 0:
                ptr = v.untyped_storage().data_ptr()
                if ptr in storages:
                    return (
                        STATE_FILE,
                        f"{field}.{k}",
                        "shares its memory with another tensor of the optimizer state",
                    )
                storages.add(ptr)
    return None


def scheduler_problem(sched: Any, saved: Any) -> tuple[str, str] | None:
    """(field, problem) if ``saved`` cannot be ``sched``'s state dict: the same keys (each becomes
    an attribute of the scheduler), values of the live ones' types, `grpo.engine.lr_schedules.LRSchedule`
    fields it accepts, ``last_epoch >= -1`` and learning rates >= 0."""
    live = sched.state_dict()
    if not isinstance(saved, Mapping) or set(saved) != set(live):
        keys = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        return "scheduler", (
            f"has the keys {short(keys)}; {type(sched).__name__}'s state has {sorted(live)} (each key "
            f"becomes an attribute of the scheduler)"
        )
    for k, v in saved.items():
        if k == "lr_lambdas" and isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            problem = lambdas_problem(sched, v, live[k])
        else:
            problem = same_kind(v, live[k])
        if problem is not None:
            return f"scheduler.{k}", problem
    if type(saved.get("last_epoch")) is int and saved["last_epoch"] < -1:
        return "scheduler.last_epoch", f"is {saved['last_epoch']}; expected >= -1"
    if type(saved.get("_step_count")) is int and saved["_step_count"] < 0:
        return "scheduler._step_count", f"is {saved['_step_count']}; expected >= 0"
    for k in ("base_lrs", "_last_lr"):
        if isinstance(saved.get(k), (list, tuple)) and any(is_number(x) and x < 0 for x in saved[k]):
            return f"scheduler.{k}", f"is {short(saved[k])}; learning rates are >= 0"
    return None


def lambdas_problem(sched: Any, v: Any, live: Any) -> str | None:
    from grpo.engine.lr_schedules import LRSchedule

    if not isinstance(v, (list, tuple)) or len(v) != len(live):
        return f"is {short(v)}; expected {len(live)} entries"
    for i, (entry, live_entry, fn) in enumerate(zip(v, live, sched.lr_lambdas, strict=True)):
        if not isinstance(fn, LRSchedule):
            problem = same_kind(entry, live_entry)
            if problem is not None:
                return f"entry {i} {problem}"
            continue
        # checkpoints from before the adaptive learning rate have no "scale" (it stays 1)
        if not isinstance(entry, Mapping) or set(entry) not in (set(live_entry), set(live_entry) - {"scale"}):
            return f"entry {i} is {short(entry)}; expected the fields {sorted(live_entry)} of an LRSchedule"
        name, warmup, total, floor = (
            entry[k] for k in ("name", "warmup_steps", "total_steps", "lr_min_ratio")
        )
        scale = entry.get("scale", 1.0)
        if not (
            isinstance(name, str)
            and type(warmup) is int
            and warmup >= 0
            and (total is None or type(total) is int)
            and is_number(floor)
            and 0 <= floor <= 1
            and is_number(scale)
        ):
            return f"entry {i} is {short(entry)}; not the fields of an LRSchedule"
        try:
            LRSchedule(name, warmup, total, floor, scale)  # type: ignore[arg-type]
        except ValueError as e:
            return f"entry {i}: {str(e).rstrip('.')}"
    return None


def running_stats_problem(state: Any) -> str | None:
    """Why ``state`` is not an `AdvantageEstimator` state (``"<stream>.<count|mean|m2>"`` -> a
    finite scalar, count and m2 >= 0, each stream complete), or None."""
    if not isinstance(state, Mapping):
        return f": is {type(state).__name__}; expected a mapping"
    fields = ("count", "mean", "m2")
    streams: dict[str, set[str]] = {}
    for key, v in state.items():
        name, _, field = key.rpartition(".") if isinstance(key, str) else ("", "", "")
        if not name or field not in fields:
            return f"[{short(key)}]: is not '<stream>.<count|mean|m2>'"
        scalar = isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex()
        if scalar or is_number(v):
            x = float(v)
        else:
            return f"[{key!r}]: is {kind(v)}; expected a number (a 1-element tensor)"
        if not math.isfinite(x) or (field != "mean" and x < 0):
            return f"[{key!r}]: is {x}; expected a finite number" + (" >= 0" if field != "mean" else "")
        streams.setdefault(name, set()).add(field)
    incomplete = sorted(n for n, f in streams.items() if f != set(fields))
    return f": the streams {incomplete} lack some of {list(fields)}" if incomplete else None
