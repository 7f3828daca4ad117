"""What the framework costs: `GRPOTrainer.step` against hand-written loops doing the same work.

Contextual bandit: B=64 states of dim 16, G=8 actions each, 10 arms, MLP 16-64-64-10 (tanh),
2 epochs per step, KL (k3) to a frozen reference on, AdamW, grad clipping, one torch thread.

Three comparisons, each in this one process with the two sides alternating; ratio = the median
over repeats of (seconds per step of a trainer run / seconds per step of the hand-written run
right after it), so that slow drifts of a shared machine's speed cancel within each pair (the
quartiles of those ratios and the plain ratio of medians are printed too):

1. tensor form: a user-written policy (tensor states / actions, the network run on all N = B*G
   rows) through the trainer vs a loop making the same policy calls and the same math. Target <= 1.10.
   With one optimizer step per epoch the trainer takes the behaviour log-probs from the first
   epoch's forward (3 policy forwards per step: reference + 2 epochs), and the target loop does the
   same; the textbook loop with a 4th forward at collection is timed too, for reference.
2. list form: the same with states as a list of tensors and actions as lists of ints.
   Target <= 1.10.
3. the ready `categorical_mlp` policy through the trainer vs the most efficient hand-written loop
   (each state's network evaluated once per group, the G actions gathered from its output).
   Target <= 1.25.

Run: ``python benchmarks/overhead.py [--steps 20 --repeats 15]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp

B, G, DIM, ARMS, EPOCHS, LR, BETA, EPS = 64, 8, 16, 10, 2, 3e-3, 0.04, 0.2


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, ARMS))


class TensorPolicy(nn.Module):
    """A user-written policy in the tensor form: no grpo base class, network on every row."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def generate_actions(self, states: Tensor, g: int, **kw: Any) -> Tensor:
        probs = torch.softmax(self.net(states), -1)
        return torch.multinomial(probs, g, replacement=True)  # (B, G)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return torch.log_softmax(self.net(states), -1).gather(1, actions.unsqueeze(1)).squeeze(1)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


class ListPolicy(TensorPolicy):
    """The same policy in the list form: states a list of (DIM,) tensors, actions lists of ints."""

    def generate_actions(self, states: list[Tensor], g: int, **kw: Any) -> list[list[int]]:  # type: ignore[override]
        return super().generate_actions(torch.stack(states), g).tolist()  # type: ignore[no-any-return]

    def get_log_probabilities(self, states: list[Tensor], actions: list[int]) -> Tensor:  # type: ignore[override]
        return super().get_log_probabilities(torch.stack(states), torch.tensor(actions))


class Task:
    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.W = torch.randn(DIM, ARMS, generator=self.gen)

    def states(self) -> Tensor:
        return torch.randn(B, DIM, generator=self.gen)

    def reward(self, states: Any, actions: Any) -> Tensor:
        s = torch.stack(states) if isinstance(states, list) else states
        a = torch.as_tensor(actions)
        return (s @ self.W).gather(1, a.unsqueeze(1)).squeeze(1)


def grpo_loss(logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor) -> Tensor:
    """The hand-written loop's math: clipped surrogate + k3 KL, token-mean (T = 1)."""
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    d = ref - logp
    return (pg + BETA * (torch.exp(d) - d - 1)).mean()


def group_adv(rewards: Tensor) -> Tensor:
    r = rewards.view(B, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()


# The hand-written loops' optimizer: torch's default AdamW ("default": the for-loop implementation
# on CPU), or the fused one the trainer uses by default ("fused", --hand-optimizer fused).
HAND_OPTIMIZER: dict[str, Any] = {}


def hand_step_factory(
    policy: TensorPolicy, task: Task, list_form: bool, old_at_collection: bool = False
) -> Callable[[Tensor], float]:
    """The same policy calls and math as the trainer: ``old_at_collection=False`` takes the
    behaviour log-probs from the first epoch's forward (as the trainer does with one optimizer step
    per epoch), True makes the textbook extra no-grad forward at collection."""
    ref = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0, **HAND_OPTIMIZER)

    def step(states: Tensor) -> float:
        with torch.no_grad():
            if list_form:
                s_list = list(states)
                actions = policy.generate_actions(s_list, G)  # type: ignore[arg-type]
                flat_s = [s for s in s_list for _ in range(G)]
                flat_a = [a for grp in actions for a in grp]
            else:
                flat_s = states.repeat_interleave(G, 0)  # type: ignore[assignment]
                flat_a = policy.generate_actions(states, G).flatten()
            rewards = task.reward(flat_s, flat_a)
            old = policy.get_log_probabilities(flat_s, flat_a) if old_at_collection else None  # type: ignore[arg-type]
            ref_lp = ref.get_log_probabilities(flat_s, flat_a)  # type: ignore[arg-type]
            adv = group_adv(rewards)
        for _ in range(EPOCHS):
            logp = policy.get_log_probabilities(flat_s, flat_a)  # type: ignore[arg-type]
            if old is None:
                old = logp.detach()
            loss = grpo_loss(logp, old, ref_lp, adv)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        return float(rewards.mean())

    return step


def efficient_hand_step_factory(net: nn.Module, task: Task) -> Callable[[Tensor], float]:
    """The most efficient hand-written loop: the network runs once per state, G actions gathered."""
    ref = copy.deepcopy(net).requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0, **HAND_OPTIMIZER)

    def step(states: Tensor) -> float:
        with torch.no_grad():
            logits = net(states)  # (B, A)
            actions = torch.multinomial(torch.softmax(logits, -1), G, replacement=True)  # (B, G)
            rewards = (states @ task.W).gather(1, actions).flatten()
            old = torch.log_softmax(logits, -1).gather(1, actions).flatten()
            ref_lp = torch.log_softmax(ref(states), -1).gather(1, actions).flatten()
            adv = group_adv(rewards)
        for _ in range(EPOCHS):
            logp = torch.log_softmax(net(states), -1).gather(1, actions).flatten()
            loss = grpo_loss(logp, old, ref_lp, adv)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        return float(rewards.mean())

    return step


def trainer_step_factory(policy: Any, task: Task, list_form: bool) -> Callable[[Tensor], float]:
    cfg = GRPOConfig(
        group_size=G,
        batch_size=B,
        num_epochs_per_update=EPOCHS,
        learning_rate=LR,
        kl_coeff=BETA,
        clip_epsilon=EPS,
        max_grad_norm=1.0,
        seed=0,
    )
    trainer = GRPOTrainer(cfg, policy, task.reward)

    def step(states: Tensor) -> float:
        return trainer.step(list(states) if list_form else states)["reward/mean"]

    return step


def timed(step: Callable[[Tensor], float], states: list[Tensor]) -> float:
    t0 = time.perf_counter()
    for s in states:
        step(s)
    return (time.perf_counter() - t0) / len(states)


def compare(
    name: str,
    ours: Callable[[Tensor], float],
    hands: dict[str, Callable[[Tensor], float]],
    task: Task,
    steps: int,
    repeats: int,
    target: float,
) -> float:
    """Alternate timed runs of ``ours`` and each hand-written loop; the target applies to the first."""
    batches = [task.states() for _ in range(steps)]
    for s in batches[:3]:  # warm-up
        ours(s)
        for hand in hands.values():
            hand(s)
    t_ours: list[float] = []
    t_hand: dict[str, list[float]] = {k: [] for k in hands}
    for _ in range(repeats):
        t_ours.append(timed(ours, batches))
        for k, hand in hands.items():
            t_hand[k].append(timed(hand, batches))
    mo = statistics.median(t_ours)
    ratios = []
    for i, (k, ts) in enumerate(t_hand.items()):
        mh = statistics.median(ts)
        # the ratio of each run of the trainer to the hand-written run right after it: slow drifts
        # of the machine's speed cancel in each pair; the median over pairs, with its quartiles
        paired = sorted(a / b for a, b in zip(t_ours, ts, strict=True))
        ratio = statistics.median(paired)
        q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
        ratios.append(ratio)
        spread = f"quartiles {q1:5.3f}-{q3:5.3f}, ratio of medians {mo / mh:5.3f}"
        if i == 0:
            verdict = "OK" if ratio <= target else "ABOVE TARGET"
            print(
                f"{name:<34} trainer {mo * 1e3:7.3f} ms/step   {k:<22} {mh * 1e3:7.3f} ms/step   "
                f"ratio {ratio:5.3f}  (target <= {target:.2f}: {verdict}; {spread})"
            )
        else:
            print(
                f"{'':<34} {'':<24} {k:<22} {mh * 1e3:7.3f} ms/step   ratio {ratio:5.3f}  "
                f"(for reference; {spread})"
            )
    return ratios[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="alternating timed runs per side")
    parser.add_argument(
        "--hand-optimizer",
        choices=["default", "fused"],
        default="default",
        help="AdamW of the hand-written loops: torch's default (for-loop on CPU) or fused, as the trainer",
    )
    args = parser.parse_args()
    if args.hand_optimizer == "fused":
        HAND_OPTIMIZER["fused"] = True
    torch.set_num_threads(1)
    task = Task()
    print(
        f"contextual bandit B={B} G={G} epochs={EPOCHS} KL on, MLP {DIM}-64-64-{ARMS}, 1 torch thread, "
        f"torch {torch.__version__}, hand-written loops' AdamW: {args.hand_optimizer}"
    )

    torch.manual_seed(0)
    p1, p2 = TensorPolicy(), TensorPolicy()
    p2.load_state_dict(p1.state_dict())
    p3 = copy.deepcopy(p2)
    compare(
        "1. user policy, tensor form",
        trainer_step_factory(p1, task, False),
        {
            "same calls (3 fwd)": hand_step_factory(p2, task, False),
            "old at collection (4)": hand_step_factory(p3, task, False, old_at_collection=True),
        },
        task,
        args.steps,
        args.repeats,
        1.10,
    )

    q1, q2 = ListPolicy(), ListPolicy()
    q2.load_state_dict(q1.state_dict())
    q3 = copy.deepcopy(q2)
    compare(
        "2. user policy, list form",
        trainer_step_factory(q1, task, True),
        {
            "same calls (3 fwd)": hand_step_factory(q2, task, True),
            "old at collection (4)": hand_step_factory(q3, task, True, old_at_collection=True),
        },
        task,
        args.steps,
        args.repeats,
        1.10,
    )

    ready = categorical_mlp(DIM, ARMS, (64, 64))
    net = copy.deepcopy(ready.net.net)
    compare(
        "3. ready policy vs most efficient",
        trainer_step_factory(ready, task, False),
        {"most efficient": efficient_hand_step_factory(net, task)},
        task,
        args.steps,
        args.repeats,
        1.25,
    )


if __name__ == "__main__":
    main()
