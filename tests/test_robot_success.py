"""Issue 45 groundwork without MetaWorld: the replay check refuses an incomplete snapshot, seeded
starts on an env whose reset ignores its seed, success as reward / episode end / metric, and
evaluation with a reused pool of envs."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.gym.episodes import Episode, EpisodePolicy, EpisodeReturn, evaluate_policy, run_episodes  # noqa: E402
from grpo.gym.seeded_starts import SeededStarts, check_seeded_starts  # noqa: E402
from grpo.gym.snapshot_check import clear_replay_checks  # noqa: E402
from grpo.gym.snapshots import SnapshotError, restore, snapshot  # noqa: E402
from grpo.gym.success import EndOnSuccess, EpisodeSuccess, LengthBiasWarning, info_success  # noqa: E402
from grpo.gym.vector_env import GymVectorEnvironment  # noqa: E402
from grpo.policies import gaussian_mlp  # noqa: E402
from grpo.rollout.action_stats import success_metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDER = """<mujoco><worldbody><body name="b"><joint name="x" type="slide" axis="1 0 0"/>
<geom type="sphere" size="0.1" mass="1"/></body></worldbody>
<actuator><motor joint="x" gear="1"/></actuator></mujoco>"""


class Wind:
    """Python-side state held in an object, not plain data: the ``"mujoco"`` method cannot see it."""

    def __init__(self) -> None:
        self.phase = 0


class WindySlider(gym.Env[np.ndarray, np.ndarray]):
    """A real MuJoCo model (one sliding ball) pushed by a wind whose phase lives in a `Wind` object."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, hide_wind: bool = True) -> None:
        import mujoco

        self.mj = mujoco
        self.model = mujoco.MjModel.from_xml_string(SLIDER)
        self.data = mujoco.MjData(self.model)
        self.hide_wind = hide_wind

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.mj.mj_resetData(self.model, self.data)
        self.wind: Any = Wind() if self.hide_wind else 0
        return self._obs(), {}

    def _obs(self) -> np.ndarray:
        return np.concatenate([self.data.qpos, self.data.qvel]).copy()

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.hide_wind:
            self.wind.phase += 1
            phase = self.wind.phase
        else:
            self.wind += 1
            phase = self.wind
        self.data.ctrl[0] = float(action[0]) + math.sin(phase)
        self.mj.mj_step(self.model, self.data)
        x = float(self.data.qpos[0])
        return self._obs(), -abs(x), False, False, {"success": abs(x) < 1e-3}


def test_replay_check_refuses_a_snapshot_that_misses_python_state() -> None:
    """The core regression: the "mujoco" method holds MuJoCo's state and plain attributes; a phase
    kept in an object escapes it, and the replay check refuses instead of replaying wrongly."""
    pytest.importorskip("mujoco")
    clear_replay_checks()
    env = WindySlider()
    env.reset(seed=0)
    for _ in range(3):
        obs, *_ = env.step(np.array([0.5], np.float32))
    with pytest.raises(
        SnapshotError, match=r"not exact for .*WindySlider.*step 0.*does not hold: \['mj', 'wind'\]"
    ):
        snapshot(env, observation=obs)
    with pytest.raises(SnapshotError, match=r"not exact"):  # the verdict is cached: refused again
        snapshot(env, observation=obs)
    # the same env with its phase as a plain int: exact, and a restore into another env replays bitwise
    plain = WindySlider(hide_wind=False)
    plain.reset(seed=0)
    for _ in range(3):
        obs, *_ = plain.step(np.array([0.5], np.float32))
    snap = snapshot(plain, observation=obs, check="always")
    assert snap.method == "mujoco"
    assert snap.state["python"]["wind"] == 3
    actions = [np.array([a], np.float32) for a in np.linspace(-1, 1, 20)]
    original = [plain.step(a)[:2] for a in actions]
    other = WindySlider(hide_wind=False)
    other.reset(seed=1)
    restore(other, snap)
    replay = [other.step(a)[:2] for a in actions]
    assert all(
        a[0].tobytes() == b[0].tobytes() and a[1] == b[1] for a, b in zip(original, replay, strict=True)
    )


class IgnoresSeed(gym.Env[np.ndarray, np.ndarray]):
    """A pure-Python env whose reset ignores its seed (like MetaWorld's): it draws from its own
    generator, made once at construction."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self) -> None:
        self.rng = np.random.default_rng()

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        self.pos, self.goal = self.rng.uniform(-1, 1, 2)
        self.t = 0
        return np.array([self.pos, self.goal]), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.pos += 0.2 * float(np.clip(action[0], -1, 1)) + 0.01 * self.rng.normal()
        self.t += 1
        done = abs(self.pos - self.goal) < 0.1
        return (
            np.array([self.pos, self.goal]),
            -abs(self.pos - self.goal),
            False,
            self.t >= 20,
            {"success": done},
        )


def seed_rng(env: Any, seed: int) -> None:
    env.rng = np.random.default_rng(seed)


def test_seeded_starts_make_a_seed_a_start() -> None:
    raw = IgnoresSeed()
    assert not np.array_equal(raw.reset(seed=0)[0], raw.reset(seed=0)[0])  # the problem
    env = SeededStarts(IgnoresSeed(), seed_rng)
    assert isinstance(env, gym.Wrapper)
    check_seeded_starts(env, (3, 3, 4))
    with pytest.raises(ValueError, match=r"two different starts"):
        check_seeded_starts(SeededStarts(IgnoresSeed(), lambda e, s: None), (0, 0))
    a, info = env.reset(seed=5)
    assert info["start_seed"] == 5
    assert env.last_seed == 5
    steps_a = [env.step(np.array([0.3], np.float32))[0] for _ in range(5)]
    b, _ = SeededStarts(IgnoresSeed(), seed_rng).reset(seed=5)  # another instance, same start
    assert a.tobytes() == b.tobytes()
    env.reset(seed=5)
    assert all(env.step(np.array([0.3], np.float32))[0].tobytes() == s.tobytes() for s in steps_a)
    assert env.reset()[0].tobytes() == a.tobytes()  # no seed (autoreset): the last start again
    with pytest.raises(ValueError, match=r"needs seed=<start seed> the first time"):
        SeededStarts(IgnoresSeed(), seed_rng).reset()
    with pytest.raises(TypeError, match=r"needs a function start\(env, seed\)"):
        SeededStarts(IgnoresSeed(), 3)  # type: ignore[arg-type]
    # EpisodePolicy's equal-start check passes with it (and fails without it)
    torch.manual_seed(0)
    policy = EpisodePolicy(lambda: SeededStarts(IgnoresSeed(), seed_rng), gaussian_mlp(2, 1, hidden=(8,)))
    policy.generate_actions([1, 2], 3)
    bare = EpisodePolicy(IgnoresSeed, gaussian_mlp(2, 1, hidden=(8,)))
    with pytest.raises(ValueError, match=r"did not start from the same observation"):
        bare.generate_actions([1], 3)


def test_end_on_success_binary_reward_and_the_success_rate_metric() -> None:
    env = EndOnSuccess(SeededStarts(IgnoresSeed(), seed_rng))
    obs, _ = env.reset(seed=0)
    toward = np.array([np.sign(obs[1] - obs[0])], np.float32)
    rewards, ended = [], False
    for _ in range(20):
        _, r, term, trunc, info = env.step(toward)
        rewards.append(r)
        if term or trunc:
            ended = term
            break
    assert ended
    assert rewards[-1] == 1.0
    assert set(rewards[:-1]) <= {0.0}
    assert "env_reward" in info
    assert info_success({"is_success": np.array(1.0)}) is True
    assert info_success({}) is None
    # G episodes per start; success flags on the episodes; the metric equals the hand count
    torch.manual_seed(0)
    policy = EpisodePolicy(
        lambda: EndOnSuccess(SeededStarts(IgnoresSeed(), seed_rng)), gaussian_mlp(2, 1, hidden=(8,))
    )
    groups = policy.generate_actions([0, 1, 2, 3], 4)
    episodes = [e for g in groups for e in g]
    assert all(isinstance(e.success, bool) for e in episodes)
    for e in episodes:  # binary reward: the return is the success
        assert e.episode_return == (1.0 if e.success else 0.0)
        assert e.terminated == e.success
    by_hand = sum(e.episode_return for e in episodes) / 16
    assert 0 < by_hand < 1
    assert success_metrics(episodes) == {"episode/success_rate": by_hand}
    assert torch.equal(
        EpisodeSuccess().compute_rewards(None, episodes), torch.tensor([e.episode_return for e in episodes])
    )
    config = GRPOConfig(group_size=4, batch_size=4, seed=0)
    with pytest.warns(LengthBiasWarning):  # whole-episode success with token-mean (the next test)
        metrics = GRPOTrainer(config, policy, EpisodeReturn()).step([0, 1, 2, 3])
    assert 0.0 <= metrics["episode/success_rate"] <= 1.0
    assert metrics["episode/success_rate"] == metrics["reward/mean"]  # binary reward: same number
    # envs that report nothing: no flag, no metric, and EpisodeSuccess refuses
    silent = Episode(
        0, torch.zeros(1, 2), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, dtype=torch.bool), False
    )
    assert silent.success is None
    assert success_metrics([silent]) == {}
    assert success_metrics(torch.zeros(3)) == {}
    with pytest.raises(ValueError, match=r"episode 0 \(of 1\) has no success flag"):
        EpisodeSuccess().compute_rewards(None, [silent])
    quiet = EndOnSuccess(gym.make("Pendulum-v1"))
    quiet.reset(seed=0)
    with pytest.raises(ValueError, match=r"holds none of \['success', 'is_success'\]"):
        quiet.step(np.zeros(1, np.float32))


def test_evaluation_reuses_a_pool_of_envs_and_reports_success_with_its_stderr() -> None:
    built = []

    def make() -> Any:
        built.append(1)
        return SeededStarts(IgnoresSeed(), seed_rng)

    torch.manual_seed(0)
    net = gaussian_mlp(2, 1, hidden=(8,))
    seeds = list(range(100, 137))  # 37 episodes
    result = evaluate_policy(net, make, seeds, num_envs=8)
    assert len(built) == 8  # ceil(37 / 8) = 5 rounds of ceil(37 / 5) = 8 envs: 8 built, not 37
    assert result.returns.shape == (37,)
    assert result.successes is not None
    assert result.successes.shape == (37,)
    # each episode equals the same seed played alone (env reuse changes nothing)
    alone = evaluate_policy(net, make, [seeds[0], seeds[17], seeds[36]], num_envs=1)
    # (equal up to float rounding: the policy's forward runs on 1 row here, on 8 there)
    assert alone.returns.tolist() == pytest.approx(result.returns[[0, 17, 36]].tolist(), rel=1e-5)
    assert alone.lengths.tolist() == result.lengths[[0, 17, 36]].tolist()
    p = result.successes.mean()
    assert result.success_rate == p
    assert result.success_stderr == pytest.approx(
        np.std(result.successes.astype(float), ddof=1) / math.sqrt(37)
    )
    assert result.success_stderr == pytest.approx(math.sqrt(p * (1 - p) / 36))
    quiet = evaluate_policy(gaussian_mlp(3, 1), "Pendulum-v1", [0, 1, 2], num_envs=2, max_steps=5)
    assert quiet.successes is None
    assert quiet.success_rate is None
    assert quiet.success_stderr is None
    with pytest.raises(ValueError, match=r"num_envs=0.*integer >= 1"):
        evaluate_policy(net, make, seeds, num_envs=0)


class PlainStep:
    """A vector env behind the `Environment` protocol's plain ``step(actions)``: every sub-env steps."""

    def __init__(self, envs: Any) -> None:
        self.inner = GymVectorEnvironment(envs)
        self.num_envs = self.inner.num_envs

    def reset(self, starts: Any) -> torch.Tensor:
        return self.inner.reset(starts)

    def step(self, actions: torch.Tensor) -> Any:
        return self.inner.step(actions)


def test_ended_sub_envs_are_not_stepped_and_the_episodes_stay_the_same() -> None:
    """A sync vector env steps only the sub-envs still playing: one ``env.step`` per real step (the
    vector env's own step ran all 16 until the batch's last episode ended), the same episodes."""
    calls = []

    class Counted(gym.Wrapper):  # type: ignore[misc, name-defined, unused-ignore]
        def step(self, action: Any) -> Any:
            calls.append(1)
            return self.env.step(action)

    torch.manual_seed(0)
    policy = EpisodePolicy(
        lambda: Counted(EndOnSuccess(SeededStarts(IgnoresSeed(), seed_rng))), gaussian_mlp(2, 1)
    )
    torch.manual_seed(1)
    episodes = [e for g in policy.generate_actions([0, 1, 2, 3], 4) for e in g]
    lengths = [e.length for e in episodes]
    assert len(set(lengths)) > 1  # some end early (success), others run to the limit of 20
    assert len(calls) == sum(lengths) == policy.env_steps
    calls.clear()
    torch.manual_seed(1)
    every = run_episodes(
        policy.policy, PlainStep(policy.vector_envs(16)), [s for s in range(4) for _ in range(4)]
    )
    # the plain step: a sub-env that ended early is reset by the next step (autoreset) and stepped on
    assert len(calls) > sum(lengths) + 16
    for a, b in zip(episodes, every, strict=True):
        assert (a.success, a.terminated) == (b.success, b.terminated)
        for x, y in [
            (a.observations, b.observations),
            (a.actions, b.actions),
            (a.rewards, b.rewards),
            (a.mask, b.mask),
        ]:
            assert torch.equal(x, y)
    policy.close()


def test_length_bias_warning_where_whole_episode_success_meets_a_length_weighted_loss() -> None:
    """EndOnSuccess ends successes early; a whole-episode reward with token-mean then pushes against
    success (grpo.gym.success's docstring): warned once, with the measured net weight; per-step
    credit and seq-mean-token-mean are not warned."""
    import warnings

    from grpo.gym.episodes import EpisodeRewards
    from grpo.gym.success import length_bias

    # by hand: groups (1, 0) with lengths (5, 20) and (0, 1) with (20, 10): A = +-0.5,
    # sum_i A_i L_i = 2.5 - 10 - 10 + 5 = -12.5 over sum L = 55
    bias = length_bias(
        torch.tensor([1.0, 0, 0, 1]), torch.tensor([5, 20, 20, 10]), torch.tensor([0, 0, 1, 1])
    )
    assert bias == pytest.approx(-12.5 / 55)
    assert length_bias(torch.tensor([1.0, 0]), torch.tensor([9, 9]), torch.tensor([3, 3])) == 0.0

    def trainer(reward: Any, aggregation: str) -> GRPOTrainer:
        torch.manual_seed(0)
        policy = EpisodePolicy(
            lambda: EndOnSuccess(SeededStarts(IgnoresSeed(), seed_rng)), gaussian_mlp(2, 1, hidden=(8,))
        )
        config = GRPOConfig(group_size=4, batch_size=4, seed=0, loss_aggregation=aggregation)  # type: ignore[arg-type]
        return GRPOTrainer(config, policy, reward)

    for reward in (EpisodeReturn(), EpisodeSuccess()):
        biased = trainer(reward, "token-mean")
        with pytest.warns(LengthBiasWarning, match=r"net weight sum_i A_i L_i / sum_i L_i is -\d.*< 0"):
            biased.step([0, 1, 2, 3])
        with warnings.catch_warnings():  # once per reward
            warnings.simplefilter("error", LengthBiasWarning)
            biased.step([0, 1, 2, 3])
    settings: list[tuple[Any, str]] = [
        (EpisodeRewards(), "token-mean"),
        (EpisodeSuccess(), "seq-mean-token-mean"),
    ]
    for reward, aggregation in settings:
        with warnings.catch_warnings():
            warnings.simplefilter("error", LengthBiasWarning)
            metrics = trainer(reward, aggregation).step([0, 1, 2, 3])
        assert 0.0 < metrics["episode/success_rate"] < 1.0  # mixed groups: the case that would warn


def test_finetune_success_recipe_trains_on_success_without_the_length_bias() -> None:
    """GRPOConfig.recipe("finetune_success"): a fixed rate (no adaptive fall to 1e-5), clip-higher,
    back-fill; per-step credit on an env ending on success trains without a LengthBiasWarning."""
    import warnings

    from grpo.gym.episodes import EpisodeRewards

    config = GRPOConfig.recipe("finetune_success", seed=0)
    assert (config.learning_rate, config.adaptive_lr_kl, config.group_size) == (3e-4, None, 8)
    # B = 2 starts an update (the sweep's choice), one group per optimizer step: 4 epochs x 2 = 8
    assert (config.batch_size, config.mini_batch_size, config.num_epochs_per_update) == (2, 1, 4)
    assert (config.clip_epsilon, config.clip_epsilon_high, config.loss_aggregation) == (
        0.2,
        0.28,
        "token-mean",
    )
    torch.manual_seed(0)
    policy = EpisodePolicy(
        lambda: EndOnSuccess(SeededStarts(IgnoresSeed(), seed_rng)), gaussian_mlp(2, 1, hidden=(8,))
    )
    trainer = GRPOTrainer(config, policy, EpisodeRewards())
    before = [p.detach().clone() for p in policy.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthBiasWarning)
        metrics = trainer.step([0, 1], more_states=iter([[2, 3], [4, 5], [6, 7]]).__next__)
    assert (config.drop_zero_variance_groups, config.max_sampling_draws) == (True, 4)
    assert 1 <= metrics["sampling/draws"] <= 4  # back-fill: new starts for all-equal groups
    assert 0.0 <= metrics["episode/success_rate"] <= 1.0
    assert trainer.optimizer is not None
    assert trainer.optimizer.param_groups[0]["lr"] == 3e-4
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
