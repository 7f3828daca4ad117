"""Overhead of GRPOTrainer.train() over a bare ``for: trainer.step(states)`` loop.

Contextual bandit (categorical MLP, B=16 states, G=8 actions, 1 optimizer step per step). Runs
the same number of steps four ways, interleaved over several rounds, and prints the median
steps/s of each and its ratio to the bare loop:

    bare      for k in range(n): trainer.step(states[chunk k])
    train     trainer.train(states, n, progress=False)
    +sinks    ... sinks=[JSONLSink, CSVSink]
    +all      ... + progress log lines + an evaluation every 10 steps on 16 states

The ratios compare separate runs and move with the machine's load; the last column (share of
each run's wall time spent outside ``trainer.step`` / ``evaluate``, measured within the run) is
the loop's own overhead and is robust to load.

Usage: python benchmarks/training_loop_overhead.py [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.metrics.sinks import CSVSink, JSONLSink
from grpo.policies import categorical_mlp


def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return (actions == states[:, :3].argmax(-1)).float()


def make() -> GRPOTrainer:
    torch.manual_seed(0)
    cfg = GRPOConfig(group_size=8, batch_size=16, seed=0, kl_coeff=0.04)
    return GRPOTrainer(cfg, categorical_mlp(8, 3, hidden=(64, 64)), reward)


def run(mode: str, states: torch.Tensor, n: int, tmp: Path) -> tuple[float, float]:
    """(steps/s, fraction of the wall time spent outside trainer.step and evaluate)."""
    trainer = make()
    b = trainer.config.batch_size
    t0 = time.perf_counter()
    inside = 0.0
    if mode == "bare":
        for k in range(n):
            begin = (k * b) % len(states)  # the chunk train() draws (len divisible by b)
            inside += trainer.step(states[begin : begin + b])["time/step"]
    else:
        with JSONLSink(tmp / "m.jsonl") as j, CSVSink(tmp / "m.csv") as c:
            if mode == "train":
                state = trainer.train(states, n, progress=False)
            elif mode == "+sinks":
                state = trainer.train(states, n, sinks=[j, c], progress=False)
            else:
                state = trainer.train(
                    states,
                    n,
                    sinks=[j, c],
                    progress="log",
                    log_every=50,
                    eval_states=states[:16],
                    eval_every=10,
                )
        inside = sum(r["time/step"] + r.get("time/eval", 0.0) for r in state.history)
    wall = time.perf_counter() - t0
    return n / wall, 1.0 - inside / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    states = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    modes = ["bare", "train", "+sinks", "+all"]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    outside: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        run("bare", states, 10, Path(d))  # warm-up
        for _ in range(args.rounds):
            for m in modes:
                rate, frac = run(m, states, args.steps, Path(d))
                rates[m].append(rate)
                outside[m].append(frac)
    base = statistics.median(rates["bare"])
    print(f"{args.steps} steps x {args.rounds} rounds, torch {torch.__version__}, 1 thread")
    for m in modes:
        med = statistics.median(rates[m])
        print(
            f"{m:<7} {med:8.1f} steps/s   ratio to bare {med / base:.3f}   "
            f"wall time outside step/evaluate {100 * statistics.median(outside[m]):.2f}%"
        )


if __name__ == "__main__":
    main()
