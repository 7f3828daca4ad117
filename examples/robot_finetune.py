"""A cloned robot policy fine-tuned on success with GRPO (MetaWorld; docs/robot_finetune.md).

1. N noisy demonstrations from MetaWorld's scripted expert (``metaworld.policies``, Gaussian action
   noise), on training starts;
2. behaviour cloning of a Gaussian MLP (an ordinary ``nn.Module`` returning a distribution) whose
   observation normalisation (the demonstrations' mean and std) is part of the module, so cloning,
   fine-tuning, evaluation and the saved file all use the same one;
3. GRPO on success: the binary reward ``1[success]`` at the step the task is solved, the episode
   ending there (`grpo.gym.success.EndOnSuccess`), groups of G episodes from one start
   (`grpo.gym.seeded_starts.make_metaworld`), per-step credit (`EpisodeRewards`: no length bias),
   the ``finetune_success`` recipe; the B x G envs are built once and stepped together;
4. evaluation: the success rate over held-out starts (seeds from 10^6) with its standard error,
   before and after; the policy saved (safetensors + JSON) and loaded back.

::

    python examples/robot_finetune.py                          # push-v3, 10 demos, 100k env steps
    python examples/robot_finetune.py --task drawer-open-v3 --demos 2 --budget 200000
    python examples/robot_finetune.py --quick                  # smoke test (the test suite runs it)

Needs ``pip install -e ".[gym,metaworld]"`` (MetaWorld 3.1 pins mujoco 3.3.0).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Distribution, Independent, Normal

from grpo import GRPOConfig, GRPOTrainer
from grpo.gym.episodes import EpisodeEvaluation, EpisodePolicy, EpisodeRewards, evaluate_policy
from grpo.gym.seeded_starts import make_metaworld
from grpo.gym.success import EndOnSuccess, EpisodeSuccess

log = logging.getLogger("robot_finetune")

EVAL_SEED0 = 1_000_000
"""Held-out starts are seeds 10^6, 10^6 + 1, ...; demonstrations and training draw below 10^6."""


class RobotPolicy(nn.Module):
    """``obs (n, obs_dim) -> Independent(Normal(mu, sigma), 1)``: a tanh MLP on normalised observations.

    ``x = clamp((obs - obs_mean) / obs_std, -10, 10)``, ``mu = head(body(x))`` ``(n, act_dim)``,
    ``sigma = exp(log_std)`` ``(act_dim,)`` (state-independent: the exploration noise). The
    normalisation statistics are buffers, saved and loaded with the weights. The layout is
    stable-baselines3's ``MlpPolicy`` (``body`` = ``mlp_extractor.policy_net``, ``head`` =
    ``action_net``), so PPO can start from the same weights (benchmarks/robot_finetune.py).
    """

    obs_mean: Tensor
    obs_std: Tensor

    def __init__(self, obs_mean: Tensor, obs_std: Tensor, act_dim: int, hidden: Sequence[int] = (256, 256)):
        super().__init__()
        self.register_buffer("obs_mean", obs_mean.float().clone())
        self.register_buffer("obs_std", obs_std.float().clamp(min=1e-3).clone())
        layers: list[nn.Module] = []
        width = obs_mean.numel()
        for h in hidden:
            layers += [nn.Linear(width, h), nn.Tanh()]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, act_dim)
        self.log_std = nn.Parameter(torch.zeros(act_dim))
        self.hidden = tuple(hidden)

    def normalise(self, obs: Tensor) -> Tensor:
        """``clamp((obs - mean) / std, -10, 10)``, (n, obs_dim)."""
        return ((obs.float() - self.obs_mean) / self.obs_std).clamp(-10.0, 10.0)

    def forward(self, obs: Tensor) -> Distribution:
        mu = self.head(self.body(self.normalise(obs)))
        return Independent(Normal(mu, self.log_std.exp().expand_as(mu)), 1)


def save_policy(policy: RobotPolicy, path: Path, meta: dict[str, Any]) -> None:
    """``path.safetensors`` (weights and normalisation) and ``path.json`` (sizes, task, metrics)."""
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in policy.state_dict().items()}, str(path.with_suffix(".safetensors"))
    )
    sizes = {"obs_dim": policy.obs_mean.numel(), "act_dim": policy.head.out_features, "hidden": policy.hidden}
    path.with_suffix(".json").write_text(json.dumps({**sizes, **meta}, indent=1))


def load_policy(path: Path) -> RobotPolicy:
    """The policy saved by `save_policy` (no pickle: safetensors and JSON)."""
    from safetensors.torch import load_file

    meta = json.loads(path.with_suffix(".json").read_text())
    state = load_file(str(path.with_suffix(".safetensors")))
    policy = RobotPolicy(state["obs_mean"], state["obs_std"], meta["act_dim"], meta["hidden"])
    policy.load_state_dict(state)
    return policy


# ---- demonstrations and cloning ------------------------------------------------------------------
def expert_for(task: str) -> Any:
    """MetaWorld's scripted expert of ``task`` (``metaworld.policies.ENV_POLICY_MAP``)."""
    from metaworld.policies import ENV_POLICY_MAP  # type: ignore[import-not-found, unused-ignore]

    if task not in ENV_POLICY_MAP:
        raise ValueError(f"no scripted MetaWorld expert for {task!r}; e.g. {sorted(ENV_POLICY_MAP)[:4]}.")
    return ENV_POLICY_MAP[task]()


def env_factory(task: str, max_steps: int) -> Callable[[], Any]:
    """``task`` with seeded starts, ending at its first success with the reward ``1[success]``."""
    return lambda: EndOnSuccess(make_metaworld(task, max_episode_steps=max_steps), binary_reward=True)


def collect_demos(
    task: str, n: int, *, noise: float, max_steps: int, seed: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """``n`` episodes of the expert plus ``N(0, noise^2)`` action noise from training starts.

    Returns observations ``(S, obs_dim)``, the executed (noisy, clipped to [-1, 1]) actions
    ``(S, act_dim)`` of all S steps, and the demonstrations' own success rate.
    """
    import warnings

    rng = np.random.default_rng(seed)
    env, expert = env_factory(task, max_steps)(), expert_for(task)
    obs_list, act_list, wins = [], [], 0
    for start in rng.integers(0, EVAL_SEED0, n):
        obs, _ = env.reset(seed=int(start))
        for _ in range(max_steps):
            with warnings.catch_warnings():  # MetaWorld's "Constant(s) may be too high"
                warnings.simplefilter("ignore", UserWarning)
                clean = expert.get_action(obs)
            action = np.clip(clean + noise * rng.standard_normal(clean.shape), -1.0, 1.0).astype(np.float32)
            obs_list.append(np.asarray(obs, np.float32))
            act_list.append(action)
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                wins += int(terminated)
                break
    env.close()
    return np.stack(obs_list), np.stack(act_list), wins / n


def behaviour_clone(
    obs: np.ndarray, actions: np.ndarray, *, hidden: Sequence[int], epochs: int, seed: int
) -> RobotPolicy:
    """Fit the mean by mean squared error (Adam 1e-3, batches of 256); the normalisation statistics
    are the demonstrations'. ``log_std`` is left at 0: the fine-tuning sets the exploration noise."""
    torch.manual_seed(seed)
    x, y = torch.from_numpy(obs), torch.from_numpy(actions)
    policy = RobotPolicy(x.mean(0), x.std(0), y.shape[1], hidden)
    opt = torch.optim.Adam([p for n, p in policy.named_parameters() if n != "log_std"], lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.split(torch.randperm(len(x), generator=gen), 256):
            loss = (policy(x[idx]).mean - y[idx]).pow(2).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return policy


def evaluate(
    policy: nn.Module, task: str, episodes: int, max_steps: int, num_envs: int = 16
) -> EpisodeEvaluation:
    """The deterministic policy (the mean action) on held-out starts 10^6, ..., 10^6 + episodes - 1."""
    seeds = range(EVAL_SEED0, EVAL_SEED0 + episodes)
    return evaluate_policy(policy, env_factory(task, max_steps), list(seeds), num_envs=num_envs)


# ---- fine-tuning ---------------------------------------------------------------------------------
@dataclass
class FinetuneSettings:
    """What the fine-tuning run varies (the rest is the ``finetune_success`` recipe)."""

    budget: int = 100_000  # env steps
    group_size: int = 8  # G episodes per start
    batch_size: int = 2  # B starts per update (the recipe's: chosen by the sweep in RESULTS.md)
    exploration_std: float = 0.3  # sigma of the Gaussian policy at the start of fine-tuning
    max_steps: int = 150  # time limit of an episode
    vectorization: str = "sync"  # "async": one process per env (B x G processes)
    seed: int = 0
    credit: str = "step"  # "step": EpisodeRewards (per-step); "episode": EpisodeSuccess (whole episode)
    overrides: dict[str, Any] | None = None  # GRPOConfig fields over the recipe


def rollout_success(metrics: dict[str, float]) -> float:
    """The policy's success rate at a step: over every episode it drew, the groups back-fill left
    out included (``episode/success_rate`` is the kept batch's, mixed groups by construction)."""
    if "sampling/drawn_episodes" in metrics:
        return metrics["sampling/drawn_successes"] / metrics["sampling/drawn_episodes"]
    return metrics["episode/success_rate"]


def finetune(policy: RobotPolicy, task: str, s: FinetuneSettings) -> dict[str, Any]:
    """GRPO on success until ``s.budget`` env steps are played; returns a summary of the run.

    The policy is trained in place. Start seeds are drawn below 10^6 (held-out starts lie above).
    """
    with torch.no_grad():
        policy.log_std.fill_(math.log(s.exploration_std))
    config = GRPOConfig.recipe(
        "finetune_success",
        group_size=s.group_size,
        batch_size=s.batch_size,
        seed=s.seed,
        **(s.overrides or {}),
    )
    episodes = EpisodePolicy(env_factory(task, s.max_steps), policy, vectorization_mode=s.vectorization)
    reward = EpisodeRewards() if s.credit == "step" else EpisodeSuccess()
    trainer = GRPOTrainer(config, episodes, reward)
    rng = np.random.default_rng(s.seed)
    start, updates, curve = time.perf_counter(), 0, []
    while episodes.env_steps < s.budget:
        metrics = trainer.step(  # more_states: new starts for the back-fill of all-equal groups
            rng.integers(0, EVAL_SEED0, s.batch_size).tolist(),
            more_states=lambda: rng.integers(0, EVAL_SEED0, s.batch_size).tolist(),
        )
        updates += 1
        curve.append((episodes.env_steps, rollout_success(metrics)))
        log.info(
            "update %3d  env steps %7d  rollout success %.2f  draws %d  entropy %.2f",
            updates, episodes.env_steps, curve[-1][1], metrics.get("sampling/draws", 1),
            metrics.get("policy/entropy", math.nan),
        )  # fmt: skip
    episodes.close()
    return {
        "env_steps": episodes.env_steps,
        "updates": updates,
        "train_seconds": time.perf_counter() - start,
        "train_success": curve,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole workflow (module docstring); returns the numbers it logs."""
    torch.manual_seed(args.seed)
    obs, actions, demo_success = collect_demos(
        args.task, args.demos, noise=args.demo_noise, max_steps=args.max_steps, seed=args.seed
    )
    policy = behaviour_clone(obs, actions, hidden=args.hidden, epochs=args.bc_epochs, seed=args.seed)
    before = evaluate(policy, args.task, args.eval_episodes, args.max_steps)
    log.info(
        "%s: %d demos (%d steps, %.0f%% solved); BC success %.2f +- %.2f",
        args.task, args.demos, len(obs), 100 * demo_success, before.success_rate, before.success_stderr,
    )  # fmt: skip
    settings = FinetuneSettings(
        budget=args.budget, group_size=args.group_size, batch_size=args.batch_size,
        exploration_std=args.exploration_std, max_steps=args.max_steps, vectorization=args.vectorization,
        seed=args.seed,
    )  # fmt: skip
    summary = finetune(policy, args.task, settings)
    after = evaluate(policy, args.task, args.eval_episodes, args.max_steps)
    out = {
        "task": args.task, "bc_success": before.success_rate, "bc_stderr": before.success_stderr,
        "success": after.success_rate, "stderr": after.success_stderr, **summary,
        "settings": asdict(settings),
    }  # fmt: skip
    path = Path(args.out)
    save_policy(policy, path, {"task": args.task, "success": after.success_rate})
    again = evaluate(load_policy(path), args.task, args.eval_episodes, args.max_steps)
    if (
        again.successes is None
        or after.successes is None
        or not np.array_equal(again.successes, after.successes)
    ):
        raise RuntimeError("the loaded policy does not replay the saved one's evaluation")
    log.info(
        "%s: success %.2f +- %.2f -> %.2f +- %.2f after %d env steps (%d updates, %.0f s); saved to %s",
        args.task, before.success_rate, before.success_stderr, after.success_rate, after.success_stderr,
        summary["env_steps"], summary["updates"], summary["train_seconds"], path.with_suffix(".safetensors"),
    )  # fmt: skip
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--task", default="push-v3", help="a MetaWorld v3 task with a scripted expert")
    p.add_argument("--demos", type=int, default=10, help="N noisy expert demonstrations")
    p.add_argument("--demo-noise", type=float, default=0.3, help="std of the demonstrations' action noise")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 256], help="hidden widths of the MLP")
    p.add_argument("--bc-epochs", type=int, default=200, help="passes over the demonstrations")
    p.add_argument("--budget", type=int, default=100_000, help="fine-tuning env steps")
    p.add_argument("--group-size", type=int, default=8, help="G: episodes per start")
    p.add_argument("--batch-size", type=int, default=2, help="B: starts per update (the recipe's)")
    p.add_argument("--exploration-std", type=float, default=0.3, help="policy std when fine-tuning starts")
    p.add_argument("--max-steps", type=int, default=150, help="time limit of an episode")
    p.add_argument("--eval-episodes", type=int, default=100, help="held-out starts evaluated")
    p.add_argument("--vectorization", choices=("sync", "async"), default="sync", help="how envs step")
    p.add_argument("--seed", type=int, default=0, help="seeds demos, cloning and fine-tuning")
    p.add_argument("--out", default="robot_policy", help="where the policy is saved (.safetensors/.json)")
    p.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes (the test suite's)")
    args = p.parse_args(argv)
    if args.quick:
        args.demos, args.hidden, args.bc_epochs, args.budget = 2, [32], 5, 300
        args.group_size, args.batch_size, args.max_steps, args.eval_episodes = 2, 2, 30, 4
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
