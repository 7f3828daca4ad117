"""The `RewardModel` Protocol, an adapter that makes a plain function a reward, and weighted sums.

A reward model scores the N flat (state, action) pairs of one step and returns ``(N,)`` numbers
(a Tensor, a NumPy array or a list of floats). A plain callable ``f(states, actions)`` is a reward
too: the trainer wraps it in `FunctionReward`. `CombinedReward` sums several rewards with weights
and exposes each component, which the trainer logs as ``reward/<name>/mean``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from typing_extensions import Self

from grpo.policy_base import check_protocol

__all__ = [
    "CombinedReward",
    "FunctionReward",
    "RewardModel",
    "StatelessReward",
    "SupportsRewardComponents",
    "as_reward_model",
    "check_reward_model",
]

RewardLike = Any  # Tensor (N,) | numpy array (N,) | Sequence[float]


@runtime_checkable
class RewardModel(Protocol):
    """The interface every reward satisfies (seed 002's names)."""

    def compute_rewards(self, states: Any, actions: Any) -> RewardLike:
        """Score N flat (state, action) pairs; return N finite numbers."""
        ...

    def train(self) -> Any: ...

    def eval(self) -> Any: ...

    def to(self, device: Any) -> Any: ...


@runtime_checkable
class SupportsRewardComponents(Protocol):
    """Optional capability: the named components that make up the reward, and their weights.

    The total reward is ``sum(reward_weights[k] * components[k])``.
    """

    reward_weights: Mapping[str, float]

    def compute_reward_components(self, states: Any, actions: Any) -> Mapping[str, RewardLike]: ...


_REWARD_SIGNATURES = {
    "compute_rewards": "compute_rewards(self, states, actions) -> Tensor (N,) | list[float]",
    "train": "train(self) -> Any",
    "eval": "eval(self) -> Any",
    "to": "to(self, device) -> Any",
}


def check_reward_model(reward_model: object, role: str = "reward_model") -> None:
    """Raise a `TypeError` naming every `RewardModel` method missing, with signatures."""
    check_protocol(reward_model, role, _REWARD_SIGNATURES)


class StatelessReward:
    """Base of rewards with no weights and no device state: ``train()``, ``eval()`` and ``to()``
    (the rest of the `RewardModel` protocol) return the reward itself."""

    def train(self) -> Self:
        return self

    def eval(self) -> Self:
        return self

    def to(self, device: Any) -> Self:
        return self


class FunctionReward(StatelessReward):
    """A `RewardModel` made from a plain function ``fn(states, actions) -> (N,) rewards``."""

    def __init__(self, fn: Callable[[Any, Any], RewardLike], name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionReward needs a callable, got {type(fn).__name__}.")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def compute_rewards(self, states: Any, actions: Any) -> RewardLike:
        return self.fn(states, actions)

    def __repr__(self) -> str:
        return f"FunctionReward({self.name})"


def as_reward_model(reward: object, role: str = "reward_model") -> RewardModel:
    """Return ``reward`` if it is a `RewardModel`; wrap a plain callable; else raise TypeError."""
    if callable(getattr(reward, "compute_rewards", None)):
        check_reward_model(reward, role)
        return reward  # type: ignore[return-value]
    if callable(reward) and not isinstance(reward, type):
        return FunctionReward(reward)
    check_reward_model(reward, role)
    return reward  # type: ignore[return-value]  # pragma: no cover (check raised)


class CombinedReward:
    """Weighted sum of several rewards: ``r = sum_k w_k * r_k``; each ``r_k`` is logged.

    Args:
        rewards: mapping ``name -> reward`` (a `RewardModel` or a plain callable), or a sequence of
            rewards (named by their function / class name).
        weights: mapping ``name -> weight`` or a sequence aligned with ``rewards``; default 1.0 each.
    """

    def __init__(
        self,
        rewards: Mapping[str, object] | Sequence[object],
        weights: Mapping[str, float] | Sequence[float] | None = None,
    ) -> None:
        if isinstance(rewards, Mapping):
            items = [(str(k), as_reward_model(v, f"rewards[{k!r}]")) for k, v in rewards.items()]
        else:
            items = []
            for i, r in enumerate(rewards):
                model = as_reward_model(r, f"rewards[{i}]")
                name = getattr(model, "name", None) or type(model).__name__
                items.append((str(name), model))
        names = [n for n, _ in items]
        if not items:
            raise ValueError("CombinedReward needs at least one reward.")
        if len(set(names)) != len(names):
            raise ValueError(
                f"CombinedReward got duplicate reward names {names}; pass a dict "
                "{'name': reward, ...} to name them uniquely."
            )
        self.components: dict[str, RewardModel] = dict(items)
        if weights is None:
            self.reward_weights: dict[str, float] = dict.fromkeys(names, 1.0)
        elif isinstance(weights, Mapping):
            unknown = set(weights) - set(names)
            if unknown:
                raise ValueError(
                    f"CombinedReward weights name unknown rewards {sorted(unknown)}; known: {names}."
                )
            self.reward_weights = {n: float(weights.get(n, 1.0)) for n in names}
        else:
            ws = list(weights)
            if len(ws) != len(names):
                raise ValueError(
                    f"CombinedReward got {len(ws)} weights for {len(names)} rewards {names}; "
                    "give one weight per reward."
                )
            self.reward_weights = {n: float(w) for n, w in zip(names, ws, strict=True)}

    def compute_reward_components(self, states: Any, actions: Any) -> dict[str, RewardLike]:
        return {n: m.compute_rewards(states, actions) for n, m in self.components.items()}

    def compute_rewards(self, states: Any, actions: Any) -> Tensor:
        comps = self.compute_reward_components(states, actions)
        total: Tensor | None = None
        for n, v in comps.items():
            t = torch.as_tensor(v, dtype=torch.float32) * self.reward_weights[n]
            total = t if total is None else total + t
        assert total is not None
        return total

    def train(self) -> CombinedReward:
        for m in self.components.values():
            m.train()
        return self

    def eval(self) -> CombinedReward:
        for m in self.components.values():
            m.eval()
        return self

    def to(self, device: Any) -> CombinedReward:
        for m in self.components.values():
            m.to(device)
        return self
