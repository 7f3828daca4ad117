"""Learning benchmark: issue 19's table re-measured side by side, GRPO next to the classic tools.

Every task runs each of its rows on the same seeds with the same stopping rule; the sides
alternate seed by seed (even seed index: GRPO rows first, odd: peer rows first) so that a change
of machine load hits both. One table per task, then a summary in the issue's format: the GRPO
row with ``GRPOConfig()``'s library defaults (where the issue has one), the GRPO row with
``GRPOConfig.recipe("small_policy")`` (read from grpo/algorithms/recipes.py, never copied here), the peer,
and the target.

Control tasks (peer: stable-baselines3 ``PPO("MlpPolicy", env, seed=seed, device="cpu")`` with
its defaults, what a new user runs; imported only inside the PPO functions, never a dependency
of grpo; its rows are skipped with a note where it is not installed)

- cartpole: CartPole-v1, env steps until solved (budget 300k). Solved = the deterministic
  policy's mean return over 10 evaluation episodes on seeds 1_000_000.. (disjoint from the
  training seeds, the same for both sides) is >= 475. The evaluation runs whenever the recent
  training episodes average >= 450 (PPO: its last 20 episodes, checked after each finished
  episode; GRPO: the last step's episodes), and once more when the budget runs out (as
  ``cartpole.solve`` does); evaluation steps are not counted.
  GRPO: ``examples/cartpole.py``'s ``solve``. Target: GRPO's median <= 1.5x PPO's (unsolved
  runs count as never).
- acrobot, pendulum: Acrobot-v1 / Pendulum-v1, train exactly 100k env steps (PPO stops the
  moment its 100,000th env step is taken; the rollout it was collecting is not learned from),
  then the mean return of 10 deterministic episodes on seeds 1_000_000.. (both sides).
  GRPO: ``examples/classic_control.py``'s ``train``. Targets: Acrobot >= -100 on every seed;
  Pendulum: GRPO's mean >= PPO's mean.

Bandit tasks (both sides in ``benchmarks/bandit_tasks.py``, whose docstring defines them)

- bandit50: probability the final decision rule picks the best of 50 Bernoulli arms after 300
  steps (GRPO defaults, the README quick start's settings, small_policy; Thompson sampling).
- nonstationary: expected reward / the oracle's over 450 rounds of a drifting, switching
  10-armed bandit (GRPO defaults, small_policy; eps-greedy; uniform).
- contextual: normalised expected reward (0 = random arms, 1 = oracle) of
  ``categorical_mlp(16, 10)`` after 300 steps (GRPO defaults, small_policy; a hand-written
  PyTorch GRPO loop).
  Target for the bandit tasks ("learns"): the small_policy row gains at least 0.9 of the peer's
  gain over picking arms uniformly at random.

Run from the repository root (the PPO rows need an interpreter with stable-baselines3)::

    python benchmarks/learning.py --tasks cartpole acrobot pendulum bandit50 nonstationary \
        contextual --seeds 0 1 2 --task-seeds acrobot=0,1,2,3,4 --json learning.json
    python benchmarks/learning.py --tasks bandit50 --side grpo --budget bandit50=100
    python benchmarks/learning.py --tasks nonstationary acrobot --side grpo --preset kl_coeff=0.01

``--preset FIELD=JSON`` changes the small_policy preset for the run (every GRPO row and the
examples read it from ``grpo.algorithms.recipes``): how the sweeps in RESULTS.md were run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bandit_tasks as bt
import cartpole

from grpo.algorithms.recipes import recipe_values

EVAL_SEEDS = list(range(1_000_000, 1_000_010))  # 10 evaluation episodes, disjoint from training
SOLVE_TARGET, EVAL_GATE, PPO_WINDOW = 475.0, 450.0, 20
TASKS = ("cartpole", "acrobot", "pendulum", "bandit50", "nonstationary", "contextual")
ENV_IDS = {"cartpole": "CartPole-v1", "acrobot": "Acrobot-v1", "pendulum": "Pendulum-v1"}
BANDIT_TARGET = 0.9  # the small_policy row's gain over uniform, as a fraction of the peer's


# ---- PPO (stable-baselines3, only ever imported here) ---------------------------------------
def sb3_available() -> bool:
    return importlib.util.find_spec("stable_baselines3") is not None


def _evaluate_sb3(model: Any, env_id: str, seeds: Sequence[int] = EVAL_SEEDS) -> float:
    """Mean return of one deterministic episode per seed."""
    import gymnasium as gym

    env = gym.make(env_id)
    discrete = isinstance(env.action_space, gym.spaces.Discrete)
    returns = []
    for s in seeds:
        obs, _ = env.reset(seed=s)
        done, ret = False, 0.0
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, r, term, trunc, _ = env.step(int(action) if discrete else action)
            ret += float(r)
            done = term or trunc
        returns.append(ret)
    env.close()
    return float(np.mean(returns))


def ppo_cartpole(seed: int, budget: int) -> dict[str, Any]:
    """SB3 PPO defaults on CartPole-v1 until solved (see the module docstring) or ``budget`` steps."""
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    env_id = ENV_IDS["cartpole"]

    class SolveCallback(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.solved_at: int | None = None
            self.eval_mean = float("nan")
            self.episodes = self.evaluated_at = 0

        def _on_step(self) -> bool:
            if self.num_timesteps >= budget:  # the budget is exact, not rounded up to a rollout
                return False
            self.episodes += sum("episode" in info for info in self.locals["infos"])
            recent = [e["r"] for e in list(self.model.ep_info_buffer)[-PPO_WINDOW:]]
            new_episode = self.episodes > self.evaluated_at
            if new_episode and len(recent) == PPO_WINDOW and np.mean(recent) >= EVAL_GATE:
                self.evaluated_at = self.episodes
                self.eval_mean = _evaluate_sb3(self.model, env_id)
                if self.eval_mean >= SOLVE_TARGET:
                    self.solved_at = self.num_timesteps
                    return False
            return True

    t0 = time.perf_counter()
    model = PPO("MlpPolicy", gym.make(env_id), seed=seed, device="cpu", verbose=0)
    cb = SolveCallback()
    model.learn(total_timesteps=budget, callback=cb)
    if cb.solved_at is None:  # the budget ran out: one last evaluation, as cartpole.solve does
        cb.eval_mean = _evaluate_sb3(model, env_id)
        if cb.eval_mean >= SOLVE_TARGET:
            cb.solved_at = model.num_timesteps
    env_steps = cb.solved_at if cb.solved_at is not None else model.num_timesteps
    return {
        "seed": seed,
        "solved": cb.solved_at is not None,
        "steps": model._n_updates // model.n_epochs,  # PPO rollouts of 2048 env steps
        "env_steps": env_steps,
        "wall_s": time.perf_counter() - t0,
        "eval_mean": cb.eval_mean,
        "metric": env_steps if cb.solved_at is not None else None,
    }


def ppo_fixed_steps(env_id: str, seed: int, env_steps: int) -> dict[str, Any]:
    """SB3 PPO defaults for exactly ``env_steps`` env steps, then 10 deterministic eval episodes."""
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    class StopAt(BaseCallback):
        def _on_step(self) -> bool:
            return self.num_timesteps < env_steps

    t0 = time.perf_counter()
    model = PPO("MlpPolicy", gym.make(env_id), seed=seed, device="cpu", verbose=0)
    model.learn(total_timesteps=env_steps, callback=StopAt())
    eval_return = _evaluate_sb3(model, env_id)
    return {
        "seed": seed,
        "env_steps": model.num_timesteps,
        "eval_return": eval_return,
        "wall_s": time.perf_counter() - t0,  # with the evaluation, as the GRPO side's
        "metric": eval_return,
    }


# ---- GRPO on the control tasks: the examples' functions ------------------------------------
def grpo_cartpole(seed: int, budget: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_env_steps": budget, "eval_episodes": len(EVAL_SEEDS), "verbose": False}
    if "max_steps" in inspect.signature(cartpole.solve).parameters:
        kwargs["max_steps"] = 10**9  # only the env-step budget stops a run
    r = dict(cartpole.solve(seed, **kwargs))
    r["metric"] = r["env_steps"] if r["solved"] else None
    return r


def classic_control_train() -> Callable[..., dict[str, Any]] | str:
    """``examples/classic_control.py``'s ``train``, or why it cannot be used."""
    try:
        module = importlib.import_module("classic_control")
    except ImportError as e:
        return f"examples/classic_control.py cannot be imported ({e})"
    train = getattr(module, "train", None)
    return train if callable(train) else "examples/classic_control.py has no train()"


def grpo_fixed_steps(env_id: str, seed: int, env_steps: int) -> dict[str, Any]:
    train = classic_control_train()
    assert not isinstance(train, str), train
    r = dict(train(env_id, seed, env_steps=env_steps, verbose=False))
    r["metric"] = r["eval_return"]
    return r


# ---- tasks and rows ----------------------------------------------------------------------
@dataclass
class Row:
    """One line of a task's table: ``run(seed, budget)`` returns a dict with ``metric``."""

    label: str  # e.g. "GRPO small_policy preset (...)"
    side: str  # "grpo" or "peer"
    column: str  # the summary column: "defaults", "quickstart", "small_policy", "peer", "uniform"
    run: Callable[[int, int], dict[str, Any]]
    short: str = ""  # the name in the summary's peer column


@dataclass
class Task:
    key: str
    title: str  # the row text; "{budget}" is replaced by the budget used
    metric: str  # what the metric column means
    budget: int
    unit: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


GRPO_CONFIG_LABELS = {
    "defaults": "GRPO library defaults, GRPOConfig()",
    "quickstart": "GRPO README quick start's settings",
    "small_policy": "GRPO small_policy preset",
}


def grpo_bandit_rows(fn: Callable[..., dict[str, Any]], *configs: str) -> list[Row]:
    """One GRPO row per config name of `bandit_tasks.config_for`, each running ``fn``."""
    return [
        Row(
            GRPO_CONFIG_LABELS[c],
            "grpo",
            c,
            lambda seed, budget, c=c: fn(bt.config_for(c, seed), seed, budget),
        )
        for c in configs
    ]


def preset_group_size() -> int:
    """G of the small_policy preset (the peers of the bandit tasks get the same pulls per round)."""
    return bt.config_for("small_policy", 0).group_size


def build_tasks(names: Sequence[str], budgets: dict[str, int], side: str) -> list[Task]:
    have_sb3 = sb3_available()
    train = classic_control_train()
    tasks = []
    for name in names:
        if name == "cartpole":
            t = Task(
                name,
                "CartPole-v1, env steps until a 10-episode eval >= 475",
                "env steps at solve",
                300_000,
                "env steps",
            )
            t.rows.append(Row("GRPO (examples/cartpole.py solve)", "grpo", "small_policy", grpo_cartpole))
            t.rows.append(
                Row(
                    "PPO (stable-baselines3 defaults, MLP 64x64)",
                    "peer",
                    "peer",
                    ppo_cartpole,
                    "SB3 PPO defaults",
                )
            )
        elif name in ("acrobot", "pendulum"):
            env_id = ENV_IDS[name]
            t = Task(
                name,
                f"{env_id}, return at {{budget}} env steps",
                "mean return, 10 det. eval episodes",
                100_000,
                "env steps",
            )
            if isinstance(train, str):
                t.skipped.append(f"GRPO rows skipped: {train}")
            else:
                t.rows.append(
                    Row(
                        "GRPO (examples/classic_control.py train)",
                        "grpo",
                        "small_policy",
                        lambda seed, budget, e=env_id: grpo_fixed_steps(e, seed, budget),
                    )
                )
            t.rows.append(
                Row(
                    "PPO (stable-baselines3 defaults, MLP 64x64)",
                    "peer",
                    "peer",
                    lambda seed, budget, e=env_id: ppo_fixed_steps(e, seed, budget),
                    "SB3 PPO defaults",
                )
            )
        elif name == "bandit50":
            g = preset_group_size()
            t = Task(
                name,
                "50-armed bandit, user-written policy, {budget} steps",
                "P(final rule picks the best arm)",
                bt.BANDIT50_STEPS,
                "steps",
            )
            t.rows += grpo_bandit_rows(bt.bandit50_grpo, "defaults", "quickstart", "small_policy")
            t.rows += [
                Row(
                    f"Thompson sampling, Beta(1,1), {g} pulls a round",
                    "peer",
                    "peer",
                    lambda seed, budget, g=g: bt.bandit50_thompson(seed, budget, g),
                    "Thompson sampling",
                ),
            ]
        elif name == "nonstationary":
            g = preset_group_size()
            t = Task(
                name,
                "non-stationary 10-armed bandit, {budget} rounds",
                "expected reward / oracle's",
                bt.NONSTATIONARY_ROUNDS,
                "rounds",
            )
            t.rows += grpo_bandit_rows(bt.nonstationary_grpo, "defaults", "small_policy")
            t.rows += [
                Row(
                    f"eps-greedy (eps 0.1, step size 0.1), {g} pulls a round",
                    "peer",
                    "peer",
                    lambda seed, budget, g=g: bt.nonstationary_eps_greedy(seed, budget, g),
                    "eps-greedy",
                ),
                Row("uniform random arms", "peer", "uniform", bt.nonstationary_uniform),
            ]
        elif name == "contextual":
            t = Task(
                name,
                "contextual bandit, `categorical_mlp`, {budget} steps",
                "normalised reward (0 random, 1 oracle)",
                bt.CONTEXTUAL_STEPS,
                "steps",
            )
            t.rows += grpo_bandit_rows(bt.contextual_grpo, "defaults", "small_policy")
            t.rows += [
                Row(
                    "hand-written PyTorch GRPO loop (B 8, G 8, Adam 3e-3, 4 epochs)",
                    "peer",
                    "peer",
                    lambda seed, budget: bt.contextual_hand_loop(seed, budget),
                    "hand-written GRPO loop",
                ),
            ]
        else:
            raise ValueError(f"unknown task {name!r}; choose from {TASKS}")
        if name in ENV_IDS and not have_sb3 and side != "grpo":
            t.skipped.append(
                f"PPO rows skipped: stable-baselines3 is not installed for {sys.executable} "
                "(use a venv with it, e.g. /work/benchvenv/bin/python)"
            )
            t.rows = [r for r in t.rows if r.side != "peer"]
        if side != "both":
            t.rows = [r for r in t.rows if r.side == side]
        t.budget = budgets.get(name, t.budget)
        b = t.budget
        t.title = t.title.replace("{budget}", f"{b // 1000}k" if b >= 1000 and b % 1000 == 0 else str(b))
        tasks.append(t)
    return tasks


# ---- running -----------------------------------------------------------------------------
def run_task(task: Task, seeds: Sequence[int], log: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    """Every row on every seed; even seed index: GRPO rows first, odd: peer rows first."""
    results: dict[str, list[dict[str, Any]]] = {r.label: [] for r in task.rows}
    for i, seed in enumerate(seeds):
        grpo_rows = [r for r in task.rows if r.side == "grpo"]
        peer_rows = [r for r in task.rows if r.side == "peer"]
        for row in grpo_rows + peer_rows if i % 2 == 0 else peer_rows + grpo_rows:
            res = row.run(seed, task.budget)
            results[row.label].append(res)
            metric = _fmt_metric(task, res["metric"])
            log(f"  {task.key} seed {seed} {row.label}: {metric} ({res['wall_s']:.1f}s)")
    return results


def _fmt_metric(task: Task, v: float | None) -> str:
    if v is None:
        return "not solved"
    if task.key == "cartpole":
        return f"{v / 1000:.1f}k"
    if task.key in ("acrobot", "pendulum"):
        return f"{v:.1f}"
    return f"{v:.3f}"


def aggregate(task: Task, values: list[float | None]) -> float:
    """cartpole: median env steps (unsolved = inf); the others: mean."""
    if task.key == "cartpole":
        return float(np.median([math.inf if v is None else v for v in values]))
    return float(np.mean([v for v in values if v is not None]))


def _agg_text(task: Task, rows: list[dict[str, Any]]) -> str:
    values = [r["metric"] for r in rows]
    agg = aggregate(task, values)
    if task.key == "cartpole":
        solved = sum(v is not None for v in values)
        med = "never" if math.isinf(agg) else f"{agg / 1000:.1f}k"
        return f"median {med} ({solved}/{len(values)} solved)"
    if task.key in ("acrobot", "pendulum"):
        return f"mean {agg:.1f} (min {min(values):.1f})"
    return f"mean {agg:.3f} (min {min(values):.3f})"


def print_task_table(task: Task, results: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n=== {task.key}: {task.title}; budget {task.budget} {task.unit}; metric: {task.metric}")
    for note in task.skipped:
        print(f"  ({note})")
    for row in task.rows:
        rows = results.get(row.label, [])
        if not rows:
            continue
        print(f"\n{row.label}")
        if task.key == "cartpole":
            print(f"{'seed':>4} {'solved':>6} {'steps':>6} {'env_steps':>10} {'wall_s':>7} {'eval':>7}")
            for r in rows:
                print(
                    f"{r['seed']:>4} {r['solved']!s:>6} {r.get('steps', '-')!s:>6} {r['env_steps']:>10} "
                    f"{r['wall_s']:>7.1f} {r['eval_mean']:>7.1f}"
                )
        elif task.key in ("acrobot", "pendulum"):
            print(f"{'seed':>4} {'env_steps':>10} {'wall_s':>7} {'eval_return':>12}")
            for r in rows:
                print(f"{r['seed']:>4} {r['env_steps']:>10} {r['wall_s']:>7.1f} {r['eval_return']:>12.1f}")
        else:
            print(f"{'seed':>4} {'metric':>8} {'wall_s':>7}")
            for r in rows:
                print(f"{r['seed']:>4} {r['metric']:>8.3f} {r['wall_s']:>7.1f}")
        print(f"{'':>4} {_agg_text(task, rows)}; wall {sum(r['wall_s'] for r in rows):.1f}s in all")


def target_check(task: Task, results: dict[str, list[dict[str, Any]]]) -> tuple[str, str]:
    """(the target, whether it is met: 'yes (...)', 'NO (...)' or 'n/a')."""
    by_col: dict[str, list[float | None]] = {}
    for row in task.rows:
        if results.get(row.label):
            by_col[row.column] = [r["metric"] for r in results[row.label]]
    grpo, peer = by_col.get("small_policy"), by_col.get("peer")
    if task.key == "cartpole":
        target = "<= 1.5x PPO's env steps (median)"
        if grpo is None or peer is None:
            return target, "n/a"
        g, p = aggregate(task, grpo), aggregate(task, peer)
        if math.isinf(g) or math.isinf(p):
            met = "n/a (neither solved)" if g == p else ("yes (PPO never solved)" if g < p else "NO (never)")
            return target, met
        return target, f"{'yes' if g <= 1.5 * p else 'NO'} ({g / p:.2f}x)"
    if task.key == "acrobot":
        target = ">= -100 on each seed"
        if grpo is None:
            return target, "n/a"
        worst = min(v for v in grpo if v is not None)
        return target, f"{'yes' if worst >= -100 else 'NO'} (worst seed {worst:.1f})"
    if task.key == "pendulum":
        target = ">= PPO's mean return"
        if grpo is None or peer is None:
            return target, "n/a"
        diff = aggregate(task, grpo) - aggregate(task, peer)
        return target, f"{'yes' if diff >= 0 else 'NO'} ({diff:+.1f})"
    target = f"small_policy >= {BANDIT_TARGET} of the peer's gain over uniform"
    if grpo is None or peer is None:
        return target, "n/a"
    uniform = {
        "bandit50": 1.0 / bt.BANDIT50_ARMS,
        "contextual": 0.0,
        "nonstationary": aggregate(task, by_col["uniform"]) if "uniform" in by_col else math.nan,
    }[task.key]
    share = (aggregate(task, grpo) - uniform) / (aggregate(task, peer) - uniform)
    return target, f"{'yes' if share >= BANDIT_TARGET else 'NO'} ({share:.2f})"


def summary_rows(
    tasks: list[Task], all_results: dict[str, dict[str, list[dict[str, Any]]]]
) -> list[dict[str, str]]:
    out = []
    for task in tasks:
        results = all_results[task.key]
        cells: dict[str, str] = {}
        for row in task.rows:
            if results.get(row.label):
                text = _agg_text(task, results[row.label])
                cells[row.column] = f"{row.short}: {text}" if row.short else text
        target, met = target_check(task, results)
        n = max((len(v) for v in results.values()), default=0)
        out.append(
            {
                "task": f"{task.title} ({n} seeds)",
                "grpo library defaults": cells.get("defaults", "—")
                + (f"; quick start: {cells['quickstart']}" if "quickstart" in cells else ""),
                "grpo small_policy preset": cells.get("small_policy", "—"),
                "peer": cells.get("peer", "—")
                + (f"; uniform: {cells['uniform']}" if "uniform" in cells else ""),
                "target": target,
                "met": met,
            }
        )
    return out


def print_summary(rows: list[dict[str, str]]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    print("\n=== summary (issue 19's table; control tasks: the GRPO column is the example's run)")
    print("| " + " | ".join(cols) + " |")
    print("| " + " | ".join("---" for _ in cols) + " |")
    for r in rows:
        print("| " + " | ".join(r[c] for c in cols) + " |")


def parse_budgets(items: Sequence[str], tasks: Sequence[str]) -> dict[str, int]:
    """``N`` (every task given, in its own unit) or ``task=N``."""
    out: dict[str, int] = {}
    for item in items:
        name, _, value = item.rpartition("=")
        if name and name not in TASKS:
            raise SystemExit(f"--budget {item}: unknown task {name!r}; choose from {TASKS}")
        out.update({name: int(value)} if name else dict.fromkeys(tasks, int(value)))
    return out


def parse_task_seeds(items: Sequence[str]) -> dict[str, list[int]]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in TASKS or not value:
            raise SystemExit(f"--task-seeds {item}: expected TASK=S,S,... with TASK in {TASKS}")
        out[name] = [int(s) for s in value.split(",")]
    return out


def _json_value(v: Any) -> Any:
    """A value json cannot write: numbers (NumPy's) as floats, others (a recipe's
    ``StepsPerEpoch``) as their repr."""
    return float(v) if isinstance(v, numbers.Real) else repr(v)


def apply_preset_changes(items: Sequence[str]) -> None:
    """``FIELD=JSON`` items into ``grpo.algorithms.recipes.RECIPES["small_policy"]`` for this process (every
    GRPO row, the examples' included, reads the preset from there)."""
    from grpo.algorithms.recipes import RECIPES

    values = RECIPES["small_policy"].values
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--preset wants FIELD=JSON, got {item!r}")
        value = json.loads(raw)
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--task-seeds",
        nargs="*",
        default=[],
        metavar="TASK=S,S",
        help="seeds of one task, e.g. acrobot=0,1,2,3,4",
    )
    parser.add_argument("--side", choices=("grpo", "peer", "both"), default="both")
    parser.add_argument("--no-ppo", action="store_true", help="the same as --side grpo")
    parser.add_argument(
        "--budget",
        nargs="*",
        default=[],
        metavar="[TASK=]N",
        help="cartpole: env-step cap (300000); acrobot/pendulum: env steps (100000); bandit50/contextual: "
        "steps (300); nonstationary: rounds (450). A bare N applies to every task given.",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every row and the summary here")
    parser.add_argument(
        "--preset",
        nargs="*",
        default=[],
        metavar="FIELD=JSON",
        help="change a field of the small_policy preset for this run (a sweep), e.g. kl_coeff=0.01 "
        "adaptive_lr_max=0.01; a JSON value, null removes the field",
    )
    args = parser.parse_args(argv)
    apply_preset_changes(args.preset)
    side = "grpo" if args.no_ppo else args.side
    torch.set_num_threads(1)
    # one state per step is what the bandit tasks define; the trainer's note about batch_size is noise here
    warnings.filterwarnings("ignore", message=r"step\(\) got \d+ states? but GRPOConfig.batch_size")
    budgets = parse_budgets(args.budget, args.tasks)
    task_seeds = parse_task_seeds(args.task_seeds)
    tasks = build_tasks(args.tasks, budgets, side)
    load0 = os.getloadavg()
    print(
        f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, 1 thread; "
        f"stable-baselines3 {'installed' if sb3_available() else 'not installed'}; "
        f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    try:
        preset: dict[str, Any] | str = recipe_values("small_policy")
    except ValueError as e:
        preset = str(e)
    print(f"small_policy preset (grpo/algorithms/recipes.py): {preset}", flush=True)
    all_results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    t0 = time.perf_counter()
    for task in tasks:
        seeds = task_seeds.get(task.key, args.seeds)
        t_task = time.perf_counter()
        all_results[task.key] = run_task(task, seeds, lambda s: print(s, flush=True))
        print_task_table(task, all_results[task.key])
        print(f"({task.key}: {time.perf_counter() - t_task:.0f}s)", flush=True)
    summary = summary_rows(tasks, all_results)
    print_summary(summary)
    load1 = os.getloadavg()
    print(
        f"\ntotal wall {time.perf_counter() - t0:.0f}s; load average at the end "
        f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}"
    )
    out: dict[str, Any] = {
        "argv": list(sys.argv[1:] if argv is None else argv),
        "python": sys.executable,
        "load_average": {"start": load0, "end": load1},
        "small_policy": preset,
        "tasks": {
            t.key: {
                "title": t.title,
                "metric": t.metric,
                "budget": t.budget,
                "unit": t.unit,
                "skipped": t.skipped,
                "rows": [
                    {
                        "label": r.label,
                        "side": r.side,
                        "column": r.column,
                        "runs": all_results[t.key][r.label],
                    }
                    for r in t.rows
                ],
            }
            for t in tasks
        },
        "summary": summary,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, default=_json_value))
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
