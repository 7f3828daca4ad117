"""Population-based training repairs a bad learning rate: a contextual bandit started at lr 1e-5.

Each state is a 16-dim context x; arm a of 10 pays (x @ W)[a]. A trainer started at learning rate
1e-5 barely moves in the run's steps. A population of 4 such trainers (`grpo.population`) trains
each for a few steps, keeps the best, copies it over the worst through state dicts and mutates
the copies' learning rates (x0.5 or x3, within [1e-6, 0.1]); within a few generations the
population runs at a learning rate that learns. The script prints the fraction of the oracle's
reward (0 = random arms, 1 = always the best arm) before and after, alone and as a population:

    alone      lr 1e-05: reward/oracle 0.00 -> 0.01
    population best lr ...: reward/oracle 0.00 -> 0.9x

    python examples/population.py                    # ~20 s on a laptop CPU
    python examples/population.py --generations 2    # smoke test
    python examples/population.py --plot lineage.png # also draw the lineage (needs matplotlib)
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp
from grpo.population import HyperparameterConfig, Member, RLParameter, plot_lineage, population

DIM, ARMS = 16, 10


class Task:
    """The contextual bandit: fixed W, fresh contexts from torch's global RNG (each member's own)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(DIM, ARMS, generator=g)
        self.eval_x = torch.randn(2000, DIM, generator=g)

    def reward(self, states: Tensor, actions: Tensor) -> Tensor:
        return (states @ self.W).gather(1, actions.long().unsqueeze(1)).squeeze(1)

    def states(self, batch_size: int) -> Tensor:
        return torch.randn(batch_size, DIM)

    def score(self, policy: Any) -> float:
        """Expected reward / the oracle's (exact over the eval contexts; 0 = uniform arms)."""
        with torch.no_grad():
            r, probs = self.eval_x @ self.W, policy.distribution(self.eval_x).probs
        uniform = r.mean(1).mean()
        return float(((probs * r).sum(1).mean() - uniform) / (r.max(1).values.mean() - uniform))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--lr", type=float, default=1e-5, help="the bad starting learning rate")
    parser.add_argument("--size", type=int, default=4, help="members of the population")
    parser.add_argument("--generations", type=int, default=12, help="generations")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per member per generation")
    parser.add_argument("--seed", type=int, default=0, help="seeds the task, the members and the selection")
    parser.add_argument("--plot", default=None, help="write the lineage plot to this PNG")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    task = Task(args.seed)

    def make_member(hp: dict[str, float]) -> GRPOTrainer:
        cfg = GRPOConfig(
            group_size=8, batch_size=32, learning_rate=hp["learning_rate"], num_epochs_per_update=2,
            seed=args.seed, distributed="off",
        )  # fmt: skip
        return GRPOTrainer(cfg, categorical_mlp(DIM, ARMS, (64,)), task.reward)

    def fitness(member: Member) -> float:
        assert member.trainer is not None
        return task.score(member.trainer.policy)

    steps = args.generations * args.steps
    torch.manual_seed(args.seed)
    alone = make_member({"learning_rate": args.lr})
    start = task.score(alone.policy)
    for _ in range(steps):
        alone.step(task.states(32))
    alone_score = task.score(alone.policy)
    print(f"alone      lr {args.lr:.0e}: reward/oracle {start:.2f} -> {alone_score:.2f} ({steps} steps)")

    hp_config = HyperparameterConfig(
        learning_rate=RLParameter(min=1e-6, max=0.1, shrink_factor=0.5, grow_factor=3.0)
    )
    pop = population(
        args.size, make_member, hp_config, hyperparameters={"learning_rate": args.lr}, fitness=fitness,
        seed=args.seed,
    )  # fmt: skip
    for record in pop.evolve(args.steps, task.states, args.generations):
        lrs = " ".join(f"{h['learning_rate']:.1e}" for h in record.hyperparameters)
        print(f"generation {record.generation:2d}  best {record.best_fitness:.2f}  learning rates {lrs}")
    best = pop.best()
    final = best.fitness[-1]
    print(
        f"population best lr {best.hp['learning_rate']:.1e}: reward/oracle {start:.2f} -> {final:.2f} "
        f"({steps} steps per member, {args.size} members)"
    )
    if args.plot:
        print(f"lineage plot: {plot_lineage(pop.history, args.plot)}")
    return {"alone": alone_score, "population": final}


if __name__ == "__main__":
    main()
