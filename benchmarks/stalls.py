"""Stalls: which remedy makes GRPO learn on a task where every group fails?

MountainCar-v0 with a random policy never reaches the flag within its 200 steps, so every episode
returns -200, every group has zero variance, every advantage is exactly 0 and (with kl_coeff = 0,
entropy_coeff = 0) so is the gradient. Candidates, each for the same env-step budget:

    none            plain GRPO (the stall)
    entropy         entropy_coeff = 0.01
    group32         B = 2 seeds x G = 32 episodes (the same 64 episodes per step, larger groups)
    batchbase       advantage_baseline = 'batch' (a fallback baseline across groups)
    spread          CombinedReward(task + 0.01 * EpisodeSpread): a small state-spread bonus
    spread20        the same bonus with weight 20
    spread20_decay  weight 20 decayed linearly to 0 over the first 15 steps (~190k env steps)

Common setup: categorical_mlp(obs_dim, n_actions, (64, 64)) on observations scaled to [-1, 1] by
the observation space's bounds, B = 8 env seeds x G = 8 episodes per step (group32: 2 x 32),
lr 3e-3, 4 epochs per update, kl_coeff 0, until the budget of training env steps is used; then
the greedy policy plays 20 held-out starts. Prints one JSON line per run: env steps, the env steps
when a training episode first reached the goal, the greedy mean return and success rate, wall
time, and a few points of the training curve (step, env steps, mean task return, frac_zero_std) and the
steps at which a StallWarning was raised.

Run from the repository root (torch uses one thread):

    python benchmarks/stalls.py --env MountainCar-v0 --seeds 0 1 2 --budget 400000
    python benchmarks/stalls.py --env Acrobot-v1 --candidates none spread --budget 800000
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

import numpy as np
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import EpisodePolicy, EpisodeReturn, evaluate_episodes
from grpo.gym.exploration import EpisodeSpread
from grpo.policies import categorical_mlp
from grpo.reward_model_base import CombinedReward
from grpo.training.stall_watch import StallWarning

EVAL_SEEDS = list(range(1_000_000, 1_000_020))
CANDIDATES = ["none", "entropy", "group32", "batchbase", "spread", "spread20", "spread20_decay"]


def make_env(env_id: str) -> Any:
    """``env_id`` with observations scaled to [-1, 1] by the observation space's bounds (a fixed
    affine map, so the G episodes of a group still start from one observation)."""
    import gymnasium as gym

    def factory() -> Any:
        env = gym.make(env_id)
        low, high = env.observation_space.low, env.observation_space.high
        center, half = (high + low) / 2, (high - low) / 2
        space = gym.spaces.Box(-1.0, 1.0, shape=low.shape, dtype=np.float32)
        return gym.wrappers.TransformObservation(
            env, lambda o: ((o - center) / half).astype(np.float32), space
        )

    return factory


class DecayingSpread(EpisodeSpread):
    """``EpisodeSpread`` times ``max(0, 1 - calls / decay_calls)``: with weight w in a
    CombinedReward, the bonus weight decays linearly from w to 0 over ``decay_calls`` steps."""

    def __init__(self, decay_calls: int) -> None:
        self.decay_calls, self.calls = decay_calls, 0

    def compute_rewards(self, states: Any, actions: Any) -> torch.Tensor:
        factor = max(0.0, 1.0 - self.calls / self.decay_calls)
        self.calls += 1
        return super().compute_rewards(states, actions) * factor


def run(env_id: str, candidate: str, seed: int, budget: int, lr: float, epochs: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    b, g = (2, 32) if candidate == "group32" else (8, 8)
    factory = make_env(env_id)
    probe = factory()
    obs_dim, n_act = int(np.prod(probe.observation_space.shape)), int(probe.action_space.n)
    probe.close()
    policy = EpisodePolicy(factory, categorical_mlp(obs_dim, n_act, hidden=(64, 64)))
    config = GRPOConfig(
        group_size=g, batch_size=b, learning_rate=lr, num_epochs_per_update=epochs, kl_coeff=0.0,
        entropy_coeff=0.01 if candidate == "entropy" else 0.0, seed=seed,
        advantage_baseline="batch" if candidate == "batchbase" else "group",
    )  # fmt: skip
    reward: Any = EpisodeReturn()
    if candidate == "spread":
        reward = CombinedReward({"task": EpisodeReturn(), "spread": EpisodeSpread()}, {"spread": 0.01})
    elif candidate == "spread20":
        reward = CombinedReward({"task": EpisodeReturn(), "spread": EpisodeSpread()}, {"spread": 20.0})
    elif candidate == "spread20_decay":
        reward = CombinedReward({"task": EpisodeReturn(), "spread": DecayingSpread(15)}, {"spread": 20.0})
    trainer = GRPOTrainer(config, policy, reward)
    t0 = time.perf_counter()
    first_success: int | None = None
    curve = []
    stall_warnings: list[int] = []  # steps at which a StallWarning was raised
    cap = -200.0 if env_id.startswith("MountainCar") else -500.0
    step = 0
    while policy.env_steps < budget:
        step += 1
        seeds = rng.integers(0, 2**20, size=b).tolist()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StallWarning)
            m = trainer.step(seeds)
        stall_warnings += [step for w in caught if issubclass(w.category, StallWarning)]
        task_mean = m.get("reward/task/mean", m["reward/mean"])
        if first_success is None and task_mean > cap:  # returns are >= cap, = cap only on failure
            first_success = policy.env_steps
        curve.append((step, policy.env_steps, round(task_mean, 2), round(m["reward/frac_zero_std"], 3)))
    returns = evaluate_episodes(policy, factory, EVAL_SEEDS)
    return {
        "env": env_id,
        "candidate": candidate,
        "seed": seed,
        "env_steps": policy.env_steps,
        "first_success_env_steps": first_success,
        "eval_mean": float(returns.mean()),
        "eval_success": float((returns > cap + 0.5).mean()),
        "wall_s": round(time.perf_counter() - t0, 1),
        "steps": step,
        "stall_warnings": stall_warnings,
        "curve": curve[:: max(1, step // 8)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="MountainCar-v0")
    p.add_argument("--candidates", nargs="+", default=CANDIDATES)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=400_000, help="env steps per run")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    for c in args.candidates:
        for s in args.seeds:
            print(json.dumps(run(args.env, c, s, args.budget, args.lr, args.epochs)), flush=True)


if __name__ == "__main__":
    main()
