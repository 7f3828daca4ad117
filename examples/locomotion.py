"""Locomotion without a critic: GRPO with branched groups on a gymnasium MuJoCo task.

The current policy plays a trunk; every H steps a snapshot of the simulator becomes a GRPO state;
from each of B = 8 snapshots, G = 4 continuations of at most H = 64 steps form a group, and each
step is credited with its return-to-go against the group's other branches at the same step
(`grpo.gym.branching`, docs/gym_episodes.md "Branching"). Every env step is counted, trunk and
branches. At the end the deterministic policy's mean return over 10 evaluation episodes is
printed (seeds 1_000_000.., as benchmarks/locomotion.py evaluates)::

    python examples/locomotion.py                                   # InvertedDoublePendulum-v5, 200k steps
    python examples/locomotion.py --env Hopper-v5 --budget 1000000
    python examples/locomotion.py --budget 2000                     # smoke test

Needs ``pip install -e ".[gym,mujoco]"`` for the MuJoCo tasks (``--env Pendulum-v1`` runs with
``[gym]`` alone).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.branching import BranchPoints, branching_policy
from grpo.gym.episodes import EpisodeRewards, evaluate_episodes
from grpo.gym.snapshots import SnapshotStore
from grpo.policies import gaussian_mlp

log = logging.getLogger("locomotion")


def train(env_id: str, budget: int, *, seed: int = 0, horizon: int = 64, group_size: int = 4) -> float:
    """Train for ``budget`` env steps; returns the mean evaluation return."""
    import gymnasium as gym

    torch.manual_seed(seed)
    probe = gym.make(env_id)
    obs_dim, act_dim = int(np.prod(probe.observation_space.shape)), int(np.prod(probe.action_space.shape))
    probe.close()
    store = SnapshotStore()
    policy = branching_policy(env_id, gaussian_mlp(obs_dim, act_dim), store, horizon=horizon)
    trunk = BranchPoints(env_id, policy, store, every=horizon, seed=seed)
    config = GRPOConfig.recipe("small_policy", group_size=group_size, batch_size=8, seed=seed)
    trainer = GRPOTrainer(config, policy, EpisodeRewards())
    start, step = time.perf_counter(), 0
    while trunk.env_steps + policy.env_steps < budget:
        metrics = trainer.step(trunk.sample(config.batch_size))
        step += 1
        if step % 20 == 0:
            steps = trunk.env_steps + policy.env_steps
            log.info("step %4d  env steps %8d  branch reward %7.3f", step, steps, metrics["reward/mean"])
    score = float(evaluate_episodes(policy, env_id, seeds=range(1_000_000, 1_000_010)).mean())
    log.info(
        "%s: %d env steps (trunk %d, branches %d) in %.0f s; evaluation return %.1f",
        env_id, trunk.env_steps + policy.env_steps, trunk.env_steps, policy.env_steps,
        time.perf_counter() - start, score,
    )  # fmt: skip
    policy.close()
    trunk.close()
    return score


def main(argv: Sequence[str] | None = None) -> float:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--env", default="InvertedDoublePendulum-v5", help="a gymnasium env id (Box actions)")
    p.add_argument("--budget", type=int, default=200_000, help="env steps, trunk and branches")
    p.add_argument("--seed", type=int, default=0, help="seeds the policy, the trainer and the trunk")
    p.add_argument("--horizon", type=int, default=64, help="H: steps per branch and per snapshot")
    p.add_argument("--group-size", type=int, default=4, help="G: branches per snapshot")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    return train(args.env, args.budget, seed=args.seed, horizon=args.horizon, group_size=args.group_size)


if __name__ == "__main__":
    main()
