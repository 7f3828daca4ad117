"""Data-parallel scaling of `GRPOTrainer`: steps/s on 1 and 2 CPU processes at a fixed global batch.

    python benchmarks/scaling.py                      # global batches 64 and 512 states, G = 8
    python benchmarks/scaling.py --global-batch 256 --steps 40 --repeats 9
    python benchmarks/scaling.py --deepspeed          # also W=2 through DeepSpeed ZeRO-2 and ZeRO-3

Strong scaling: the global batch (states per step over all processes) is fixed; with W processes
each steps on ``global_batch / W`` states. Every process uses one thread (``torch.set_num_threads
(1)``), so W processes use W cores. Two processes are spawned once, with the environment torchrun
would give them (the trainer joins the gloo group from RANK / WORLD_SIZE / MASTER_*), and they
time three kinds of windows of ``--steps`` steps, interleaved ``--repeats`` times so that load
changes on a shared machine hit all three alike:

    W=1       rank 0 alone steps on the whole global batch (rank 1 waits in a barrier)
    W=2       both ranks, data-parallel, global_batch / 2 states each
    no-sync   both ranks on their halves with distributed="off" (no collectives at all)
    ZeRO-2    (with --deepspeed) W=2 with backward and optimizer step through DeepSpeed ZeRO-2
    ZeRO-3    (with --deepspeed) the same with ZeRO-3, every weight partitioned (no persistent
              small weights: each forward all-gathers, each backward reduce-scatters)

Printed per global batch: the median steps/s of each, speedup = W=2 / W=1, efficiency =
speedup / 2, and sync cost = 1 - W=2 / no-sync (the share of a step spent in collectives and
waiting for the other rank); with --deepspeed, ZeRO-2 and ZeRO-3 steps/s and their ratios to W=2
(the trainer's own gradient sync), and what they hold on rank 0: Adam moments (ZeRO-2) and
weights (ZeRO-3) against the trainer's own sync.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

OBS, ARMS, HIDDEN, GROUP = 16, 8, (64, 64), 8


def _worker(
    rank: int, world: int, port: int, args: tuple[int, int, int, int, dict[str, str]], out: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )  # fmt: skip
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.policies import categorical_mlp

    global_batch, steps, warmup, repeats, ds_configs = args
    torch.set_num_threads(1)
    torch.manual_seed(0)
    true_w = torch.randn(OBS, ARMS)

    def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (actions == (states @ true_w).argmax(-1)).float()

    def trainer(batch: int, mode: str, deepspeed: str = "off") -> GRPOTrainer:
        cfg = GRPOConfig(
            group_size=GROUP, batch_size=batch, kl_coeff=0.0, learning_rate=1e-3, seed=0,
            distributed=mode, deepspeed=deepspeed,  # type: ignore[arg-type]
        )  # fmt: skip
        return GRPOTrainer(cfg, categorical_mlp(OBS, ARMS, HIDDEN), reward)

    local = global_batch // world
    synced = trainer(local, "auto")  # joins the process group (collective)
    alone = trainer(local, "off")
    single = trainer(global_batch, "off") if rank == 0 else None
    zeros = {label: trainer(local, "auto", path) for label, path in ds_configs.items()}

    def window(t: GRPOTrainer, batch: int, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            t.step(torch.randn(batch, OBS))
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"W=1": [], "W=2": [], "no-sync": [], **{k: [] for k in zeros}}
    for r in range(repeats + 1):
        n = warmup if r == 0 else steps
        torch.distributed.barrier()
        if single is not None:
            dt = window(single, global_batch, n)
            if r:
                times["W=1"].append(dt)
        torch.distributed.barrier()
        dt = window(synced, local, n)
        torch.distributed.barrier()
        if r:
            times["W=2"].append(dt)
        dt = window(alone, local, n)
        if r:
            times["no-sync"].append(dt)
        for label, zero in zeros.items():
            torch.distributed.barrier()
            dt = window(zero, local, n)
            if r:
                times[label].append(dt)
    if rank == 0:
        result = {k: steps / statistics.median(v) for k, v in times.items() if v}
        # what ZeRO saves on this rank, bytes: Adam moments (ZeRO-2), weights (ZeRO-3)
        result["moments own"] = state_bytes(synced.optimizer)
        result["weights own"] = weight_bytes(synced.params)
        if "ZeRO-2" in zeros:
            result["moments ZeRO-2"] = state_bytes(zeros["ZeRO-2"].optimizer)
        if "ZeRO-3" in zeros:
            result["weights ZeRO-3"] = weight_bytes(zeros["ZeRO-3"].params)
        Path(out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def state_bytes(optimizer: torch.optim.Optimizer | None) -> float:
    """Bytes of the optimizer's state tensors on this rank (under ZeRO: of its partition)."""
    assert optimizer is not None
    return float(
        sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
    )


def weight_bytes(params: list[torch.Tensor]) -> float:
    """Bytes of the weights this rank holds between forwards (under ZeRO-3: its partitions,
    ``ds_tensor``; the full tensors exist only while a module runs)."""
    return float(sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in params))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(
    global_batch: int, steps: int, warmup: int, repeats: int, deepspeed: bool = False
) -> dict[str, float]:
    """Median steps/s of each kind of window (see the module docstring)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "sps.txt")
        ds_configs: dict[str, str] = {}
        if deepspeed:
            for stage in (2, 3):
                zero: dict[str, int] = {"stage": stage}
                if stage == 3:
                    zero["stage3_param_persistence_threshold"] = 0  # partition every weight
                ds_configs[f"ZeRO-{stage}"] = path = os.path.join(d, f"zero{stage}.json")
                Path(path).write_text(json.dumps({"zero_optimization": zero}))
        run_args = (global_batch, steps, warmup, repeats, ds_configs)
        mp.spawn(_worker, args=(2, free_port(), run_args, out), nprocs=2)
        result: dict[str, float] = json.loads(Path(out).read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--deepspeed", action="store_true", help="also time W=2 through DeepSpeed ZeRO-2 and ZeRO-3"
    )
    args = parser.parse_args()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    with open("/proc/loadavg") if os.path.exists("/proc/loadavg") else open(os.devnull) as f:
        load = f.read().split()[:3]
    print(
        f"contextual bandit: categorical_mlp({OBS}, {ARMS}, hidden={HIDDEN}), G={GROUP}; torch "
        f"{torch.__version__}; {os.cpu_count()} CPUs; 1 thread per process; gloo; load average {load}"
    )
    zero_head = f" {'ZeRO-2':>8} {'vs W=2':>7} {'ZeRO-3':>8} {'vs W=2':>7}" if args.deepspeed else ""
    print(
        f"{'global B':>8} {'samples':>8} {'sps W=1':>8} {'sps W=2':>8} {'speedup':>8} "
        f"{'efficiency':>10} {'no-sync':>8} {'sync cost':>9}{zero_head}"
    )
    for gb in args.global_batch:
        if gb % 2:
            raise SystemExit(f"--global-batch {gb} must be even to split over 2 processes")
        sps = measure(gb, args.steps, args.warmup, args.repeats, args.deepspeed)
        one, two, alone = sps["W=1"], sps["W=2"], sps["no-sync"]
        speedup = two / one
        zero = ""
        if "ZeRO-2" in sps:
            z2, z3 = sps["ZeRO-2"], sps["ZeRO-3"]
            held = (
                f"rank 0 holds: Adam moments {sps['moments own']:.0f} B own sync, "
                f"{sps['moments ZeRO-2']:.0f} B ZeRO-2; weights {sps['weights own']:.0f} B own sync, "
                f"{sps['weights ZeRO-3']:.0f} B ZeRO-3"
            )
            zero = f" {z2:>8.1f} {z2 / two:>7.2f} {z3:>8.1f} {z3 / two:>7.2f}   ({held})"
        print(
            f"{gb:>8} {gb * GROUP:>8} {one:>8.1f} {two:>8.1f} {speedup:>8.2f} {speedup / 2:>10.2f} "
            f"{alone:>8.1f} {1 - two / alone:>9.0%}{zero}"
        )


if __name__ == "__main__":
    main()
