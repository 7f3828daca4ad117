"""Soak test: a long run stays flat in memory and speed, with checkpoints along the way.

5,000 steps of a contextual bandit (state dim 16, 10 arms, ``grpo.policies.categorical_mlp``), a checkpoint
every 100 steps (keep last 3). Prints

* RSS growth from step 500 to the end (goal: < 50 MB);
* steps/s over the first and the last 500 steps, and their ratio (goal: within 10%);
* the same speed measured robustly on a shared machine: the trainer after the long run against a
  fresh one, in alternating blocks of 50 steps (both see the same background load);
* the mean reward of the first and last 500 steps (the policy learns).

Usage::

    python benchmarks/soak.py [--steps 5000] [--checkpoint-every 100] [--window 500]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import tempfile
import time

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp


def rss_mb() -> float:
    """Current resident set size in MB (Linux /proc; elsewhere the peak RSS)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _p10(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (1 suits a tiny MLP; 0 = torch's default)",
    )
    ap.add_argument(
        "--no-flush-denormals",
        action="store_true",
        help="GRPOConfig(flush_denormals=False): keep subnormal floats during the steps (CPU "
        "arithmetic on them is slow; a near-deterministic policy produces them, see "
        "docs/reliability.md). Default: the trainer's default, flushed during each step.",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = args.window
    if args.steps < 2 * w:
        raise SystemExit(f"--steps must be at least 2 * --window = {2 * w}")

    obs_dim, arms = 16, 10
    gen = torch.Generator().manual_seed(1)
    true_w = torch.randn(obs_dim, arms, generator=gen)

    def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (states @ true_w).gather(1, actions.view(-1, 1)).squeeze(1)

    config = GRPOConfig(
        group_size=args.group_size,
        batch_size=args.batch_size,
        kl_coeff=0.04,
        learning_rate=1e-3,
        seed=0,
        flush_denormals=not args.no_flush_denormals,
    )
    trainer = GRPOTrainer(config, categorical_mlp(obs_dim, arms), reward)
    times: list[float] = []
    cpu_times: list[float] = []
    rewards: list[float] = []
    rss_at_window = 0.0
    ckpt_time = 0.0
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for step in range(1, args.steps + 1):
            t0, p0 = time.perf_counter(), time.process_time()
            states = torch.randn(args.batch_size, obs_dim, generator=gen)
            metrics = trainer.step(states)
            if step % args.checkpoint_every == 0:
                c0 = time.perf_counter()
                trainer.save_checkpoint(ckpt_dir, keep_last=3)
                ckpt_time += time.perf_counter() - c0
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - p0)
            rewards.append(metrics["reward/mean"])
            if step == w:
                rss_at_window = rss_mb()
        n_ckpt = len(os.listdir(ckpt_dir))
    rss_end = rss_mb()

    # Load-robust check: the trainer after the long run against a fresh one, alternating blocks of
    # 50 steps so that both see the same load from other processes.
    fresh = GRPOTrainer(config, categorical_mlp(obs_dim, arms), reward)
    block = 50
    for _ in range(block):
        fresh.step(torch.randn(args.batch_size, obs_dim, generator=gen))
    old_blocks, fresh_blocks = [], []
    for _ in range(10):
        for t, out in ((trainer, old_blocks), (fresh, fresh_blocks)):
            t0 = time.perf_counter()
            for _ in range(block):
                t.step(torch.randn(args.batch_size, obs_dim, generator=gen))
            out.append(time.perf_counter() - t0)
    interleaved = statistics.median(fresh_blocks) / statistics.median(old_blocks)

    first, last = w / sum(times[:w]), w / sum(times[-w:])
    cpu_first, cpu_last = w / sum(cpu_times[:w]), w / sum(cpu_times[-w:])
    med_first, med_last = 1 / statistics.median(times[:w]), 1 / statistics.median(times[-w:])
    p10_first, p10_last = 1 / _p10(times[:w]), 1 / _p10(times[-w:])
    print(
        f"machine: {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"GRPOConfig.flush_denormals={config.flush_denormals}"
    )
    print(
        f"steps: {args.steps} (B={args.batch_size}, G={args.group_size}), checkpoint every "
        f"{args.checkpoint_every} steps ({args.steps // args.checkpoint_every} saves, "
        f"{ckpt_time / max(args.steps // args.checkpoint_every, 1) * 1e3:.1f} ms each; "
        f"{n_ckpt} entries left in the directory)"
    )
    print(f"RSS at step {w}: {rss_at_window:.1f} MB, at the end: {rss_end:.1f} MB")
    print(f"RSS growth from step {w} to the end: {rss_end - rss_at_window:+.1f} MB (goal < 50 MB)")
    print(
        f"steps/s first {w}: {first:.1f}, last {w}: {last:.1f}, "
        f"last/first = {last / first:.3f} (goal 0.9-1.1)"
    )
    print(
        f"steps/s from the median step time (robust to bursts of other load) first {w}: {med_first:.1f}, "
        f"last {w}: {med_last:.1f}, last/first = {med_last / med_first:.3f}"
    )
    print(
        f"steps/s from the 10th-percentile step time (the uncontended speed) first {w}: {p10_first:.1f}, "
        f"last {w}: {p10_last:.1f}, last/first = {p10_last / p10_first:.3f}"
    )
    print(
        f"steps per CPU-second (less sensitive to other load on the machine) first {w}: {cpu_first:.1f}, "
        f"last {w}: {cpu_last:.1f}, last/first = {cpu_last / cpu_first:.3f}"
    )
    old_rate = block / statistics.median(old_blocks)
    fresh_rate = block / statistics.median(fresh_blocks)
    print(
        f"interleaved, {block}-step blocks x 10: after {args.steps} steps {old_rate:.1f} steps/s, "
        f"fresh trainer {fresh_rate:.1f} steps/s, old/fresh speed = {interleaved:.3f} "
        f"(load-robust; goal 0.9-1.1)"
    )
    print(
        f"mean reward first {w}: {sum(rewards[:w]) / w:.3f}, last {w}: {sum(rewards[-w:]) / w:.3f}; "
        f"non-finite steps: {trainer.non_finite_steps}"
    )


if __name__ == "__main__":
    main()
