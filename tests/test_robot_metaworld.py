"""Issue 45 on MetaWorld v3 (skipped without it: ``pip install metaworld``, which pins mujoco 3.3.0):
snapshot branches replay bitwise, deepcopy is refused, seeded starts, success on real tasks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")
pytest.importorskip("metaworld", reason="MetaWorld v3 is not installed (pip install metaworld)")

from grpo.gym.branching import BranchPoints, branching_policy  # noqa: E402
from grpo.gym.episodes import EpisodePolicy, evaluate_policy  # noqa: E402
from grpo.gym.seeded_starts import check_seeded_starts, make_metaworld  # noqa: E402
from grpo.gym.snapshots import SnapshotError, SnapshotStore, restore, snapshot  # noqa: E402
from grpo.gym.success import EndOnSuccess  # noqa: E402
from grpo.policies import gaussian_mlp  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TASKS = ["reach-v3", "push-v3", "drawer-open-v3"]


def random_actions(n: int, seed: int) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).uniform(-1, 1, (n, 4)).astype(np.float32))


def play(env: Any, actions: list[np.ndarray]) -> list[tuple[bytes, float, bool, bool, float]]:
    out = []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        out.append((np.asarray(obs).tobytes(), float(r), bool(term), bool(trunc), float(info["success"])))
    return out


@pytest.mark.parametrize("task", TASKS)
def test_a_branch_restored_into_another_env_replays_bitwise(task: str) -> None:
    """Restored into an env reset to another start (another goal and object placement, which
    MetaWorld writes into the model), 60 steps replay the original bitwise, success included."""
    env = make_metaworld(task)
    obs, _ = env.reset(seed=0)
    for a in random_actions(10, 1):
        obs, *_ = env.step(a)
    snap = snapshot(env, observation=obs)
    assert snap.method == "mujoco"
    actions = random_actions(60, 2)
    original = play(env, actions)
    other = make_metaworld(task)
    start, _ = other.reset(seed=7)
    assert start.tobytes() != obs.tobytes()
    assert np.array_equal(restore(other, snap), obs)
    assert play(other, actions) == original
    if task == "drawer-open-v3":  # a deep copy rebuilds the simulator from its file: refused
        with pytest.raises(SnapshotError, match=r"method='deepcopy'\) is not exact for .*DrawerOpen"):
            snapshot(env, observation=obs, method="deepcopy")
        with pytest.raises(SnapshotError, match=r"no exact snapshot method"):
            snapshot(_Opaque())


class _Opaque(gym.Env[np.ndarray, int]):
    """An env with no exact method (for the refusal of method='auto')."""


def test_seeded_starts_on_metaworld() -> None:
    env = make_metaworld("push-v3")
    check_seeded_starts(env, (0, 0, 1, 2, 1))  # same seed: bitwise same start; others differ
    first, _ = env.reset(seed=3)
    continuation = play(env, random_actions(20, 0))
    again = make_metaworld("push-v3")  # another instance: the same start and continuation
    assert again.reset(seed=3)[0].tobytes() == first.tobytes()
    assert play(again, random_actions(20, 0)) == continuation
    hidden = make_metaworld("push-v3", goal_observable=False)
    assert not hidden.reset(seed=3)[0][-3:].any()  # MT1's setting: the goal is not observed
    # G episodes from one seed start alike (EpisodePolicy checks it), and success is reported
    torch.manual_seed(0)
    policy = EpisodePolicy(
        lambda: EndOnSuccess(make_metaworld("reach-v3", max_episode_steps=10)),
        gaussian_mlp(39, 4, hidden=(16,)),
    )
    (group,) = policy.generate_actions([5], 2)
    assert all(e.success is not None for e in group)
    policy.close()


def test_expert_success_and_evaluation_on_metaworld() -> None:
    """MetaWorld's scripted expert solves reach from seeded starts and from a restored snapshot;
    the evaluation reports success for a MetaWorld env."""
    from metaworld.policies import SawyerReachV3Policy

    expert = SawyerReachV3Policy()
    env = EndOnSuccess(make_metaworld("reach-v3", max_episode_steps=150), binary_reward=True)
    obs, _ = env.reset(seed=11)
    for _ in range(5):
        obs, *_ = env.step(expert.get_action(obs))
    snap = snapshot(env, observation=obs)
    for target in (env, EndOnSuccess(make_metaworld("reach-v3", max_episode_steps=150))):
        target.reset(seed=99)
        o = restore(target, snap)
        for _ in range(145):
            o, r, term, trunc, _ = target.step(expert.get_action(o))
            if term or trunc:
                break
        assert term
        assert r == 1.0
    torch.manual_seed(0)
    result = evaluate_policy(
        gaussian_mlp(39, 4, hidden=(8,)),
        lambda: make_metaworld("reach-v3", max_episode_steps=5),
        [0, 1, 2],
        num_envs=2,
    )
    assert result.successes is not None
    assert result.successes.shape == (3,)


def test_branching_on_metaworld_starts_each_group_from_its_snapshot() -> None:
    store = SnapshotStore()
    torch.manual_seed(0)
    net = gaussian_mlp(39, 4, hidden=(8,))
    trunk_policy = EpisodePolicy(lambda: make_metaworld("drawer-open-v3"), net)
    trunk = BranchPoints(lambda: make_metaworld("drawer-open-v3"), trunk_policy, store, every=3, seed=0)
    points = trunk.sample(2)
    branches = branching_policy(lambda: make_metaworld("drawer-open-v3"), net, store, horizon=4)
    groups = branches.generate_actions(points, 2)  # the equal-start check runs
    for i, group in zip(points, groups, strict=True):
        assert all(
            torch.equal(e.observations[0], torch.from_numpy(store[i].observation).float()) for e in group
        )
    branches.close()
    trunk.close()


def test_robot_finetune_example_quick(tmp_path: Any) -> None:
    """examples/robot_finetune.py --quick: demonstrations, cloning, GRPO updates on success, the
    evaluation before and after, and the saved policy loaded back (the example checks that the
    loaded policy replays the evaluation)."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = root / "examples" / "robot_finetune.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(tmp_path / "p")],
        capture_output=True, text=True, cwd=tmp_path, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(
        r"push-v3: 2 demos \(\d+ steps, \d+% solved\); BC success [\d.]+ \+- [\d.]+", proc.stdout
    )
    updates = re.findall(r"update +(\d+) +env steps +(\d+) +rollout success ([\d.]+)", proc.stdout)
    assert len(updates) >= 1
    assert int(updates[-1][1]) >= 300  # the --quick budget, every env step counted
    final = re.search(r"after (\d+) env steps \((\d+) updates", proc.stdout)
    assert final is not None
    assert (int(final.group(1)), int(final.group(2))) == (int(updates[-1][1]), len(updates))
    meta = json.loads((tmp_path / "p.json").read_text())
    assert (meta["obs_dim"], meta["act_dim"], meta["task"]) == (39, 4, "push-v3")
    assert (tmp_path / "p.safetensors").stat().st_size > 0
