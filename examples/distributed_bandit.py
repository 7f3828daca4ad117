"""A contextual bandit trained with GRPO; the same script on 1 process or under torchrun.

    python examples/distributed_bandit.py                                   # one process
    torchrun --standalone --nproc_per_node=2 examples/distributed_bandit.py # two processes
    torchrun --standalone --nproc_per_node=2 examples/distributed_bandit.py \
        --deepspeed examples/configs/deepspeed_zero2.json                   # + DeepSpeed ZeRO-2
    (deepspeed_zero3.json: ZeRO-3, the weights partitioned too; the same curve)

Nothing in the training loop knows how many processes run it: each process draws its own
random contexts (the trainer seeds each rank with ``seed + rank``), the trainer reduces gradients
and metrics, and only rank 0 prints. ``--batch-size`` is per process.
"""

from __future__ import annotations

import argparse

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.engine.deepspeed import DeepSpeedBackend
from grpo.engine.distributed import get_world_size, is_main_process, shutdown
from grpo.policies import categorical_mlp


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps")
    parser.add_argument("--batch-size", type=int, default=32, help="states per process per step")
    parser.add_argument("--group-size", type=int, default=8, help="G, arms sampled per context")
    parser.add_argument("--obs-dim", type=int, default=8, help="size of a context")
    parser.add_argument("--arms", type=int, default=4, help="number of arms")
    parser.add_argument("--log-every", type=int, default=10, help="steps between printed lines")
    parser.add_argument("--device", default="cpu", help="'cpu', 'cuda' (cuda:LOCAL_RANK), 'auto'")
    parser.add_argument(
        "--deepspeed", default="auto", help="a DeepSpeed JSON config (ZeRO-1/2/3), 'auto' or 'off'"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    true_w = torch.randn(args.obs_dim, args.arms)  # the same on every rank (seeded before the trainer)

    def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """1 for the best arm of the context, else 0."""
        best = (states @ true_w.to(states.device)).argmax(-1)
        return (actions == best).float()

    policy = categorical_mlp(args.obs_dim, args.arms, hidden=(64,))
    config = GRPOConfig(
        group_size=args.group_size,
        batch_size=args.batch_size,
        learning_rate=1e-2,
        kl_coeff=0.0,
        seed=0,
        device=args.device,
        deepspeed=args.deepspeed,
    )
    trainer = GRPOTrainer(config, policy, reward)
    if is_main_process():
        backend = trainer.backend  # a grpo.engine.deepspeed.DeepSpeedBackend when DeepSpeed runs
        zero = f"ZeRO-{backend.stage}" if isinstance(backend, DeepSpeedBackend) else "off"
        print(
            f"world_size={get_world_size()} global_batch={get_world_size() * args.batch_size} states "
            f"deepspeed={zero}"
        )
    for step in range(args.steps):
        states = torch.randn(args.batch_size, args.obs_dim, device=trainer.device)  # this rank's shard
        metrics = trainer.step(states)
        if is_main_process() and (step % args.log_every == 0 or step == args.steps - 1):
            r, g = metrics["reward/mean"], metrics["grad/norm"]
            print(f"step {step:4d}  reward/mean {r:.3f}  grad/norm {g:.3f}")
    shutdown(trainer)  # release DeepSpeed's engine, wait for every rank, destroy the process group


if __name__ == "__main__":
    main()
