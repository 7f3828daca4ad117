"""GRPO on CartPole-v1: each GRPO state is an env seed, each action a whole episode.

A group is G episodes started from the same ``env.reset(seed=s)``. Settings: the `small_policy`
preset (``GRPOConfig.recipe("small_policy", group_size=4, batch_size=4)``) with per-step credit
(`EpisodeRewards`): each step's return-to-go (gamma 0.99) is compared with the other episodes of
its group at the same step (see grpo/gym/episodes.py). Training stops when the deterministic
policy (argmax) averages >= 475 over 10 evaluation episodes (full 500-step episodes) whose seeds
are disjoint from the training seeds. ``--train-horizon N`` caps
training episodes at N steps (default: the env's own 500).

Run: ``python examples/cartpole.py --seeds 0 1 2`` (needs the gym extra: ``pip install -e ".[gym]"``
in a checkout).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import EpisodePolicy, EpisodeRewards, evaluate_episodes
from grpo.policies import categorical_mlp

ENV_ID = "CartPole-v1"
EVAL_SEEDS = list(range(1_000_000, 1_000_020))  # never drawn for training (those are < 2**20)


def solve(
    seed: int = 0,
    *,
    max_steps: int = 200,
    max_env_steps: int | None = None,
    batch_size: int = 4,
    group_size: int = 4,
    learning_rate: float | None = None,
    epochs: int | None = None,
    hidden: int = 64,
    train_horizon: int | None = None,
    target: float = 475.0,
    eval_episodes: int = 10,
    eval_threshold: float = 0.9,
    log_every: int = 5,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train until the greedy policy's mean return over ``eval_episodes`` reaches ``target``.

    ``learning_rate`` / ``epochs`` override the preset's (None = the preset's 5e-3 / 10).
    ``train_horizon`` caps training episodes (None = the env's 500); evaluation always plays
    full 500-step episodes. A cap (e.g. 200) makes the late phase cheaper but can stall: once every
    training episode hits the cap, each group's returns are equal, its advantages are 0, and
    nothing pushes the policy to stay up past the cap (see benchmarks/RESULTS.md).
    Stops without solving after ``max_steps`` GRPO steps or once ``max_env_steps``
    training env steps are used. Evaluation runs only when the training episodes' mean return
    reaches ``eval_threshold`` times the longest possible training episode (500, or
    ``train_horizon``); evaluation steps are not counted in ``env_steps``. Returns the figures.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = categorical_mlp(obs_dim=4, num_actions=2, hidden=(hidden, hidden))
    policy = EpisodePolicy(ENV_ID, net, max_steps=train_horizon)
    overrides: dict[str, Any] = {}
    if learning_rate is not None:
        overrides["learning_rate"] = learning_rate
    if epochs is not None:
        overrides["num_epochs_per_update"] = epochs
    config = GRPOConfig.recipe(
        "small_policy", group_size=group_size, batch_size=batch_size, seed=seed, **overrides
    )
    trainer = GRPOTrainer(config, policy, EpisodeRewards())
    t0 = time.perf_counter()
    eval_mean, solved_at = float("nan"), None
    step = 0
    for step in range(1, max_steps + 1):
        seeds = rng.integers(0, 2**20, size=batch_size).tolist()
        m = trainer.step(seeds)
        evaluated = False
        last = step == max_steps or (max_env_steps is not None and policy.env_steps >= max_env_steps)
        if m["reward/mean"] >= eval_threshold * (train_horizon or 500) or last:
            returns = evaluate_episodes(policy, ENV_ID, EVAL_SEEDS[:eval_episodes])
            eval_mean, evaluated = float(returns.mean()), True
        if verbose and (step % log_every == 0 or step == 1 or evaluated):
            print(
                f"seed {seed} step {step:4d}  env_steps {policy.env_steps:7d}  "
                f"train return {m['reward/mean']:6.1f}  "
                + (f"eval return {eval_mean:6.1f}  " if evaluated else "")
                + f"{time.perf_counter() - t0:6.1f}s",
                flush=True,
            )
        if evaluated and eval_mean >= target:
            solved_at = step
            break
        if max_env_steps is not None and policy.env_steps >= max_env_steps:
            break
    policy.close()
    return {
        "seed": seed,
        "solved": solved_at is not None,
        "steps": step,
        "env_steps": policy.env_steps,
        "wall_s": time.perf_counter() - t0,
        "eval_mean": eval_mean,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per seed")
    parser.add_argument("--steps", type=int, default=200, help="maximum GRPO steps per seed")
    parser.add_argument("--batch-size", type=int, default=4, help="B, env seeds (groups) per step")
    parser.add_argument("--group-size", type=int, default=4, help="G, episodes per seed")
    parser.add_argument("--lr", type=float, default=None, help="learning rate; None keeps the preset's")
    parser.add_argument(
        "--epochs", type=int, default=None, help="num_epochs_per_update; None keeps the preset's"
    )
    parser.add_argument("--hidden", type=int, default=64, help="width of the two hidden layers")
    parser.add_argument(
        "--train-horizon",
        type=int,
        default=0,
        help="cap training episodes at this many steps (0: the env's 500); evaluation plays 500",
    )
    parser.add_argument("--eval-episodes", type=int, default=10, help="deterministic episodes per evaluation")
    parser.add_argument(
        "--target", type=float, default=475.0, help="stop when the evaluation mean reaches this"
    )
    args = parser.parse_args(argv)
    # trainer.step runs this small policy on one thread by itself (GRPOConfig.num_threads); the
    # evaluation episodes run outside it, and one thread is faster for them too
    torch.set_num_threads(1)

    results = [
        solve(
            s,
            max_steps=args.steps,
            batch_size=args.batch_size,
            group_size=args.group_size,
            learning_rate=args.lr,
            epochs=args.epochs,
            hidden=args.hidden,
            train_horizon=args.train_horizon or None,
            target=args.target,
            eval_episodes=args.eval_episodes,
        )
        for s in args.seeds
    ]
    print(f"\n{'seed':>4} {'solved':>6} {'steps':>6} {'env_steps':>10} {'wall_s':>7} {'eval':>7}")
    for r in results:
        print(
            f"{r['seed']:>4} {r['solved']!s:>6} {r['steps']:>6} {r['env_steps']:>10} "
            f"{r['wall_s']:>7.1f} {r['eval_mean']:>7.1f}"
        )
    return results


if __name__ == "__main__":
    main()
