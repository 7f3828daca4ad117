"""Env steps per second (issue 27 item 3): a batched tensor environment against gymnasium's vector
env and stable-baselines3's PPO, on Pendulum-v1 (200-step episodes, 1-d torque).

Sides (each a separate process; run them alternately and report the spread):

* ``grpo-tensor``: `EpisodePolicy` over `grpo.envs.pendulum.TensorPendulum(N)`, N = B x G
  pendulums stepped in one call; ``collect``: ``generate_actions`` only (a policy forward per step
  for all N), ``train``: whole ``trainer.step`` s (collection + the small_policy update).
* ``grpo-gym``: the same over ``gymnasium.make_vec("Pendulum-v1", N, "sync")``.
* ``sb3``: ``PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs), device="cpu").learn(steps)``
  with its defaults otherwise (n_steps=2048 per env, 10 epochs): its whole loop (collection +
  update), and collection alone (``collect_rollouts`` of one rollout buffer).

Run (the sb3 side with an interpreter that has stable-baselines3)::

    python benchmarks/env_throughput.py --side grpo-tensor grpo-gym --envs 64 256
    /work/benchvenv/bin/python benchmarks/env_throughput.py --side sb3 --envs 1 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
G = 4


def report(side: str, n: int, collect: float, train: float) -> None:
    sys.stdout.write(
        f"{side:12s} N={n:4d}  collect {collect:9.0f} env steps/s  train {train:9.0f} env steps/s\n"
    )
    sys.stdout.flush()


def grpo_side(kind: str, n: int, rounds: int) -> None:
    import gymnasium as gym

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.envs.pendulum import TensorPendulum
    from grpo.gym.episodes import EpisodePolicy, EpisodeRewards
    from grpo.policies import gaussian_mlp

    torch.manual_seed(0)
    env = (
        TensorPendulum(n)
        if kind == "grpo-tensor"
        else gym.make_vec("Pendulum-v1", n, vectorization_mode="sync")
    )
    policy = EpisodePolicy(env, gaussian_mlp(3, 1))
    b = n // G
    seeds = [list(range(r * b, r * b + b)) for r in range(rounds + 1)]
    policy.generate_actions(seeds[0], G)  # warm-up
    t0, before = time.perf_counter(), policy.env_steps
    for r in range(rounds):
        policy.generate_actions(seeds[r + 1], G)
    collect = (policy.env_steps - before) / (time.perf_counter() - t0)
    trainer = GRPOTrainer(
        GRPOConfig.recipe("small_policy", group_size=G, batch_size=b), policy, EpisodeRewards()
    )
    t0, before = time.perf_counter(), policy.env_steps
    for r in range(rounds):
        trainer.step(seeds[r])
    train = (policy.env_steps - before) / (time.perf_counter() - t0)
    sys.stdout.write(
        f"{kind:12s} N={n:4d}  collect {collect:9.0f} env steps/s  train {train:9.0f} env steps/s\n"
    )


def sb3_side(n: int, steps: int) -> None:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    model = PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=n, seed=0), seed=0, device="cpu")
    t0 = time.perf_counter()
    model.learn(total_timesteps=steps)
    train = model.num_timesteps / (time.perf_counter() - t0)
    from stable_baselines3.common.callbacks import BaseCallback

    class Nothing(BaseCallback):
        def _on_step(self) -> bool:
            return True

    cb = Nothing()
    cb.init_callback(model)
    t0 = time.perf_counter()
    model.collect_rollouts(model.env, cb, model.rollout_buffer, n_rollout_steps=model.n_steps)
    collect = model.n_steps * n / (time.perf_counter() - t0)
    sys.stdout.write(
        f"{'sb3-ppo':12s} N={n:4d}  collect {collect:9.0f} env steps/s  train {train:9.0f} env steps/s\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", nargs="+", default=["grpo-tensor", "grpo-gym"])
    p.add_argument("--envs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=5, help="grpo: collections / trainer steps timed")
    p.add_argument("--sb3-steps", type=int, default=20_480, help="sb3: env steps of learn() timed")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for n in args.envs:
        for side in args.side:
            if side == "sb3":
                sb3_side(n, args.sb3_steps)
            else:
                grpo_side(side, n, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
