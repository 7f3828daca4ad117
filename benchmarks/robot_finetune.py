"""Behaviour cloning, then GRPO on success vs PPO from the same weights, on MetaWorld tasks.

One cell of the table at a time (each prints one JSON line and appends it to ``--results``):

* ``bc``: N noisy expert demonstrations (examples/robot_finetune.py: action noise sigma 0.3, start
  seeds below 10^6, demo seed 0), behaviour cloning, the clone's success over the held-out starts;
  saved to ``<dir>/<task>/bc`` and used by every other side, so the demonstrations and the BC
  policy are the same for GRPO and PPO;
* ``grpo``: the clone fine-tuned by examples/robot_finetune.py's `finetune` (the
  ``finetune_success`` recipe; ``--set field=json`` overrides a config field, ``--credit episode``
  uses the whole-episode success as the reward instead of per-step credit);
* ``ppo``: stable-baselines3 PPO (its defaults: Adam 3e-4, 10 epochs, mini-batches of 64, GAE(0.99,
  0.95), clip 0.2; 8 envs x 256 steps a rollout) whose actor is the clone (same layout, same
  observation normalisation, same starting sigma) and whose critic is new; the first
  ``--warmup`` env steps train the critic only (the actor's parameters frozen), as PPO users
  fine-tuning a pretrained actor do; the warm-up counts in the budget;
* ``table``: the results file as a markdown table (mean, sample std and range over seeds).

Both sides play episodes of at most 150 steps ending at the first success, with the reward
``1[success]``, from random training starts (SB3: a new start at every reset; GRPO: B starts per
update, G episodes each), and are evaluated alike (deterministic, 100 held-out starts)::

    python benchmarks/robot_finetune.py bc --task push-v3 --demos 10
    python benchmarks/robot_finetune.py grpo --task push-v3 --seed 0 --budget 200000
    python benchmarks/robot_finetune.py ppo --task push-v3 --seed 0 --budget 200000
    python benchmarks/robot_finetune.py table

Needs ``pip install -e ".[gym,metaworld]" stable-baselines3`` (SB3 for the PPO side only).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _example() -> Any:
    """examples/robot_finetune.py (the same name as this file, so loaded from its path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "robot_finetune_example", ROOT / "examples" / "robot_finetune.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_ex = _example()
EVAL_SEED0 = _ex.EVAL_SEED0
FinetuneSettings = _ex.FinetuneSettings
RobotPolicy = _ex.RobotPolicy
behaviour_clone, collect_demos, env_factory = _ex.behaviour_clone, _ex.collect_demos, _ex.env_factory
evaluate, finetune, load_policy, save_policy = _ex.evaluate, _ex.finetune, _ex.load_policy, _ex.save_policy

HIDDEN = (256, 256)
DEMO_NOISE = 0.3
MAX_STEPS = 150


def load() -> str:
    """The machine's load average and core count, as recorded with each row."""
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f} on {os.cpu_count()} cores"


def outcome(result: Any) -> dict[str, Any]:
    """The success rate, its standard error, and which held-out starts succeeded ("0110...", start
    10^6 + i at position i: runs can be compared start by start)."""
    flags = "".join("1" if x else "0" for x in result.successes)
    return {"success": result.success_rate, "stderr": result.success_stderr, "eval_successes": flags}


def bc_cell(args: argparse.Namespace) -> dict[str, Any]:
    obs, actions, demo_success = collect_demos(
        args.task, args.demos, noise=DEMO_NOISE, max_steps=MAX_STEPS, seed=0
    )
    policy = behaviour_clone(obs, actions, hidden=HIDDEN, epochs=args.bc_epochs, seed=0)
    result = evaluate(policy, args.task, args.eval_episodes, MAX_STEPS)
    path = Path(args.dir) / args.task / "bc"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_policy(policy, path, {"task": args.task, "demos": args.demos, "success": result.success_rate})
    return {
        "demos": args.demos, "demo_steps": len(obs), "demo_success": demo_success,
        **outcome(result),
    }  # fmt: skip


def grpo_cell(args: argparse.Namespace) -> dict[str, Any]:
    policy = load_policy(Path(args.dir) / args.task / "bc")
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    settings = FinetuneSettings(
        budget=args.budget, group_size=args.group_size, batch_size=args.batch_size,
        exploration_std=args.exploration_std, max_steps=MAX_STEPS, seed=args.seed, credit=args.credit,
        overrides=overrides,
    )  # fmt: skip
    summary = finetune(policy, args.task, settings)
    result = evaluate(policy, args.task, args.eval_episodes, MAX_STEPS)
    curve = summary.pop("train_success")
    return {**summary, **outcome(result),
            "overrides": overrides, "credit": args.credit, "G": args.group_size, "B": args.batch_size,
            "train_success_last5": float(np.mean([c[1] for c in curve[-5:]]))}  # fmt: skip


def start_draws(env: Any, seed: int) -> Any:
    """A gymnasium wrapper drawing a new training start (a seed below 10^6) at every reset: SB3's
    vector env resets without a seed after each episode, and `SeededStarts` would repeat the last."""
    import gymnasium as gym

    class StartDraws(gym.Wrapper):  # type: ignore[misc, type-arg, unused-ignore]
        def __init__(self, env: Any) -> None:
            super().__init__(env)
            self.rng = np.random.default_rng(seed)

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            return self.env.reset(seed=int(self.rng.integers(0, EVAL_SEED0)), options=options)

    return StartDraws(env)


def normalised(env: Any, policy: Any) -> Any:
    """The clone's own observation normalisation, in front of SB3's MlpPolicy (which has none)."""
    import gymnasium as gym

    def norm(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out: np.ndarray = policy.normalise(torch.as_tensor(obs)[None])[0].numpy()
        return out

    space = gym.spaces.Box(-10.0, 10.0, env.observation_space.shape, np.float32)
    return gym.wrappers.TransformObservation(env, norm, space)


def ppo_model(policy: Any, task: str, seed: int, n_envs: int, exploration_std: float) -> Any:
    """SB3 PPO on ``n_envs`` envs with the clone as its actor (weights copied), a fresh critic and
    the starting sigma ``exploration_std``."""
    from stable_baselines3 import PPO  # type: ignore[import-not-found, unused-ignore]
    from stable_baselines3.common.vec_env import DummyVecEnv  # type: ignore[import-not-found, unused-ignore]

    make = env_factory(task, MAX_STEPS)
    fns = [lambda i=i: normalised(start_draws(make(), 1000 * seed + i), policy) for i in range(n_envs)]
    model = PPO(
        "MlpPolicy", DummyVecEnv(fns), n_steps=256, batch_size=64, gamma=0.99, seed=seed, device="cpu",
        policy_kwargs={"net_arch": {"pi": list(HIDDEN), "vf": list(HIDDEN)}, "activation_fn": nn.Tanh,
                       "log_std_init": math.log(exploration_std), "ortho_init": True},
    )  # fmt: skip
    sb3 = model.policy
    sb3.mlp_extractor.policy_net.load_state_dict(policy.body.state_dict())
    sb3.action_net.load_state_dict(policy.head.state_dict())
    return model


def actor_params(model: Any) -> list[nn.Parameter]:
    sb3 = model.policy
    return [*sb3.mlp_extractor.policy_net.parameters(), *sb3.action_net.parameters(), sb3.log_std]


def ppo_cell(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    policy = load_policy(Path(args.dir) / args.task / "bc")
    model = ppo_model(policy, args.task, args.seed, n_envs=8, exploration_std=args.exploration_std)
    start = time.perf_counter()
    for p in actor_params(model):  # critic warm-up: value-only updates, the actor frozen
        p.requires_grad_(False)
    model.learn(total_timesteps=args.warmup)
    for p in actor_params(model):
        p.requires_grad_(True)
    model.learn(total_timesteps=args.budget - args.warmup, reset_num_timesteps=False)
    seconds = time.perf_counter() - start
    sb3 = model.policy
    policy.body.load_state_dict(sb3.mlp_extractor.policy_net.state_dict())
    policy.head.load_state_dict(sb3.action_net.state_dict())
    with torch.no_grad():
        policy.log_std.copy_(sb3.log_std)
    result = evaluate(policy, args.task, args.eval_episodes, MAX_STEPS)
    return {"env_steps": int(model.num_timesteps), "warmup": args.warmup, "train_seconds": seconds,
            **outcome(result)}  # fmt: skip


def _mean_of(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    """The mean of ``key`` over the rows that have it, formatted; "-" where none has it."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return format(float(np.mean(values)), fmt) if values else "-"


def table(path: Path) -> str:
    """Mean, sample std and range of the after-training success over seeds, per (task, side, tag),
    with the env steps played, the updates (GRPO), the wall and the CPU seconds of a run."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[(r["task"], r["side"], r.get("tag", ""))].append(r)
    head = [
        "task",
        "side",
        "tag",
        "seeds",
        "env steps",
        "updates",
        "success mean",
        "std",
        "range",
        "wall s",
        "CPU s",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (task, side, tag), rs in sorted(cells.items()):
        s = np.array([r["success"] for r in rs])
        std = float(s.std(ddof=1)) if len(s) > 1 else math.nan
        steps = sorted({r.get("env_steps", 0) for r in rs})
        cols = [task, side, tag, str(len(rs)), f"{steps[0]}-{steps[-1]}", _mean_of(rs, "updates", ".1f"),
                f"{s.mean():.3f}", f"{std:.3f}", f"{s.min():.2f}-{s.max():.2f}",
                _mean_of(rs, "wall_seconds", ".0f"), _mean_of(rs, "cpu_seconds", ".0f")]  # fmt: skip
        out.append("| " + " | ".join(cols) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("side", choices=("bc", "grpo", "ppo", "table"), help="the cell to run, or the table")
    p.add_argument("--task", default="push-v3", help="a MetaWorld v3 task with a scripted expert")
    p.add_argument("--seed", type=int, default=0, help="seeds the fine-tuning (not the demonstrations)")
    p.add_argument("--demos", type=int, default=10, help="bc: N noisy demonstrations")
    p.add_argument("--bc-epochs", type=int, default=200, help="bc: passes over the demonstrations")
    p.add_argument("--budget", type=int, default=200_000, help="env steps (PPO: warm-up included)")
    p.add_argument("--warmup", type=int, default=20_480, help="ppo: critic-only env steps")
    p.add_argument(
        "--exploration-std", type=float, default=0.3, help="sigma when fine-tuning starts (grpo and ppo)"
    )
    p.add_argument("--group-size", type=int, default=8, help="grpo: G episodes per start")
    p.add_argument("--batch-size", type=int, default=2, help="grpo: B starts per update (the recipe's)")
    p.add_argument(
        "--credit", choices=("step", "episode"), default="step", help="grpo: per-step or whole-episode"
    )
    p.add_argument(
        "--set", action="append", default=[], help="grpo: a GRPOConfig field=json value (repeatable)"
    )
    p.add_argument("--tag", default="", help="a label for the row (e.g. the candidate setting)")
    p.add_argument("--eval-episodes", type=int, default=100, help="held-out starts evaluated")
    p.add_argument("--dir", default="/tmp/robot-bench", help="where the BC policies are kept")
    p.add_argument("--results", default="/tmp/robot-bench/results.jsonl", help="the JSON lines file")
    args = p.parse_args(argv)
    if args.side == "table":
        print(table(Path(args.results)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the example's per-update lines
    torch.set_num_threads(1)
    start, cpu, load_before = time.perf_counter(), time.process_time(), load()
    cell = {"bc": bc_cell, "grpo": grpo_cell, "ppo": ppo_cell}[args.side](args)
    row = {"task": args.task, "side": args.side, "tag": args.tag, "seed": args.seed, "budget": args.budget,
           "sigma": args.exploration_std,
           **cell, "wall_seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
           "load": f"{load_before} -> {load()}"}  # fmt: skip
    line = json.dumps(row)
    print(line)
    with open(args.results, "a") as f:
        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
