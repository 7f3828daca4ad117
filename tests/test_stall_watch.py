"""No silent stalls: `grpo.training.stall_watch` warns with the numbers, `optim/update_ratio` is the real
size of the update, and `grpo.gym.exploration`'s bonus makes an all-fail task learn."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.engine.lr_schedules import schedule_length_problem
from grpo.policies import categorical_mlp
from grpo.reward_model_base import CombinedReward
from grpo.training.loop import train
from grpo.training.stall_watch import CONVERGED_ENTROPY, STALL_STEPS, StallWarning, StallWatch
from tests.conftest import ContextualBandit, bandit_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def _steps(
    trainer: GRPOTrainer, states: Callable[[], Any], n: int
) -> tuple[list[dict[str, float]], dict[int, str]]:
    """``n`` steps; their metrics and the StallWarnings raised, by (1-based) step."""
    history, warned = [], {}
    for i in range(1, n + 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history.append(trainer.step(states()))
        for w in caught:
            if issubclass(w.category, StallWarning):
                warned[i] = str(w.message)
    return history, warned


def _flat_weights(trainer: GRPOTrainer) -> Tensor:
    return torch.cat([p.detach().double().flatten() for p in trainer.params])


# ---- all groups equal ---------------------------------------------------------------------------
def test_a_constant_reward_warns_once_after_k_steps_with_the_value_and_the_remedy() -> None:
    """Every reward is -500 (Acrobot's cap): the advantages and, with kl_coeff = entropy_coeff = 0,
    the gradient are exactly 0. Nothing for K - 1 steps; at step K one warning naming the value,
    the zero gradient and the remedy; none after it while the stall goes on."""
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=0.1, seed=0)
    trainer = GRPOTrainer(config, bandit_policy(5), lambda s, a: torch.full((len(a),), -500.0))
    start = _flat_weights(trainer)
    for step in range(1, STALL_STEPS):
        with warnings.catch_warnings():
            warnings.simplefilter("error", StallWarning)  # not before K steps
            m = trainer.step(torch.zeros(4, 1))
        assert m["reward/frac_zero_std"] == 1.0
        assert m["advantage/min"] == m["advantage/max"] == 0.0
        assert m["optim/update_ratio"] == 0.0, step  # the weights did not move at all
    expected = (
        r"for the last 5 steps \(steps 1-5\) every group's rewards were equal \(all -500, the only "
        r"reward seen since step 1\), so every advantage is 0 and, with kl_coeff=0 and "
        r"entropy_coeff=0, so is the gradient: these steps teach nothing\..*EpisodeSpread"
    )
    with pytest.warns(StallWarning, match=expected):
        trainer.step(torch.zeros(4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StallWarning)  # once per stall
        for _ in range(3):
            trainer.step(torch.zeros(4, 1))
    assert torch.equal(_flat_weights(trainer), start)


def test_with_kl_and_entropy_terms_the_warning_names_the_gradient_left() -> None:
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=2, kl_coeff=0.04, entropy_coeff=0.01, seed=0)
    trainer = GRPOTrainer(config, bandit_policy(3), lambda s, a: torch.zeros(len(a)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StallWarning)
        for _ in range(STALL_STEPS - 1):
            trainer.step(torch.zeros(2, 1))
    match = (
        r"the only gradient left is the KL term's pull towards the reference policy "
        r"\(kl_coeff=0\.04\) and the entropy bonus's push towards uniform \(entropy_coeff=0\.01\)"
    )
    with pytest.warns(StallWarning, match=match):
        trainer.step(torch.zeros(2, 1))


def test_a_task_learned_to_perfection_is_solved_not_stalled(caplog: pytest.LogCaptureFixture) -> None:
    """A 0/1 task (arm 0 pays 1) that the policy learns until every sample succeeds: no
    StallWarning; at exactly the K-th consecutive step whose groups were all equal at the highest
    reward (found independently from the returned metrics) one INFO line says it is solved."""
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0, learning_rate=0.3, seed=0)
    trainer = GRPOTrainer(config, bandit_policy(3), lambda s, a: (a == 0).float())
    history, solved_at = [], []
    with caplog.at_level(logging.INFO, logger="grpo.training.stall_watch"):
        for i in range(1, 61):
            caplog.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error", StallWarning)
                history.append(trainer.step(torch.zeros(4, 1)))
            if "solved:" in caplog.text:
                solved_at.append(i)
                message = caplog.text
    run, expected_at = 0, None
    for i, m in enumerate(history, 1):
        run = run + 1 if m["reward/min"] == m["reward/max"] == 1.0 else 0
        if run == STALL_STEPS:
            expected_at = i
            break
    assert expected_at is not None, "the policy did not learn to always succeed"
    assert history[0]["reward/min"] == 0.0  # it started by failing sometimes
    assert solved_at[0] == expected_at
    assert "every sample reached the highest reward seen (all 1, the highest reward seen so far" in message


def test_all_fail_and_mixed_uniform_groups_are_told_apart() -> None:
    """The case is judged from the rewards seen before the stall."""

    def flat(value_lo: float, value_hi: float, step: int) -> dict[str, float]:
        return {"step": float(step), "reward/frac_zero_std": 1.0, "reward/min": value_lo,
                "reward/max": value_hi, "advantage/min": 0.0, "advantage/max": 0.0}  # fmt: skip

    watch = StallWatch(steps=2)
    watch.observe({"reward/frac_zero_std": 0.5, "reward/min": -200.0, "reward/max": -150.0})
    watch.observe(flat(-200.0, -200.0, 2))
    fail = r"all -200, the lowest reward seen so far \(earlier steps reached -150\).*Every sample fails"
    with pytest.warns(StallWarning, match=fail):
        watch.observe(flat(-200.0, -200.0, 3))
    watch.observe({"reward/frac_zero_std": 0.5, "reward/min": 0.0, "reward/max": 1.0})  # ends the stall
    watch.observe(flat(0.0, 1.0, 5))
    mixed = r"equal within each group but not across groups: from 0 to 1.*Each group either"
    with pytest.warns(StallWarning, match=mixed):
        watch.observe(flat(0.0, 1.0, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StallWarning)
        StallWatch(steps=None).observe(flat(0.0, 0.0, 1))  # None: never warns
    with pytest.raises(ValueError, match="steps=0"):
        StallWatch(steps=0)


def test_a_task_that_learns_never_warns(contextual: ContextualBandit) -> None:
    torch.manual_seed(0)
    config = GRPOConfig(group_size=8, batch_size=16, num_epochs_per_update=2, learning_rate=3e-3, seed=0)
    policy = contextual.policy(hidden=(32,))
    trainer = GRPOTrainer(config, policy, contextual.reward)
    before = contextual.score(policy)
    history, warned = _steps(trainer, lambda: contextual.states(16), 40)
    assert warned == {}
    assert contextual.score(policy) > before + 0.3  # it did learn
    assert all(m["optim/update_ratio"] > 1e-4 for m in history)


def bernoulli_arms(means: list[float], seed: int = 0) -> Callable[[Tensor, Tensor], Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.tensor(means)
    return lambda states, actions: torch.bernoulli(p[actions], generator=gen)


def test_a_converged_bandit_runs_long_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The small_policy preset on a 10-armed Bernoulli bandit (B = 1, G = 8): it learns the best
    arm (P > 0.95, policy/entropy below CONVERGED_ENTROPY), its updates become vanishingly small
    (optim/update_ratio < 1e-7 for K steps in a row: what warned before), and 400 steps raise no
    StallWarning; one INFO line says it converged."""
    torch.manual_seed(0)
    config = GRPOConfig.recipe("small_policy", group_size=8, batch_size=1, seed=0)
    policy = bandit_policy(10)
    means = [0.2, 0.3, 0.85, 0.4, 0.1, 0.5, 0.3, 0.2, 0.45, 0.35]
    trainer = GRPOTrainer(config, policy, bernoulli_arms(means))
    with caplog.at_level(logging.INFO, logger="grpo.training.stall_watch"):
        history, warned = _steps(trainer, lambda: torch.zeros(1, 1), 400)
    assert warned == {}
    run = longest = 0
    for m in history:
        run = run + 1 if m["optim/update_ratio"] < 1e-7 else 0
        longest = max(longest, run)
    assert longest >= STALL_STEPS  # the update did vanish: the old watch warned here
    with torch.no_grad():
        p_best = torch.softmax(policy.net.logits, -1)[2]
    assert p_best > 0.95
    assert history[-1]["policy/entropy"] < CONVERGED_ENTROPY
    assert "converged: the policy is near deterministic" in caplog.text


def test_a_vanishing_update_of_a_policy_that_is_not_deterministic_still_warns() -> None:
    """The same signals as a converged policy but a uniform one (entropy log 10): a stall."""
    watch = StallWatch(steps=2)
    small = {"reward/mean": 0.5, "reward/min": 0.0, "reward/max": 1.0, "reward/frac_zero_std": 0.0,
             "advantage/min": -1.0, "advantage/max": 1.0, "optim/update_ratio": 1e-9,
             "policy/entropy": math.log(10)}  # fmt: skip
    watch.observe(dict(small))
    with pytest.warns(StallWarning, match="the policy has effectively stopped changing"):
        watch.observe(dict(small))
    assert not watch.converged(small)
    assert watch.converged({**small, "policy/entropy": 0.1})


def test_a_schedule_that_ended_is_named_not_the_learning_rate(caplog: pytest.LogCaptureFixture) -> None:
    """A cosine schedule whose total_steps was meant in trainer steps: the preset makes 40
    optimizer steps per trainer step, so total_steps=60 ends in trainer step 2. Building the trainer
    warns (the unit of total_steps); once the rate is 0 the StallWarning names the schedule, not
    'raise GRPOConfig.learning_rate'."""
    torch.manual_seed(0)
    config = GRPOConfig.recipe(
        "small_policy", group_size=8, batch_size=4, seed=0, lr_schedule="cosine", total_steps=60
    )
    assert config.optimizer_steps_per_step == 40
    with pytest.warns(
        UserWarning,
        match=r"reaches its final rate within the first 2 trainer steps: "
        r"GRPOConfig.total_steps=60 counts optimizer steps, and each trainer step makes 40",
    ):
        trainer = GRPOTrainer(config, bandit_policy(5), bernoulli_arms([0.2, 0.5, 0.4, 0.3, 0.1]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2 + STALL_STEPS):
            trainer.step(torch.zeros(4, 1))
    stalls = [w for w in record if issubclass(w.category, StallWarning)]
    assert len(stalls) == 1
    message = str(stalls[0].message)
    assert "the learning-rate schedule has ended: lr_schedule='cosine'" in message
    assert "at total_steps=60" in message
    assert "schedule ended after trainer step 2" in message
    assert "raise GRPOConfig.learning_rate" not in message


def test_schedule_length_problem() -> None:
    assert schedule_length_problem("constant", None, 40) is None
    assert schedule_length_problem("linear", 400, 40) is None  # 10 trainer steps
    assert "within the first 9 trainer steps" in str(schedule_length_problem("linear", 360, 40))
    assert "within the first 1 trainer step:" in str(schedule_length_problem("cosine", 3, 4))
    assert "within the first 1 trainer step:" in str(schedule_length_problem("cosine", 4, 4))
    assert schedule_length_problem("cosine", 4000, 40, num_steps=100) is None
    assert schedule_length_problem("cosine", 3640, 40, num_steps=100) is None  # within N / 10
    assert schedule_length_problem("cosine", 8000, 40, num_steps=100) is None  # a later train() continues
    wrong = schedule_length_problem("cosine", 100, 40, num_steps=100)
    assert "at trainer step 3 of the 100 this run makes" in str(wrong)
    assert "set total_steps = 100 * 40 = 4000." in str(wrong)


@pytest.mark.filterwarnings(
    "ignore::grpo.training.stall_watch.StallWarning"
)  # the schedule then ends: tested above
def test_train_warns_when_the_schedule_does_not_span_the_run() -> None:
    """A schedule of 12 trainer steps in a run of 30 warns; one longer than the run does not."""
    config = GRPOConfig(group_size=4, batch_size=4, lr_schedule="linear", total_steps=12, seed=0)
    trainer = GRPOTrainer(config, bandit_policy(3), lambda s, a: (a == 0).float())
    with pytest.warns(
        UserWarning, match=r"at trainer step 12 of the 30 this run makes.*total_steps = 30 \* 1 = 30"
    ):
        train(trainer, lambda b: torch.zeros(b, 1), num_steps=30, progress=False)
    longer = GRPOTrainer(config, bandit_policy(3), lambda s, a: (a == 0).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        train(longer, lambda b: torch.zeros(b, 1), num_steps=6, progress=False)


def test_a_stall_warning_points_at_the_callers_line() -> None:
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=4, kl_coeff=0.0, seed=0)
    trainer = GRPOTrainer(config, bandit_policy(3), lambda s, a: torch.zeros(len(a)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(STALL_STEPS):
            trainer.step(torch.zeros(4, 1))
    stalls = [w for w in record if issubclass(w.category, StallWarning)]
    assert [w.filename for w in stalls] == [__file__]


# ---- the size of the update -----------------------------------------------------------------------
@pytest.mark.parametrize("epochs", [3, 1])
def test_update_ratio_is_the_norm_of_the_weight_change_over_the_weight_norm(
    contextual: ContextualBandit, epochs: int
) -> None:
    """Several epochs (the guard's snapshot) and one optimizer step (its copy of small weights):
    ||theta_after - theta_before|| / ||theta_before|| computed here in float64."""
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=8, num_epochs_per_update=epochs, learning_rate=1e-2, seed=0)
    trainer = GRPOTrainer(config, contextual.policy(hidden=(8,)), contextual.reward)
    for _ in range(3):
        before = _flat_weights(trainer)
        m = trainer.step(contextual.states(8))
        after = _flat_weights(trainer)
        expected = float((after - before).norm() / before.norm())
        assert expected > 1e-4
        assert m["optim/update_ratio"] == pytest.approx(expected, rel=1e-4)


def test_update_ratio_is_nan_when_nothing_was_copied_and_0_when_the_update_was_undone(
    contextual: ContextualBandit,
) -> None:
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=8, learning_rate=1e-2, seed=0)
    trainer = GRPOTrainer(config, contextual.policy(hidden=(8,)), contextual.reward)
    trainer.guard.ratio_copy_limit = 0  # a "large" model with one optimizer step: not measured
    assert math.isnan(trainer.step(contextual.states(8))["optim/update_ratio"])

    # a learning rate that is not finite: the guard refuses the step and the weights stay as they are
    policy = contextual.policy(hidden=(8,))
    optimizer = torch.optim.SGD(policy.parameters(), lr=math.inf)
    trainer = GRPOTrainer(
        GRPOConfig(group_size=4, batch_size=8, seed=0), policy, contextual.reward, optimizer=optimizer
    )
    before = _flat_weights(trainer)
    with pytest.warns(RuntimeWarning, match="lr=inf is not finite"):
        m = trainer.step(contextual.states(8))
    assert m["optim/non_finite_steps"] == 1.0
    assert torch.equal(_flat_weights(trainer), before)
    assert m["optim/update_ratio"] == 0.0


def test_a_vanishing_update_warns_after_k_steps_with_the_ratio_and_the_learning_rate(
    contextual: ContextualBandit,
) -> None:
    """lr = 1e-12: the rewards vary (no zero-variance stall), the gradient is fine, but the
    weights move by ~1e-11 of their norm. The warning quotes the largest ratio of the K steps
    (the returned metrics' own numbers) and the learning rate."""
    torch.manual_seed(0)
    config = GRPOConfig(group_size=4, batch_size=8, learning_rate=1e-12, seed=0)
    trainer = GRPOTrainer(config, contextual.policy(hidden=(8,)), contextual.reward)
    history: list[dict[str, float]] = []
    for _ in range(STALL_STEPS - 1):
        with warnings.catch_warnings():
            warnings.simplefilter("error", StallWarning)
            history.append(trainer.step(contextual.states(8)))
    with pytest.warns(StallWarning) as record:
        history.append(trainer.step(contextual.states(8)))
    ratios = [m["optim/update_ratio"] for m in history]
    assert all(0 <= r < 1e-7 for r in ratios)
    assert all(m["reward/frac_zero_std"] < 1 for m in history)
    message = str(record[0].message)
    assert (
        f"for the last {STALL_STEPS} steps the update moved the weights by at most {max(ratios):.4g}"
        in message
    )
    assert "the learning rate is too small for this network (lr=1e-12;" in message


# ---- the remedy --------------------------------------------------------------------------------
gym = pytest.importorskip("gymnasium")

from grpo.gym.episodes import EpisodePolicy, EpisodeReturn, EpisodeRewards, evaluate_episodes  # noqa: E402
from grpo.gym.exploration import EpisodeSpread  # noqa: E402


class Corridor(gym.Env):  # type: ignore[misc]
    """Start at cell 0 by a wall; step left or right; reward 1 on reaching cell ``length``, else
    0; at most ``length`` steps. Only the all-right episode succeeds (probability 2**-14 for a
    uniform policy), so practically every group of a random policy is all 0."""

    def __init__(self, length: int = 14) -> None:
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.pos = self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.pos / self.length], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos = self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.pos = max(0, self.pos + (1 if int(action) == 1 else -1))
        self.t += 1
        done = self.pos >= self.length
        return self._obs(), float(done), done, self.t >= self.length, {}


def test_episode_spread_is_the_swept_fraction_of_each_dimension() -> None:
    torch.manual_seed(0)
    policy = EpisodePolicy(Corridor, categorical_mlp(1, 2, hidden=(4,)))
    episodes = [e for group in policy.generate_actions([0, 1], 4) for e in group]
    spread = EpisodeSpread().compute_rewards([0] * 8, episodes)
    # the one dimension is the position / 14 and every episode starts at 0, so an episode's
    # swept width is the furthest cell it reached, the batch's range the furthest of any
    furthest = torch.tensor([float(e.observations[e.mask].max()) for e in episodes])
    assert furthest.max() > furthest.min()  # the episodes differ
    assert torch.allclose(spread, furthest / furthest.max())


def _corridor_run(reward: Any, seed: int, steps: int) -> tuple[float, dict[int, str], list[float]]:
    """Success rate of 64 sampled episodes after ``steps`` steps, the StallWarnings by step, the
    mean task reward of each step."""
    torch.manual_seed(seed)
    policy = EpisodePolicy(Corridor, categorical_mlp(1, 2, hidden=(16,)))
    config = GRPOConfig(
        group_size=8, batch_size=4, learning_rate=3e-2, num_epochs_per_update=2, kl_coeff=0.0, seed=seed
    )
    trainer = GRPOTrainer(config, policy, reward)
    rng = np.random.default_rng(seed)
    history, warned = _steps(trainer, lambda: rng.integers(0, 2**20, size=4).tolist(), steps)
    seeds = range(10**6, 10**6 + 64)
    success = evaluate_episodes(policy, Corridor, seeds=seeds, deterministic=False).mean()
    return float(success), warned, [m.get("reward/task/mean", m["reward/mean"]) for m in history]


def test_the_spread_bonus_makes_an_all_fail_task_learn_where_plain_grpo_stalls() -> None:
    """Same seeds, same steps: plain GRPO never succeeds, its gradient is 0 and the StallWarning
    fires at step K; with 0.01 x EpisodeSpread beside the task reward the policy learns to walk
    to the goal (once every episode does, the all-succeed warning may come: the task is solved)."""
    for seed in (0, 1):
        plain, warned_plain, task_plain = _corridor_run(EpisodeReturn(), seed, 30)
        assert list(warned_plain) == [STALL_STEPS], seed
        assert "(all 0, the only reward seen since step 1)" in warned_plain[STALL_STEPS]
        assert max(task_plain) == 0.0, seed  # no training episode ever reached the goal
        assert plain < 0.05, seed
        bonus = CombinedReward({"task": EpisodeReturn(), "spread": EpisodeSpread()}, {"spread": 0.01})
        success, warned_bonus, task_bonus = _corridor_run(bonus, seed, 30)
        assert all("Every sample succeeds" in m for m in warned_bonus.values()), (seed, warned_bonus)
        assert success > 0.9, seed
        assert task_bonus[-1] > 0.5, (seed, task_bonus)


@pytest.mark.slow
def test_a_solved_cartpole_runs_long_without_a_warning() -> None:
    """The small_policy preset on CartPole-v1 (episodes capped at 200 steps): it balances every
    training episode for the last 30 of 80 steps (mean return >= 195 of 200) and no
    StallWarning is raised on the way or after."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    policy = EpisodePolicy("CartPole-v1", categorical_mlp(obs_dim=4, num_actions=2), max_steps=200)
    config = GRPOConfig.recipe("small_policy", group_size=4, batch_size=4, seed=0)
    trainer = GRPOTrainer(config, policy, EpisodeRewards())
    history, warned = _steps(trainer, lambda: rng.integers(0, 2**20, size=4).tolist(), 80)
    policy.close()
    assert warned == {}
    late = [m["reward/mean"] for m in history[-30:]]
    assert sum(late) / len(late) >= 195.0, late  # solved
