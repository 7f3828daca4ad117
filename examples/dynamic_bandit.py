"""GRPO on a dynamic K-armed bandit: slow drift plus abrupt switches of the best arm.

This module is the demo's single source: ``examples/grpo_dynamic_bandit_demo.ipynb`` imports it
and explains each step; ``python examples/dynamic_bandit.py --out-dir figs`` runs the same
experiments and saves the figures as PNG.

The bandit. K arms; pulling arm a at round t pays a Bernoulli reward with mean ``mu[t, a]``::

    mu[t, a] = clip(base[phase(t), a] + drift * sin(2 pi t / period + phi_a), 0.02, 0.98)

``base`` changes abruptly at each switch round (a different arm becomes the best) and the
sinusoid moves every arm slowly in between. The oracle plays ``argmax_a mu[t, a]`` every round.

GRPO. The policy is a softmax over K learned preferences, ``pi(a) = softmax(theta)_a``. Each round
is one ``trainer.step``: the state is the round index t (so the reward knows which means apply),
the policy samples a group of G arms, each gets a reward ``r_i``, and the group-relative advantage
``A_i = (r_i - mean(r)) / (std(r) + eps)`` pushes up the arms that beat the group and down the
others. The KL term to the uniform starting policy (``kl_coeff``) and the entropy bonus keep some
probability on every arm, which is what lets the policy notice a switch.

Run: ``python examples/dynamic_bandit.py --rounds 450 --out-dir bandit_figs``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import DistributionPolicy
from grpo.runtime.extras import install_hint


# ---- the environment -----------------------------------------------------------------------
@dataclass
class DynamicBandit:
    """Means ``mu (rounds, K)`` of a drifting, switching Bernoulli bandit, and its switch rounds."""

    means: Tensor
    switches: tuple[int, ...]

    @property
    def rounds(self) -> int:
        return int(self.means.shape[0])

    @property
    def num_arms(self) -> int:
        return int(self.means.shape[1])

    @property
    def oracle(self) -> Tensor:
        """(rounds,) the best arm's mean at each round."""
        return self.means.max(dim=1).values

    def phases(self) -> list[tuple[int, int]]:
        """[start, end) rounds of each phase between switches."""
        edges = [0, *self.switches, self.rounds]
        return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]

    def reward(self, states: Tensor, actions: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Bernoulli rewards: states (N, 1) round index, actions (N,) arm -> (N,) in {0, 1}."""
        t = states[:, 0].long()
        return torch.bernoulli(self.means[t, actions.long()], generator=generator)


def make_bandit(
    num_arms: int = 5,
    rounds: int = 450,
    num_phases: int = 3,
    drift: float = 0.08,
    period: float = 120.0,
    seed: int = 0,
) -> DynamicBandit:
    """A bandit whose best arm changes at ``num_phases - 1`` evenly spaced rounds.

    In each phase a different arm has base mean 0.85; the others get means in [0.15, 0.55].
    """
    if num_arms < 2 or num_phases < 1 or rounds < num_phases:
        raise ValueError(
            f"need num_arms >= 2 and rounds >= num_phases >= 1; got {num_arms}, {rounds}, {num_phases}"
        )
    g = torch.Generator().manual_seed(seed)
    best = torch.randperm(num_arms, generator=g)
    base = torch.empty(num_phases, num_arms)
    for p in range(num_phases):
        base[p] = 0.15 + 0.4 * torch.rand(num_arms, generator=g)
        base[p, best[p % num_arms]] = 0.85
    switches = tuple(round(rounds * p / num_phases) for p in range(1, num_phases))
    phase_of = torch.bucketize(torch.arange(rounds), torch.tensor(switches, dtype=torch.long), right=True)
    phi = 2 * math.pi * torch.rand(num_arms, generator=g)
    t = torch.arange(rounds, dtype=torch.float32).unsqueeze(1)
    means = base[phase_of] + drift * torch.sin(2 * math.pi * t / period + phi)
    return DynamicBandit(means.clamp(0.02, 0.98), switches)


# ---- the policy ----------------------------------------------------------------------------
class ArmPreferences(nn.Module):
    """states (B, 1) -> Categorical(softmax(theta)) over K arms; theta (K,) is shared by all rounds."""

    def __init__(self, num_arms: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(num_arms))

    def forward(self, states: Tensor) -> Categorical:
        return Categorical(logits=self.theta.expand(states.shape[0], -1))


# ---- the experiment ------------------------------------------------------------------------
@dataclass
class History:
    """What one run recorded, round by round."""

    group_size: int
    probs: np.ndarray  # (rounds, K) pi_t(a) before the update of round t
    expected_reward: np.ndarray  # (rounds,) sum_a pi_t(a) mu[t, a]
    sampled_reward: np.ndarray  # (rounds,) mean reward of the G pulls of round t
    seconds: float


def default_config(group_size: int, seed: int) -> GRPOConfig:
    """The GRPO settings used throughout the demo (one state per step, a few epochs)."""
    return GRPOConfig(
        group_size=group_size,
        batch_size=1,
        learning_rate=0.2,
        num_epochs_per_update=2,
        kl_coeff=0.1,
        entropy_coeff=0.01,
        max_grad_norm=None,
        seed=seed,
    )


def run_grpo(
    bandit: DynamicBandit, group_size: int = 8, seed: int = 0, config: GRPOConfig | None = None
) -> History:
    """Train a fresh policy for ``bandit.rounds`` rounds, one ``trainer.step`` per round."""
    config = config or default_config(group_size, seed)
    policy = DistributionPolicy(ArmPreferences(bandit.num_arms))
    reward_gen = torch.Generator().manual_seed(10_000 + seed)

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        return bandit.reward(states, actions, reward_gen)

    trainer = GRPOTrainer(config, policy, reward)
    probs = np.zeros((bandit.rounds, bandit.num_arms))
    sampled = np.zeros(bandit.rounds)
    t0 = time.perf_counter()
    for t in range(bandit.rounds):
        with torch.no_grad():
            probs[t] = torch.softmax(policy.net.theta, 0).numpy()
        metrics = trainer.step(torch.full((1, 1), float(t)))
        sampled[t] = metrics["reward/mean"]
    expected = (probs * bandit.means.numpy()).sum(1)
    return History(group_size, probs, expected, sampled, time.perf_counter() - t0)


def phase_ratios(history: History, bandit: DynamicBandit) -> list[float]:
    """Per phase: mean expected reward of the policy / mean oracle reward."""
    oracle = bandit.oracle.numpy()
    return [float(history.expected_reward[a:b].mean() / oracle[a:b].mean()) for a, b in bandit.phases()]


def cumulative_regret(history: History, bandit: DynamicBandit) -> np.ndarray:
    """(rounds,) sum_{s<=t} (mu*_s - sum_a pi_s(a) mu[s, a]), the expected regret per pull."""
    return np.cumsum(bandit.oracle.numpy() - history.expected_reward)


def group_size_sweep(
    bandit: DynamicBandit, group_sizes: Sequence[int] = (2, 4, 8, 16), seeds: Sequence[int] = (0, 1, 2)
) -> dict[int, list[History]]:
    """``run_grpo`` for every group size and seed."""
    return {g: [run_grpo(bandit, g, s) for s in seeds] for g in group_sizes}


def summary(
    main: History, bandit: DynamicBandit, sweep: dict[int, list[History]] | None = None
) -> dict[str, Any]:
    """Numbers the test and the README quote: per-phase reward / oracle, final regret, timings."""
    ratios = phase_ratios(main, bandit)
    out: dict[str, Any] = {
        "group_size": main.group_size,
        "rounds": bandit.rounds,
        "phase_reward_over_oracle": ratios,
        "last_phase_reward_over_oracle": ratios[-1],
        "final_regret": float(cumulative_regret(main, bandit)[-1]),
        "seconds": main.seconds,
    }
    if sweep:
        out["sweep_final_regret"] = {
            str(g): float(np.mean([cumulative_regret(h, bandit)[-1] for h in hs])) for g, hs in sweep.items()
        }
        out["sweep_last_phase_ratio"] = {
            str(g): float(np.mean([phase_ratios(h, bandit)[-1] for h in hs])) for g, hs in sweep.items()
        }
    return out


# ---- plots (matplotlib is imported here only: the notebook extra) -------------------------
def _plt() -> Any:
    try:
        import matplotlib

        if __name__ == "__main__":
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover
        raise ImportError(f"the plots need matplotlib: {install_hint('notebook')}") from e
    return plt


def _mark_switches(ax: Any, bandit: DynamicBandit) -> None:
    for s in bandit.switches:
        ax.axvline(s, color="black", ls=":", lw=1, zorder=5)


def plot_means(bandit: DynamicBandit) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    for a in range(bandit.num_arms):
        ax.plot(bandit.means[:, a].numpy(), label=f"arm {a}")
    _mark_switches(ax, bandit)
    ax.set(xlabel="round t", ylabel="mean reward mu[t, a]", title="The dynamic bandit")
    ax.legend(ncol=bandit.num_arms, fontsize=8)
    fig.tight_layout()
    return fig


def plot_reward_vs_oracle(history: History, bandit: DynamicBandit, window: int = 10) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    csum = np.cumsum(np.concatenate([[0.0], history.sampled_reward]))
    t = np.arange(1, bandit.rounds + 1)
    smooth = (csum[t] - csum[np.maximum(t - window, 0)]) / np.minimum(t, window)  # trailing mean
    ax.plot(bandit.oracle.numpy(), "k--", label="oracle  max_a mu[t, a]")
    ax.plot(history.expected_reward, label="policy  sum_a pi(a) mu[t, a]")
    ax.plot(smooth, alpha=0.5, label=f"sampled reward (trailing {window}-round mean)")
    _mark_switches(ax, bandit)
    ax.set(
        xlabel="round t", ylabel="reward", title=f"Reward vs oracle (G = {history.group_size})", ylim=(0, 1)
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_arm_probabilities(history: History, bandit: DynamicBandit) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.stackplot(
        np.arange(bandit.rounds), history.probs.T, labels=[f"arm {a}" for a in range(bandit.num_arms)]
    )
    best = bandit.means.argmax(1).numpy()
    _mark_switches(ax, bandit)
    ax.set(
        xlabel="round t",
        ylabel="pi_t(a)",
        title=f"Policy's arm probabilities (best arm per phase: "
        f"{[int(best[a]) for a, _ in bandit.phases()]})",
        ylim=(0, 1),
    )
    ax.legend(ncol=bandit.num_arms, fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def plot_regret(sweep: dict[int, list[History]], bandit: DynamicBandit) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    for g, hs in sweep.items():
        regrets = np.stack([cumulative_regret(h, bandit) for h in hs])
        mean = regrets.mean(0)
        ax.plot(mean, label=f"G = {g}")
        ax.fill_between(np.arange(bandit.rounds), regrets.min(0), regrets.max(0), alpha=0.15)
    _mark_switches(ax, bandit)
    ax.set(
        xlabel="round t",
        ylabel="cumulative expected regret",
        title="Cumulative regret by group size "
        f"(mean and range over {len(next(iter(sweep.values())))} seeds)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_group_size_effect(sweep: dict[int, list[History]], bandit: DynamicBandit) -> Any:
    """Final regret per round and per pull (a round costs G pulls) against G."""
    plt = _plt()
    sizes = list(sweep)
    final = np.array([[cumulative_regret(h, bandit)[-1] for h in sweep[g]] for g in sizes])
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].errorbar(sizes, final.mean(1), yerr=final.std(1), marker="o", capsize=3)
    axes[0].set(
        xscale="log",
        xticks=sizes,
        xticklabels=sizes,
        xlabel="group size G",
        ylabel="final cumulative regret",
        title="Regret after all rounds",
    )
    axes[1].plot(sizes, [bandit.rounds * g for g in sizes], marker="o")
    axes[1].set(
        xscale="log",
        yscale="log",
        xticks=sizes,
        xticklabels=sizes,
        xlabel="group size G",
        ylabel="arm pulls used",
        title="Samples used (rounds x G)",
    )
    for ax in axes:
        ax.xaxis.set_minor_locator(plt.NullLocator())
    fig.tight_layout()
    return fig


# ---- script --------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=450, help="bandit rounds = GRPO steps per run")
    parser.add_argument("--arms", type=int, default=5, help="K, number of arms")
    parser.add_argument("--group-size", type=int, default=8, help="G of the main run")
    parser.add_argument("--sweep", type=int, nargs="*", default=[2, 4, 8, 16], help="group sizes to compare")
    parser.add_argument("--sweep-seeds", type=int, default=3, help="seeds per group size")
    parser.add_argument("--seed", type=int, default=0, help="seeds the bandit and the main run")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="save PNGs (and summary.json) here; None: save nothing"
    )
    args = parser.parse_args(argv)
    if args.out_dir is not None:
        _plt()  # matplotlib is checked before the experiments run, not after

    bandit = make_bandit(args.arms, args.rounds, seed=args.seed)
    main_run = run_grpo(bandit, args.group_size, args.seed)
    for i, (a, b) in enumerate(bandit.phases()):
        r = main_run.expected_reward[a:b].mean()
        o = bandit.oracle[a:b].mean().item()
        print(f"phase {i} rounds [{a}, {b}): policy reward {r:.3f}  oracle {o:.3f}  ratio {r / o:.3f}")
    sweep = group_size_sweep(bandit, args.sweep, range(args.sweep_seeds)) if args.sweep else None
    result = summary(main_run, bandit, sweep)
    if sweep:
        for g in args.sweep:
            print(
                f"G={g:>2}: final regret {result['sweep_final_regret'][str(g)]:7.2f}  "
                f"last-phase reward/oracle {result['sweep_last_phase_ratio'][str(g)]:.3f}"
            )
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        figs = {
            "bandit_means": plot_means(bandit),
            "reward_vs_oracle": plot_reward_vs_oracle(main_run, bandit),
            "arm_probabilities": plot_arm_probabilities(main_run, bandit),
        }
        if sweep:
            figs["cumulative_regret"] = plot_regret(sweep, bandit)
            figs["group_size_effect"] = plot_group_size_effect(sweep, bandit)
        for name, fig in figs.items():
            fig.savefig(args.out_dir / f"{name}.png", dpi=100)
        (args.out_dir / "summary.json").write_text(json.dumps(result, indent=2))
        print(f"saved {len(figs)} figures to {args.out_dir}")
    return result


if __name__ == "__main__":
    main()
