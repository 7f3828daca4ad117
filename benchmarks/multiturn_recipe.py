"""Multi-turn starting point: candidate settings over seeds on two multi-turn tasks of a tiny
causal LM trained from scratch (the measurement behind ``GRPOConfig.recipe("tiny_lm")``).

Tasks (both built by ``examples/llm_multiturn.py``'s machinery: the tiny 2-layer Llama, hidden
64, its character tokenizer with ``pad_is_eos=True``, 2 tokens per turn, K = 3 turns):

- guess: the example's task, find a hidden digit from "higher" / "lower" replies. Success = the
  secret found; a reply-ignoring policy reaches at most 0.3, binary search 0.7.
- next: `NextDigit`, a second task of another kind: the environment says a digit d (first
  message and every reply, drawn from the start's seed), the model must answer the next digit
  (d + 1) mod 10, for K turns whatever it answers. Success = the share of correct turns; a policy
  that ignores the messages reaches 0.1.

Each run trains ``--steps`` steps (batch 10 starts x group 8) and evaluates the success of 20
episodes per start on 10 fixed starts before and after (sampled at temperature 1 from a fixed
seed). The candidate settings are `CANDIDATES`. Runs go one after the other in one process,
alternating settings within each seed, so that a change of machine load hits every setting::

    python benchmarks/multiturn_recipe.py --tasks guess next --settings recipe snippet hot \
        --seeds 0 1 2 --steps 300 --json mt.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from grpo import CombinedReward, GRPOConfig, GRPOTrainer
from grpo.envs.protocol import Message
from grpo.envs.text import TextEnv, TurnResult

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("multiturn_recipe")

# name -> (GRPOConfig.recipe name or None for the plain defaults, overrides)
CANDIDATES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "recipe": ("tiny_lm", {}),  # the chosen starting point (grpo/algorithms/recipes.py)
    "snippet": (None, {"learning_rate": 1e-3}),  # docs/multiturn.md's old snippet: default KL 0.04
    "defaults": (None, {}),  # GRPOConfig() (lr 3e-4, KL 0.04, no entropy bonus)
    "hot": ("tiny_lm", {"learning_rate": 1e-2}),
    "no_entropy": ("tiny_lm", {"entropy_coeff": 0.0}),
}


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "llm_multiturn_example", ROOT / "examples" / "llm_multiturn.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NextDigit:
    """Say the digit after the one the environment says: K turns, each answered by a new digit.

    A start is an int seed; the digits are ``random.Random(seed).randrange(10)`` draws, so equal
    starts give equal episodes. ``info``: ``{"correct": bool}``; reward 1/K per correct turn."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.digits: list[int] = []
        self.k = 0

    def reset(self, start: Any) -> list[Message]:
        rng = random.Random(int(start))
        self.digits = [rng.randrange(10) for _ in range(self.turns + 1)]
        self.k = 0
        return [{"role": "user", "content": str(self.digits[0])}]

    def step(self, turn: str) -> TurnResult:
        correct = turn.strip() == str((self.digits[self.k] + 1) % 10)
        self.k += 1
        reply: list[Message] = [{"role": "user", "content": str(self.digits[self.k])}]
        return TurnResult(reply, float(correct) / self.turns, False, info={"correct": correct})


def next_success(states: Any, actions: Any) -> list[float]:
    """The share of the episode's turns that named the next digit."""
    return [sum(bool(i.get("correct")) for i in c.infos) / max(len(c.infos), 1) for c in actions]


def config_for(setting: str, seed: int) -> GRPOConfig:
    name, overrides = CANDIDATES[setting]
    fixed: dict[str, Any] = {"group_size": 8, "batch_size": 10, "seed": seed}
    if name is None:
        return GRPOConfig(**fixed, **overrides)
    return GRPOConfig.recipe(name, **fixed, **overrides)


def run(example: ModuleType, task: str, setting: str, seed: int, steps: int) -> dict[str, Any]:
    """One training run: the evaluated success before and after, the seconds it took."""
    from grpo.llm import CausalLMPolicy, SamplingSettings
    from grpo.llm.multiturn import MultiTurnPolicy
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    workdir = Path(tempfile.mkdtemp(prefix="grpo_mt_recipe_"))
    tok = build_tiny_tokenizer(workdir, pad_is_eos=True, chat_template=True)
    model = build_tiny_model(workdir, tok, hidden=64, layers=2, seed=seed)
    lm = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=2, temperature=1.0))
    if task == "guess":
        make_env, success = (lambda n: TextEnv(example.DigitGuess, n)), example.success
        starts: list[Any] = [{"secret": s} for s in range(10)]
    else:
        make_env, success = (lambda n: TextEnv(NextDigit, n)), next_success
        starts = list(range(10_000, 10_010))
    policy = MultiTurnPolicy(lm, make_env, max_turns=3, max_total_tokens=256)
    reward = CombinedReward(
        {"success": success, "format": example.single_digit_turns}, weights={"success": 1.0, "format": 0.1}
    )
    trainer = GRPOTrainer(config_for(setting, seed), policy, reward)

    def evaluate() -> float:
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(seed + 1000)
            policy.eval()
            groups = policy.generate_actions(starts, 20)
            policy.train()
        return statistics.fmean(x for g in groups for x in success(None, g))

    t0 = time.perf_counter()
    before = evaluate()
    order = torch.randperm(10_000, generator=torch.Generator().manual_seed(seed)).tolist()
    for step in range(steps):
        if task == "guess":
            batch: list[Any] = [{"secret": (step * 10 + i + seed) % 10} for i in range(10)]
        else:
            batch = [order[(step * 10 + i) % 10_000] for i in range(10)]  # training starts < 10,000
        trainer.step(batch)
    after = evaluate()
    policy.close()
    return {"task": task, "setting": setting, "seed": seed, "steps": steps, "before": before,
            "after": after, "seconds": time.perf_counter() - t0}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["guess", "next"], choices=["guess", "next"])
    p.add_argument("--settings", nargs="+", default=["recipe", "snippet", "hot"], choices=sorted(CANDIDATES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", default=None, help="append each run's row to this JSON-lines file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    example = load_example()
    rows = []
    for k, seed in enumerate(args.seeds):
        settings = args.settings if k % 2 == 0 else args.settings[::-1]  # alternate the order
        for task in args.tasks:
            for setting in settings:
                row = run(example, task, setting, seed, args.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    for task in args.tasks:
        for setting in args.settings:
            after = [r["after"] for r in rows if r["task"] == task and r["setting"] == setting]
            seeds = " ".join(f"{a:.3f}" for a in after)
            print(f"{task:6s} {setting:11s} after: {seeds}  mean {statistics.fmean(after):.3f}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
