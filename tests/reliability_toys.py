"""Toy problem for the reliability tests, also runnable as a worker process.

A contextual bandit: states (B, 4) drawn from NumPy's global RNG, 3 arms, reward = (s @ W)[a] plus
noise from torch's, Python's and NumPy's global RNGs (so every RNG stream matters for an exact
resume). The trainer runs 2 epochs x 2 minibatches with a KL term (reference policy) and an LR
scheduler, so the optimizer, scheduler and reference all carry state.

Worker use (prints one JSON line per trainer step: {"step", "reward", ...}; then "done <hash>"):

    python reliability_toys.py run   CKPT_DIR STEPS [--save-every K] [--resume]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp

W = torch.tensor([[0.5, -0.2, 0.1], [0.0, 0.3, -0.4], [0.2, 0.2, 0.9], [-0.6, 0.1, 0.0]])


def bandit_reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """(N, 4) states, (N,) arms -> (N,) rewards with a little noise from three RNG streams."""
    base = (states @ W).gather(1, actions.view(-1, 1)).squeeze(1)
    noise = 0.01 * torch.rand(base.shape) + 0.01 * random.random() + 0.01 * float(np.random.rand())
    return base + noise


def make_policy(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return categorical_mlp(4, 3, (8,))


def make_config(**overrides: Any) -> GRPOConfig:
    kw: dict[str, Any] = dict(
        group_size=4,
        batch_size=4,
        mini_batch_size=2,
        num_epochs_per_update=2,
        kl_coeff=0.04,
        seed=0,
        learning_rate=1e-2,
        lr_schedule="linear",  # the trainer builds and steps this scheduler (state to checkpoint)
        warmup_steps=2,
        total_steps=10_000,
    )
    kw.update(overrides)
    return GRPOConfig(**kw)


def make_trainer(**overrides: Any) -> GRPOTrainer:
    return GRPOTrainer(make_config(**overrides), make_policy(), bandit_reward)


def next_states() -> torch.Tensor:
    return torch.from_numpy(np.random.randn(4, 4).astype(np.float32))


def train_step(trainer: GRPOTrainer) -> dict[str, float]:
    return trainer.step(next_states())


def param_hash(trainer: GRPOTrainer) -> str:
    h = hashlib.sha256()
    for p in trainer.params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def resume(ckpt_dir: str) -> GRPOTrainer:
    """A trainer built like `make_trainer` and restored from ``ckpt_dir`` (a new process's view)."""
    policy = make_policy(seed=123)  # different init: every weight must come from the checkpoint
    trainer = GRPOTrainer(make_config(), policy, bandit_reward)
    trainer.load_checkpoint(ckpt_dir)
    return trainer


def run(ckpt_dir: str, steps: int, save_every: int | None, do_resume: bool) -> None:
    torch.set_num_threads(1)
    from grpo.state.checkpoint import find_latest_checkpoint

    if do_resume and find_latest_checkpoint(ckpt_dir) is not None:
        trainer = resume(ckpt_dir)
    else:
        trainer = make_trainer()
    print(json.dumps({"ready": trainer.step_count}), flush=True)
    while trainer.step_count < steps:
        m = train_step(trainer)
        saved = None
        if save_every is not None and trainer.step_count % save_every == 0:
            saved = str(trainer.save_checkpoint(ckpt_dir, keep_last=3))
        print(
            json.dumps({"step": trainer.step_count, "reward": m["reward/mean"], "saved": saved}), flush=True
        )
    print(f"done {param_hash(trainer)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run"])
    ap.add_argument("ckpt_dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--save-every", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    run(a.ckpt_dir, a.steps, a.save_every, a.resume)


def zygote() -> None:
    """Read commands on stdin; ``run <args>`` forks a child that runs `main` with those args.

    The zygote imports and warms up on one thread (no OpenMP pool to break on fork), so a child
    starts in milliseconds instead of the seconds an interpreter needs to import torch.
    """
    import os
    import tempfile

    # Warm up (one thread: no OpenMP pool exists when we fork), so children start hot.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        trainer = make_trainer()
        train_step(trainer)
        trainer.save_checkpoint(d)
        train_step(resume(d))
    print("zygote ready", flush=True)
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "run":
            pid = os.fork()
            if pid == 0:  # child
                try:
                    main(rest.split())
                finally:
                    sys.stdout.flush()
                    os._exit(0)
            print(f"child {pid}", flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(rest), 0)
            print(f"reaped {status}", flush=True)
        elif cmd == "exit":
            return


class PlainPolicy:
    """Not an nn.Module: one weight tensor, saved through get_parameters() and copied in place."""

    def __init__(self, value: float) -> None:
        self.w = torch.full((3,), value, requires_grad=True)

    def generate_actions(self, states: Any, num_actions_per_state: int, **kw: Any) -> Tensor:
        return torch.distributions.Categorical(logits=self.w).sample((len(states), num_actions_per_state))

    def get_log_probabilities(self, states: Any, actions: Any) -> Tensor:
        return torch.log_softmax(self.w, -1)[actions]

    def get_parameters(self) -> dict[str, Tensor]:
        return {"w": self.w}

    def train(self) -> None: ...
    def eval(self) -> None: ...
    def to(self, device: Any) -> PlainPolicy:
        return self


class StateDictPolicy(PlainPolicy):
    """Not an nn.Module, but with the state_dict()/load_state_dict() hook (which wins)."""

    def __init__(self, value: float) -> None:
        super().__init__(value)
        self.temperature = torch.tensor(1.0)

    def state_dict(self) -> dict[str, Tensor]:
        return {"w": self.w.detach(), "temperature": self.temperature}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
        self.temperature = state["temperature"].clone()


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        main()
