"""grpo.population (issue 41): a generation never fails half-way (the adaptive learning rate and
learning-rate mutations agree; every slot's new values are checked before any slot changes), the
population's cost in env steps (training and fitness, counted by hand on a tiny env), and
`build_alone` (slot i outside the population, its first step bitwise the slot's)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import EpisodePolicy, EpisodeRewards
from grpo.policies import categorical_mlp
from grpo.population import (
    HyperparameterConfig,
    Member,
    RLParameter,
    apply_hyperparameters,
    build_alone,
    population,
)
from tests.conftest import bandit_policy
from tests.population_toys import HPC, arm_reward, expected_reward, make_clipped_bandit

pytestmark = pytest.mark.usefixtures("one_thread")

LR_GROWS = HyperparameterConfig(
    learning_rate=RLParameter(min=1e-4, max=1.0, shrink_factor=0.5, grow_factor=2.0)
)


def make_recipe_bandit(hp: dict[str, float]) -> GRPOTrainer:
    """The small_policy recipe as it is: its adaptive learning rate on, so that
    ``adaptive_lr_max == learning_rate`` (the recipe's "never above the start")."""
    cfg = GRPOConfig.recipe(
        "small_policy", group_size=4, batch_size=4, learning_rate=hp["learning_rate"], seed=0,
        distributed="off",
    )  # fmt: skip
    return GRPOTrainer(cfg, bandit_policy(10), arm_reward)


# ---- the adaptive learning rate and learning-rate mutations ------------------------------------
def test_learning_rate_mutation_moves_the_adaptive_range_with_it() -> None:
    t = make_recipe_bandit({"learning_rate": 0.01})
    assert (t.config.adaptive_lr_min, t.config.adaptive_lr_max) == (1e-5, 0.01)
    ctrl = t.adaptive_lr
    assert ctrl is not None
    apply_hyperparameters(t, {"learning_rate": 0.04})  # x4: above the old adaptive_lr_max
    assert t.config.learning_rate == 0.04
    assert t.config.adaptive_lr_max == 0.04  # max(4 * 0.01, 0.04): exactly the new rate
    assert t.config.adaptive_lr_min == pytest.approx(4e-5, rel=1e-12)
    assert (ctrl.lr_min, ctrl.lr_max) == (t.config.adaptive_lr_min, t.config.adaptive_lr_max)
    assert ctrl.lr == 0.04  # eta = base * scale, the scale (1) kept
    metrics = t.step(torch.zeros(4, 1))
    assert metrics["optim/adaptive_lr"] <= 0.04  # the adaptation respects the moved ceiling
    apply_hyperparameters(t, {"learning_rate": 0.02})  # x0.5: eta halves with the range
    assert t.config.adaptive_lr_max == pytest.approx(0.02, rel=1e-12)
    assert ctrl.lr == pytest.approx(metrics["optim/adaptive_lr"] / 2, rel=1e-12)


def test_adaptive_recipe_population_grows_its_learning_rate() -> None:
    """Issue 41's crash: with the recipe's adaptive rate on, the first growth mutation raised
    ``ValueError ... must lie in [adaptive_lr_min, adaptive_lr_max]`` inside evolve, after the
    generation's training and clones."""
    pop = population(
        4, make_recipe_bandit, LR_GROWS, hyperparameters=[{"learning_rate": 0.01}] * 4,
        fitness=expected_reward, seed=0,
    )  # fmt: skip
    records = pop.evolve(1, torch.zeros(64, 1), num_generations=3)
    grown = [m for r in records for m in r.mutations if m.name is not None and m.new > m.old]
    assert grown  # the case of the issue happened
    for m in pop.local_members:
        t = m.require_trainer()
        assert t.config.learning_rate == m.hp["learning_rate"]
        assert t.config.adaptive_lr_max == pytest.approx(m.hp["learning_rate"], rel=1e-12)
        ctrl = t.adaptive_lr
        assert ctrl is not None
        assert ctrl.lr_max == t.config.adaptive_lr_max
        assert ctrl.lr_min <= ctrl.lr <= ctrl.lr_max * (1 + 1e-12)


def test_a_refused_mutation_leaves_every_slot_unchanged() -> None:
    """group_size may shrink to 1 in the declared range, which GRPOConfig refuses: evolve raises
    before any slot is cloned or changed (on the starting code, the clones had happened)."""
    hpc = HyperparameterConfig(group_size=RLParameter(min=1, max=8, dtype=int))

    def make(hp: dict[str, float]) -> GRPOTrainer:
        cfg = GRPOConfig(
            group_size=int(hp["group_size"]), batch_size=4, learning_rate=0.1, seed=0, distributed="off"
        )
        return GRPOTrainer(cfg, bandit_policy(10), arm_reward)

    after_training: dict[int, dict[str, Any]] = {}

    def fitness(m: Member) -> float:  # called after the generation's training, before selection
        after_training[m.index] = {
            k: v.clone() for k, v in m.require_trainer().policy.get_parameters().items()
        }
        return float(m.index)  # slot 3 the elite; 0, 1, 2 cloned from the tournament's winners

    pop = population(4, make, hpc, hyperparameters=[{"group_size": 2}] * 4, fitness=fitness, seed=2)
    configs = [m.require_trainer().config for m in pop.members]
    rng_state = pop.rng.getstate()
    with pytest.raises(
        ValueError, match=r"generation 0: slot \d refuses its new hyperparameters .*group_size=1"
    ):
        pop.evolve(1, torch.zeros(64, 1))
    for m, cfg in zip(pop.members, configs, strict=True):
        t = m.require_trainer()
        assert t.config is cfg
        assert m.hp == {"group_size": 2}
        assert m.fitness == []
        for k, v in t.policy.get_parameters().items():
            assert torch.equal(v, after_training[m.index][k])
    assert len({tuple(v.flatten().tolist()) for w in after_training.values() for v in w.values()}) == 4
    assert (pop.generation, pop.history, pop.rng.getstate()) == (0, [], rng_state)


# ---- cost in env steps, by hand -----------------------------------------------------------------
class CountdownEnv(gym.Env[np.ndarray, int]):
    """One observation (seed mod 3); the episode of ``reset(seed=s)`` lasts ``L(s) = 2 + s % 3``
    steps whatever the actions; reward 1 for action 1."""

    observation_space = gym.spaces.Box(-1.0, 3.0, (1,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.left = 2 + (seed or 0) % 3
        return np.array([(seed or 0) % 3], dtype=np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        return np.zeros(1, dtype=np.float32), float(action), self.left == 0, False, {}


def L(seed: int) -> int:
    return 2 + seed % 3


class Sink:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def write(self, record: dict[str, float], step: int) -> None:
        self.rows.append(dict(record))


def test_env_step_cost_by_hand_on_a_tiny_env() -> None:
    def make(hp: dict[str, float]) -> GRPOTrainer:
        cfg = GRPOConfig(
            group_size=2, batch_size=2, learning_rate=hp["learning_rate"], seed=0, distributed="off"
        )
        return GRPOTrainer(cfg, EpisodePolicy(CountdownEnv, categorical_mlp(1, 2, (8,))), EpisodeRewards())

    sink = Sink()
    seeds, eval_seeds = [0, 1, 2, 3], [5, 6]
    pop = population(
        2, make, LR_GROWS, hyperparameters=[{"learning_rate": 0.01}, {"learning_rate": 0.1}],
        eval_states=eval_seeds, sinks=[sink], seed=0,
    )  # fmt: skip
    pop.evolve(2, seeds, num_generations=2)
    # each slot's 4 steps take the seeds [0, 1], [2, 3], [0, 1], [2, 3]; G = 2 episodes each
    train = 2 * 2 * sum(L(s) for s in seeds)  # 2 passes x G x (2 + 3 + 4 + 2) = 44
    evaluation = 2 * 2 * sum(L(s) for s in eval_seeds)  # 2 generations x G x (4 + 2) = 24
    for m in pop.members:
        assert (m.train_env_steps, m.eval_env_steps, m.env_steps) == (train, evaluation, train + evaluation)
        assert m.samples == 4 * 2 * 2  # episodes: 4 steps x B x G
    last = sink.rows[-1]
    assert last["population/train_env_steps"] == 2 * train
    assert last["population/eval_env_steps"] == 2 * evaluation
    assert last["population/env_steps"] == 2 * (train + evaluation) == 136
    assert last["member1/train_env_steps"] == train
    assert last["member1/eval_env_steps"] == evaluation
    assert pop.cost_metrics() == {k: last[k] for k in pop.cost_metrics()}


def test_cost_of_single_action_policies_counts_actions() -> None:
    pop = population(
        2, make_clipped_bandit, HPC, hyperparameters=[{"learning_rate": 0.1, "clip_epsilon": 0.2}] * 2,
        eval_states=torch.zeros(5, 1), seed=0,
    )  # fmt: skip
    pop.evolve(3, torch.zeros(64, 1))
    for m in pop.members:  # B = 4, G = 4: 3 steps x 16 actions; the evaluation 5 states x G
        assert (m.train_env_steps, m.eval_env_steps, m.samples) == (48, 20, 48)
    fit = population(
        2, make_clipped_bandit, HPC, hyperparameters=[{"learning_rate": 0.1, "clip_epsilon": 0.2}] * 2,
        fitness=expected_reward, seed=0,
    )  # fmt: skip
    fit.evolve(3, torch.zeros(64, 1))
    assert [m.eval_env_steps for m in fit.members] == [0, 0]  # an exact fitness draws nothing


# ---- slot i alone ------------------------------------------------------------------------------
def test_build_alone_first_step_is_the_slots_first_step_bitwise() -> None:
    starts = [{"learning_rate": lr, "clip_epsilon": 0.2} for lr in (0.3, 0.03, 0.003)]

    def states(b: int) -> Tensor:
        return torch.randn(b, 1)  # drawn on the slot's streams

    firsts: dict[int, dict[str, Tensor]] = {}  # each slot's weights after its first step

    def fitness(m: Member) -> float:
        firsts[m.index] = {k: v.clone() for k, v in m.require_trainer().policy.get_parameters().items()}
        return m.step_metrics[-1]["loss/policy"]

    pop = population(3, make_clipped_bandit, HPC, hyperparameters=starts, fitness=fitness, seed=7)
    pop.evolve(1, states)
    for i, hp in enumerate(starts):
        alone = build_alone(make_clipped_bandit, hp, i, seed=7, hp_config=HPC)
        metrics = alone.step(states(alone.config.batch_size))
        assert metrics["loss/policy"] == pop.history[0].fitness[i]
        for k, v in alone.policy.get_parameters().items():
            assert torch.equal(v, firsts[i][k])
    (w0,), (w1,) = firsts[0].values(), firsts[1].values()
    assert not torch.equal(w0, w1)  # different runs, not one run twice
    with pytest.raises(ValueError, match="outside its declared range"):
        build_alone(make_clipped_bandit, {"learning_rate": 5.0, "clip_epsilon": 0.2}, 0, hp_config=HPC)
