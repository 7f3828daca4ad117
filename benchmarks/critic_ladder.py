"""Where critic-free GRPO loses to PPO on locomotion: PPO's own update, with and without its critic.

A minimal PPO with stable-baselines3's defaults (64x64 tanh networks with orthogonal init, a
state-independent log-std starting at 0, Adam 3e-4 with eps 1e-5, rollouts of 2,048 steps from one
env, 10 epochs of mini-batches of 64 steps, advantages normalised per mini-batch, clip 0.2,
gradient norm 0.5, GAE(0.99, 0.95), value loss weight 0.5, bootstrapping at time limits), and the
same update fed critic-free advantages instead. Only the advantage changes between the modes:

* ``gae``: PPO: ``A_t = GAE(0.99, 0.95)`` from a learned ``V(s)`` (the control: it must land where
  SB3's PPO lands, benchmarks/RESULTS.md);
* ``group``: no critic; each update plays B x G whole episodes, G from one seed, and credits step t
  of episode i with ``A_it = G_it - mean_{j in group, alive at t} G_jt`` (returns-to-go, gamma 0.99;
  0 where fewer than two episodes are alive): grpo's per-step group credit (`EpisodeRewards` with
  ``advantage_scale="none"``), optimised by PPO's update (mini-batches of 64 steps across groups);
* ``branch``: no critic; B snapshots one every H steps along a trunk played by the policy, G
  branches of at most H steps from each, credited as ``group`` within each branch group
  (grpo.gym.branching's estimator), again with PPO's update.

If ``group`` / ``branch`` reach ``gae`` on a task, the update is what grpo lacks there; if they
stay below it with PPO's own update, the critic's bootstrapped per-state baseline is the gap.
Run from the repository root (one thread; prints one JSON line per run)::

    python benchmarks/critic_ladder.py --env Walker2d-v5 --seed 0 --mode gae
    python benchmarks/critic_ladder.py --env Walker2d-v5 --seed 0 --mode group --B 4 --G 4
    python benchmarks/critic_ladder.py --env InvertedDoublePendulum-v5 --seed 0 --mode branch --B 8 --H 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from locomotion import evaluate  # noqa: E402 (the same 10 evaluation episodes as every row)

from grpo.gym.snapshots import restore, snapshot  # noqa: E402

Batch = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]  # obs, actions, log-probs, A, V targets


def mlp(n_in: int, n_out: int, out_gain: float) -> nn.Sequential:
    """64x64 tanh MLP with SB3's orthogonal init (hidden gain sqrt 2, zero biases)."""
    net = nn.Sequential(nn.Linear(n_in, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, n_out))
    for layer, gain in zip((net[0], net[2], net[4]), (np.sqrt(2), np.sqrt(2), out_gain), strict=True):
        assert isinstance(layer, nn.Linear)
        nn.init.orthogonal_(layer.weight, gain)
        nn.init.zeros_(layer.bias)
    return net


def group_advantages(returns: np.ndarray) -> np.ndarray:
    """``(G, T)`` returns-to-go (NaN after an episode's end) -> ``G_it - mean_{j alive at t} G_jt``,
    0 where fewer than two are alive (and after the end)."""
    alive = ~np.isnan(returns)
    count = alive.sum(0, keepdims=True)
    total = np.where(alive, returns, 0.0).sum(0, keepdims=True)
    mean = total / np.maximum(count, 1)
    return np.where(alive & (count >= 2), returns - mean, 0.0)


def returns_to_go(rewards: list[float], gamma: float, length: int) -> np.ndarray:
    """``G_t = r_t + gamma G_{t+1}`` over one episode, NaN-padded to ``length``."""
    out = np.full(length, np.nan)
    g = 0.0
    for t in reversed(range(len(rewards))):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


class Ladder:
    """The policy, the critic (``gae`` only), the optimiser and the env-step count of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        import gymnasium as gym

        self.args, self.gym = args, gym
        probe = gym.make(args.env)
        self.low, self.high = probe.action_space.low, probe.action_space.high
        obs_dim, act_dim = probe.observation_space.shape[0], probe.action_space.shape[0]
        probe.close()
        self.pi, self.vf = mlp(obs_dim, act_dim, 0.01), mlp(obs_dim, 1, 1.0)
        self.log_std = nn.Parameter(torch.zeros(act_dim))
        params = [*self.pi.parameters(), self.log_std]
        if args.mode == "gae":
            params += list(self.vf.parameters())
        self.params = params
        self.opt = torch.optim.Adam(params, lr=3e-4, eps=1e-5)
        self.rng = np.random.default_rng(args.seed)
        self.steps = 0

    def dist(self, obs: Tensor) -> torch.distributions.Normal:
        return torch.distributions.Normal(self.pi(obs), self.log_std.exp())

    def value(self, obs: Any) -> float:
        with torch.no_grad():
            return float(self.vf(torch.as_tensor(obs, dtype=torch.float32))[0])

    def act(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """Sampled actions and their log-probs (no grad)."""
        with torch.no_grad():
            d = self.dist(obs)
            a = d.sample()
            return a, d.log_prob(a).sum(-1)

    def env_step(self, env: Any, action: Tensor) -> tuple[Any, float, bool, bool]:
        obs, r, term, trunc, _ = env.step(np.clip(action.numpy(), self.low, self.high))
        self.steps += 1
        return obs, float(r), bool(term), bool(trunc)

    def new_seed(self) -> int:
        return int(self.rng.integers(0, 2**31))

    # ---- the three advantage estimators -----------------------------------------------
    def collect_gae(self, env: Any, state: dict[str, Any], n_steps: int = 2048) -> Batch:
        """``n_steps`` steps of one env (autoreset), GAE(0.99, 0.95) with bootstrapping at time limits."""
        gamma, lam = 0.99, 0.95
        obs_l, act_l, lp_l, rew, done, val = [], [], [], [], [], []
        o = state["obs"]
        for _ in range(n_steps):
            ot = torch.as_tensor(o, dtype=torch.float32)
            a, lp = self.act(ot[None])
            v = self.value(o)
            o, r, term, trunc = self.env_step(env, a[0])
            if trunc and not term:
                r += gamma * self.value(o)
            obs_l.append(ot)
            act_l.append(a[0])
            lp_l.append(lp[0])
            rew.append(r)
            done.append(term or trunc)
            val.append(v)
            if term or trunc:
                o, _ = env.reset(seed=self.new_seed())
        state["obs"] = o
        adv, g, last = np.zeros(n_steps), 0.0, self.value(o)
        for t in reversed(range(n_steps)):
            nonterminal = 0.0 if done[t] else 1.0
            next_v = last if t == n_steps - 1 else val[t + 1]
            g = rew[t] + gamma * next_v * nonterminal - val[t] + gamma * lam * nonterminal * g
            adv[t] = g
        targets = torch.as_tensor(adv + np.array(val), dtype=torch.float32)
        return (
            torch.stack(obs_l),
            torch.stack(act_l),
            torch.stack(lp_l),
            torch.as_tensor(adv, dtype=torch.float32),
            targets,
        )

    def play_group(self, envs: list[Any], starts: list[Any], max_steps: int | None) -> Batch:
        """Play ``len(envs)`` episodes from their start observations (one group), credited with
        `group_advantages` of their returns-to-go (gamma 0.99)."""
        n = len(envs)
        obs, alive = list(starts), [True] * n
        trajs: list[list[tuple[Tensor, Tensor, Tensor, float]]] = [[] for _ in range(n)]
        t = 0
        while any(alive) and (max_steps is None or t < max_steps):
            idx = [i for i in range(n) if alive[i]]
            ot = torch.as_tensor(np.stack([obs[i] for i in idx]), dtype=torch.float32)
            a, lp = self.act(ot)
            for k, i in enumerate(idx):
                obs[i], r, term, trunc = self.env_step(envs[i], a[k])
                trajs[i].append((ot[k], a[k], lp[k], r))
                alive[i] = not (term or trunc)
            t += 1
        length = max(len(tr) for tr in trajs)
        adv = group_advantages(np.stack([returns_to_go([x[3] for x in tr], 0.99, length) for tr in trajs]))
        rows = [(x[0], x[1], x[2], adv[i, t]) for i, tr in enumerate(trajs) for t, x in enumerate(tr)]
        return (
            torch.stack([r[0] for r in rows]),
            torch.stack([r[1] for r in rows]),
            torch.stack([r[2] for r in rows]),
            torch.as_tensor(np.array([r[3] for r in rows]), dtype=torch.float32),
            None,
        )

    def collect_group(self, envs: list[Any]) -> Batch:
        """B x G whole episodes; the G of a group reset with one seed."""
        g = self.args.G
        parts = []
        for b in range(self.args.B):
            seed = self.new_seed()
            group = envs[b * g : (b + 1) * g]
            parts.append(self.play_group(group, [e.reset(seed=seed)[0] for e in group], None))
        return concat(parts)

    def collect_branch(self, trunk: Any, envs: list[Any], state: dict[str, Any]) -> Batch:
        """B snapshots along the trunk, one every H trunk steps; G branches of <= H steps each."""
        horizon, parts = self.args.H, []
        for _ in range(self.args.B):
            snap = snapshot(trunk, observation=state["obs"])
            parts.append(self.play_group(envs, [restore(e, snap) for e in envs], horizon))
            o = state["obs"]
            for _ in range(horizon):
                a, _ = self.act(torch.as_tensor(o, dtype=torch.float32)[None])
                o, _, term, trunc = self.env_step(trunk, a[0])
                if term or trunc:
                    o, _ = trunk.reset(seed=self.new_seed())
                    break
            state["obs"] = o
        return concat(parts)

    # ---- PPO's update -----------------------------------------------------------------
    def update(self, batch: Batch) -> None:
        obs, act, logp_old, adv_all, targets = batch
        n = obs.shape[0]
        for _ in range(10):
            perm = torch.randperm(n)
            for start in range(0, n, 64):
                idx = perm[start : start + 64]
                logp = self.dist(obs[idx]).log_prob(act[idx]).sum(-1)
                ratio = (logp - logp_old[idx]).exp()
                adv = adv_all[idx]
                if idx.numel() > 1:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                if targets is not None:
                    loss = loss + 0.5 * ((self.vf(obs[idx]).squeeze(-1) - targets[idx]) ** 2).mean()
                self.opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, 0.5)
                self.opt.step()


def concat(parts: list[Batch]) -> Batch:
    return (
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts]),
        torch.cat([p[3] for p in parts]),
        None,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    ladder = Ladder(args)
    gym = ladder.gym
    t0, updates = time.perf_counter(), 0
    if args.mode == "gae":
        env = gym.make(args.env)
        state = {"obs": env.reset(seed=args.seed)[0]}
    elif args.mode == "branch":
        trunk = gym.make(args.env)
        state = {"obs": trunk.reset(seed=args.seed)[0]}
        envs = [gym.make(args.env) for _ in range(args.G)]
        for e in envs:
            e.reset(seed=0)  # restore() needs a reset env
    else:
        envs = [gym.make(args.env) for _ in range(args.B * args.G)]
    while ladder.steps < args.budget:
        if args.mode == "gae":
            batch = ladder.collect_gae(env, state)
        elif args.mode == "branch":
            batch = ladder.collect_branch(trunk, envs, state)
        else:
            batch = ladder.collect_group(envs)
        ladder.update(batch)
        updates += 1
    wall = time.perf_counter() - t0

    def policy(obs: Any) -> Any:
        with torch.no_grad():
            return ladder.pi(torch.as_tensor(obs, dtype=torch.float32)).numpy()

    return {
        "env": args.env, "seed": args.seed, "mode": args.mode, "B": args.B, "G": args.G, "H": args.H,
        "budget": args.budget, "return": round(evaluate(policy, args.env), 1), "env_steps": ladder.steps,
        "updates": updates, "wall_s": round(wall),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="Hopper-v5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=200_000, help="env steps (every step counted)")
    p.add_argument("--mode", choices=["gae", "group", "branch"], default="gae")
    p.add_argument("--B", type=int, default=4, help="groups per update (group, branch)")
    p.add_argument("--G", type=int, default=4, help="episodes / branches per group")
    p.add_argument("--H", type=int, default=64, help="branch horizon and trunk steps per snapshot")
    p.add_argument("--json", type=Path, help="append the result (one JSON line) here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    res = run(args)
    line = json.dumps(res)
    sys.stdout.write(line + "\n")
    if args.json:
        with args.json.open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
