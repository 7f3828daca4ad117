"""What the "clip" twin buys: whole `GRPOTrainer.step` time with the twin against the readable path.

    python benchmarks/objective_twin.py [--workloads small-policy ready-policy tiny-lm] [--repeats 12]

`grpo.grpo_objective.GRPOObjective` computes its loss with `GRPOObjective.composed` (autograd over
the pure functions); for the built-in "clip" loss it runs the twin
`grpo.algorithms.clip_twin.clip_objective_twin` (same values and gradients). A twin stays only
where it saves at least 5 % of a whole step on a named workload; this script measures that.

Two trainers per workload, built alike from the same seed; one with ``objective.clip_twin =
False`` (the readable path). They train on the same batches, in blocks of ``--steps`` steps,
alternating which side goes first in each repeat (after one warm-up block each). Printed: the
median seconds per step of each side, the median over repeats of (readable / twin) for blocks
run back to back, its quartiles and range, and the load average before and after (a shared
machine: the ratio of neighbouring blocks is what holds up under load).

Workloads (1 torch thread):

* ``small-policy``: benchmarks/overhead.py's bandit (B=64, G=8, MLP 16-64-64-10 written by the
  user, tensor form, 2 epochs, k3 KL to the reference, clip 0.2, grad clipping).
* ``ready-policy``: the same with the ready `grpo.categorical_mlp` policy.
* ``tiny-lm``: a tiny Qwen2 (hidden 32, 2 layers, `grpo.llm.tiny`) through `grpo.llm.CausalLMPolicy`,
  B=8 prompts, G=8, 16 new tokens, 2 epochs, k3 KL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's grpo, and overhead.py

import overhead  # noqa: E402  (benchmarks/overhead.py: the bandit task and its policy)

from grpo import GRPOConfig, GRPOTrainer, categorical_mlp  # noqa: E402

Step = Callable[[], None]


def small_policy(ready: bool) -> Step:
    """One trainer on overhead.py's bandit; each call is one step on the next batch."""
    task = overhead.Task()
    torch.manual_seed(0)
    policy: Any = categorical_mlp(overhead.DIM, overhead.ARMS, (64, 64)) if ready else overhead.TensorPolicy()
    cfg = GRPOConfig(
        group_size=overhead.G, batch_size=overhead.B, num_epochs_per_update=overhead.EPOCHS,
        learning_rate=overhead.LR, kl_coeff=overhead.BETA, clip_epsilon=overhead.EPS, max_grad_norm=1.0,
        seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg, policy, task.reward)
    return _stepper(trainer, task.states)


def tiny_lm() -> Step:
    """One trainer on a tiny causal LM (no download: built from a config)."""
    from grpo.llm import CausalLMPolicy
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tok = build_tiny_tokenizer(d, pad_is_eos=True)
        model = build_tiny_model(d, tok, arch="qwen2", hidden=32, layers=2, heads=4, seed=0)
        policy = CausalLMPolicy(model, tok, max_new_tokens=16, temperature=1.0)

    def reward(prompts: list[str], completions: list[Any]) -> list[float]:
        return [float(c.text.count("a")) - 0.1 * len(c.text) for c in completions]

    cfg = GRPOConfig(
        group_size=8, batch_size=8, seed=0, kl_coeff=0.04, learning_rate=1e-3, num_epochs_per_update=2
    )
    trainer = GRPOTrainer(cfg, policy, reward)
    prompts = ["1+2=", "ab", "cd", "x", "yy", "3*4=", "q", "hello"]
    return _stepper(trainer, lambda: prompts)


def _stepper(trainer: GRPOTrainer, states: Callable[[], Any]) -> Step:
    def step() -> None:
        trainer.step(states())

    step.trainer = trainer  # type: ignore[attr-defined]
    return step


WORKLOADS: dict[str, Callable[[], Step]] = {
    "small-policy": lambda: small_policy(False),
    "ready-policy": lambda: small_policy(True),
    "tiny-lm": tiny_lm,
}


def block(step: Step, steps: int) -> float:
    """Seconds per step over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def measure(name: str, steps: int, repeats: int) -> float:
    """Alternating blocks of the twin and the readable path; prints and returns the median
    ratio readable / twin."""
    twin, readable = WORKLOADS[name](), WORKLOADS[name]()
    readable.trainer.objective.clip_twin = False  # type: ignore[attr-defined]
    assert twin.trainer.objective.uses_clip_twin  # type: ignore[attr-defined]
    load0 = os.getloadavg()
    block(twin, 1), block(readable, 1)  # warm-up
    t_twin: list[float] = []
    t_read: list[float] = []
    for r in range(repeats):
        if r % 2 == 0:
            t_twin.append(block(twin, steps))
            t_read.append(block(readable, steps))
        else:
            t_read.append(block(readable, steps))
            t_twin.append(block(twin, steps))
    ratios = sorted(a / b for a, b in zip(t_read, t_twin, strict=True))
    med = statistics.median(ratios)
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    load1 = os.getloadavg()
    print(
        f"{name:<13} twin {statistics.median(t_twin) * 1e3:8.2f} ms/step   readable "
        f"{statistics.median(t_read) * 1e3:8.2f} ms/step   readable/twin {med:5.3f} (quartiles "
        f"{q1:5.3f}-{q3:5.3f}, range {ratios[0]:5.3f}-{ratios[-1]:5.3f}, {repeats} pairs of {steps} "
        f"steps)   load {load0[0]:.1f} -> {load1[0]:.1f}",
        flush=True,
    )
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=12, help="pairs of blocks per workload")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} cores; threshold: readable/twin >= 1.05")
    for name in args.workloads:
        ratio = measure(name, args.steps, args.repeats)
        verdict = "twin buys >= 5 %" if ratio >= 1.05 else "twin buys < 5 %"
        print(f"{'':<13} -> {verdict} of a whole step", flush=True)


if __name__ == "__main__":
    main()
