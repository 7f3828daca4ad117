"""The three bandit tasks of issue 19, as a new user meets them, with their classic peers.

Each task is defined once here and run the same way for every row (every GRPO config and the
peer): same arms, same reward noise stream, same evaluation. Runs repeat exactly: every random
number comes from a generator seeded from ``seed`` (torch, numpy) and the trainer gets
``GRPOConfig(seed=seed)``. ``benchmarks/learning.py`` prints the tables;
``tests/test_learning_presets.py`` checks that ``GRPOConfig.recipe("small_policy")`` learns each.

bandit50 (`bandit50_grpo`, `bandit50_thompson`)
    50 arms with Bernoulli rewards. Means, drawn once per seed: one best arm (at a random index)
    pays 0.9, the other 49 pay uniform(0, 0.8) -- the best arm leads by at least 0.1, so a good
    learner can identify it in the budget. The GRPO policy is a user-written ``nn.Module`` with
    50 learned logits (``ArmLogits``, the quick start's ``ArmPolicy`` without a context): no grpo
    base class, just the `PolicyModel` methods. One state per step (a dummy ``(1, 1)`` zero
    tensor), ``steps`` = 300 ``trainer.step`` calls, so ``300 x group_size`` pulls.
    Peer: Thompson sampling with Beta(1, 1) priors, given the same pulls (300 rounds of
    ``group_size`` posterior-sampled pulls; the posterior is updated after each round, as GRPO's
    policy is). Metric, the same for both: the probability that the final decision rule picks the
    best arm -- the softmax probability of the best arm for GRPO, ``P(argmax of a posterior
    sample = best)`` for Thompson (Monte Carlo, 20,000 samples). Uniform = 1/50 = 0.02.

nonstationary (`nonstationary_grpo`, `nonstationary_eps_greedy`, `nonstationary_uniform`)
    The 10-armed drifting and switching Bernoulli bandit of ``examples/dynamic_bandit.py``
    (``make_bandit(num_arms=10, rounds=450, num_phases=3, seed=seed)``: the best arm changes
    abruptly twice, every mean drifts sinusoidally). One round = one ``trainer.step`` whose state
    is the round index; each round pulls ``group_size`` arms. The GRPO policy is the example's
    softmax over 10 learned preferences (``DistributionPolicy(ArmPreferences(10))``).
    Peer: epsilon-greedy (Sutton & Barto, Sec. 2.5: eps = 0.1, constant step size 0.1, Q
    starting at 0, ties broken at random) with the same pulls: each round its ``group_size``
    pulls are drawn from the rule of the round's start, then Q is updated pull by pull. Metric,
    the same for every row: ``sum_t E[reward of a pull at round t] / sum_t max_a mu[t, a]``, the
    expected reward of the round's pull distribution (before the round's update) as a fraction
    of the oracle's, over the whole run. Uniform random arms are a row of their own.

contextual (`contextual_grpo`, `contextual_hand_loop`)
    The README quick start's contextual bandit: contexts ``x ~ N(0, I_16)``, 10 arms, arm ``a``
    pays ``(x @ W)[a]`` (no noise) with ``W ~ N(0, 1)^(16 x 10)`` drawn once per seed. The policy
    is the ready ``grpo.policies.categorical_mlp(obs_dim=16, num_actions=10)`` (MLP 64x64, tanh). Each
    step gets ``config.batch_size`` fresh contexts; ``steps`` = 300 steps. Metric: expected reward
    on 2,000 fixed held-out contexts, normalised so that arms at random score 0 and the oracle
    1: ``(E_pi[r] - mean_a r) / (max_a r - mean_a r)``, averaged over contexts first.
    Peer: a plain PyTorch GRPO loop written by hand, no grpo import: the same network and
    initial weights, B = 8 contexts x G = 8 samples per step (the samples of ``GRPOConfig()``'s
    defaults), group-normalised advantages ``(r - mean_g r) / (std_g r + 1e-6)``, the clipped
    surrogate (eps 0.2), 4 epochs of full-batch Adam (lr 3e-3: the best of 1e-2, 5e-3 and 3e-3
    measured, 0.78 / 0.88 / 0.90 mean over seeds 0-2), no KL, 300 steps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from grpo import GRPOConfig, GRPOTrainer
from grpo.policies import categorical_mlp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import dynamic_bandit

BANDIT50_ARMS = 50
BANDIT50_STEPS = 300
NONSTATIONARY_ARMS = 10
NONSTATIONARY_ROUNDS = 450
CONTEXT_DIM, CONTEXT_ARMS = 16, 10
CONTEXTUAL_STEPS = 300
THOMPSON_MC_SAMPLES = 20_000

# The README quick start's GRPOConfig (README.md, "Quick start"; examples/quickstart.py).
QUICKSTART_SETTINGS: dict[str, Any] = {
    "group_size": 8,
    "batch_size": 64,
    "num_epochs_per_update": 2,
    "learning_rate": 3e-3,
    "kl_coeff": 0.01,
}


def config_for(row: str, seed: int, **overrides: Any) -> GRPOConfig:
    """The GRPOConfig of a GRPO row: "defaults" (``GRPOConfig()``), "quickstart" (the README quick
    start's settings) or "small_policy" (``GRPOConfig.recipe("small_policy")``), seeded."""
    if row == "defaults":
        return GRPOConfig(seed=seed, **overrides)
    if row == "quickstart":
        return GRPOConfig(**{**QUICKSTART_SETTINGS, **overrides}, seed=seed)
    return GRPOConfig.recipe(row, seed=seed, **overrides)


def _result(seed: int, metric: float, t0: float, **extra: Any) -> dict[str, Any]:
    return {"seed": seed, "metric": float(metric), "wall_s": time.perf_counter() - t0, **extra}


# ---- bandit50 ------------------------------------------------------------------------------
def bandit50_means(seed: int) -> Tensor:
    """(50,) Bernoulli means: one best arm at 0.9, the others uniform(0, 0.8)."""
    g = torch.Generator().manual_seed(seed)
    means = 0.8 * torch.rand(BANDIT50_ARMS, generator=g, dtype=torch.float64)
    means[int(torch.randint(BANDIT50_ARMS, (1,), generator=g))] = 0.9
    return means


class ArmLogits(nn.Module):
    """A user-written policy over K arms: K learned logits, the PolicyModel methods, nothing else."""

    def __init__(self, num_arms: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(num_arms))

    def generate_actions(self, states: Tensor, num_actions_per_state: int, **kwargs: Any) -> Tensor:
        probs = torch.softmax(self.logits, dim=-1).expand(states.shape[0], -1)  # (B, K)
        return torch.multinomial(probs, num_actions_per_state, replacement=True)  # (B, G)

    def get_log_probabilities(self, states: Tensor, actions: Tensor) -> Tensor:
        return torch.log_softmax(self.logits, dim=-1)[actions]  # (N,)

    def get_parameters(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())


def bandit50_grpo(config: GRPOConfig, seed: int, steps: int = BANDIT50_STEPS) -> dict[str, Any]:
    """GRPO with ``config`` on bandit50: the best arm's probability after ``steps`` steps."""
    t0 = time.perf_counter()
    means = bandit50_means(seed)
    noise = torch.Generator().manual_seed(10_000 + seed)

    def reward(states: Tensor, actions: Tensor) -> Tensor:
        return torch.bernoulli(means[actions], generator=noise).float()

    torch.manual_seed(seed)
    policy = ArmLogits(BANDIT50_ARMS)
    trainer = GRPOTrainer(config, policy, reward)
    state = torch.zeros(1, 1)
    for _ in range(steps):
        trainer.step(state)
    with torch.no_grad():
        probs = torch.softmax(policy.logits, dim=-1).double()
    return _result(
        seed,
        probs[int(means.argmax())],
        t0,
        pulls=steps * config.group_size,
        reward_over_best=float((probs * means).sum() / means.max()),
    )


def bandit50_thompson(seed: int, rounds: int = BANDIT50_STEPS, pulls_per_round: int = 8) -> dict[str, Any]:
    """Thompson sampling (Beta(1, 1) priors), ``rounds`` x ``pulls_per_round`` pulls."""
    t0 = time.perf_counter()
    means = bandit50_means(seed).numpy()
    rng = np.random.default_rng(20_000 + seed)
    wins, losses = np.ones(BANDIT50_ARMS), np.ones(BANDIT50_ARMS)
    for _ in range(rounds):
        arms = rng.beta(wins, losses, size=(pulls_per_round, BANDIT50_ARMS)).argmax(1)
        rewards = rng.random(pulls_per_round) < means[arms]
        np.add.at(wins, arms, rewards)
        np.add.at(losses, arms, ~rewards)
    picks = rng.beta(wins, losses, size=(THOMPSON_MC_SAMPLES, BANDIT50_ARMS)).argmax(1)
    probs = np.bincount(picks, minlength=BANDIT50_ARMS) / THOMPSON_MC_SAMPLES
    return _result(
        seed,
        probs[int(means.argmax())],
        t0,
        pulls=rounds * pulls_per_round,
        reward_over_best=float((probs * means).sum() / means.max()),
    )


# ---- nonstationary ---------------------------------------------------------------------------
def nonstationary_bandit(seed: int, rounds: int = NONSTATIONARY_ROUNDS) -> dynamic_bandit.DynamicBandit:
    return dynamic_bandit.make_bandit(num_arms=NONSTATIONARY_ARMS, rounds=rounds, num_phases=3, seed=seed)


def _fraction_of_oracle(expected: np.ndarray, bandit: dynamic_bandit.DynamicBandit) -> float:
    return float(expected.sum() / bandit.oracle.double().sum())


def nonstationary_grpo(config: GRPOConfig, seed: int, rounds: int = NONSTATIONARY_ROUNDS) -> dict[str, Any]:
    """GRPO with ``config``, one step per round: expected reward / the oracle's over the run."""
    t0 = time.perf_counter()
    bandit = nonstationary_bandit(seed, rounds)
    torch.manual_seed(seed)
    history = dynamic_bandit.run_grpo(bandit, config.group_size, seed, config)
    return _result(seed, _fraction_of_oracle(history.expected_reward, bandit), t0)


def nonstationary_eps_greedy(
    seed: int,
    rounds: int = NONSTATIONARY_ROUNDS,
    pulls_per_round: int = 8,
    epsilon: float = 0.1,
    step_size: float = 0.1,
) -> dict[str, Any]:
    """Epsilon-greedy with a constant step size (Sutton & Barto 2.5), ``pulls_per_round`` a round."""
    t0 = time.perf_counter()
    bandit = nonstationary_bandit(seed, rounds)
    means = bandit.means.double().numpy()
    k = bandit.num_arms
    rng = np.random.default_rng(30_000 + seed)
    q = np.zeros(k)
    expected = np.zeros(bandit.rounds)
    for t in range(bandit.rounds):
        greedy = np.flatnonzero(q == q.max())
        rule = np.full(k, epsilon / k)
        rule[greedy] += (1.0 - epsilon) / len(greedy)  # the round's pull distribution
        expected[t] = rule @ means[t]
        explore = rng.random(pulls_per_round) < epsilon
        arms = np.where(explore, rng.integers(k, size=pulls_per_round), rng.choice(greedy, pulls_per_round))
        rewards = rng.random(pulls_per_round) < means[t, arms]
        for a, r in zip(arms, rewards, strict=True):
            q[a] += step_size * (float(r) - q[a])
    return _result(seed, _fraction_of_oracle(expected, bandit), t0)


def nonstationary_uniform(seed: int, rounds: int = NONSTATIONARY_ROUNDS) -> dict[str, Any]:
    """Arms at random every round."""
    t0 = time.perf_counter()
    bandit = nonstationary_bandit(seed, rounds)
    return _result(seed, _fraction_of_oracle(bandit.means.double().mean(1).numpy(), bandit), t0)


# ---- contextual ----------------------------------------------------------------------------
class ContextualTask:
    """The quick start's bandit for one seed: W, the training context stream, the held-out set."""

    def __init__(self, seed: int) -> None:
        self.W = torch.randn(CONTEXT_DIM, CONTEXT_ARMS, generator=torch.Generator().manual_seed(seed))
        self.contexts = torch.Generator().manual_seed(40_000 + seed)
        held_out = torch.randn(2000, CONTEXT_DIM, generator=torch.Generator().manual_seed(1_000_000 + seed))
        self.eval_x, self.eval_r = held_out, held_out @ self.W

    def states(self, batch: int) -> Tensor:
        return torch.randn(batch, CONTEXT_DIM, generator=self.contexts)

    def reward(self, states: Tensor, actions: Tensor) -> Tensor:
        return (states @ self.W).gather(1, actions.long().unsqueeze(1)).squeeze(1)

    def score(self, logits_fn: Any) -> float:
        """Normalised expected reward on the held-out contexts: 0 = arms at random, 1 = oracle."""
        with torch.no_grad():
            probs = torch.softmax(logits_fn(self.eval_x), dim=-1)
        r = self.eval_r
        got, rand, best = (probs * r).sum(1).mean(), r.mean(1).mean(), r.max(1).values.mean()
        return float((got - rand) / (best - rand))


def contextual_grpo(config: GRPOConfig, seed: int, steps: int = CONTEXTUAL_STEPS) -> dict[str, Any]:
    """GRPO with ``config`` and ``categorical_mlp(16, 10)``: normalised score after ``steps``."""
    t0 = time.perf_counter()
    task = ContextualTask(seed)
    torch.manual_seed(seed)
    policy = categorical_mlp(obs_dim=CONTEXT_DIM, num_actions=CONTEXT_ARMS)
    trainer = GRPOTrainer(config, policy, task.reward)
    for _ in range(steps):
        trainer.step(task.states(config.batch_size))
    return _result(seed, task.score(lambda x: policy.distribution(x).logits), t0)


def contextual_hand_loop(
    seed: int,
    steps: int = CONTEXTUAL_STEPS,
    batch: int = 8,
    group: int = 8,
    lr: float = 3e-3,
    epochs: int = 4,
    clip: float = 0.2,
) -> dict[str, Any]:
    """The peer: GRPO written by hand in plain PyTorch (see the module docstring)."""
    t0 = time.perf_counter()
    task = ContextualTask(seed)
    torch.manual_seed(seed)  # the same initial weights as categorical_mlp's
    net = nn.Sequential(
        nn.Linear(CONTEXT_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, CONTEXT_ARMS)
    )
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        x = task.states(batch)  # (B, 16)
        with torch.no_grad():
            old_logp_all = torch.log_softmax(net(x), dim=-1)
            actions = torch.multinomial(old_logp_all.exp(), group, replacement=True)  # (B, G)
            old_logp = old_logp_all.gather(1, actions)
            r = (x @ task.W).gather(1, actions)
            adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
        for _ in range(epochs):
            logp = torch.log_softmax(net(x), dim=-1).gather(1, actions)
            ratio = torch.exp(logp - old_logp)
            loss = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return _result(seed, task.score(net), t0)
