"""Population benchmark: a population of 4 against the median of 4 independent runs started from
the same random hyperparameters, in samples (or env steps) until a target.

For each repeat r (seeded), 4 starting points are drawn log-uniformly from the declared ranges
(`grpo.population.sample_hyperparameters(hp_config, 4, seed=1000 + r)`: learning rate in
[1e-5, 1e-1], clip epsilon in [0.05, 0.4]). Each point trains alone (no mutation) until its score
(the measure the target is on) reaches the target or its budget runs out; its score is checked
after every trainer step, and those checks are free (not in its cost): an independent run is
charged only for its training. Run i is built and trained on the seeds of the population's slot
i, so the population's generation 0 is exactly the independent runs' first steps. The population
of the same 4 points evolves (a generation of ``--steps-per-generation`` trainer steps, 1 by
default: tournament of 2, elitism, one mutation per copy: x0.5 / x2 within the ranges) until its
best member reaches the target; its cost is everything all 4 members drew: ``population/env_steps``
of `Population.cost_metrics` (training and every charged evaluation, grpo/population/cost.py).
Besides the median run, the population is compared with the 4 starts run as a search (each run
to the target or to its budget: the sum of what the 4 runs spent) and with the best of the 4
runs (a start that was already good). ``--fitness`` picks
what the selection ranks:

- eval (default): the score itself; its env steps (CartPole's greedy episodes) are charged to
  the population, since they choose the parents.
- train: the generation's mean training reward (``member.step_metrics``, already paid for); the
  score is then checked on every member for free, as the independent runs' is. Costs the same
  as eval where the score plays no env steps (the contextual bandit's is exact), and selects on
  a noisier measure there.

Tasks:

- contextual: the contextual bandit of examples/population.py (16-dim contexts, 10 arms,
  ``categorical_mlp(16, 10, (64,))``, B = 32, G = 8, 2 epochs); score = expected reward over
  the oracle's (0 = uniform arms, 1 = the oracle), exact over 2,000 fixed contexts; target 0.95;
  cost = sampled actions (B x G per step); budget 400 steps per run (102,400 samples), the
  population 4 x that.
- cartpole: CartPole-v1 episodes (`grpo.gym.EpisodePolicy`), ``categorical_mlp(4, 2, (64, 64))``,
  B = 4, G = 4, the ``small_policy`` preset's 10 epochs x 4 mini-batches with its adaptive
  learning rate and restart switched off (the population searches the rate); score = mean
  return of 5 greedy episodes on seeds 1_000_000..; target 475; cost = env steps; budget 150k env
  steps per run, the population 4 x that.
- acrobot (issue 41's held-out task; only when named): Acrobot-v1 through the documented
  episode path (docs/gym_episodes.md, examples/classic_control.py): the ``small_policy`` preset
  as it is, its adaptive learning rate on, per-step credit with the ``EpisodeSpread``
  tie-breaker, ``categorical_mlp(6, 3, (64, 64))``, B = 4, G = 4; the learning rate alone
  declared (``--hp lr``, [1e-5, 1e-1]); score = mean return of 5 greedy episodes on seeds
  1_000_000..; target -100; cost = env steps; budget 200k env steps per run.

``--hp all`` declares every hyperparameter issue 31 names for control tasks (learning rate, clip
epsilon, KL weight in [1e-3, 1], entropy weight in [1e-4, 0.1], group size in [2, 16]); the 4
starting points and the mutations then cover all five, and the cost counts the samples or env
steps each member actually drew (its own group size).

A run that never reaches the target counts as never (inf). Output: one table per task (the
population's cost, the share of it its evaluations took, and its ratio to the median run, to the
search and to the best run) and a summary line per task.

    python benchmarks/population.py                          # contextual and cartpole, 3 repeats
    python benchmarks/population.py --tasks acrobot --repeats 3
    python benchmarks/population.py --tasks contextual --repeats 1
    python benchmarks/population.py --tasks cartpole --fitness train
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp
from grpo.population import (
    HyperparameterConfig,
    Member,
    RLParameter,
    build_alone,
    population,
    sample_hyperparameters,
)
from grpo.training.stall_watch import StallWarning

HP_CONFIGS = {
    # the learning rate alone (issue 41's held-out Acrobot comparison)
    "lr": HyperparameterConfig(
        learning_rate=RLParameter(min=1e-5, max=1e-1, shrink_factor=0.5, grow_factor=2.0)
    ),
    # the learning rate and the clip range (the first benchmark)
    "lr-clip": HyperparameterConfig(
        learning_rate=RLParameter(min=1e-5, max=1e-1, shrink_factor=0.5, grow_factor=2.0),
        clip_epsilon=RLParameter(min=0.05, max=0.4),
    ),
    # every hyperparameter issue 31 names for control tasks: + KL and entropy weights, group size
    "all": HyperparameterConfig(
        learning_rate=RLParameter(min=1e-5, max=1e-1, shrink_factor=0.5, grow_factor=2.0),
        clip_epsilon=RLParameter(min=0.05, max=0.4),
        kl_coeff=RLParameter(min=1e-3, max=1.0, shrink_factor=0.5, grow_factor=2.0),
        entropy_coeff=RLParameter(min=1e-4, max=1e-1, shrink_factor=0.5, grow_factor=2.0),
        group_size=RLParameter(min=2, max=16, shrink_factor=0.5, grow_factor=2.0, dtype=int),
    ),
}
SIZE = 4


@dataclass
class Task:
    """What the benchmark needs of a task."""

    name: str
    make: Callable[[dict[str, float], int], GRPOTrainer]  # (hp, seed) -> trainer
    states: Callable[[int], Any]  # batch_size -> states (drawn on the member's RNG streams)
    score: Callable[[GRPOTrainer], tuple[float, int]]  # (the measure the target is on, env steps it played)
    cost: Callable[[GRPOTrainer], int]  # env steps used so far by this trainer (counts_samples: unused)
    target: float
    steps_per_generation: int
    budget: int  # cost units per independent run
    counts_samples: bool = False  # cost = sampled actions (B x G per step), counted by the harness
    hp: str = "lr-clip"  # the declared hyperparameters unless --hp says otherwise


# ---- contextual bandit -----------------------------------------------------------------------
def contextual_task(seed: int) -> Task:
    g = torch.Generator().manual_seed(seed)
    w, eval_x = torch.randn(16, 10, generator=g), torch.randn(2000, 16, generator=g)
    r = eval_x @ w
    uniform, oracle = r.mean(1).mean(), r.max(1).values.mean()

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        return (states @ w).gather(1, actions.long().unsqueeze(1)).squeeze(1)

    def make(hp: dict[str, float], s: int) -> GRPOTrainer:
        cfg = GRPOConfig(
            group_size=int(hp.get("group_size", 8)), batch_size=32, learning_rate=hp["learning_rate"],
            clip_epsilon=hp["clip_epsilon"], kl_coeff=hp.get("kl_coeff", 0.0),
            entropy_coeff=hp.get("entropy_coeff", 0.0), num_epochs_per_update=2, seed=s, distributed="off",
        )  # fmt: skip
        return GRPOTrainer(cfg, categorical_mlp(16, 10, (64,)), reward)

    def score(t: GRPOTrainer) -> tuple[float, int]:
        with torch.no_grad():
            probs = t.policy.distribution(eval_x).probs  # type: ignore[attr-defined]
        return float(((probs * r).sum(1).mean() - uniform) / (oracle - uniform)), 0  # exact: no samples

    def cost(t: GRPOTrainer) -> int:  # not used: the harness counts the samples (counts_samples)
        raise NotImplementedError

    return Task(
        "contextual",
        make,
        lambda b: torch.randn(b, 16),
        score,
        cost,
        0.95,
        1,
        400 * 32 * 8,
        counts_samples=True,
    )


# ---- CartPole ----------------------------------------------------------------------------------
def cartpole_task(seed: int) -> Task:
    from grpo.gym.episodes import EpisodePolicy, EpisodeRewards, evaluate_episodes

    eval_seeds = list(range(1_000_000, 1_000_005))

    def make(hp: dict[str, float], s: int) -> GRPOTrainer:
        policy = EpisodePolicy("CartPole-v1", categorical_mlp(4, 2, (64, 64)))
        cfg = GRPOConfig.recipe(
            "small_policy", group_size=int(hp.get("group_size", 4)), batch_size=4,
            learning_rate=hp["learning_rate"], clip_epsilon=hp["clip_epsilon"],
            kl_coeff=hp.get("kl_coeff", 0.0), entropy_coeff=hp.get("entropy_coeff", 0.0),
            adaptive_lr_kl=None, reward_shift_z=None, seed=s,
            distributed="off",
        )  # fmt: skip
        return GRPOTrainer(cfg, policy, EpisodeRewards())

    def states(b: int) -> list[int]:
        return [int(x) for x in np.random.randint(0, 2**20, size=b)]  # the member's NumPy stream

    def score(t: GRPOTrainer) -> tuple[float, int]:
        returns = evaluate_episodes(t.policy, "CartPole-v1", eval_seeds)  # type: ignore[arg-type]
        return float(returns.mean()), int(returns.sum())  # CartPole pays 1 a step

    def cost(t: GRPOTrainer) -> int:
        return int(t.policy.env_steps)  # type: ignore[attr-defined]

    return Task("cartpole", make, states, score, cost, 475.0, 1, 150_000)


# ---- Acrobot (issue 41: a held-out task, the documented episode path) ----------------------------
def acrobot_task(seed: int) -> Task:
    """Acrobot-v1 as docs/gym_episodes.md and examples/classic_control.py train it: the
    ``small_policy`` preset as it is (its adaptive learning rate on: with a declared learning
    rate the adaptive range moves with each mutation, grpo/population/settings.py), per-step
    credit with the all-fail tie-breaker ``EpisodeSpread``, B = 4, G = 4, a 64x64 MLP."""
    from grpo.gym.episodes import EpisodePolicy, EpisodeRewards, evaluate_episodes
    from grpo.gym.exploration import EpisodeSpread

    eval_seeds = list(range(1_000_000, 1_000_005))

    def make(hp: dict[str, float], s: int) -> GRPOTrainer:
        policy = EpisodePolicy("Acrobot-v1", categorical_mlp(6, 3, (64, 64)))
        cfg = GRPOConfig.recipe(
            "small_policy", group_size=4, batch_size=4, learning_rate=hp["learning_rate"], seed=s,
            distributed="off",
        )  # fmt: skip
        return GRPOTrainer(cfg, policy, EpisodeRewards(bonus=EpisodeSpread()))

    def states(b: int) -> list[int]:
        return [int(x) for x in np.random.randint(0, 2**20, size=b)]

    def score(t: GRPOTrainer) -> tuple[float, int]:
        returns = evaluate_episodes(t.policy, "Acrobot-v1", eval_seeds)  # type: ignore[arg-type]
        return float(returns.mean()), int(-returns.sum())  # -1 a step (the last step pays 0: an
        # episode of L steps returns -(L - 1) if it reached the goal; the count is then 1 short)

    def cost(t: GRPOTrainer) -> int:
        return int(t.policy.env_steps)  # type: ignore[attr-defined]

    return Task("acrobot", make, states, score, cost, -100.0, 1, 200_000, hp="lr")


TASKS = {"contextual": contextual_task, "cartpole": cartpole_task, "acrobot": acrobot_task}


# ---- the two sides ---------------------------------------------------------------------------
def start_like_slot(task: Task, hp: dict[str, float], seed: int, index: int) -> GRPOTrainer:
    """A trainer built as `population(..., seed=seed)` builds slot ``index`` (on the slot's seed),
    with the global RNGs then on the slot's training streams: `grpo.population.build_alone`."""
    return build_alone(lambda h: task.make(h, seed), hp, index, seed=seed)


def independent(task: Task, hp: dict[str, float], seed: int, index: int) -> tuple[float, int]:
    """(training cost until the score, checked after every step for free, reaches the target, or
    inf; the cost spent, the whole budget for a run that never does). Run ``index`` starts exactly
    as the population's slot ``index`` does (`grpo.population.build_alone`), so generation 0 of
    the population is these runs' first steps."""
    t = start_like_slot(task, hp, seed, index)
    samples = 0

    def cost() -> int:
        return samples if task.counts_samples else task.cost(t)

    while cost() < task.budget:
        t.step(task.states(t.config.batch_size))
        samples += t.config.batch_size * t.config.group_size
        if task.score(t)[0] >= task.target:
            return float(cost()), cost()
    return math.inf, cost()


def evolved(
    task: Task, starts: list[dict[str, float]], seed: int, hp_config: HyperparameterConfig, fitness: str
) -> tuple[float, float, float]:
    """(total cost of all members until the best reaches the target, its learning rate then, the
    share of the total that the charged evaluations took).

    ``fitness="eval"``: selection on the score itself, its env steps charged to the population.
    ``fitness="train"``: selection on the generation's mean training reward (already paid for);
    the score is then checked on every member for free, as the independent runs' is."""
    checked = [-math.inf] * SIZE  # each slot's score this generation, before selection

    def evaluation(m: Member) -> float:
        value, steps = task.score(_trainer(m))
        m.eval_env_steps += steps  # played on its own env: not in policy.env_steps (cost.py)
        checked[m.index] = value
        return value

    def training_reward(m: Member) -> float:
        checked[m.index] = task.score(_trainer(m))[0]  # free: the independent runs' check
        return statistics.fmean(row["reward/mean"] for row in m.step_metrics)

    pop = population(
        SIZE, lambda hp: task.make(hp, seed), hp_config, hyperparameters=starts,
        fitness=evaluation if fitness == "eval" else training_reward, seed=seed,
    )  # fmt: skip
    while True:
        lrs = [m.hp["learning_rate"] for m in pop.members]  # before selection changes them
        pop.evolve(task.steps_per_generation, task.states)
        cost = pop.cost_metrics()  # training, and every charged evaluation (grpo/population/cost.py)
        total, share = (
            cost["population/env_steps"],
            cost["population/eval_env_steps"] / cost["population/env_steps"],
        )
        best = max(range(SIZE), key=lambda i: checked[i])
        if checked[best] >= task.target:
            return total, lrs[best], share
        if total >= SIZE * task.budget:
            return math.inf, math.nan, share


def _trainer(m: Member) -> GRPOTrainer:
    assert m.trainer is not None
    return m.trainer


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) else "-"


def _k(x: float) -> str:
    return "never" if math.isinf(x) else f"{x / 1000:.1f}k"


def run_task(
    name: str,
    repeats: int,
    steps_per_generation: int | None = None,
    hp: str | None = None,
    fitness: str = "eval",
    first_repeat: int = 0,
) -> list[float]:
    hp = hp or TASKS[name](0).hp
    print(f"\n## {name}: cost until the target (k = thousands), population of {SIZE} vs independent runs")
    print(
        "| repeat | starting learning rates | independent runs | median | population (lr found) | ratio | "
        "evaluation share | 4 starts as a search | population / search | population / best run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    for r in range(first_repeat, first_repeat + repeats):
        task = TASKS[name](r)
        hp_config = HP_CONFIGS[hp]
        if steps_per_generation is not None:
            task.steps_per_generation = steps_per_generation
        starts = sample_hyperparameters(hp_config, SIZE, seed=1000 + r)
        t0 = time.perf_counter()
        runs = [independent(task, hp, seed=r, index=i) for i, hp in enumerate(starts)]
        alone = [a for a, _ in runs]
        med = statistics.median(alone)
        search = float(sum(spent for _, spent in runs)) if any(map(math.isfinite, alone)) else math.inf
        pop_cost, lr, share = evolved(task, starts, seed=r, hp_config=hp_config, fitness=fitness)
        ratio = pop_cost / med if math.isfinite(med) else (0.0 if math.isfinite(pop_cost) else math.nan)
        ratios.append(ratio)  # 0: the population reached the target, the median run never did
        lrs = ", ".join(f"{h['learning_rate']:.1e}" for h in starts)
        if hp not in ("lr-clip", "lr"):  # the other starting values, one member a line
            for i, h in enumerate(starts):
                print(
                    f"<!-- repeat {r} member {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in h.items()) + " -->"
                )
        shown = "median never" if ratio == 0 else f"{ratio:.2f}"
        print(
            f"| {r} | {lrs} | {', '.join(_k(a) for a in alone)} | {_k(med)} | {_k(pop_cost)} ({lr:.1e}) | "
            f"{shown} | {share:.0%} | {_k(search)} | {_ratio(pop_cost, search)} | "
            f"{_ratio(pop_cost, min(alone))} | <!-- {time.perf_counter() - t0:.0f} s -->",
            flush=True,
        )
    return ratios


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--tasks", nargs="+", default=["contextual", "cartpole"], choices=list(TASKS),
        help="acrobot (issue 41's held-out task) runs only when named",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="seeded repeats per task")
    parser.add_argument("--first-repeat", type=int, default=0, help="the seed of the first repeat")
    parser.add_argument(
        "--steps-per-generation", type=int, default=None,
        help="the population's trainer steps between two selections (default: the task's, 1)",
    )  # fmt: skip
    parser.add_argument(
        "--hp", choices=list(HP_CONFIGS), default=None,
        help="the declared hyperparameters: lr (learning rate), lr-clip (+ clip epsilon) or all (+ KL "
        "and entropy weights, group size); default: the task's (acrobot: lr, the others: lr-clip)",
    )  # fmt: skip
    parser.add_argument(
        "--fitness", choices=["eval", "train"], default="eval",
        help="the population's fitness: eval (the target's own measure, its env steps charged) or "
        "train (the generation's mean training reward, free; the target then checked for free)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore", StallWarning)  # bad starting rates stall: that is the point
    torch.set_num_threads(1)
    out = {
        name: run_task(
            name, args.repeats, args.steps_per_generation, args.hp, args.fitness, args.first_repeat
        )
        for name in args.tasks
    }
    print()
    for name, ratios in out.items():
        wins = sum(1 for x in ratios if x < 1)
        shown = ", ".join("median never" if x == 0 else f"{x:.2f}" for x in ratios)
        print(
            f"{name}: population cheaper than the median independent run in {wins}/{len(ratios)} "
            f"repeats ({shown})"
        )
    return out


if __name__ == "__main__":
    main()
