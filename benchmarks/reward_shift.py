"""Restart on a reward shift: does the rule restart when the task changed, and only then?

Five non-stationary tasks, each run with three settings of the ``small_policy`` preset:

    none      reward_shift_z=None (no restart)
    drop      the drop alone restarts (the rule before the preference check: stage 1 of
              grpo.training.reward_shift, every drop a restart)
    checked   the preset's rule (stage 1, then stage 2: restart only when the policy's favoured
              actions lost their edge in their groups)

Tasks (10 arms, Bernoulli rewards, one state and G = 8 pulls a round, 450 rounds; the means of
``examples/dynamic_bandit.make_bandit``):

    switch     the best arm switches at rounds 150 and 300 (the "non-stationary" row of
               benchmarks/learning.py)
    shift      no switch; from round 150 on every reward is r - 0.5 (the task got harder by the
               same amount for every arm: the best arm stays best)
    rescale    no switch; from round 150 on every reward is 0.2 r
    walk       no switch, no sinusoid: each arm's mean takes a Gaussian random walk (std 0.03 a
               round, clipped to [0.02, 0.98]), so the best arm changes now and then
    cartpole   CartPole-v1 capped at 200 steps (B = 4 seeds x G = 4 episodes, categorical_mlp
               64x64, EpisodeRewards): 50 steps; then for 50 more the cart's push slips (it goes
               the other way with probability 0.3: harder dynamics, the same best action)

Metric: bandits, the policy's expected reward / the oracle's (from the arm means) over the rounds
after the first change (all rounds for walk); cartpole, the mean training return over the last 20
steps. Also: the restarts made and, for the bandits, P(best arm) at the end.

Run from the repository root (one thread, each run seeded)::

    python benchmarks/reward_shift.py --tasks switch shift rescale walk cartpole --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import dynamic_bandit as db

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import EpisodePolicy, EpisodeRewards
from grpo.policies import DistributionPolicy, categorical_mlp
from grpo.training.reward_shift import RewardShiftRestart

TASKS = ("switch", "shift", "rescale", "walk", "cartpole")
VARIANTS = ("none", "drop", "checked")
ARMS, ROUNDS, CHANGE, G = 10, 450, 150, 8


class DropOnly(RewardShiftRestart):
    """The rule without its probation: every drop of a settled policy is a restart that stands."""

    def _judge(self, sums: Sequence[float]) -> bool:
        self.incumbent = None
        return False


def make_trainer(config: GRPOConfig, policy: Any, reward: Any, variant: str) -> GRPOTrainer:
    trainer = GRPOTrainer(config, policy, reward)
    if variant == "drop":
        trainer.reward_shift = DropOnly(trainer.params, z=config.reward_shift_z or 4.0)
    return trainer


def config(variant: str, seed: int, **overrides: Any) -> GRPOConfig:
    z = None if variant == "none" else 4.0
    return GRPOConfig.recipe("small_policy", seed=seed, reward_shift_z=z, **overrides)


def bandit_means(task: str, seed: int) -> tuple[Tensor, int]:
    """(rounds, K) arm means and the first round whose rewards changed."""
    if task == "switch":
        b = db.make_bandit(num_arms=ARMS, rounds=ROUNDS, num_phases=3, seed=seed)
        return b.means, b.switches[0]
    if task == "walk":
        g = torch.Generator().manual_seed(seed)
        start = 0.15 + 0.7 * torch.rand(ARMS, generator=g)
        steps = 0.03 * torch.randn(ROUNDS, ARMS, generator=g)
        steps[0] = 0
        return (start + steps.cumsum(0)).clamp(0.02, 0.98), 0
    b = db.make_bandit(num_arms=ARMS, rounds=ROUNDS, num_phases=1, seed=seed)
    return b.means, CHANGE


def run_bandit(task: str, variant: str, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    means, first = bandit_means(task, seed)
    transform: Callable[[Tensor], Tensor] = {
        "shift": lambda r: r - 0.5, "rescale": lambda r: 0.2 * r
    }.get(task, lambda r: r)  # fmt: skip
    gen = torch.Generator().manual_seed(10_000 + seed)
    clock = [0]

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        t = int(states[0, 0])
        r = torch.bernoulli(means[t, actions.long()], generator=gen)
        return transform(r) if t >= CHANGE else r

    torch.manual_seed(seed)
    policy = DistributionPolicy(db.ArmPreferences(ARMS))
    trainer = make_trainer(config(variant, seed, group_size=G, batch_size=1), policy, reward, variant)
    probs = np.zeros((ROUNDS, ARMS))
    restarts = given_back = 0
    for t in range(ROUNDS):
        clock[0] = t
        with torch.no_grad():
            probs[t] = torch.softmax(policy.net.theta, 0).numpy()
        m = trainer.step(torch.full((1, 1), float(t)))
        restarts += int(m.get("restart/reward_shift", 0.0))
        given_back += int(m.get("restart/given_back", 0.0))
    mu = means.double().numpy()
    expected = (probs * mu).sum(1)
    score = float(expected[first:].sum() / mu.max(1)[first:].sum())
    p_best = float(probs[-1, mu[-1].argmax()])
    return {
        "score": score,
        "restarts": restarts,
        "given_back": given_back,
        "p_best": p_best,
        "wall_s": time.perf_counter() - t0,
    }


SLIP = 0.3


class Slip:
    """The probability that a push goes the other way, shared by every sub-env."""

    p = 0.0


def cartpole_env() -> Any:
    import gymnasium as gym

    class Slippery(gym.Wrapper):  # type: ignore[misc]
        rng = np.random.default_rng(0)

        def reset(self, *, seed: int | None = None, **kwargs: Any) -> Any:
            self.rng = np.random.default_rng(seed)
            return self.env.reset(seed=seed, **kwargs)

        def step(self, action: Any) -> Any:
            if self.rng.random() < Slip.p:
                action = 1 - int(action)
            return self.env.step(action)

    return Slippery(gym.make("CartPole-v1"))


def run_cartpole(variant: str, seed: int, steps: int = 50) -> dict[str, Any]:
    t0 = time.perf_counter()
    Slip.p = 0.0
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = categorical_mlp(obs_dim=4, num_actions=2, hidden=(64, 64))
    policy = EpisodePolicy(cartpole_env, net, max_steps=200)
    trainer = make_trainer(
        config(variant, seed, group_size=4, batch_size=4), policy, EpisodeRewards(), variant
    )
    returns, restarts, given_back = [], 0, 0
    for step in range(2 * steps):
        if step == steps:
            Slip.p = SLIP
        m = trainer.step(rng.integers(0, 2**20, size=4).tolist())
        returns.append(m["reward/mean"])
        restarts += int(m.get("restart/reward_shift", 0.0))
        given_back += int(m.get("restart/given_back", 0.0))
    policy.close()
    return {
        "score": float(np.mean(returns[-20:])),
        "before": float(np.mean(returns[steps - 10 : steps])),
        "restarts": restarts,
        "given_back": given_back,
        "env_steps": policy.env_steps,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="tasks to run (default: all)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="rules (default: all)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default: 0 1 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            for variant in args.variants:  # the variants alternate seed by seed
                out = run_cartpole(variant, seed) if task == "cartpole" else run_bandit(task, variant, seed)
                row = {"task": task, "variant": variant, "seed": seed, **out}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
