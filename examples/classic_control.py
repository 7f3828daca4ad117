"""GRPO on gymnasium classic control with the `small_policy` preset and per-step credit.

One recipe for every task: ``GRPOConfig.recipe("small_policy", group_size=4, batch_size=4)``.
Each step plays B = 4 env seeds x G = 4 episodes; every env step is credited with its discounted
return-to-go (gamma 0.99), compared with the other episodes of its group at the same time step
(`grpo.gym.episodes.EpisodeRewards`). Discrete action spaces get ``categorical_mlp``, Box ones
``gaussian_mlp`` (64 x 64, like stable-baselines3's default MlpPolicy).

Goal-reaching tasks that pay nothing until the goal (Acrobot-v1, MountainCar-v0) start with every
episode failing alike: every group's rewards are equal and GRPO has nothing to compare. For those
``--bonus`` (the default for them) adds `grpo.gym.exploration.EpisodeSpread` with weight 0.01 to the
last step of each episode: a tie-breaker that only acts where a group's task rewards are all equal
(docs/gym_episodes.md, "All-fail tasks").

After ``--env-steps`` training env steps, the deterministic policy (argmax / Gaussian mean) plays
10 evaluation episodes on seeds 1,000,000.. (never used for training) and their mean return is
reported. Run::

    python examples/classic_control.py --env Acrobot-v1 --seeds 0 1 2 3 4
    python examples/classic_control.py --env Pendulum-v1 --seeds 0 1 2
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
from grpo.gym.exploration import EpisodeSpread
from grpo.policies import categorical_mlp, gaussian_mlp

EVAL_SEEDS = list(range(1_000_000, 1_000_010))
ALL_FAIL_AT_FIRST = ("Acrobot-v1", "MountainCar-v0")  # pay nothing until the goal


def make_trainer(
    env_id: str, seed: int, *, bonus: bool | None = None, batch_size: int = 4, group_size: int = 4
) -> tuple[GRPOTrainer, EpisodePolicy]:
    """The trainer every task here uses: the preset, per-step credit, a 64x64 MLP policy."""
    import gymnasium as gym

    torch.manual_seed(seed)
    probe = gym.make(env_id)
    obs_dim = int(np.prod(probe.observation_space.shape))
    space = probe.action_space
    probe.close()
    if isinstance(space, gym.spaces.Discrete):
        net = categorical_mlp(obs_dim, int(space.n))
    else:
        net = gaussian_mlp(obs_dim, int(np.prod(space.shape)))
    policy = EpisodePolicy(env_id, net)
    config = GRPOConfig.recipe("small_policy", group_size=group_size, batch_size=batch_size, seed=seed)
    use_bonus = env_id in ALL_FAIL_AT_FIRST if bonus is None else bonus
    reward = EpisodeRewards(bonus=EpisodeSpread() if use_bonus else None)
    return GRPOTrainer(config, policy, reward), policy


def train(
    env_id: str,
    seed: int = 0,
    *,
    env_steps: int = 100_000,
    bonus: bool | None = None,
    verbose: bool = True,
    log_every: int = 10,
) -> dict[str, Any]:
    """Train until ``env_steps`` training env steps are used; evaluate the deterministic policy.

    Returns seed, env_steps (used), eval_return (mean of the 10 evaluation episodes), wall_s.
    """
    trainer, policy = make_trainer(env_id, seed, bonus=bonus)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    step = 0
    while policy.env_steps < env_steps:
        metrics = trainer.step(rng.integers(0, 2**20, size=trainer.config.batch_size).tolist())
        step += 1
        if verbose and step % log_every == 0:
            print(
                f"{env_id} seed {seed} step {step:4d}  env_steps {policy.env_steps:7d}  "
                f"train return {metrics['reward/mean']:8.1f}  {time.perf_counter() - t0:6.1f}s",
                flush=True,
            )
    eval_return = float(evaluate_episodes(policy, env_id, EVAL_SEEDS).mean())
    policy.close()
    return {
        "seed": seed,
        "env_steps": policy.env_steps,
        "eval_return": eval_return,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--env", default="Acrobot-v1", help="a gymnasium classic-control env id")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per seed")
    parser.add_argument("--env-steps", type=int, default=100_000, help="training env steps per seed")
    parser.add_argument(
        "--bonus",
        choices=["auto", "on", "off"],
        default="auto",
        help="the all-fail tie-breaker (auto: on for Acrobot-v1 and MountainCar-v0)",
    )
    args = parser.parse_args(argv)
    # trainer.step runs this small policy on one thread by itself (GRPOConfig.num_threads); the
    # evaluation episodes run outside it, and one thread is faster for them too
    torch.set_num_threads(1)
    bonus = None if args.bonus == "auto" else args.bonus == "on"
    rows = [train(args.env, s, env_steps=args.env_steps, bonus=bonus) for s in args.seeds]
    print(f"\n{args.env}: deterministic return over {len(EVAL_SEEDS)} eval episodes")
    for r in rows:
        print(
            f"seed {r['seed']}  env_steps {r['env_steps']}  eval {r['eval_return']:8.1f}  {r['wall_s']:.1f}s"
        )
    return rows


if __name__ == "__main__":
    main()
