"""Which in-process sampler a GRPO step should use: the KV-cache loop or Hugging Face ``generate``.

    python benchmarks/sampling_route.py [--rounds 12] [--new-tokens 32] [--hidden 64] [--layers 2]

Issue 42: a fast twin of a readable implementation stays only if it buys at least 5 % of a
whole step. `grpo.llm.decode.sample_with_kv_cache` (``SamplingSettings(decoding="auto")``, the
default) is the twin of ``generate`` (``decoding="generate"``): bitwise the same tokens from the
same random stream (tests/test_llm_decode.py). This measures a whole `GRPOTrainer.step` (sample
8 prompts x 8 completions of up to ``--new-tokens`` tokens, reward, old log-probs, one update)
on a tiny random Llama built from a config (`grpo.llm.tiny`), with each sampler.

The two trainers start from the same weights; before each round's steps the torch seed is set to
the round number, so both sample the same tokens and make the same update: their weights stay
bitwise equal (checked after every round, printed), and the only difference between the sides is
the sampler. The sides alternate order each round (kv first, then generate first) and every ratio
is taken within a round, so a load change between rounds cancels. Printed: each round's
wall and CPU seconds per step (CPU: this process's time, ``time.process_time``, with one torch
thread: the work done, barely moved by other processes on a loaded machine) and the ratios
``generate / kv``; for each, the median ratio with its min-max spread and the median share of a
step the KV loop saves, ``1 - kv / generate``; the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's grpo

PROMPTS = [f"{i}+{j}=" for i, j in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (0, 9), (4, 4), (6, 3)]]


def _trainer(model: Any, tok: Any, decoding: str, new_tokens: int) -> Any:
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings

    sampling = SamplingSettings(max_new_tokens=new_tokens, temperature=1.0, decoding=decoding)
    policy = CausalLMPolicy(model, tok, sampling)
    reward = RewardFunctions(lambda p, c: [x.count("7") / max(len(x), 1) for x in c])
    config = GRPOConfig(group_size=8, batch_size=8, learning_rate=1e-4, kl_coeff=0.0, seed=0)
    return GRPOTrainer(config, policy, reward)


def _timed_step(trainer: Any, seed: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step from torch seed ``seed``."""
    torch.manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.step(PROMPTS)
    return time.perf_counter() - t0, time.process_time() - c0


def _same_weights(a: Any, b: Any) -> bool:
    pa, pb = a.policy.get_parameters(), b.policy.get_parameters()
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: CPU time = work)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tok = build_tiny_tokenizer(d)
        model = build_tiny_model(d, tok, hidden=args.hidden, layers=args.layers)
    sides = {
        "kv": _trainer(model, tok, "auto", args.new_tokens),
        "generate": _trainer(copy.deepcopy(model), tok, "generate", args.new_tokens),
    }
    for trainer in sides.values():  # warm-up (not timed), same seed: weights stay equal
        _timed_step(trainer, 10_000)
    wall: list[float] = []  # generate / kv per round
    cpu: list[float] = []
    equal = True
    head = ("round", "kv wall s", "cpu s", "generate wall s", "cpu s", "generate/kv wall", "cpu")
    print("{:>5} {:>9} {:>9} {:>15} {:>9} {:>17} {:>6}".format(*head))
    for r in range(args.rounds):
        order = ["kv", "generate"] if r % 2 == 0 else ["generate", "kv"]
        t = {name: _timed_step(sides[name], r) for name in order}
        equal &= _same_weights(sides["kv"], sides["generate"])
        wall.append(t["generate"][0] / t["kv"][0])
        cpu.append(t["generate"][1] / t["kv"][1])
        kv, gen = t["kv"], t["generate"]
        row = (r, kv[0], kv[1], gen[0], gen[1], wall[-1], cpu[-1])
        print("{:>5} {:>9.4f} {:>9.4f} {:>15.4f} {:>9.4f} {:>17.3f} {:>6.3f}".format(*row))
    print(f"weights bitwise equal after every round (same tokens, same updates): {equal}")
    for what, ratios in (("wall", wall), ("CPU", cpu)):
        saved = sorted(1.0 - 1.0 / x for x in ratios)
        print(
            f"whole step, generate / kv ({what} time): median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {args.rounds} rounds; share of a "
            f"step the KV-cache loop saves: median {100 * statistics.median(saved):.1f} % "
            f"(min {100 * saved[0]:.1f} %, max {100 * saved[-1]:.1f} %)"
        )
    print("the twin stays when the median share is >= 5 %")
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}; cpus {os.cpu_count()}")


if __name__ == "__main__":
    main()
