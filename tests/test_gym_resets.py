"""Groups without resets: snapshot/restore on real gymnasium envs, SnapshotReset inside EpisodePolicy
(sync and async vector envs), and grouping by nearest start states with its bias diagnostic."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.gym.episodes import EpisodePolicy, EpisodeReturn, evaluate_episodes  # noqa: E402
from grpo.gym.resets import (  # noqa: E402
    NearestStartPolicy,
    Snapshot,
    SnapshotError,
    SnapshotReset,
    SnapshotStore,
    StartStateBiasWarning,
    group_by_nearest_start,
    grouping_stats,
    restore,
    snapshot,
)
from grpo.policies import categorical_mlp, gaussian_mlp  # noqa: E402

CLASSIC = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCar-v0", "MountainCarContinuous-v0"]


pytestmark = pytest.mark.usefixtures("one_thread")


def make(env_id: str) -> Any:
    env = gym.make(env_id)
    if env_id.startswith("Acrobot"):
        env.unwrapped.torque_noise_max = 0.3  # stochastic transitions: the rng must be restored too
    return env


def play(env: Any, actions: list[Any]) -> list[tuple[np.ndarray, float, bool, bool]]:
    """Step ``env`` with ``actions`` until the episode ends: [(obs, reward, terminated, truncated)]."""
    out = []
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out.append((np.array(obs), float(r), bool(term), bool(trunc)))
        if term or trunc:
            break
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x[0], y[0]) and x[1:] == y[1:] for x, y in zip(a, b, strict=True)
    )


def played_env(env_id: str, seed: int, steps: int) -> tuple[Any, np.ndarray]:
    """An env reset with ``seed`` and stepped ``steps`` times with sampled actions."""
    env = make(env_id)
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    for _ in range(steps):
        obs, *_ = env.step(env.action_space.sample())
    return env, obs


# ---- snapshot / restore -------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", CLASSIC)
def test_restored_state_replays_the_original_continuation(env_id: str) -> None:
    env, obs = played_env(env_id, seed=3, steps=7)
    snap = snapshot(env)  # the observation is computed from the state ...
    assert snap.method == "classic_control"
    assert np.array_equal(snap.observation, obs)  # ... and equals what the env returned
    assert snap.elapsed_steps == 7
    actions = [env.action_space.sample() for _ in range(400)]
    original = play(env, actions)
    assert len(original) > 5
    for _ in range(2):  # G restores of one snapshot, into fresh envs: all identical to the original
        other = make(env_id)
        assert np.array_equal(restore(other, snap), obs)
        assert same(play(other, actions), original)
        other.close()
    if env_id == "Pendulum-v1":  # TimeLimit counter restored: truncated where the original was
        assert len(original) == 200 - 7
        assert original[-1][3]
    env.close()


def test_stochastic_transitions_repeat_because_the_generator_is_restored() -> None:
    env, _ = played_env("Acrobot-v1", seed=0, steps=5)
    snap = snapshot(env)
    actions = [1] * 60
    original = play(env, actions)
    other = make("Acrobot-v1")
    restore(other, snap)
    assert same(play(other, actions), original)
    restore(other, snap)
    other.unwrapped.np_random = np.random.default_rng(123)  # same state, other noise
    assert not same(play(other, actions), original)


def test_reset_time_limit_gives_a_fresh_time_budget() -> None:
    env, _ = played_env("Pendulum-v1", seed=1, steps=190)
    snap = snapshot(env)
    other = make("Pendulum-v1")
    restore(other, snap)
    assert len(play(other, [np.zeros(1, np.float32)] * 300)) == 10
    restore(other, snap, reset_time_limit=True)
    assert len(play(other, [np.zeros(1, np.float32)] * 300)) == 200


class RandomWalk(gym.Env[np.ndarray, int]):
    """A pure-Python env unknown to `snapshot`: position, step counter and its own noise."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos, self.t = float(self.np_random.normal()), 0
        return self._get_obs(), {}

    def _get_obs(self) -> np.ndarray:
        return np.array([self.pos, self.t], np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.pos += (action - 1) * 0.1 + 0.05 * float(self.np_random.normal())
        self.t += 1
        return self._get_obs(), -abs(self.pos), abs(self.pos) > 2, self.t >= 50, {}


def test_deepcopy_only_when_asked_and_restored_in_place() -> None:
    env = RandomWalk()
    env.reset(seed=4)
    for _ in range(5):
        obs, *_ = env.step(2)
    with pytest.raises(SnapshotError, match=r"no exact snapshot method for .*RandomWalk.*method='deepcopy'"):
        snapshot(env)  # never a silent deepcopy
    snap = snapshot(env, method="deepcopy")
    assert snap.method == "deepcopy"
    assert np.array_equal(snap.observation, obs)
    actions = [0, 2, 1] * 20
    original = play(env, actions)
    other = RandomWalk()
    for _ in range(2):
        assert np.array_equal(restore(other, snap), obs)
        assert same(play(other, actions), original)
    # wrapped by gym.make-style wrappers: the chain is restored layer by layer
    wrapped = gym.wrappers.TimeLimit(RandomWalk(), 30)
    wrapped.reset(seed=0)
    wrapped.step(1)
    snap = snapshot(wrapped, method="deepcopy")
    first = play(wrapped, actions)
    target = gym.wrappers.TimeLimit(RandomWalk(), 30)
    restore(target, snap)
    assert same(play(target, actions), first)
    assert len(first) == 29  # the TimeLimit counter came with the copy


def mujoco_env(env_id: str) -> Any:
    pytest.importorskip("mujoco")
    try:
        return gym.make(env_id)
    except (ImportError, gym.error.DependencyNotInstalled) as e:  # e.g. imageio for the renderer
        pytest.skip(f"{env_id} needs {e}")


def test_mujoco_state_replays_contacts_exactly() -> None:
    env = mujoco_env("HalfCheetah-v5")  # never terminates; feet and body hit the floor
    env.reset(seed=0)
    env.action_space.seed(0)
    for _ in range(20):
        obs, *_ = env.step(env.action_space.sample())
    snap = snapshot(env)
    assert snap.method == "mujoco"
    assert np.array_equal(snap.observation, obs)
    assert snap.state["physics"][0] > 0  # MuJoCo's integration state starts with the time
    assert "_np_random" in snap.state["python"]
    actions = [env.action_space.sample() for _ in range(150)]
    original = play(env, actions)
    assert len(original) == 150
    for _ in range(2):
        other = mujoco_env("HalfCheetah-v5")
        assert np.array_equal(restore(other, snap), obs)
        assert same(play(other, actions), original)
    with pytest.raises(ValueError, match=r"mismatched observation spaces"):
        restore(mujoco_env("Hopper-v5"), snap)
    with pytest.raises(ValueError, match=r"snapshot is of a .*HalfCheetahEnv, the env is a .*Walker2dEnv"):
        restore(mujoco_env("Walker2d-v5"), snap)  # same spaces, another model


# ---- SnapshotReset and the store ----------------------------------------------------------------
def cartpole_store(
    n: int, store: SnapshotStore | None = None, first_seed: int = 0
) -> tuple[SnapshotStore, list[Any]]:
    """Snapshots of CartPole states reached by playing; also returns deep copies of those states
    (the original envs at snapshot time) to play the original continuations from."""
    store = SnapshotStore() if store is None else store
    originals = []
    for s in range(first_seed, first_seed + n):
        env, obs = played_env("CartPole-v1", seed=s, steps=6)
        assert store.capture(env, observation=obs) == len(store) - 1
        originals.append(copy.deepcopy(env))
    return store, originals


def test_episode_policy_groups_from_snapshots_replay_the_originals() -> None:
    store, originals = cartpole_store(3)
    torch.manual_seed(0)
    policy = EpisodePolicy(
        lambda: SnapshotReset(gym.make("CartPole-v1"), store), categorical_mlp(4, 2, hidden=(16,))
    )
    assert policy.check_group_reset  # the default check runs, and passes
    groups = policy.generate_actions([2, 0, 1], 4)
    for seed, group in zip([2, 0, 1], groups, strict=True):
        for e in group:
            assert e.seed == seed
            assert torch.equal(e.observations[0], torch.from_numpy(store[seed].observation))
            # the original env, continued with this episode's actions, gives this episode
            env = copy.deepcopy(originals[seed])
            steps = play(env, [int(a) for a in e.actions[: e.length]])
            assert len(steps) == e.length
            assert np.array_equal(np.stack([s[0] for s in steps[:-1]]), e.observations[1 : e.length].numpy())
            assert [s[1] for s in steps] == e.rewards[: e.length].tolist()
            assert steps[-1][2] == e.terminated
    assert len({tuple(e.actions[:8].tolist()) for e in groups[1]}) > 1  # the G episodes differ
    # a GRPO step on snapshot states, with a reference copy (kl) that never plays
    config = GRPOConfig(group_size=4, batch_size=3, kl_coeff=0.05, num_epochs_per_update=2, seed=0)
    metrics = GRPOTrainer(config, policy, EpisodeReturn()).step([0, 1, 2])
    assert np.isfinite(metrics["loss/total"])
    returns = evaluate_episodes(policy, lambda: SnapshotReset(gym.make("CartPole-v1"), store), [0, 1, 2])
    assert returns.shape == (3,)
    policy.close()


def test_snapshot_reset_is_a_gymnasium_wrapper() -> None:
    store, _ = cartpole_store(2)
    env = SnapshotReset(gym.make("CartPole-v1"), store)
    assert isinstance(env, SnapshotReset)
    assert isinstance(env, gym.Wrapper)
    assert str(env).startswith("<SnapshotReset<TimeLimit<")
    outer = gym.wrappers.RecordEpisodeStatistics(env)  # other wrappers can wrap it
    obs, info = outer.reset(seed=1)
    assert np.array_equal(obs, store[1].observation)
    assert info["snapshot"] == 1
    assert env.last_index == 1
    obs, *_ = outer.step(0)
    assert np.array_equal(outer.reset()[0], store[1].observation)  # no seed: the last snapshot
    fresh = SnapshotReset(gym.make("CartPole-v1"), store)  # restore() works through the wrapper too
    assert np.array_equal(restore(fresh, store[0]), store[0].observation)
    restore(env, store[0])
    assert np.array_equal(fresh.step(1)[0], env.step(1)[0])
    for clone in (copy.deepcopy(env), pickle.loads(pickle.dumps(env))):
        assert isinstance(clone, gym.Wrapper)
        assert np.array_equal(clone.reset(seed=0)[0], store[0].observation)
    # a snapshot taken through an observation wrapper needs the observation it returned
    scaled = gym.wrappers.TransformObservation(gym.make("CartPole-v1"), lambda o: 2 * o, None)
    obs, _ = scaled.reset(seed=0)
    with pytest.raises(ValueError, match=r"change what the env observes.*Pass observation="):
        snapshot(scaled)
    i = store.capture(scaled, observation=obs)
    assert np.array_equal(store[i].observation, obs)


def test_store_in_a_directory_serves_async_workers(tmp_path: Path) -> None:
    store, _ = cartpole_store(2, SnapshotStore(tmp_path / "snaps"))
    torch.manual_seed(0)
    policy = EpisodePolicy(
        lambda: SnapshotReset(gym.make("CartPole-v1"), store),
        categorical_mlp(4, 2, hidden=(8,)),
        vectorization_mode="async",
    )
    (group,) = policy.generate_actions([1], 2)
    assert all(torch.equal(e.observations[0], torch.from_numpy(store[1].observation)) for e in group)
    cartpole_store(1, store, first_seed=7)  # added after the workers started: read from disk
    (group,) = policy.generate_actions([2], 2)
    assert torch.equal(group[0].observations[0], torch.from_numpy(store[2].observation))
    policy.close()
    reopened = SnapshotStore(tmp_path / "snaps")  # the directory persists
    assert len(reopened) == 3
    assert np.array_equal(reopened[2].observation, store[2].observation)
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [
        f"snapshot-{i:09d}.pkl" for i in range(3)
    ]


def test_memory_store_in_async_workers_names_the_fix() -> None:
    store, _ = cartpole_store(1)
    policy = EpisodePolicy(
        lambda: SnapshotReset(gym.make("CartPole-v1"), store),
        categorical_mlp(4, 2, hidden=(8,)),
        vectorization_mode="async",
        check_group_reset=False,
    )
    policy.generate_actions([0], 2)
    cartpole_store(1, store, first_seed=5)
    with warnings.catch_warnings():  # gymnasium also reports the worker's error as a UserWarning
        warnings.simplefilter("ignore")
        with pytest.raises(
            IndexError, match=r"snapshot 1 is not in the store.*copy.*SnapshotStore\(directory="
        ):
            policy.generate_actions([1], 2)
    policy.close()


# ---- errors -------------------------------------------------------------------------------------
class Unpicklable(RandomWalk):
    """Holds a generator object: no known state, and copy.deepcopy fails."""

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        self.stream = (i for i in range(3))
        return super().reset(seed=seed)


def test_errors_name_the_problem(tmp_path: Path) -> None:
    store, _ = cartpole_store(2)
    env = SnapshotReset(gym.make("CartPole-v1"), store)
    with pytest.raises(ValueError, match=r"needs seed=<snapshot index>.*none was restored yet"):
        env.reset()
    with pytest.raises(IndexError, match=r"snapshot 7 is not in the store \(2 snapshot\(s\): indices 0..1\)"):
        env.reset(seed=7)
    with pytest.raises(IndexError, match=r"the store.*is empty"):
        SnapshotReset(gym.make("CartPole-v1"), SnapshotStore()).reset(seed=0)
    with pytest.raises(TypeError, match=r"non-negative int; got -1"):
        store[-1]
    with pytest.raises(TypeError, match=r"not a factory"):
        SnapshotReset(lambda: gym.make("CartPole-v1"), store)
    with pytest.raises(TypeError, match=r"needs a grpo.gym.resets.SnapshotStore; got list"):
        SnapshotReset(gym.make("CartPole-v1"), [])  # type: ignore[arg-type]
    # an env that cannot be snapshotted
    bad = Unpicklable()
    bad.reset(seed=0)
    with pytest.raises(SnapshotError, match=r"cannot snapshot .*Unpicklable.*copy.deepcopy\(env\) failed"):
        snapshot(bad, method="deepcopy")
    with pytest.raises(SnapshotError, match=r"method='mujoco' needs .*mujoco.MjModel"):
        snapshot(gym.make("CartPole-v1"), method="mujoco")
    with pytest.raises(SnapshotError, match=r"method='classic_control' needs"):
        snapshot(RandomWalk(), method="classic_control")
    with pytest.raises(ValueError, match=r"no state yet; call env.reset\(\) first"):
        snapshot(gym.make("CartPole-v1"))
    # mismatched spaces, classes, shapes and chains
    with pytest.raises(ValueError, match=r"mismatched observation spaces.*CartPoleEnv.*PendulumEnv"):
        restore(gym.make("Pendulum-v1"), store[0])
    mc, _ = played_env("MountainCar-v0", seed=0, steps=1)
    mc_snap = snapshot(mc)
    with pytest.raises(ValueError, match=r"mismatched action spaces"):
        restore(gym.make("MountainCarContinuous-v0"), mc_snap)
    with pytest.raises(ValueError, match=r"observation has shape \(3,\).*shape \(4,\)"):
        snapshot(played_env("CartPole-v1", 0, 1)[0], observation=np.zeros(3))
    walk = RandomWalk()
    walk.reset(seed=0)
    with pytest.raises(ValueError, match=r"same wrapper chain"):
        restore(gym.wrappers.TimeLimit(RandomWalk(), 10), snapshot(walk, method="deepcopy"))
    with pytest.raises(TypeError, match=r"expects a grpo.gym.resets.Snapshot; got dict"):
        restore(gym.make("CartPole-v1"), {})  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match=r"cannot be pickled"):
        SnapshotStore(tmp_path).add(
            Snapshot("deepcopy", np.zeros(2), None, None, "x", ("x",), None, {"f": lambda: 0})
        )


def test_import_does_not_import_gymnasium() -> None:
    code = "import sys, grpo.gym.resets; assert 'gymnasium' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- grouping by nearest start states -----------------------------------------------------------
def test_group_by_nearest_start_recovers_shuffled_clusters() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, 3)) * 10
    points = np.repeat(centres, 4, 0) + 0.01 * rng.normal(size=(24, 3))
    perm = rng.permutation(24)
    groups = group_by_nearest_start(points[perm], 4)
    assert groups.shape == (6, 4)
    assert groups.dtype == np.int64
    assert sorted(groups.ravel().tolist()) == list(range(24))
    clusters = {frozenset((perm[row] // 4).tolist()) for row in groups}
    assert clusters == {frozenset([c]) for c in range(6)}  # every group is one cluster
    assert np.array_equal(groups, group_by_nearest_start(points[perm], 4))  # deterministic
    assert np.array_equal(group_by_nearest_start(torch.tensor(points[perm]), 4), groups)
    with pytest.raises(ValueError, match=r"24 episodes do not split into groups of 5"):
        group_by_nearest_start(points, 5)
    with pytest.raises(ValueError, match=r"must be \(N, d\)"):
        group_by_nearest_start(np.zeros((4, 2, 2)), 2)


def test_grouping_stats_on_hand_made_cases() -> None:
    rng = np.random.default_rng(1)
    starts = np.repeat(rng.normal(size=(8, 2)), 4, 0)  # 8 groups, equal starts within each
    groups = np.arange(32).reshape(8, 4)
    noise = rng.normal(size=32)
    stats = grouping_stats(starts, noise, groups)
    assert stats["start_dist_within"] == 0.0
    assert stats["start_dist_ratio"] == 0.0
    assert stats["start_share"] == 0.0  # nothing to explain: real resets
    assert stats["return_std_within"] == pytest.approx(
        np.sqrt(((noise.reshape(8, 4) - noise.reshape(8, 4).mean(1, keepdims=True)) ** 2).sum() / 24)
    )
    # random starts, returns a quadratic function of the start: fully explained
    starts = rng.normal(size=(64, 2))
    returns = 3 * starts[:, 0] - starts[:, 1] ** 2
    random_groups = np.arange(64).reshape(16, 4)
    stats = grouping_stats(starts, returns, random_groups)
    assert stats["start_share"] == pytest.approx(1.0)
    assert stats["start_share_degree"] == 2.0
    assert stats["start_dist_ratio"] == pytest.approx(1.0, abs=0.15)
    assert grouping_stats(starts, returns, random_groups, degree=1)["start_share"] < 0.95
    # returns independent of the start: the adjusted share stays near 0
    shares = [grouping_stats(starts, rng.normal(size=64), random_groups)["start_share"] for _ in range(20)]
    assert np.mean(shares) < 0.08
    with pytest.raises(ValueError, match=r"every episode index 0..63 once"):
        grouping_stats(starts, returns, np.zeros((16, 4)))
    with pytest.raises(ValueError, match=r"64 start observations but 3 returns"):
        grouping_stats(starts, [1.0, 2.0, 3.0], random_groups)


def pendulum_batch(grouping: str) -> tuple[NearestStartPolicy, list[list[Any]]]:
    torch.manual_seed(0)
    policy = NearestStartPolicy(
        "Pendulum-v1",
        gaussian_mlp(3, 1, hidden=(16,)),
        grouping=grouping,
        max_steps=100,  # type: ignore[arg-type]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = policy.generate_actions(list(range(16)), 8)
        if grouping == "random":  # start_share > 0.5 again: warned once per policy, not every step
            stats = policy.last_grouping_stats
            policy.generate_actions(list(range(16, 32)), 8)
            assert policy.last_grouping_stats["start_share"] > 0.5
            policy.last_grouping_stats = stats
    policy.close()
    assert [w.category for w in caught] == ([StartStateBiasWarning] if grouping == "random" else [])
    if caught:
        assert "start states explain 8" in str(caught[0].message)
    return policy, groups


def test_nearest_start_groups_lower_the_diagnostic_on_pendulum() -> None:
    """Pendulum starts anywhere on the circle: the start decides most of a random policy's return.
    Nearest-start groups (B*G = 128 starts) shrink the within-group start distance and the share of
    the within-group return variance that the start explains, relative to groups of random starts."""
    nearest, groups = pendulum_batch("nearest")
    random, random_groups = pendulum_batch("random")
    n, r = nearest.last_grouping_stats, random.last_grouping_stats
    assert r["start_dist_ratio"] == pytest.approx(1.0, abs=0.1)
    assert n["start_dist_ratio"] < 0.4
    assert r["start_share"] > 0.8  # groups of random starts: mostly start-state noise (warned)
    assert n["start_share"] < r["start_share"] - 0.3
    assert n["start_share_random"] == pytest.approx(r["start_share"])  # same batch, other grouping
    assert n["return_std_within"] < 0.5 * r["return_std_within"]
    assert n["num_episodes"] == 128
    episodes = [e for g in groups for e in g]
    assert len(groups) == 16
    assert all(len(g) == 8 for g in groups)
    assert len({e.seed for e in episodes}) == 128  # independent starts
    assert len({tuple(e.observations[0].tolist()) for e in episodes}) == 128
    assert nearest.env_steps == sum(e.length for e in episodes) == 128 * 100
    # the same episodes, only regrouped
    assert {e.seed for e in episodes} == {e.seed for g in random_groups for e in g}
    print(f"pendulum diagnostic: nearest {n}, random {r}")


def test_nearest_start_policy_learns_cartpole() -> None:
    eval_seeds = list(range(10_000, 10_010))
    torch.manual_seed(0)
    policy = NearestStartPolicy("CartPole-v1", categorical_mlp(4, 2, hidden=(16,)), max_steps=100)
    before = evaluate_episodes(policy, "CartPole-v1", eval_seeds, max_steps=100).mean()
    config = GRPOConfig(
        group_size=8, batch_size=4, learning_rate=0.02, num_epochs_per_update=4, kl_coeff=0.01, seed=0
    )
    trainer = GRPOTrainer(config, policy, EpisodeReturn())
    rng = np.random.default_rng(0)
    rewards, shares = [], []
    for _ in range(6):
        rewards.append(trainer.step(rng.integers(0, 2**20, size=4).tolist())["reward/mean"])
        shares.append(policy.last_grouping_stats["start_share"])
    after = evaluate_episodes(policy, "CartPole-v1", eval_seeds, max_steps=100).mean()
    policy.close()
    assert isinstance(trainer.reference_policy, NearestStartPolicy)
    assert np.mean(rewards[-2:]) > 1.5 * np.mean(rewards[:2]), rewards
    assert after > before + 30, (before, after)
    assert max(shares) < 0.5  # CartPole's starts are all near upright: little start-state noise
    print(f"cartpole greedy return {before:.1f} -> {after:.1f}; rewards {rewards}; start_share {shares}")
