"""Shared toy problems for the core tests: bandits, a list-form policy, a counting wrapper."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Categorical

from grpo.policies import DistributionPolicy, categorical_mlp

# DeepSpeed JIT-builds its C++ ops (about a minute on 2 cores, see docs/scaling.md) into
# TORCH_EXTENSIONS_DIR. torch's default, ~/.cache/torch_extensions, is shared by every process and
# checkout on the machine, so a build killed there (a timed-out test) leaves a lock file that makes
# every later DeepSpeed run wait. The tests build into a directory of this checkout instead
# (.torch_extensions/, ignored by git), one per Python and torch version. It persists between runs
# (a directory under pytest's basetemp would be new, and the ops rebuilt, in every session), and
# tests/test_deepspeed.py fails fast, naming the file and the `rm` that removes it, on a lock left
# there by a killed build. Set TORCH_EXTENSIONS_DIR yourself to use another directory.
ROOT = Path(__file__).resolve().parents[1]
OWN_EXTENSIONS_DIR = not os.environ.get("TORCH_EXTENSIONS_DIR")  # False: the user chose one
if OWN_EXTENSIONS_DIR:
    _tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ROOT / ".torch_extensions" / _tag)


class Logits(nn.Module):
    """A stateless K-armed bandit policy: one learnable logit per arm, ignores the state."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(k))

    def forward(self, states: Tensor) -> Categorical:
        return Categorical(logits=self.logits.expand(states.shape[0], -1))


def bandit_policy(k: int = 10) -> DistributionPolicy:
    return DistributionPolicy(Logits(k))


class ContextualBandit:
    """States x ~ N(0, I_16); the reward of arm a is (x @ W)[a]; the oracle picks the argmax."""

    def __init__(self, seed: int = 0, dim: int = 16, arms: int = 10) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.W = torch.randn(dim, arms, generator=self.gen)
        self.dim, self.arms = dim, arms

    def states(self, b: int) -> Tensor:
        return torch.randn(b, self.dim, generator=self.gen)

    def reward(self, states: Tensor, actions: Tensor) -> Tensor:
        return (states @ self.W).gather(1, actions.long().unsqueeze(1)).squeeze(1)

    def policy(self, hidden: tuple[int, ...] = (64, 64)) -> DistributionPolicy:
        return categorical_mlp(self.dim, self.arms, hidden)

    def score(self, policy: DistributionPolicy, n: int = 4000) -> float:
        """Expected reward of the policy / expected reward of the oracle, on fresh states."""
        with torch.no_grad():
            x = torch.randn(n, self.dim, generator=torch.Generator().manual_seed(123))
            r = x @ self.W
            probs = policy.distribution(x).probs
            return float((probs * r).sum(1).mean() / r.max(1).values.mean())


class WordPolicy:
    """A user-written list-form policy: states are strings, actions are words from a vocabulary.

    It does not inherit from anything and is not an nn.Module.
    """

    vocab = ("red", "green", "blue", "yellow")

    def __init__(self) -> None:
        self.logits = torch.zeros(len(self.vocab), requires_grad=True)
        self.generator = torch.Generator().manual_seed(0)

    def generate_actions(
        self, states: list[Any], num_actions_per_state: int, **kwargs: Any
    ) -> list[list[str]]:
        probs = torch.softmax(self.logits.detach(), 0)
        idx = torch.multinomial(
            probs, len(states) * num_actions_per_state, replacement=True, generator=self.generator
        )
        words = [self.vocab[i] for i in idx.tolist()]
        g = num_actions_per_state
        return [words[i * g : (i + 1) * g] for i in range(len(states))]

    def get_log_probabilities(self, states: list[Any], actions: list[str]) -> Tensor:
        idx = torch.tensor([self.vocab.index(a) for a in actions])
        return torch.log_softmax(self.logits, 0)[idx]

    def get_parameters(self) -> dict[str, Tensor]:
        return {"logits": self.logits}

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def to(self, device: Any) -> WordPolicy:
        return self


class Counting:
    """Wraps a policy and counts calls of each method (reference forwards, generations...)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
        self._count("generate_actions")
        return self.inner.generate_actions(states, num_actions_per_state, **kwargs)

    def get_log_probabilities(self, states: Any, actions: Any) -> Any:
        self._count("get_log_probabilities")
        return self.inner.get_log_probabilities(states, actions)

    def get_parameters(self) -> Any:
        return self.inner.get_parameters()

    def train(self) -> None:
        self.inner.train()

    def eval(self) -> None:
        self.inner.eval()

    def to(self, device: Any) -> Counting:
        self.inner.to(device)
        return self


@pytest.fixture
def one_thread() -> Any:
    """Tiny networks: one intra-op thread is faster, and far faster on a busy 2-core runner. Use
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``; the count is restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def contextual() -> ContextualBandit:
    return ContextualBandit(seed=0)


@pytest.fixture(scope="module")
def sandbox() -> None:
    """Skips the test, naming why, where `grpo.envs.sandbox` cannot run (no bubblewrap, user
    namespaces off): the sandbox tests and the code reward's."""
    from grpo.envs.sandbox import SandboxUnavailable, run_python

    try:
        run_python("pass")
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")
