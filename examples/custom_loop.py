"""A hand-written training loop around ``trainer.step(states)``, with a hand-written policy.

The task is a toy "reach" problem of the kind a robotics user starts from: the state is a target
point ``x* in [-1, 1]^2``, the action is the 2-D point the arm moves to, and the reward is
``-||a - x*||``. The policy implements the `grpo.PolicyModel` Protocol directly (no base class):
a small MLP gives the mean of a Gaussian, with a learned state-independent log-std.

The loop is yours: draw states, ``metrics = trainer.step(states)``, log what you like (here a
JSON-lines file and a console line), evaluate, stop early when the evaluation stops improving or
reaches the target, keep the best weights (``torch.save(policy.state_dict())``) and load them
back into a fresh policy at the end.

Run: ``python examples/custom_loop.py --steps 300 --out-dir reach_run``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Independent, Normal

from grpo import GRPOConfig, GRPOTrainer, PolicyModel, check_policy


class ReachPolicy(nn.Module):
    """A `PolicyModel` by hand: target (B, 2) -> Gaussian over the 2-D reach point.

    ``generate_actions(states (B, 2), G) -> (B, G, 2)`` and ``get_log_probabilities(states (N, 2),
    actions (N, 2)) -> (N,)``; ``train``/``eval``/``to`` come from `nn.Module`.
    """

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.log_std = nn.Parameter(torch.full((2,), -0.5))

    def dist(self, states: Tensor) -> Independent:
        mu = self.mean(states)
        return Independent(Normal(mu, self.log_std.exp().expand_as(mu)), 1)

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        return self.dist(states).sample((num_actions_per_state,)).transpose(0, 1)  # (B, G, 2)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return self.dist(states).log_prob(actions)  # (N,)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def reach_reward(states: Tensor, actions: Tensor) -> Tensor:
    """r = -||a - x*||_2 for the N flat (target, point) pairs -> (N,)."""
    return -(actions - states).norm(dim=-1)


@torch.no_grad()
def evaluate(policy: ReachPolicy, targets: Tensor) -> float:
    """Mean reward of the deterministic policy (the Gaussian's mean) on fixed targets."""
    return float(reach_reward(targets, policy.dist(targets).mean).mean())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400, help="maximum trainer.step calls")
    parser.add_argument("--batch-size", type=int, default=16, help="B, targets (groups) per step")
    parser.add_argument("--group-size", type=int, default=8, help="G, reach points sampled per target")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument(
        "--patience", type=int, default=5, help="evaluations without improvement before stopping"
    )
    parser.add_argument("--target", type=float, default=-0.05, help="stop when eval reward >= this")
    parser.add_argument("--seed", type=int, default=0, help="seeds torch and the trainer")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="log + checkpoint here; None: a new temporary directory"
    )
    args = parser.parse_args(argv)

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="grpo_custom_loop_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt, log_path = out_dir / "best_policy.pt", out_dir / "metrics.jsonl"

    torch.manual_seed(args.seed)
    policy = ReachPolicy()
    check_policy(policy)  # a friendly TypeError if a Protocol method were missing
    _: PolicyModel = policy  # and the type checker agrees
    config = GRPOConfig(
        group_size=args.group_size,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        kl_coeff=0.0,
        num_epochs_per_update=2,
        seed=args.seed,
    )
    trainer = GRPOTrainer(config, policy, reach_reward)
    gen = torch.Generator().manual_seed(args.seed)
    eval_targets = torch.rand(256, 2, generator=torch.Generator().manual_seed(12345)) * 2 - 1

    best, bad_evals, stop_reason = evaluate(policy, eval_targets), 0, "max steps"
    torch.save(policy.state_dict(), ckpt)
    print(f"step    0  eval reward {best:8.4f}  (checkpoint: {ckpt})")
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        for step in range(1, args.steps + 1):
            states = torch.rand(args.batch_size, 2, generator=gen) * 2 - 1  # B targets
            metrics = trainer.step(states)
            record = {k: metrics[k] for k in ("step", "reward/mean", "loss/policy", "policy/entropy")}
            if step % args.eval_every == 0:
                score = evaluate(policy, eval_targets)
                record["eval/reward"] = score
                improved = score > best
                if improved:
                    best, bad_evals = score, 0
                    torch.save(policy.state_dict(), ckpt)
                else:
                    bad_evals += 1
                print(
                    f"step {step:4d}  train reward {metrics['reward/mean']:8.4f}  eval reward {score:8.4f}"
                    f"{'  *saved' if improved else ''}  std {policy.log_std.exp().mean().item():.3f}  "
                    f"{time.perf_counter() - t0:5.1f}s",
                    flush=True,
                )
                if score >= args.target:
                    stop_reason = f"reached target {args.target}"
                elif bad_evals >= args.patience:
                    stop_reason = f"no improvement in {args.patience} evaluations"
            log.write(json.dumps(record) + "\n")
            if stop_reason != "max steps":
                break

    restored = ReachPolicy()
    restored.load_state_dict(torch.load(ckpt, weights_only=True))
    reloaded = evaluate(restored, eval_targets)
    print(
        f"stopped at step {step}: {stop_reason}. best eval reward {best:.4f}; "
        f"reloaded checkpoint scores {reloaded:.4f}. log: {log_path}"
    )
    return {
        "steps": step,
        "stop_reason": stop_reason,
        "best": best,
        "reloaded": reloaded,
        "log": str(log_path),
    }


if __name__ == "__main__":
    main()
