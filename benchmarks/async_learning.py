"""Async rollouts learn as the synchronous step does (issue 30, item 5).

    python benchmarks/async_learning.py [--steps 150] [--seeds 0 1 2] [--sides hf:0 worker:1]

Runs examples/llm_tiny.py (a tiny Llama learns to answer "n:" with n+1) for each seed and each
side ``ENGINE:K`` (``generation_engine=ENGINE``, ``async_staleness=K``; ``worker:1`` = a
generation worker one step ahead, every batch sampled by the weights of the step before), each in
its own process, and prints the mean reward of every 25-step window and the sampled accuracy at
the end, per run, then the mean and spread over seeds per side. k = 1 matches k = 0 when its
windows fall inside the seeds' spread of k = 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(side: str, seed: int, steps: int) -> tuple[list[float], float]:
    engine, k = side.split(":")
    with tempfile.TemporaryDirectory() as d:
        hist = Path(d) / "history.json"
        cmd = [sys.executable, str(ROOT / "examples" / "llm_tiny.py"), "--steps", str(steps)]
        cmd += ["--seed", str(seed), "--engine", engine, "--async", k]
        cmd += ["--history-json", str(hist), "--log-every", str(steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        acc = float(out.stderr.strip().splitlines()[-1].split()[-1])  # "sampled accuracy after N steps: X"
        return json.loads(hist.read_text()), acc


def windows(curve: list[float], width: int) -> list[float]:
    return [statistics.fmean(curve[i : i + width]) for i in range(0, len(curve), width)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sides", nargs="+", default=["hf:0", "worker:1"])
    p.add_argument("--window", type=int, default=25)
    a = p.parse_args()
    table: dict[str, list[tuple[list[float], float]]] = {s: [] for s in a.sides}
    for seed in a.seeds:
        for side in a.sides:  # alternating sides within each seed
            curve, acc = run(side, seed, a.steps)
            table[side].append((windows(curve, a.window), acc))
            w = " ".join(f"{x:.2f}" for x in table[side][-1][0])
            print(f"seed {seed} {side:<9} reward per {a.window} steps: {w}   accuracy {acc:.3f}", flush=True)
    for side, rows in table.items():
        cols = list(zip(*(r[0] for r in rows), strict=True))
        mean = " ".join(f"{statistics.fmean(c):.2f}" for c in cols)
        spread = " ".join(f"[{min(c):.2f}-{max(c):.2f}]" for c in cols)
        accs = [r[1] for r in rows]
        print(f"{side:<9} mean {mean}\n{'':<9} range {spread}\n{'':<9} accuracy {statistics.fmean(accs):.3f} "
              f"[{min(accs):.3f}-{max(accs):.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
