"""GRPO on Pendulum-v1 with a Gaussian policy (continuous actions, episodes of 200 steps).

Goal: improve the mean return by at least half the gap between a random policy and -200, i.e.
reach ``random + (-200 - random) / 2``. The random baseline (uniform actions in [-2, 2]) and the
trained policy's deterministic return (the Gaussian's mean) are measured on the same 20
evaluation seeds, disjoint from the training seeds.

Run: ``python examples/pendulum.py`` (needs the gym extra: ``pip install -e ".[gym]"`` in a checkout).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import EpisodePolicy, EpisodeReturn, evaluate_episodes
from grpo.policies import gaussian_mlp

ENV_ID = "Pendulum-v1"
EVAL_SEEDS = list(range(1_000_000, 1_000_020))


def random_policy_return(seeds: Sequence[int]) -> float:
    """Mean return of uniformly random actions on ``seeds`` (one episode each)."""
    import gymnasium as gym

    env = gym.make(ENV_ID)
    env.action_space.seed(0)
    total = 0.0
    for s in seeds:
        env.reset(seed=s)
        done = False
        while not done:
            _, r, term, trunc, _ = env.step(env.action_space.sample())
            total += float(r)
            done = term or trunc
    env.close()
    return total / len(seeds)


def train(
    seed: int = 0,
    *,
    steps: int = 150,
    batch_size: int = 8,
    group_size: int = 8,
    learning_rate: float = 1e-3,
    epochs: int = 10,
    hidden: int = 64,
    log_std_init: float = -0.5,
    eval_every: int = 25,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train for ``steps`` GRPO steps; return random / initial / best / final evaluation returns."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = gaussian_mlp(obs_dim=3, action_dim=1, hidden=(hidden, hidden), log_std_init=log_std_init)
    policy = EpisodePolicy(ENV_ID, net)
    config = GRPOConfig(
        group_size=group_size,
        batch_size=batch_size,
        learning_rate=learning_rate,
        num_epochs_per_update=epochs,
        kl_coeff=0.0,
        seed=seed,
    )
    trainer = GRPOTrainer(config, policy, EpisodeReturn())
    eval_seeds = EVAL_SEEDS
    random_ret = random_policy_return(eval_seeds)
    initial = float(evaluate_episodes(policy, ENV_ID, eval_seeds).mean())
    target = random_ret + (-200.0 - random_ret) / 2
    t0 = time.perf_counter()
    final = best = initial
    for step in range(1, steps + 1):
        m = trainer.step(rng.integers(0, 2**20, size=batch_size).tolist())
        if step % eval_every == 0 or step == steps:
            final = float(evaluate_episodes(policy, ENV_ID, eval_seeds).mean())
            best = max(best, final)
            if verbose:
                print(
                    f"seed {seed} step {step:4d}  env_steps {policy.env_steps:8d}  train return "
                    f"{m['reward/mean']:8.1f}  eval return {final:8.1f}  (target {target:.0f})  "
                    f"std {net.net.log_std.exp().item():.2f}  {time.perf_counter() - t0:6.1f}s",
                    flush=True,
                )
    policy.close()
    return {
        "seed": seed,
        "random_return": random_ret,
        "initial_return": initial,
        "final_return": final,
        "best_return": best,
        "target": target,
        "reached": final >= target,
        "steps": steps,
        "env_steps": policy.env_steps,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps per seed")
    parser.add_argument("--batch-size", type=int, default=8, help="B, env seeds (groups) per step")
    parser.add_argument("--group-size", type=int, default=8, help="G, episodes per seed")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--epochs", type=int, default=10, help="num_epochs_per_update")
    parser.add_argument("--hidden", type=int, default=64, help="width of the two hidden layers")
    parser.add_argument("--log-std-init", type=float, default=-0.5, help="initial log std of the Gaussian")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    args = parser.parse_args(argv)
    # trainer.step runs this small policy on one thread by itself (GRPOConfig.num_threads); the
    # evaluation episodes run outside it, and one thread is faster for them too
    torch.set_num_threads(1)
    results = [
        train(
            s,
            steps=args.steps,
            batch_size=args.batch_size,
            group_size=args.group_size,
            learning_rate=args.lr,
            epochs=args.epochs,
            hidden=args.hidden,
            log_std_init=args.log_std_init,
            eval_every=min(args.eval_every, args.steps),
        )
        for s in args.seeds
    ]
    print(
        f"\n{'seed':>4} {'random':>8} {'initial':>8} {'final':>8} {'target':>8} {'reached':>7} "
        f"{'env_steps':>10} {'wall_s':>7}"
    )
    for r in results:
        print(
            f"{r['seed']:>4} {r['random_return']:>8.1f} {r['initial_return']:>8.1f} "
            f"{r['final_return']:>8.1f} "
            f"{r['target']:>8.1f} {r['reached']!s:>7} {r['env_steps']:>10} {r['wall_s']:>7.1f}"
        )
    return results


if __name__ == "__main__":
    main()
