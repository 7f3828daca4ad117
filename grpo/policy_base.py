"""The `PolicyModel` Protocol, its optional capabilities, and the check that explains what is missing.

A policy is any object with the six methods of `PolicyModel`; it does not inherit from anything.
Two optional capabilities let the trainer do better when a policy offers them:

* ``evaluate_actions`` (`SupportsEvaluateActions`): per-step log-probs with a mask and the exact
  entropy in one forward, and evaluation of each state once per group (``group_size=G``).
* log-probs returned as a `PolicyOutput` from ``get_log_probabilities``: per-step values with a
  mask, for actions made of several steps (tokens, env steps).

All of them are turned into one shape, ``(N, T)`` log-probs plus a boolean ``(N, T)`` mask, by
`grpo.experience_collector.evaluate_log_probs` — the single normalisation point.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = [
    "EntropyRequest",
    "PolicyModel",
    "PolicyOutput",
    "SupportsEvaluateActions",
    "SupportsGenerateWithLogProbs",
    "check_policy",
    "entropy_grad_mode",
    "entropy_request",
    "has_method",
    "policy_parameters",
]


@dataclass(frozen=True)
class PolicyOutput:
    """What a policy may return instead of a bare log-prob tensor.

    Attributes:
        log_probs: ``(N,)`` for one-shot actions or ``(N, T)`` per step.
        mask: ``(N, T)`` bool, True where a step is real (not padding). ``None`` = all real.
            Giving it also says that ``(N, T)`` values are per step: without it, log-probs
            ``(N, D)`` for float actions ``(N, D)`` are refused as a forgotten ``.sum(-1)``.
        entropy: exact entropy of the policy's distribution at each step, same shape as
            ``log_probs``, computed in the same forward. ``None`` = not available (the trainer
            then uses the Monte Carlo estimate documented in `grpo.grpo_objective.entropy_bonus`).
    """

    log_probs: Tensor
    mask: Tensor | None = None
    entropy: Tensor | None = None


@runtime_checkable
class PolicyModel(Protocol):
    """The interface every policy satisfies (seed 002's names).

    ``states`` is a sequence of any objects, or a Tensor ``(B, ...)``; ``actions`` likewise.
    """

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> Any:
        """Sample ``G = num_actions_per_state`` actions for each of the B states.

        Returns a list of B lists of G actions, or a Tensor ``(B, G, ...)``.
        """
        ...

    def get_log_probabilities(self, states: Any, actions: Any) -> Tensor | PolicyOutput:
        """Log-probabilities of ``actions[i]`` given ``states[i]`` for the N flat samples.

        Returns ``(N,)``, ``(N, T)``, or a `PolicyOutput` with a mask. During the update this must
        carry gradient to the policy's parameters.

        One log-prob per action, ``(N,)``, for an action that is one vector: sum over its
        components (``dist.log_prob(a).sum(-1)``, or ``Independent(Normal(mu, std), 1)``).
        ``(N, T)`` means T steps per action (tokens, env steps), each with its own ratio. When the
        actions are a float Tensor ``(N, D)`` with D > 1, log-probs ``(N, D)`` could be either (a
        Gaussian policy that forgot ``.sum(-1)`` returns them), so they are refused unless given
        as ``PolicyOutput(log_probs, mask=...)``, the mask saying the columns are steps. Integer
        actions (token ids ``(N, T)``) and list actions are not affected.
        """
        ...

    def get_parameters(self) -> Mapping[str, Tensor] | Iterable[Tensor]:
        """The tensors to optimise (a name -> tensor mapping or an iterable). May be empty."""
        ...

    def train(self) -> Any:
        """Switch to training mode (called before the update)."""
        ...

    def eval(self) -> Any:
        """Switch to evaluation mode (called before collecting experience)."""
        ...

    def to(self, device: Any) -> Any:
        """Move to ``device``; may return ``self``."""
        ...


EntropyRequest: TypeAlias = bool | Literal["no_grad"]
"""``with_entropy`` of ``evaluate_actions``: False (no entropy needed), True (the exact entropy,
differentiable: the loss has an entropy bonus), or ``"no_grad"`` (the exact entropy for the
metrics only; it may be computed without recording a graph)."""


def entropy_grad_mode(with_entropy: EntropyRequest) -> torch.set_grad_enabled:
    """Context manager for computing an entropy: grad off for ``"no_grad"``, unchanged otherwise.

    ``with entropy_grad_mode(with_entropy): ent = dist.entropy()``
    """
    return torch.set_grad_enabled(with_entropy != "no_grad" and torch.is_grad_enabled())


@runtime_checkable
class SupportsEvaluateActions(Protocol):
    """Optional capability: log-probs, mask and exact entropy in one forward, grouped evaluation.

    ``evaluate_actions(states, actions, group_size=G, with_entropy=...)``:
    with ``group_size=1`` the rows of ``states`` and ``actions`` pair up one to one (N rows each);
    with ``group_size=G > 1`` ``states`` holds one row per group (N/G rows) and ``actions`` holds
    the N actions group-major (row k belongs to state k // G), so the policy can run its network
    once per state instead of once per sample.

    ``with_entropy`` (`EntropyRequest`): when truthy, ``PolicyOutput.entropy`` holds the exact
    entropy of each row's distribution. True: it must carry gradient (the trainer passes True
    when ``entropy_coeff != 0``). ``"no_grad"``: it is only reported (``policy/entropy``), so it
    may be computed under ``torch.no_grad()``; an implementation that treats every truthy value
    as True is correct, only slower.
    """

    def evaluate_actions(
        self, states: Any, actions: Any, *, group_size: int = 1, with_entropy: EntropyRequest = False
    ) -> PolicyOutput: ...


@runtime_checkable
class SupportsGenerateWithLogProbs(Protocol):
    """Optional capability: sample actions and return their log-probs from the same forward.

    ``generate_actions_with_log_probs(states, G) -> (actions, log_probs)`` with ``actions`` as
    ``generate_actions`` returns them and ``log_probs`` as ``get_log_probabilities`` would return
    them for the flat group-major samples. The collector uses it to record the behaviour
    log-probs without a second forward (what an efficient hand-written loop does).
    """

    def generate_actions_with_log_probs(
        self, states: Any, num_actions_per_state: int, **kwargs: Any
    ) -> tuple[Any, Tensor | PolicyOutput]: ...


def has_method(obj: object, name: str) -> bool:
    """Fast capability test (a runtime Protocol ``isinstance`` is slow on the hot path).

    For an ``nn.Module`` whose class lacks ``name`` (and whose ``__getattr__`` is torch's), the
    answer is read from the instance's dict without the lookup that ends in
    ``Module.__getattr__`` raising AttributeError (tens of us per call on the hot path).
    """
    cls = type(obj)
    if (
        isinstance(obj, nn.Module)
        and getattr(cls, "__getattr__", None) is nn.Module.__getattr__
        and getattr(cls, name, None) is None
    ):
        return callable(obj.__dict__.get(name))
    return callable(getattr(obj, name, None))


def set_training_mode(obj: Any, training: bool) -> None:
    """``obj.train()`` or ``obj.eval()``, cheaper for a plain ``nn.Module`` tree.

    When no module of the tree overrides ``nn.Module.train``, setting each module's ``training``
    flag is exactly what ``train(mode)`` does, without its recursion through ``__setattr__``
    (tens of microseconds per call on a small policy, three calls per step). Anything else (a
    module with its own ``train``, a non-module policy) gets its own method called.
    """
    if isinstance(obj, nn.Module) and _set_flags(obj, training):
        return
    if training:
        obj.train()
    else:
        obj.eval()


_MODULE_TRAIN = nn.Module.train


def _set_flags(root: nn.Module, training: bool) -> bool:
    """Set ``training`` on every module of the tree (a walk over ``_modules``, without the prefix
    strings of ``named_modules``). Returns False, leaving the job to ``train``/``eval``, as soon as
    a module overrides ``train`` (flags set before that are set again by that call)."""
    stack: list[nn.Module | None] = [root]
    while stack:
        m = stack.pop()
        if m is None:
            continue
        if type(m).train is not _MODULE_TRAIN:
            return False
        m.__dict__["training"] = training
        stack.extend(m._modules.values())
    return True


_POLICY_SIGNATURES = {
    "generate_actions": "generate_actions(self, states, num_actions_per_state: int, **kwargs)"
    " -> list[list[action]] | Tensor (B, G, ...)",
    "get_log_probabilities": "get_log_probabilities(self, states, actions)"
    " -> Tensor (N,) | Tensor (N, T) | PolicyOutput",
    "get_parameters": "get_parameters(self) -> Mapping[str, Tensor] | Iterable[Tensor]",
    "train": "train(self) -> Any",
    "eval": "eval(self) -> Any",
    "to": "to(self, device) -> Any",
}


def check_protocol(obj: object, role: str, signatures: Mapping[str, str]) -> None:
    """Raise a `TypeError` listing every missing or non-callable method of ``obj``.

    ``role`` names the argument (``"policy"``, ``"reward_model"``...) in the message.
    """
    problems = []
    for name, signature in signatures.items():
        attr = inspect.getattr_static(obj, name, None)
        if attr is None:
            problems.append(f"  - missing  {signature}")
        elif not callable(getattr(obj, name, None)):
            problems.append(f"  - not callable ({type(getattr(obj, name)).__name__}): {signature}")
    if problems:
        raise TypeError(
            f"{role} of type {type(obj).__name__} does not satisfy the "
            f"{'PolicyModel' if role.endswith('policy') else 'RewardModel'} protocol:\n"
            + "\n".join(problems)
            + "\nAdd these methods (no base class needed); see grpo/"
            + ("policy_base.py" if role.endswith("policy") else "reward_model_base.py")
            + " for what each must return."
        )


def check_policy(policy: object, role: str = "policy") -> None:
    """Raise a `TypeError` naming every `PolicyModel` method ``policy`` lacks, with signatures."""
    check_protocol(policy, role, _POLICY_SIGNATURES)


def policy_parameters(policy: PolicyModel) -> list[Tensor]:
    """The distinct tensors from ``policy.get_parameters()`` that require grad, in order."""
    params = policy.get_parameters()
    values: Iterable[Any] = params.values() if isinstance(params, Mapping) else params
    seen: set[int] = set()
    out: list[Tensor] = []
    for p in values:
        if not isinstance(p, Tensor):
            raise TypeError(
                f"policy.get_parameters() must return tensors, got an item of type "
                f"{type(p).__name__}. Return dict(module.named_parameters()) or "
                f"list(module.parameters())."
            )
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def entropy_request(policy: object, entropy_coeff: float) -> EntropyRequest:
    """What the update asks ``evaluate_actions`` for: the exact entropy, differentiable only when
    the loss trains it (``entropy_coeff != 0``), else without grad (logged); False for a policy
    without ``evaluate_actions``."""
    if not has_method(policy, "evaluate_actions"):
        return False
    return True if entropy_coeff != 0 else "no_grad"
