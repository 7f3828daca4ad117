"""Checkpoints: what they hold, atomic writes, keep-last-K, no unpickling, exact resume."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.state.checkpoint import CheckpointError, find_latest_checkpoint, list_checkpoints
from tests.reliability_toys import (
    PlainPolicy,
    StateDictPolicy,
    bandit_reward,
    make_config,
    make_policy,
    make_trainer,
    param_hash,
    resume,
    train_step,
)

HERE = Path(__file__).parent


def _tree_equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class RunningStats:
    """A stateful component (like running advantage statistics) with tensors and plain numbers."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = torch.zeros(3)

    def update(self, x: Tensor) -> None:
        self.count += 1
        self.mean += (x - self.mean) / self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.mean = state["mean"].clone()


def test_roundtrip_restores_every_piece_of_state(tmp_path: Path) -> None:
    t1 = make_trainer()
    t1.advantage_stats = RunningStats()  # type: ignore[attr-defined]
    t1.register_checkpoint_state("advantage_stats", t1.advantage_stats)  # type: ignore[attr-defined]
    t1.unregistered = RunningStats()  # type: ignore[attr-defined]  # never saved: no reflection
    sampler = RunningStats()
    t1.register_checkpoint_state("sampler", sampler)
    for _ in range(3):
        train_step(t1)
        t1.advantage_stats.update(torch.randn(3))  # type: ignore[attr-defined]
        sampler.update(torch.randn(3))
    t1.unregistered.update(torch.randn(3))  # type: ignore[attr-defined]
    t1.non_finite_steps = 2
    t1.save_checkpoint(tmp_path)
    rng = (torch.get_rng_state(), t1.generator.get_state())

    t2 = GRPOTrainer(make_config(), make_policy(seed=5), bandit_reward)
    t2.advantage_stats = RunningStats()  # type: ignore[attr-defined]
    t2.register_checkpoint_state("advantage_stats", t2.advantage_stats)  # type: ignore[attr-defined]
    sampler2 = RunningStats()
    t2.register_checkpoint_state("sampler", sampler2)
    torch.manual_seed(999)
    loaded = t2.load_checkpoint(tmp_path)

    assert loaded.name == "step-00000003"
    assert t2.step_count == 3
    assert t2.non_finite_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(t1.params, t2.params, strict=True))
    assert _tree_equal(t1.reference_policy.state_dict(), t2.reference_policy.state_dict())  # type: ignore[union-attr]
    assert _tree_equal(t1.optimizer.state_dict(), t2.optimizer.state_dict())  # type: ignore[union-attr]
    assert t1.scheduler.state_dict()["last_epoch"] == t2.scheduler.state_dict()["last_epoch"] == 3 * 4  # type: ignore[union-attr]
    assert t2.advantage_stats.count == 3  # type: ignore[attr-defined]
    assert torch.equal(t2.advantage_stats.mean, t1.advantage_stats.mean)  # type: ignore[attr-defined]
    assert sampler2.count == 3
    assert torch.equal(sampler2.mean, sampler.mean)
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert torch.equal(t2.generator.get_state(), rng[1])
    meta = json.loads((loaded / "state.json").read_text())
    assert meta["config"]["group_size"] == 4
    assert meta["step"] == 3
    assert sorted(p.name for p in loaded.iterdir()) == [
        "policy.safetensors",
        "reference.safetensors",
        "state.json",
        "state.safetensors",
    ]


def test_from_checkpoint_uses_the_saved_config(tmp_path: Path) -> None:
    t1 = GRPOTrainer(make_config(kl_coeff=0.0, num_epochs_per_update=1), make_policy(), bandit_reward)
    t1.step(torch.randn(4, 4))
    t1.save_checkpoint(tmp_path)
    t2 = GRPOTrainer.from_checkpoint(tmp_path, policy=make_policy(seed=3), reward_model=bandit_reward)
    assert t2.config == t1.config
    assert t2.reference_policy is None
    assert t2.step_count == 1
    assert all(torch.equal(a, b) for a, b in zip(t1.params, t2.params, strict=True))


@pytest.mark.parametrize("cls", [PlainPolicy, StateDictPolicy])
def test_policies_that_are_not_modules_save_through_the_hook(tmp_path: Path, cls: type[PlainPolicy]) -> None:
    cfg = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.0, learning_rate=0.1, seed=0)
    t1 = GRPOTrainer(cfg, cls(0.0), lambda s, a: a.float())
    for _ in range(3):
        t1.step(torch.zeros(2, 1))
    if isinstance(t1.policy, StateDictPolicy):
        t1.policy.temperature = torch.tensor(0.5)
    t1.save_checkpoint(tmp_path)
    p2 = cls(7.0)
    w_before = p2.w
    t2 = GRPOTrainer(cfg, p2, lambda s, a: a.float())
    t2.load_checkpoint(tmp_path)
    assert p2.w is w_before, "restored in place, so the optimizer still holds the same tensor"
    assert torch.equal(p2.w, t1.policy.w)  # type: ignore[attr-defined]
    assert not torch.equal(p2.w, torch.zeros(3))
    if isinstance(p2, StateDictPolicy):
        assert float(p2.temperature) == 0.5


def test_keep_last_latest_pointer_and_leftovers(tmp_path: Path) -> None:
    t = make_trainer()
    for _ in range(4):
        train_step(t)
        t.save_checkpoint(tmp_path, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    # a save killed half-way leaves a .tmp-* directory: ignored by the loader, removed by the next save
    (tmp_path / ".tmp-step-00000005-x").mkdir()
    (tmp_path / ".tmp-step-00000005-x" / "state.json").write_text("{")
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    train_step(t)
    t.save_checkpoint(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000005"]


def test_incomplete_checkpoint_is_never_picked(tmp_path: Path) -> None:
    t = make_trainer()
    train_step(t)
    t.save_checkpoint(tmp_path)
    train_step(t)
    newest = t.save_checkpoint(tmp_path)
    # truncate one file of the newest: its manifest no longer matches, so the previous one is used
    f = newest / "state.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    skipped = r"skipping the checkpoint .*step-00000002: state\.safetensors has \d+ bytes, the manifest says"
    with pytest.warns(RuntimeWarning, match=skipped):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    with pytest.raises(CheckpointError, match=r"state.safetensors has \d+ bytes, the manifest says \d+"):
        t.load_checkpoint(newest)
    with pytest.warns(RuntimeWarning, match=skipped):
        assert resume(str(tmp_path)).step_count == 1


def test_no_checkpoint_and_mismatches_fail_clearly(tmp_path: Path) -> None:
    t = make_trainer()
    with pytest.raises(CheckpointError, match="no complete grpo checkpoint in"):
        t.load_checkpoint(tmp_path)
    t.save_checkpoint(tmp_path)
    no_ref = GRPOTrainer(make_config(kl_coeff=0.0), make_policy(), bandit_reward)
    no_ref.scheduler = t.scheduler
    with pytest.raises(CheckpointError, match="has reference policy but this trainer has none"):
        no_ref.load_checkpoint(tmp_path)
    no_sched = GRPOTrainer(make_config(lr_schedule="constant", warmup_steps=0), make_policy(), bandit_reward)
    with pytest.raises(CheckpointError, match=r"has LR scheduler state but trainer\.scheduler is NoneType"):
        no_sched.load_checkpoint(tmp_path)
    other = make_trainer(learning_rate=0.5)
    with pytest.warns(UserWarning, match=r"config differs in \['learning_rate'\]"):
        other.load_checkpoint(tmp_path)


def _as_grpo_02(ckpt: Path, normalize_advantages: bool, num_mini_batches: int) -> None:
    """Rewrite ``ckpt``'s saved config the way grpo 0.2 wrote it: ``normalize_advantages`` beside an
    unset ``advantage_scale``, ``num_mini_batches`` beside an unset ``mini_batch_size``."""
    meta = json.loads((ckpt / "state.json").read_text())
    meta["config"].update(
        advantage_scale=None,
        normalize_advantages=normalize_advantages,
        mini_batch_size=None,
        num_mini_batches=num_mini_batches,
    )
    (ckpt / "state.json").write_text(json.dumps(meta))


def test_a_config_saved_under_the_old_field_names_is_compared_by_its_meaning(tmp_path: Path) -> None:
    """grpo 0.2's normalize_advantages=True / num_mini_batches=2 of batch_size=4 mean this trainer's
    advantage_scale='group' / mini_batch_size=2: no "differs" warning; a different meaning is
    named by the current field, with the saved value read as that field's."""
    t = make_trainer()  # advantage_scale="group", batch_size=4, mini_batch_size=2
    train_step(t)
    ckpt = t.save_checkpoint(tmp_path)
    _as_grpo_02(ckpt, normalize_advantages=True, num_mini_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = make_trainer()
        loaded.load_checkpoint(ckpt)
    assert [str(w.message) for w in caught if "differs" in str(w.message)] == []
    assert loaded.step_count == 1
    _as_grpo_02(ckpt, normalize_advantages=False, num_mini_batches=1)
    with pytest.warns(
        UserWarning,
        match=r"config differs in \['advantage_scale', 'mini_batch_size'\] \(saved: \[\"'none'\", '4'\], "
        r"now: \['group', 2\]\); the run will not continue exactly as the saved one\.$",
    ):
        make_trainer().load_checkpoint(ckpt)


class _Exploit:
    """Unpickling this creates the file ``path``: proof that code from the file ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("target", ["state.safetensors", "policy.safetensors"])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_planted_pickle_is_refused_without_running_it(tmp_path: Path, target: str, how: str) -> None:
    t = make_trainer()
    ckpt = t.save_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    # the payload is live: unpickling it elsewhere does create the marker
    pickle.loads(pickle.dumps(_Exploit(str(tmp_path / "proof"))))
    assert (tmp_path / "proof").exists()

    f = ckpt / target
    if how == "pickle":
        f.write_bytes(pickle.dumps({"weights": _Exploit(str(marker))}))
    else:
        torch.save({"weights": _Exploit(str(marker))}, f)
    # make the manifest agree, as an attacker would
    meta = json.loads((ckpt / "state.json").read_text())
    meta["files"][target] = f.stat().st_size
    (ckpt / "state.json").write_text(json.dumps(meta))

    with (
        pytest.raises(CheckpointError, match=f"{target} is not a valid safetensors file.*never unpickles"),
        pytest.warns(RuntimeWarning, match=f"skipping the checkpoint .*{target} is not a valid safetensors"),
    ):
        make_trainer().load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


def _worker(*args: str) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(HERE / "reliability_toys.py"), "run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    rows = [json.loads(line) for line in out if line.startswith("{") and "step" in line]
    assert out[-1].startswith("done ")
    return [*rows, {"hash": out[-1].split()[1]}]


def test_resume_in_a_new_process_is_bitwise_exact(tmp_path: Path) -> None:
    """2N steps straight == N steps + save here + load in a new process + N steps (bitwise)."""
    n = 4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the worker
    try:
        straight = make_trainer()
        rewards = [train_step(straight)["reward/mean"] for _ in range(2 * n)]
        first = make_trainer()
        first_rewards = [train_step(first)["reward/mean"] for _ in range(n)]
        first.save_checkpoint(tmp_path)
    finally:
        torch.set_num_threads(threads)
    second = _worker(str(tmp_path), str(2 * n), "--resume")
    assert first_rewards == rewards[:n]
    assert [r["step"] for r in second[:-1]] == list(range(n + 1, 2 * n + 1))
    assert [r["reward"] for r in second[:-1]] == rewards[n:]
    assert second[-1]["hash"] == param_hash(straight)
    assert param_hash(first) != param_hash(straight), "the second half did change the weights"


def test_running_advantage_statistics_are_saved(tmp_path: Path) -> None:
    """The trainer's advantage estimator (running baseline/scale) is found and restored on its own."""
    t1 = make_trainer(advantage_baseline="running", advantage_scale="running")
    for _ in range(3):
        train_step(t1)
    saved = t1.advantage_estimator.state_dict()
    assert saved, "the running statistics are not empty after 3 steps"
    t1.save_checkpoint(tmp_path)
    t2 = make_trainer(advantage_baseline="running", advantage_scale="running")
    assert t2.advantage_estimator.state_dict() != saved
    t2.load_checkpoint(tmp_path)
    restored = t2.advantage_estimator.state_dict()
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


def test_the_earlier_save_checkpoint_trainer_root_form_still_works_with_a_deprecation(tmp_path: Path) -> None:
    from grpo.state import checkpoint

    t = make_trainer()
    train_step(t)
    with pytest.warns(DeprecationWarning, match=r"call trainer.save_checkpoint\(root\)"):
        path = checkpoint.save_checkpoint(t, tmp_path)
    assert path.name == "step-00000001"
    t2 = GRPOTrainer(make_config(), make_policy(seed=5), bandit_reward)
    t2.load_checkpoint(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(t.params, t2.params, strict=True))
