"""Locomotion (issue 27): GRPO on gymnasium's MuJoCo tasks, whole episodes vs branching, vs PPO.

Every row trains for the same budget of env steps, every env step counted (trunk and branches
included for branching), then the deterministic policy's mean return over 10 evaluation episodes
on seeds 1_000_000.. (the same for every row; evaluation steps are not counted). Rows:

* ``episodes`` (``episodes-B<b>-G<g>``: other sizes): what docs/gym_episodes.md recommends:
  ``gaussian_mlp``, ``EpisodeRewards()``, ``GRPOConfig.recipe("small_policy", group_size=4,
  batch_size=4)``, B=4 whole episodes x G=4;
* ``branch-H<h>-G<g>``: `grpo.gym.branching` with horizon H and group size G, B=8 snapshots per
  update, one every ``H`` trunk steps, the same preset;
* ``...-seg``: the same with ``EpisodeReturn(gamma)``: one discounted return per episode or
  branch, every step of it credited alike (segment credit) instead of per-step returns-to-go;
* ``value`` (``value-B<b>-G<g>``): a reference only, not a grpo recipe: whole episodes as in
  ``episodes`` with a learned state-value baseline (a 64x64 MLP fit to the Monte Carlo
  returns-to-go of each batch, 10 Adam epochs): the per-step rewards are reshaped as
  ``r'_t = r_t + gamma V(s_{t+1}) - V(s_t)`` (``V = 0`` after the last step), whose
  return-to-go telescopes to ``G_t - V(s_t)``, then group-normalised per step as usual;
* ``value-gae``: the same shaped rewards ``delta_t`` (gamma 0.99) with the trainer's discount set
  to ``gamma * lambda = 0.99 * 0.95``: the return-to-go of ``delta`` is then PPO's GAE(0.99, 0.95)
  advantage, a bootstrapped one (a reference for what a critic's bootstrap buys);
* ``ppo``: stable-baselines3 ``PPO("MlpPolicy", env, seed=seed, device="cpu")`` with its
  defaults (run with an interpreter that has stable-baselines3; never a grpo dependency).

Run from the repository root::

    python benchmarks/locomotion.py --env Hopper-v5 --budget 200000 --seeds 0 \
        --rows episodes branch-H64-G4 [--json out.json]
    /work/benchvenv/bin/python benchmarks/locomotion.py --env Hopper-v5 --budget 200000 --rows ppo

Prints one line per (row, seed): the evaluation return, env steps, updates, wall clock.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.reward_model_base import StatelessReward  # noqa: E402

EVAL_SEEDS = range(1_000_000, 1_000_010)
logger = logging.getLogger("locomotion")


def evaluate(policy_fn: Any, env_id: str) -> float:
    """Mean return of 10 deterministic episodes (``policy_fn(obs) -> action``)."""
    import gymnasium as gym

    env = gym.make(env_id)
    total = []
    for seed in EVAL_SEEDS:
        obs, _ = env.reset(seed=seed)
        done, ret = False, 0.0
        while not done:
            obs, r, term, trunc, _ = env.step(policy_fn(obs))
            ret += float(r)
            done = term or trunc
        total.append(ret)
    env.close()
    return float(np.mean(total))


class ValueBaseline(StatelessReward):
    """Reward model of the ``value`` row: per-step rewards minus a learned V(s) baseline.

    ``compute_rewards(states, episodes) -> (N, T)`` returns ``r_t + gamma V(s_{t+1}) - V(s_t)``
    (V detached; 0 after the end, so an episode's return-to-go is ``G_t - V(s_t)``), then fits V
    to this batch's Monte Carlo returns-to-go ``G_t`` (so the baseline used is the previous one).
    """

    def __init__(self, obs_dim: int, gamma: float, seed: int) -> None:
        from grpo.algorithms.advantages import discounted_returns

        torch.manual_seed(seed + 10_000)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(obs_dim, 64),
            torch.nn.Tanh(),
            torch.nn.Linear(64, 64),
            torch.nn.Tanh(),
            torch.nn.Linear(64, 1),
        )
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        self.gamma = gamma
        self.returns_to_go = discounted_returns
        self.scale = torch.tensor(1.0)  # V(s) = net(s) * scale (the net fits G / scale)

    def compute_rewards(self, states: Any, actions: Any) -> torch.Tensor:
        from grpo.gym.episodes import stack_episodes

        obs, _, rew, mask = stack_episodes(actions, "ValueBaseline")
        rew = rew * mask
        with torch.no_grad():
            v = self.net(obs).squeeze(-1) * self.scale * mask
        v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
        shaped = (rew + self.gamma * v_next - v) * mask
        self._fit(obs[mask], self.returns_to_go(rew, mask, self.gamma)[mask])
        return shaped

    def _fit(self, obs: torch.Tensor, target: torch.Tensor) -> None:
        scale = target.abs().mean().clamp(min=1.0)  # fit G / scale: one lr for every task
        with torch.enable_grad():  # rewards are computed under no_grad
            self._fit_scaled(obs, target / scale)
        self.scale = scale

    def _fit_scaled(self, obs: torch.Tensor, target: torch.Tensor) -> None:
        for _ in range(10):
            for idx in torch.randperm(obs.shape[0]).split(256):
                loss = ((self.net(obs[idx]).squeeze(-1) - target[idx]) ** 2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()


def grpo_row(env_id: str, row: str, seed: int, budget: int, overrides: dict[str, Any]) -> dict[str, Any]:
    import gymnasium as gym

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.gym.branching import BranchPoints, branching_policy
    from grpo.gym.episodes import EpisodePolicy, EpisodeReturn, EpisodeRewards
    from grpo.gym.snapshots import SnapshotStore
    from grpo.policies import gaussian_mlp

    torch.manual_seed(seed)
    probe = gym.make(env_id)
    obs_dim, act_dim = probe.observation_space.shape[0], probe.action_space.shape[0]
    probe.close()
    net = gaussian_mlp(obs_dim, act_dim)
    rng = np.random.default_rng(seed)
    trunk = None
    if row.startswith(("episodes", "value")):
        m = re.fullmatch(r"(?:episodes|value(?:-gae)?)(?:-B(\d+)-G(\d+))?(?:-seg)?", row)
        if m is None:
            raise ValueError(f"unknown row {row!r}")
        b, g = (int(m.group(1)), int(m.group(2))) if m.group(1) else (4, 4)
        policy = EpisodePolicy(env_id, net)

        def states() -> list[int]:
            return rng.integers(0, 2**31, size=b).tolist()
    else:
        m = re.fullmatch(r"branch-H(\d+)-G(\d+)(?:-seg)?", row)
        if m is None:
            raise ValueError(f"unknown row {row!r}")
        horizon, g, b = int(m.group(1)), int(m.group(2)), 8
        store = SnapshotStore()
        policy = branching_policy(env_id, net, store, horizon=horizon)
        trunk = BranchPoints(env_id, policy, store, every=horizon, seed=seed)

        def states() -> list[int]:
            assert trunk is not None
            return trunk.sample(b)

    if row.startswith("value-gae"):  # the return-to-go of delta_t under gamma * lambda is GAE
        overrides = {"gamma": 0.99 * 0.95, **overrides}
    config = GRPOConfig.recipe("small_policy", group_size=g, batch_size=b, seed=seed, **overrides)
    # "-seg": one return per episode / branch (segment credit), else per-step returns-to-go
    reward: Any = EpisodeReturn(gamma=config.gamma) if row.endswith("-seg") else EpisodeRewards()
    if row.startswith("value"):
        reward = ValueBaseline(obs_dim, 0.99 if row.startswith("value-gae") else config.gamma, seed)
    trainer = GRPOTrainer(config, policy, reward)
    t0 = time.perf_counter()
    updates = 0

    def steps() -> int:
        return policy.env_steps + (trunk.env_steps if trunk is not None else 0)

    while steps() < budget:
        trainer.step(states())
        updates += 1
    wall = time.perf_counter() - t0
    dist_policy = policy.policy

    def act(obs: Any) -> Any:
        with torch.no_grad():
            d = dist_policy.distribution(np.asarray(obs, dtype=np.float32).reshape(1, -1))
            return d.mode[0].numpy()

    ret = evaluate(act, env_id)
    policy.close()
    if trunk is not None:
        trunk.close()
    return {"return": ret, "env_steps": steps(), "updates": updates, "wall_s": wall}


def ppo_row(env_id: str, seed: int, budget: int) -> dict[str, Any]:
    from stable_baselines3 import PPO

    t0 = time.perf_counter()
    model = PPO("MlpPolicy", env_id, seed=seed, device="cpu")
    model.learn(total_timesteps=budget)
    wall = time.perf_counter() - t0
    ret = evaluate(lambda obs: model.predict(obs, deterministic=True)[0], env_id)
    return {"return": ret, "env_steps": int(model.num_timesteps), "updates": None, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="Hopper-v5")
    p.add_argument("--budget", type=int, default=200_000, help="env steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--rows", nargs="+", default=["episodes", "branch-H64-G4"])
    p.add_argument("--json", type=Path, help="append the results (JSON lines) here")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=JSON", help="GRPOConfig overrides (grpo rows)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    for seed in args.seeds:
        for row in args.rows:
            if row == "ppo":
                res = ppo_row(args.env, seed, args.budget)
            else:
                res = grpo_row(args.env, row, seed, args.budget, overrides)
            res |= {"env": args.env, "row": row, "seed": seed, "budget": args.budget, "set": args.set}
            shown = f"{args.env:16s} {row:16s} {' '.join(args.set):24s} seed {seed}"
            sys.stdout.write(
                f"{shown}  return {res['return']:9.1f}  env steps {res['env_steps']:8d}  "
                f"updates {res['updates']}  wall {res['wall_s']:7.1f} s\n"
            )
            sys.stdout.flush()
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
