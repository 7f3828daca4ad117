"""Quick start: GRPO on a contextual bandit, with a policy and a reward written from scratch.

Each state is a 16-dim context x; there are 10 arms; arm a pays (x @ W)[a]. The policy is a small
MLP; nothing in it knows about GRPO except the six methods of the `PolicyModel` protocol. The
script prints the policy's expected reward as a fraction of the oracle's (0 = arms picked at random,
1 = always the best arm) every 25 steps, and at the end the line the README's quick start prints:

    fraction of the oracle's reward: 0.00 -> 0.98

    python examples/quickstart.py              # ~10 s on a laptop CPU
    python examples/quickstart.py --steps 5    # smoke test
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer, PolicyOutput

DIM, ARMS = 16, 10


class ArmPolicy(nn.Module):
    """A user-written policy: no grpo base class, just the PolicyModel methods."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, ARMS))

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        probs = torch.softmax(self.net(states), dim=-1)  # (B, ARMS)
        return torch.multinomial(probs, num_actions_per_state, replacement=True)  # (B, G)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> PolicyOutput:
        logp = torch.log_softmax(self.net(states), dim=-1)  # (N, ARMS)
        # log-probs (N,) and the exact entropy -sum_a p log p (N,) of the same forward (without
        # it the trainer falls back to a Monte Carlo estimate of the entropy)
        entropy = -(logp.exp() * logp).sum(-1)
        return PolicyOutput(logp.gather(1, actions.unsqueeze(1)).squeeze(1), entropy=entropy)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())

    # train(), eval() and to() come from nn.Module.


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=0, help="seeds the task, the policy and the trainer")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    W = torch.randn(DIM, ARMS)

    def reward(states: Tensor, actions: Tensor) -> Tensor:  # a plain function is a reward
        return (states @ W).gather(1, actions.unsqueeze(1)).squeeze(1)

    def fraction_of_oracle(policy: ArmPolicy) -> float:  # expected reward / the best arm's
        x = torch.randn(2000, DIM, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            r, probs = x @ W, torch.softmax(policy.net(x), dim=-1)
        return float((probs * r).sum(1).mean() / r.max(1).values.mean())

    policy = ArmPolicy()
    # the preset for small policies: lr 5e-3 (lowered when steps move too far), 10 epochs x 4
    # mini-batches (grpo/algorithms/recipes.py)
    config = GRPOConfig.recipe("small_policy", group_size=8, batch_size=64, seed=args.seed)
    trainer = GRPOTrainer(config, policy, reward)  # print(config) shows every setting
    score = start = fraction_of_oracle(policy)
    print(f"step    0  reward/oracle {score:.3f}")
    for step in range(1, args.steps + 1):
        metrics = trainer.step(torch.randn(config.batch_size, DIM))
        if step % 25 == 0 or step == args.steps:
            score = fraction_of_oracle(policy)
            print(
                f"step {step:4d}  reward/oracle {score:.3f}  reward {metrics['reward/mean']:+.3f}  "
                f"kl/old {metrics['kl/old']:.4f}  entropy {metrics['policy/entropy']:.3f}  "
                f"clip {metrics['clip/frac_low'] + metrics['clip/frac_high']:.3f}"
            )
    print(f"fraction of the oracle's reward: {start:.2f} -> {score:.2f}")
    return score


if __name__ == "__main__":
    main()
