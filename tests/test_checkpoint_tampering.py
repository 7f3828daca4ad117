"""Checkpoints are untrusted input (issue "Trust II"): every tampered file is refused with one
`CheckpointError` naming the file and the field, before anything of the trainer, its policy or the
process-global RNG streams changes; nothing is unpickled and no path written in a checkpoint is
opened. One test class per kind of tampering found on real checkpoints, then a property-based
fuzz of ``state.json`` and the safetensors headers."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import pickle
import random
import re
import shutil
import signal
import struct
import tempfile
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import Tensor

import grpo.state.checkpoint.codec as codec_mod
import grpo.state.checkpoint.meta as meta_mod
from grpo import GRPOConfig, GRPOTrainer
from grpo.state.checkpoint import PATH_FIELDS, CheckpointError, find_latest_checkpoint
from tests.reliability_toys import StateDictPolicy, bandit_reward, make_policy, make_trainer, train_step


# ---- the trainers: a saved one, and a different one to load into --------------------------------
class Stats:
    """A registered component whose ``load_state_dict`` changes a field before it can fail."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.mean = state["mean"].clone()  # fails on a number: count has changed already


def build() -> GRPOTrainer:
    """The reliability toy trainer (KL reference, scheduler, 2 epochs x 2 minibatches, fused AdamW)
    with running advantage statistics and a registered component."""
    t = make_trainer(advantage_baseline="running", advantage_scale="running")
    t.register_checkpoint_state("stats", Stats())
    return t


def trained(steps: int, seed: int) -> GRPOTrainer:
    np.random.seed(seed)
    t = build()
    stats = t.stateful_components()["stats"]
    for _ in range(steps):
        train_step(t)
        stats.count += 1
        stats.mean += torch.randn(3)
    return t


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint after 2 steps (read-only: tests tamper with copies)."""
    return trained(2, seed=1).save_checkpoint(tmp_path_factory.mktemp("saved"))


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / saved.name))


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """A checkpoint of the toy trainer without registered components, for `from_checkpoint`."""
    np.random.seed(1)
    t = make_trainer()
    for _ in range(2):
        train_step(t)
    return t.save_checkpoint(tmp_path / "plain")


def target() -> GRPOTrainer:
    """A trainer to load into, with state of its own (one step on other data)."""
    return trained(1, seed=2)


# ---- bitwise fingerprints ------------------------------------------------------------------------
def fingerprint(t: GRPOTrainer) -> dict[str, Any]:
    assert t.optimizer is not None
    assert t.scheduler is not None
    assert t.reference_policy is not None
    return {
        "policy": {k: v.detach().clone() for k, v in t.policy.state_dict().items()},  # type: ignore[attr-defined]
        "reference": {k: v.detach().clone() for k, v in t.reference_policy.state_dict().items()},  # type: ignore[attr-defined]
        "optimizer": copy.deepcopy(t.optimizer.state_dict()),
        "scheduler": copy.deepcopy(t.scheduler.state_dict()),
        "components": copy.deepcopy({k: v.state_dict() for k, v in t.stateful_components().items()}),
        "generator": t.generator.get_state(),
        "counters": (t.step_count, t.non_finite_steps),
        "rng": (random.getstate(), np.random.get_state(), torch.get_rng_state()),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def structure(t: GRPOTrainer) -> Any:
    """Keys, shapes and dtypes of everything a checkpoint restores (not the values)."""

    def shape(x: Any) -> Any:
        if isinstance(x, Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [shape(v) for v in x]
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return "number"
        return type(x).__name__

    fp = fingerprint(t)
    return shape({k: fp[k] for k in ("policy", "reference", "optimizer", "components", "generator")})


def valid_structure(t: GRPOTrainer, fresh: Any) -> None:
    """``t`` has the structure ``fresh`` (`structure` of a valid trainer), except that parameters may
    have no optimizer state yet (torch initialises it at the next step). A registered component
    checks its own state (`Stats` takes what it is given)."""
    got = structure(t)
    fresh = {**fresh, "components": {**fresh["components"], "stats": got["components"]["stats"]}}
    opt, want_opt = got.pop("optimizer"), dict(fresh)["optimizer"]
    assert got == {k: v for k, v in fresh.items() if k != "optimizer"}
    assert opt["param_groups"] == want_opt["param_groups"]
    assert all(opt["state"][k] == want_opt["state"][k] for k in opt["state"])


def refused(t: GRPOTrainer, path: Path, match: str) -> CheckpointError:
    """Loading ``path`` into ``t`` raises a CheckpointError matching ``match`` and changes nothing
    (weights, optimizer, scheduler, components, generator, counters, global RNG streams)."""
    before = fingerprint(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=match) as err:
            t.load_checkpoint(path)
    after = fingerprint(t)
    for k in before:
        assert same(before[k], after[k]), f"{k} changed by a refused load: {err.value}"
    return err.value


def still_trains(t: GRPOTrainer) -> None:
    train_step(t)
    assert all(bool(torch.isfinite(p).all()) for p in t.params)


# ---- tampering tools -----------------------------------------------------------------------------
def edit_json(ckpt: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    meta = json.loads((ckpt / "state.json").read_text())
    fn(meta)
    (ckpt / "state.json").write_text(json.dumps(meta))


@contextlib.contextmanager
def within_seconds(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError if the block runs longer than ``seconds`` (a hang on a crafted value)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fix_size(ckpt: Path, file: str) -> None:
    """Make the manifest agree with the file, as an attacker would."""
    edit_json(ckpt, lambda m: m["files"].__setitem__(file, (ckpt / file).stat().st_size))


def edit_tensors(ckpt: Path, fn: Callable[[dict[str, Tensor]], Any], file: str = "state.safetensors") -> None:
    tensors = load_file(ckpt / file)
    fn(tensors)
    save_file(tensors, ckpt / file)
    fix_size(ckpt, file)


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def header_bytes(header: dict[str, Any]) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


OPT0 = "state.optimizer.state.0."  # tensor keys of the first parameter's AdamW state


def tree(meta: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = meta["tree"]
    return t


def opt_state(meta: dict[str, Any], pid: int) -> dict[str, Any]:
    """The JSON of the optimizer state of parameter ``pid`` (an ``__items__`` pair list)."""
    for k, v in tree(meta)["optimizer"]["state"]["__items__"]:
        if k == pid:
            return v  # type: ignore[no-any-return]
    raise KeyError(pid)


# ---- 1. optimizer state shapes (the fused AdamW wrote out of bounds) ----------------------------
def _scale(key: str, f: float) -> Callable[[dict[str, Tensor]], None]:
    return lambda ts: ts.__setitem__(key, ts[key] * f)


OPTIMIZER_TAMPERING: dict[str, tuple[Callable[[dict[str, Tensor]], Any], str]] = {
    "shrunk exp_avg": (
        lambda ts: ts.__setitem__(OPT0 + "exp_avg", ts[OPT0 + "exp_avg"][:4].clone()),
        r"state\.safetensors: optimizer\.state\[0\]\.exp_avg: is a float32 tensor of shape \(4, 4\); "
        r"expected a tensor like its parameter, a float32 tensor of shape \(8, 4\)\.",
    ),
    "shrunk exp_avg_sq": (
        lambda ts: ts.__setitem__(OPT0 + "exp_avg_sq", ts[OPT0 + "exp_avg_sq"].flatten()[:5].clone()),
        r"state\.safetensors: optimizer\.state\[0\]\.exp_avg_sq: is a float32 tensor of shape \(5,\)",
    ),
    "float64 exp_avg": (
        lambda ts: ts.__setitem__(OPT0 + "exp_avg", ts[OPT0 + "exp_avg"].double()),
        r"optimizer\.state\[0\]\.exp_avg: is a float64 tensor of shape \(8, 4\)",
    ),
    "exp_avg 100x too large": (
        lambda ts: ts.__setitem__(OPT0 + "exp_avg", torch.zeros(100, 32)),
        r"state\.safetensors: tree\.optimizer\.state\.0\.exp_avg: is a float32 tensor of shape \(100, 32\) "
        r"\(12800 bytes\); this trainer holds at most 320 bytes there",
    ),
    "NaN in exp_avg": (
        lambda ts: ts[OPT0 + "exp_avg"].__setitem__((0, 0), float("nan")),
        r"optimizer\.state\[0\]\.exp_avg: holds NaN or inf\.",
    ),
    "negative exp_avg_sq": (
        _scale(OPT0 + "exp_avg_sq", -1.0),
        r"optimizer\.state\[0\]\.exp_avg_sq: holds negative values \(a second moment is >= 0\)\.",
    ),
    "negative step": (
        lambda ts: ts.__setitem__(OPT0 + "step", torch.tensor(-3.0)),
        r"optimizer\.state\[0\]\.step: is -3\.0; expected a finite count >= 0\.",
    ),
    "step as a vector": (
        lambda ts: ts.__setitem__(OPT0 + "step", torch.zeros(2)),
        r"optimizer\.state\[0\]\.step: is a float32 tensor of shape \(2,\); expected a 0-d "
        r"floating-point tensor",
    ),
}


class TestOptimizerState:
    @pytest.mark.parametrize("case", sorted(OPTIMIZER_TAMPERING))
    def test_tensors_that_do_not_fit_the_parameter(self, ckpt: Path, case: str) -> None:
        edit, match = OPTIMIZER_TAMPERING[case]
        edit_tensors(ckpt, edit)
        t = target()
        refused(t, ckpt, match)
        still_trains(t)  # the fused AdamW kept its own, valid state

    @pytest.mark.parametrize(
        ("case", "edit", "match"),
        [
            (
                "missing exp_avg_sq",
                lambda m: opt_state(m, 0).pop("exp_avg_sq"),
                r"state\.json: optimizer\.state\[0\]: has the keys \['exp_avg', 'step'\]; AdamW keeps "
                r"\['exp_avg', 'exp_avg_sq', 'step'\]",
            ),
            (
                "state for a parameter the optimizer lacks",
                lambda m: tree(m)["optimizer"]["state"]["__items__"].append([7, opt_state(m, 0)]),
                r"state\.json: tree\.optimizer\.state\.7: is state for the parameter 7, but the optimizer "
                r"has the parameters 0\.\.3",
            ),
            (
                "two moments sharing memory",
                lambda m: opt_state(m, 0).__setitem__("exp_avg", opt_state(m, 0)["exp_avg_sq"]),
                r"state\.safetensors: optimizer\.state\[0\]\.exp_avg_sq: shares its memory with another "
                r"tensor",
            ),
            (
                "a negative learning rate",
                lambda m: tree(m)["optimizer"]["param_groups"][0].__setitem__("lr", -1.0),
                r"state\.json: optimizer\.param_groups\[0\]\.lr: is -1\.0; expected a number >= 0",
            ),
            (
                "betas out of range",
                lambda m: tree(m)["optimizer"]["param_groups"][0].__setitem__(
                    "betas", {"__tuple__": [0.9, 1.5]}
                ),
                r"optimizer\.param_groups\[0\]\.betas: is \(0\.9, 1\.5\); betas are in \[0, 1\)",
            ),
            (
                "amsgrad switched on",
                lambda m: tree(m)["optimizer"]["param_groups"][0].__setitem__("amsgrad", True),
                r"optimizer\.param_groups\[0\]\.amsgrad: is True; this optimizer's is False",
            ),
            (
                "an unknown group key",
                lambda m: tree(m)["optimizer"]["param_groups"][0].__setitem__("step", 3),
                r"state\.json: optimizer\.param_groups\[0\]: has the keys",
            ),
        ],
    )
    def test_structure_that_does_not_fit_the_optimizer(
        self, ckpt: Path, case: str, edit: Callable[[dict[str, Any]], Any], match: str
    ) -> None:
        edit_json(ckpt, edit)
        t = target()
        refused(t, ckpt, match)
        still_trains(t)

    def test_implementation_flags_come_from_the_live_optimizer(self, ckpt: Path) -> None:
        """fused/foreach/capturable choose kernels for this machine: a checkpoint cannot set them."""
        edit_json(
            ckpt, lambda m: tree(m)["optimizer"]["param_groups"][0].update(fused=False, capturable=True)
        )
        t = target()
        assert t.optimizer is not None
        t.load_checkpoint(ckpt)
        assert t.optimizer.param_groups[0]["fused"] is True
        assert t.optimizer.param_groups[0]["capturable"] is False
        still_trains(t)

    def test_load_state_dict_checks_a_state_dict_too(self) -> None:
        good = trained(2, seed=1).state_dict()
        bad = copy.deepcopy(good)
        bad["optimizer"]["state"][0]["exp_avg"] = bad["optimizer"]["state"][0]["exp_avg"][:4]
        t = target()
        before = fingerprint(t)
        with pytest.raises(
            CheckpointError, match=r"^the state dict: optimizer\.state\[0\]\.exp_avg: is a float32"
        ):
            t.load_state_dict(bad)
        assert all(same(before[k], v) for k, v in fingerprint(t).items())
        t.load_state_dict(good)
        assert t.step_count == 2


# ---- 2. no path written in a checkpoint is opened -----------------------------------------------
class TestPathsInTheConfig:
    def test_a_deepspeed_config_path_is_refused_unopened(
        self, ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        ds = tmp_path / "ds.json"
        ds.write_text('{"zero_optimization": {"stage": 2}}')
        edit_json(ckpt, lambda m: m["config"].__setitem__("deepspeed", str(ds)))
        import grpo.engine.setup

        asked: list[str] = []
        real = grpo.engine.setup.deepspeed_config_from
        monkeypatch.setattr(grpo.engine.setup, "deepspeed_config_from", lambda s: asked.append(s) or real(s))
        policy = make_policy(seed=3)
        w = [p.detach().clone() for p in policy.parameters()]
        rng = torch.get_rng_state()
        with pytest.raises(
            CheckpointError,
            match=rf"state\.json: config\.deepspeed='{re.escape(str(ds))}': any value but \['auto', 'off'\] "
            r"is the path of a file to read, and from_checkpoint never opens a path written in a checkpoint",
        ):
            GRPOTrainer.from_checkpoint(ckpt, policy=policy, reward_model=bandit_reward)
        assert asked == []  # no trainer was even built
        assert all(torch.equal(a, b) for a, b in zip(w, policy.parameters(), strict=True))
        assert torch.equal(rng, torch.get_rng_state())

    def test_every_path_valued_config_field_is_guarded(self) -> None:
        """A GRPOConfig field documented as taking a path must be listed in PATH_FIELDS."""
        for f in dataclasses.fields(GRPOConfig):
            if re.search(r"\bpath\b", f.metadata.get("help", "")):
                assert f.name in PATH_FIELDS, f.name

    def test_load_checkpoint_ignores_the_saved_deepspeed_field(self, ckpt: Path) -> None:
        """Loading into a built trainer uses that trainer's config; the saved one is only compared."""
        edit_json(ckpt, lambda m: m["config"].__setitem__("deepspeed", "/nonexistent/ds.json"))
        t = target()
        with pytest.warns(UserWarning, match=r"config differs in \['deepspeed'\]"):
            t.load_checkpoint(ckpt)
        assert t.step_count == 2


# ---- 2b. the saved config: read through GRPOConfig.from_dict, never a crash ----------------------
class TestSavedConfig:
    def test_an_unreadable_saved_config_is_a_warning_on_load(self, ckpt: Path) -> None:
        """load_checkpoint keeps the live config and only compares the saved one: a name this grpo
        does not know and a value no GRPOConfig holds (an int too large for a float) are named in
        the warning, with why the saved config was compared unchecked; the load goes on."""
        edit_json(ckpt, lambda m: m["config"].update(learning_rate=10**400, no_such_knob=1))
        t = target()
        with pytest.warns(
            UserWarning,
            match=r"config differs in \['learning_rate', 'no_such_knob'\] .* \(The saved config is not a "
            r"valid GRPOConfig here, compared unchecked: ValueError: GRPOConfig\.learning_rate=1000.*"
            r"expected a finite number > 0",
        ):
            t.load_checkpoint(ckpt)
        assert t.step_count == 2

    def test_from_checkpoint_refuses_an_unreadable_saved_config_by_name(self, plain: Path) -> None:
        """from_checkpoint builds its trainer from the saved config: a value no GRPOConfig holds is
        a CheckpointError naming the field (was an OverflowError from deep inside), and a count of
        mini-batches with a huge batch size is refused at once (was a divisor search of 2**61 steps)."""
        edit_json(plain, lambda m: m["config"].update(learning_rate=10**400))
        with pytest.raises(CheckpointError, match=r"state\.json: config: GRPOConfig\.learning_rate=1000"):
            GRPOTrainer.from_checkpoint(plain, policy=make_policy(), reward_model=bandit_reward)
        big = {"learning_rate": 0.01, "batch_size": 2**61 - 1, "mini_batch_size": None, "num_mini_batches": 2}
        edit_json(plain, lambda m: m["config"].update(big))
        with (
            within_seconds(10),
            pytest.raises(
                CheckpointError,
                match=r"config: GRPOConfig: a count of mini-batches needs batch_size as an int",
            ),
        ):
            GRPOTrainer.from_checkpoint(plain, policy=make_policy(), reward_model=bandit_reward)


# ---- 3. the scalars --------------------------------------------------------------------------------
class TestScalars:
    @pytest.mark.parametrize("key", ["step_count", "non_finite_steps"])
    @pytest.mark.parametrize("value", ["abc", -5, True, 3.0, 2**64, None, [3]], ids=repr)
    def test_wrong_types_and_ranges(self, ckpt: Path, key: str, value: Any) -> None:
        edit_json(ckpt, lambda m: m["scalars"].__setitem__(key, value))
        shown = re.escape(repr(value))
        refused(
            target(),
            ckpt,
            rf"state\.json: scalars\.{key}: is {shown} \({type(value).__name__}\); expected an integer",
        )

    def test_no_other_attribute_can_be_set(self, ckpt: Path) -> None:
        edit_json(ckpt, lambda m: m["scalars"].__setitem__("learning_rate", 1))
        refused(
            target(),
            ckpt,
            r"state\.json: scalars: has the keys \['learning_rate', 'non_finite_steps', 'step_count'\]",
        )

    def test_step_and_step_count_agree(self, ckpt: Path) -> None:
        edit_json(ckpt, lambda m: m["scalars"].__setitem__("step_count", 5))
        refused(target(), ckpt, r"state\.json: scalars\.step_count: is 5 but step is 2")

    @pytest.mark.parametrize("value", ["abc", -5, True, 3.0])
    def test_load_state_dict_refuses_them(self, value: Any) -> None:
        state = trained(2, seed=1).state_dict()
        state["step_count"] = value
        t = target()
        with pytest.raises(
            CheckpointError, match=r"scalars\.step_count: must be an integer in \[0, 2\*\*63\)"
        ):
            t.load_state_dict(state)
        assert t.step_count == 1


# ---- 4. a failing load changes nothing -------------------------------------------------------------
def _python_rng_short(m: dict[str, Any]) -> None:
    tree(m)["rng"]["python"]["__tuple__"][1]["__tuple__"].pop()


UNCHANGED_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "Python RNG state of 624 words": (
        lambda c: edit_json(c, _python_rng_short),
        r"state\.json: tree\.rng\.python: is not a state of Python's random module",
    ),
    "NumPy RNG key with a negative word": (
        lambda c: edit_json(c, lambda m: tree(m)["rng"]["numpy"]["key"].__setitem__(3, -1)),
        r"state\.json: tree\.rng\.numpy: is not a NumPy MT19937 state",
    ),
    "torch RNG state cut short": (
        lambda c: edit_tensors(
            c, lambda ts: ts.__setitem__("state.rng.torch", ts["state.rng.torch"][:100].clone())
        ),
        r"state\.safetensors: tree\.rng\.torch: is a uint8 tensor of shape \(100,\); expected torch's CPU "
        r"RNG state",
    ),
    "param_groups naming half the parameters": (
        lambda c: edit_json(
            c, lambda m: tree(m)["optimizer"]["param_groups"][0].__setitem__("params", [0, 1])
        ),
        r"state\.json: optimizer\.param_groups\[0\]\.params: names the parameters \[0, 1\]; the optimizer's "
        r"group holds \[0, 1, 2, 3\]",
    ),
    "an RNG state for a generator the trainer lacks": (
        lambda c: edit_json(
            c,
            lambda m: tree(m)["rng"]["generators"].__setitem__(
                "sampler", tree(m)["rng"]["generators"]["_generator"]
            ),
        ),
        r"state\.json: tree\.rng\.generators\.sampler: is the RNG state of a generator 'sampler' that the "
        r"trainer lacks",
    ),
    "a component refusing its state half-way": (
        lambda c: edit_json(c, lambda m: tree(m)["components"]["stats"].__setitem__("mean", 5)),
        r"state\.json: components\['stats'\] \(Stats\.load_state_dict\): loading it failed \(AttributeError: "
        r".*\); the trainer was restored to its state before the load\.",
    ),
    "negative running m2": (
        lambda c: edit_tensors(c, _scale("state.components.advantage_estimator.reward.m2", -1.0)),
        r"state\.json: components\['advantage_estimator'\]\['reward\.m2'\]: is -\d.*; expected a finite "
        r"number >= 0",
    ),
    "a scheduler key that would shadow a method": (
        lambda c: edit_json(c, lambda m: tree(m)["scheduler"].__setitem__("step", 0)),
        r"state\.json: scheduler: has the keys .*each key becomes an attribute of the scheduler",
    ),
    "a schedule the LRSchedule refuses": (
        lambda c: edit_json(c, lambda m: tree(m)["scheduler"]["lr_lambdas"][0].__setitem__("name", "exp")),
        r"state\.json: scheduler\.lr_lambdas: entry 0: lr schedule 'exp' is unknown",
    ),
    "policy weights of another architecture": (
        lambda c: edit_tensors(
            c, lambda ts: ts.__setitem__("net.net.0.weight", torch.zeros(16, 4)), file="policy.safetensors"
        ),
        r"policy\.safetensors: 'net\.net\.0\.weight': is float32 of shape \(16, 4\); the policy's is "
        r"float32 of shape \(8, 4\)",
    ),
    "NaN policy weights": (
        lambda c: edit_tensors(
            c, lambda ts: ts["net.net.0.bias"].__setitem__(0, float("nan")), file="policy.safetensors"
        ),
        r"policy\.safetensors: policy\['net\.net\.0\.bias'\]: holds NaN\.",
    ),
    "reference weights of another dtype": (
        lambda c: edit_tensors(
            c,
            lambda ts: ts.__setitem__("net.net.0.bias", ts["net.net.0.bias"].double()),
            file="reference.safetensors",
        ),
        r"reference\.safetensors: 'net\.net\.0\.bias': is float64 of shape \(8,\); the reference_policy's "
        r"is float32",
    ),
}


class TestNothingChangesOnFailure:
    @pytest.mark.parametrize("case", sorted(UNCHANGED_CASES))
    def test_refused_before_or_rolled_back(self, ckpt: Path, case: str) -> None:
        tamper, match = UNCHANGED_CASES[case]
        tamper(ckpt)
        t = target()
        refused(t, ckpt, match)
        still_trains(t)

    def test_a_policy_failing_half_way_is_restored(self, tmp_path: Path) -> None:
        """Second line of defence: the policy's own load_state_dict copies one weight, then refuses
        the next; the weight it changed, and everything else, is put back."""
        cfg = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, learning_rate=0.1, seed=0)
        t1 = GRPOTrainer(cfg, HalfLoader(0.0), lambda s, a: a.float())
        for _ in range(2):
            t1.step(torch.zeros(2, 1))
        t1.policy.temperature = torch.tensor(2.0)  # type: ignore[attr-defined]
        path = t1.save_checkpoint(tmp_path)
        p2 = HalfLoader(7.0)
        t2 = GRPOTrainer(cfg, p2, lambda s, a: a.float())
        t2.step(torch.zeros(2, 1))
        w, opt = p2.w.detach().clone(), copy.deepcopy(t2.optimizer.state_dict())  # type: ignore[union-attr]
        with pytest.raises(
            CheckpointError,
            match=r"policy\.safetensors: policy: loading it failed \(CheckpointError: policy HalfLoader"
            r"\.load_state_dict refused the checkpoint's weights: temperature 2\.0 > 1.*\); the trainer was "
            r"restored to its state before the load\.",
        ):
            t2.load_checkpoint(path)
        assert torch.equal(p2.w, w)
        assert not torch.equal(p2.w, t1.policy.w)  # type: ignore[attr-defined]
        assert same(t2.optimizer.state_dict(), opt)  # type: ignore[union-attr]
        assert t2.step_count == 1


class HalfLoader(StateDictPolicy):
    """A policy (not an nn.Module) whose load_state_dict copies ``w`` before checking ``temperature``."""

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
        if float(state["temperature"]) > 1:
            raise ValueError(f"temperature {float(state['temperature'])} > 1")
        self.temperature = state["temperature"].clone()


# ---- 5. allocations are bounded by the live trainer, never by sizes written in JSON --------------
class TestAllocation:
    def test_a_huge_numpy_string_dtype_is_refused_without_allocating(self, ckpt: Path) -> None:
        edit_json(
            ckpt,
            lambda m: tree(m)["components"]["stats"].__setitem__(
                "count", {"__ndarray__": ["x"], "dtype": "<U100000000"}
            ),
        )
        tracemalloc.start()
        try:
            refused(
                target(),
                ckpt,
                r"state\.json: tree\.components\.stats\.count: is an array of dtype '<U100000000'; grpo "
                r"reads arrays of \[.*\] only",
            )
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 50 * 2**20, peak  # the array would take 400 MB

    def test_a_tensor_larger_than_the_trainers_is_never_read(
        self, ckpt: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        edit_tensors(ckpt, lambda ts: ts.__setitem__(OPT0 + "exp_avg_sq", torch.zeros(1000, 1000)))
        read: list[str] = []
        real = codec_mod.get_tensor  # every tensor of a checkpoint is read through it
        monkeypatch.setattr(codec_mod, "get_tensor", lambda f, k, file: read.append(k) or real(f, k, file))
        refused(
            target(),
            ckpt,
            r"state\.safetensors: tree\.optimizer\.state\.0\.exp_avg_sq: is a float32 tensor of shape "
            r"\(1000, 1000\) \(4000000 bytes\); this trainer holds at most 320 bytes there",
        )
        assert read  # the spy sees reads: the policy's weights are read before the state's tensors
        assert OPT0 + "exp_avg_sq" not in read

    def test_a_header_claiming_a_huge_tensor_is_refused(self, ckpt: Path) -> None:
        header, data = read_header(ckpt / "state.safetensors")
        header[OPT0 + "exp_avg"]["shape"] = [10**6, 10**6]
        (ckpt / "state.safetensors").write_bytes(header_bytes(header) + data)
        fix_size(ckpt, "state.safetensors")
        refused(target(), ckpt, r"state\.safetensors is not a valid safetensors file")

    def test_an_oversized_state_json_is_not_read(self, ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(meta_mod, "MAX_STATE_JSON_BYTES", 1000)
        refused(target(), ckpt, r"state\.json has \d+ bytes, more than the 1000 grpo reads")


# ---- 6. malformed JSON, and the fallback past a malformed newer checkpoint -----------------------
MALFORMED_JSON: dict[str, tuple[Callable[[Path], None], str]] = {
    "not JSON": (lambda c: (c / "state.json").write_text("{"), r"state\.json is not valid JSON"),
    "not UTF-8": (
        lambda c: (c / "state.json").write_bytes(b'{"a": "\xff"}'),
        r"state\.json is not valid JSON",
    ),
    "100000 nested arrays": (
        lambda c: (c / "state.json").write_text("[" * 100_000 + "]" * 100_000),
        r"state\.json is nested too deeply",
    ),
    "files as a list": (
        lambda c: edit_json(c, lambda m: m.__setitem__("files", [])),
        r"state\.json: files: is list",
    ),
    "config as a list": (
        lambda c: edit_json(c, lambda m: m.__setitem__("config", [])),
        r"state\.json: config: is list",
    ),
    "a config value that is an object": (
        lambda c: edit_json(c, lambda m: m["config"].__setitem__("seed", {"a": 1})),
        r"state\.json: config\.seed: is dict",
    ),
    "tree without rng": (
        lambda c: edit_json(c, lambda m: tree(m).pop("rng")),
        r"state\.json: tree: has the keys",
    ),
    "no scalars": (
        lambda c: edit_json(c, lambda m: m.pop("scalars")),
        r"state\.json: \(top level\): keys missing \['scalars'\]",
    ),
    "version as a string": (
        lambda c: edit_json(c, lambda m: m.__setitem__("version", "1")),
        r"state\.json: version: format version '1' is not supported",
    ),
    "aliases as a list": (
        lambda c: edit_json(c, lambda m: m["policy"].__setitem__("aliases", [])),
        r"state\.json: policy\.aliases: is \[\]",
    ),
    "an alias of a missing tensor": (
        lambda c: edit_json(c, lambda m: m["state_aliases"].__setitem__("x", "nowhere")),
        r"state\.json: state_aliases\.x: is an alias of 'nowhere', which state\.safetensors does not hold",
    ),
    "a reference to a missing tensor": (
        lambda c: edit_json(c, lambda m: opt_state(m, 1).__setitem__("exp_avg", {"__tensor__": "nowhere"})),
        r"state\.json: tree\.optimizer\.state\.1\.exp_avg: refers to the tensor 'nowhere'",
    ),
    "a tensor reference that is a number": (
        lambda c: edit_json(c, lambda m: opt_state(m, 1).__setitem__("exp_avg", {"__tensor__": 3})),
        r"state\.json: tree\.optimizer\.state\.1\.exp_avg: refers to the tensor 3; expected the name",
    ),
    "an unknown marker": (
        lambda c: edit_json(
            c, lambda m: tree(m)["components"].__setitem__("stats", {"__reduce__": ["os.system"]})
        ),
        r"state\.json: tree\.components\.stats: has the keys \['__reduce__'\]; a grpo state tree marks",
    ),
    "a dtype named after a torch function": (
        lambda c: edit_json(
            c, lambda m: tree(m)["components"]["stats"].__setitem__("count", {"__dtype__": "load"})
        ),
        r"state\.json: tree\.components\.stats\.count: names the dtype 'load', which is not a torch dtype",
    ),
    "an __items__ key that is a list": (
        lambda c: edit_json(c, lambda m: tree(m)["optimizer"]["state"]["__items__"][0].__setitem__(0, [0])),
        r"state\.json: tree\.optimizer\.state: item 0 has the key \[0\]",
    ),
    "a key twice": (
        lambda c: edit_json(
            c,
            lambda m: tree(m)["optimizer"]["state"]["__items__"].append(
                tree(m)["optimizer"]["state"]["__items__"][0]
            ),
        ),
        r"state\.json: tree\.optimizer\.state: has the key 0 twice",
    ),
    "a value nested 80 deep": (
        lambda c: edit_json(
            c, lambda m: tree(m)["components"]["stats"].__setitem__("count", json.loads("[" * 80 + "]" * 80))
        ),
        r"state\.json: tree\.components\.stats\.count(\.0)+: is nested deeper than 64 levels",
    ),
    "a safetensors header that is not JSON": (
        lambda c: (c / "policy.safetensors").write_bytes(
            struct.pack("<Q", 8) + b"{{{{{{{{" + (c / "policy.safetensors").read_bytes()[16:]
        ),
        r"policy\.safetensors is not a valid safetensors file",
    ),
}


class TestMalformedFiles:
    @pytest.mark.parametrize("case", sorted(MALFORMED_JSON))
    def test_one_checkpoint_error(self, ckpt: Path, case: str) -> None:
        tamper, match = MALFORMED_JSON[case]
        tamper(ckpt)
        err = refused(target(), ckpt, rf"^{re.escape(str(ckpt))} is not a complete grpo checkpoint: {match}")
        assert str(ckpt) in str(err)

    @pytest.mark.parametrize("case", ["files as a list", "not JSON", "100000 nested arrays", "a key twice"])
    def test_a_malformed_newer_checkpoint_is_skipped(self, tmp_path: Path, case: str) -> None:
        t = trained(1, seed=1)
        t.save_checkpoint(tmp_path)
        train_step(t)
        newer = t.save_checkpoint(tmp_path)
        MALFORMED_JSON[case][0](newer)
        with pytest.warns(RuntimeWarning, match=r"skipping the checkpoint .*step-00000002: state\.json"):
            assert find_latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
        u = target()
        with pytest.warns(RuntimeWarning, match=r"skipping the checkpoint .*step-00000002"):
            assert u.load_checkpoint(tmp_path) == tmp_path / "step-00000001"
        assert u.step_count == 1

    def test_no_good_checkpoint_names_the_newest_problem(self, ckpt: Path) -> None:
        edit_json(ckpt, lambda m: m.__setitem__("files", []))
        refused(
            target(),
            ckpt.parent,
            r"no complete grpo checkpoint in .* the newest, step-00000002: state\.json: files: is list",
        )


# ---- 7. the device override -------------------------------------------------------------------------
def as_cuda_checkpoint(ckpt: Path) -> None:
    """What a run on one CUDA device saves: device 'cuda:0' and a CUDA RNG state."""
    edit_tensors(ckpt, lambda ts: ts.__setitem__("state.rng.cuda.0", torch.zeros(16, dtype=torch.uint8)))
    edit_json(ckpt, lambda m: m["config"].__setitem__("device", "cuda:0"))
    edit_json(ckpt, lambda m: tree(m)["rng"].__setitem__("cuda", [{"__tensor__": "state.rng.cuda.0"}]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
class TestDeviceOverride:
    def test_a_cuda_checkpoint_on_a_cpu_machine(self, plain: Path) -> None:
        as_cuda_checkpoint(plain)
        policy = make_policy(seed=3)
        with pytest.raises(
            CheckpointError,
            match=r"state\.json: config\.device='cuda:0': names a CUDA device, but this machine has 0\. Pass "
            r"from_checkpoint\(\.\.\., device='cpu'\)",
        ):
            GRPOTrainer.from_checkpoint(plain, policy=policy, reward_model=bandit_reward)
        with (
            pytest.warns(UserWarning, match=r"config differs in \['device'\]"),
            pytest.warns(RuntimeWarning, match="CUDA RNG states for 1 device"),
        ):
            t = GRPOTrainer.from_checkpoint(plain, policy=policy, reward_model=bandit_reward, device="cpu")
        assert t.config.device == "cpu"
        assert t.step_count == 2
        saved = load_file(plain / "policy.safetensors")
        assert all(torch.equal(v, t.policy.state_dict()[k]) for k, v in saved.items())  # type: ignore[attr-defined]
        still_trains(t)

    def test_a_bad_override_is_the_callers_value_error(self, plain: Path) -> None:
        with pytest.raises(ValueError, match=r"GRPOConfig\.device='gpu' is not allowed"):
            GRPOTrainer.from_checkpoint(plain, policy=make_policy(), reward_model=bandit_reward, device="gpu")


def test_a_failed_from_checkpoint_leaves_the_policy_and_the_rng_alone(plain: Path) -> None:
    edit_tensors(plain, OPTIMIZER_TAMPERING["shrunk exp_avg"][0])
    policy = make_policy(seed=3)
    w = {k: v.clone() for k, v in policy.state_dict().items()}
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    with pytest.raises(CheckpointError, match=r"optimizer\.state\[0\]\.exp_avg"):
        GRPOTrainer.from_checkpoint(plain, policy=policy, reward_model=bandit_reward)
    assert same(w, dict(policy.state_dict()))
    assert same(
        rng, (random.getstate(), np.random.get_state(), torch.get_rng_state())
    )  # the constructor seeds


# ---- the fuzz: random mutations of state.json and of the safetensors headers ---------------------
class Unpickled(BaseException):
    """Raised by every unpickling entry point during the fuzz (a BaseException: nothing catches it)."""


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def trap(name: str) -> Callable[..., Any]:
        def f(*a: Any, **k: Any) -> Any:
            calls.append(name)
            raise Unpickled(name)

        return f

    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, name, trap(f"{mod.__name__}.{name}"))
    return calls


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):  # of a long list (an RNG state's words), the first two and the last
        for i in range(len(obj)) if len(obj) <= 8 else (0, 1, len(obj) - 1):
            yield from _paths(obj[i], (*prefix, i))


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 3, 624, 625, 2**32, 2**63, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["auto", "off", "cpu", "cuda:0", "/etc/passwd", "MT19937", "__tensor__", "float32"])
)
json_values = st.recursive(
    json_leaves,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)


def _nested(n: int) -> list[Any]:
    """``n`` nested lists (the 100,000-deep text is in `MALFORMED_JSON`: json.dumps cannot write it)."""
    value: list[Any] = []
    for _ in range(n - 1):
        value = [value]
    return value


def _special_values(tensor_keys: list[str]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda k: {"__tensor__": k}, st.sampled_from(tensor_keys) | st.text(max_size=8)),
        st.builds(
            lambda v, d: {"__ndarray__": v, "dtype": d},
            json_values,
            st.sampled_from(["<U100000000", "float32", "object", "V8", "int8", "uint32", "S1000000000"]),
        ),
        st.builds(lambda d: {"__dtype__": d}, st.sampled_from(["float32", "load", "save", "uint8", "x"])),
        st.builds(lambda v: {"__tuple__": v}, json_values),
        st.builds(lambda v: {"__items__": v}, json_values),
        st.integers(1, 500).map(_nested),
    )


def _retyped(v: Any) -> list[Any]:
    """``v`` as values of other JSON types."""
    if isinstance(v, bool):
        return [int(v), str(v)]
    if isinstance(v, int):
        return [str(v), float(v), bool(v)]
    if isinstance(v, float):
        return [str(v), int(v) if v == v and abs(v) < 1e300 else 0]
    if isinstance(v, str):
        return [len(v), [v], None]
    if isinstance(v, list):
        return [{"__tuple__": v}, dict(enumerate(v)), len(v)]
    if isinstance(v, dict):
        return [list(v.values()), list(v), {"__items__": [[k, x] for k, x in v.items()]}]
    return [0, "", []]


def _mutate_json(data: st.DataObject, meta: dict[str, Any], tensor_keys: list[str]) -> str:
    """Apply one random mutation to ``meta`` in place; a description of it."""
    paths = list(_paths(meta))
    path = data.draw(st.sampled_from(paths[1:]), label="path")
    parent, key = _get(meta, path[:-1]), path[-1]
    op = data.draw(
        st.sampled_from(["delete", "replace", "special", "resize", "nest", "rename", "retype"]), label="op"
    )
    value = parent[key]
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = data.draw(json_values, label="value")
    elif op == "special":
        parent[key] = data.draw(_special_values(tensor_keys), label="value")
    elif op == "resize":
        if isinstance(value, list):
            n = data.draw(st.integers(0, len(value) + 3), label="length")
            parent[key] = (value + [data.draw(json_values) for _ in range(max(0, n - len(value)))])[:n]
        elif isinstance(value, dict):
            value[data.draw(st.text(max_size=10), label="new key")] = data.draw(json_values)
        else:
            parent[key] = [value] * data.draw(st.integers(0, 3))
    elif op == "nest":
        wrap = data.draw(st.sampled_from(["list", "dict", "tuple", "items"]), label="wrap")
        parent[key] = {
            "list": [value],
            "dict": {"x": value},
            "tuple": {"__tuple__": [value]},
            "items": {"__items__": [[0, value]]},
        }[wrap]
    elif op == "rename" and isinstance(parent, dict):
        parent[
            data.draw(
                st.text(max_size=10) | st.sampled_from(["__tensor__", "__items__", "step"]), label="name"
            )
        ] = parent.pop(key)
    else:  # retype
        parent[key] = data.draw(st.sampled_from(_retyped(value)), label="retyped")
    return f"{op} at {path}"


def _mutate_header(data: st.DataObject, raw: bytes) -> bytes:
    """A safetensors file with its header tampered with (the data as it was)."""
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names), label="tensor")
    entry = header[name]
    op = data.draw(
        st.sampled_from(
            ["dtype", "shape", "offsets", "swap", "delete", "rename", "metadata", "length", "garbage"]
        ),
        label="header op",
    )
    if op == "dtype":
        entry["dtype"] = data.draw(
            st.sampled_from(["F16", "BF16", "F64", "I32", "U8", "I64", "BOOL", "F8_E4M3", "C64", "X"])
        )
    elif op == "shape":
        entry["shape"] = data.draw(
            st.lists(st.integers(0, 40), max_size=4)
            | st.just(list(reversed(entry["shape"])))
            | st.just([2**40])
        )
    elif op == "offsets":
        entry["data_offsets"] = data.draw(st.lists(st.integers(-1, len(body) + 8), min_size=2, max_size=2))
    elif op == "swap":  # two tensors' bytes exchanged (a valid file when the sizes agree)
        other = header[data.draw(st.sampled_from(names), label="other")]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif op == "delete":
        del header[name]
    elif op == "rename":
        header[data.draw(st.text(min_size=1, max_size=10), label="new name")] = header.pop(name)
    elif op == "metadata":
        header["__metadata__"] = data.draw(st.dictionaries(st.text(max_size=5), json_leaves, max_size=3))
    if op == "length":
        return struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1), label="length")) + raw[8:]
    if op == "garbage":
        at = data.draw(st.integers(8, 8 + n - 1), label="byte")
        return raw[:at] + bytes([data.draw(st.integers(0, 255))]) + raw[at + 1 :]
    return header_bytes(header) + body


FUZZ_EXAMPLES = 300


def _what(message: str) -> str:
    """The file (and the first word of the field) an error names, for the fuzz's statistics."""
    m = re.search(r"(state\.json|[a-z]+\.safetensors)(: ([A-Za-z_]+))?", message)
    return "?" if m is None else f"{m.group(1)} {m.group(3) or ''}".strip()


@pytest.fixture(scope="module")
def fuzz_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[str]]:
    path = trained(2, seed=1).save_checkpoint(tmp_path_factory.mktemp("fuzz"))
    meta = json.loads((path / "state.json").read_text())
    keys = sorted(read_header(path / "state.safetensors")[0])
    return path, meta, keys


@pytest.mark.slow  # 300 trainers built and loaded: ~12 s of CPU; the targeted tampering tests run by default
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_fuzz_the_manifest_and_the_headers(
    data: st.DataObject, fuzz_source: tuple[Path, dict[str, Any], list[str]], no_unpickling: list[str]
) -> None:
    """Random mutations of state.json (delete / retype / resize / nest / rename keys, random and
    marker values) and of the safetensors headers (dtype, shape, offsets, names, length prefix,
    bytes): the load raises CheckpointError and nothing changed (weights, optimizer state,
    scheduler, components, generator, step counters, global RNG streams, bitwise), or it succeeds
    and the trainer has the structure of a valid one and trains. Nothing is ever unpickled."""
    source, meta, keys = fuzz_source
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(shutil.copytree(source, Path(d) / source.name))
        target_file = data.draw(
            st.sampled_from(
                [
                    "state.json",
                    "state.json",
                    "state.safetensors",
                    "policy.safetensors",
                    "reference.safetensors",
                ]
            ),
            label="file",
        )
        if target_file == "state.json":
            mutated = copy.deepcopy(meta)
            for _ in range(data.draw(st.integers(1, 3), label="mutations")):
                _mutate_json(data, mutated, keys)
            (ckpt / "state.json").write_text(json.dumps(mutated))
        else:
            (ckpt / target_file).write_bytes(_mutate_header(data, (ckpt / target_file).read_bytes()))
            if data.draw(st.booleans(), label="fix manifest size"):
                fix_size(ckpt, target_file)
        t = target()
        shape = structure(t)
        before = fingerprint(t)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                t.load_checkpoint(ckpt)
            except CheckpointError as e:
                event(f"refused: {_what(str(e))}")
                after = fingerprint(t)
                for k in before:
                    assert same(before[k], after[k]), k
                loaded = False
            else:
                event("loaded")
                loaded = True
            if loaded:  # a harmless mutation: the trainer is valid and trains (a tampered learning
                valid_structure(t, shape)  # rate may make the step non-finite: the guard skips it)
                train_step(t)
    assert no_unpickling == []
