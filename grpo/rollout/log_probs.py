"""Log-probs as the trainer reads them: ``(n,)``, ``(n, T)`` or a `PolicyOutput` -> ``(n, T)`` + mask.

`normalise_log_probs` is the one normalisation point of whatever a policy returns. There the one
shape that means two things is refused (`_check_not_per_component`): float actions ``(N, D)`` with
log-probs ``(N, D)`` and no mask, the mark of a Gaussian policy that forgot ``.sum(-1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo.policy_base import PolicyOutput
from grpo.runtime.devices import same_device

__all__ = ["LogProbs", "normalise_log_probs"]


@dataclass
class LogProbs:
    """Normalised log-probs: ``log_probs`` (n, T) float, ``mask`` (n, T) bool, ``entropy`` or None."""

    log_probs: Tensor
    mask: Tensor
    entropy: Tensor | None = None


_TRUE: dict[torch.device, Tensor] = {}


def _all_valid(shape: torch.Size, device: torch.device) -> Tensor:
    """An all-True bool mask of ``shape``: a read-only expanded view of one cached element (in-place
    writes to it raise), cheaper than allocating and filling a new tensor every call."""
    true = _TRUE.get(device)
    if true is None:
        true = _TRUE[device] = torch.ones((), dtype=torch.bool, device=device)
    return true.expand(shape)


_EXPLICIT = "return grpo.PolicyOutput(log_probs, mask=torch.ones_like(log_probs, dtype=torch.bool))"


def normalise_log_probs(
    out: Tensor | PolicyOutput,
    n: int,
    where: str,
    device: torch.device,
    *,
    check_inf: bool = True,
    actions: Any = None,
    explicit: str = _EXPLICIT,
) -> LogProbs:
    """The one normalisation point: (n,) | (n, T) | PolicyOutput -> LogProbs (n, T).

    ``check_inf=False`` skips the +-inf check (`_check_no_inf`): the update passes it, because
    `grpo.grpo_objective.GRPOObjective` turns a non-finite log-prob on a valid step into a
    non-finite loss, which the trainer's non-finite policy contains (no weight changes).
    ``actions``: the actions the log-probs belong to (rows of the same shape; None = not known),
    for `_check_not_per_component`; ``explicit`` is the fix that error offers for per-step values.
    """
    entropy = mask = None
    if isinstance(out, PolicyOutput):
        logp, mask, entropy = out.log_probs, out.mask, out.entropy
    else:
        logp = out
    _check_log_probs_tensor(logp, n, where)
    if mask is None and logp.dim() == 2:
        _check_not_per_component(logp, actions, where, explicit)
    logp_device = logp.device
    if logp_device != device and not same_device(logp_device, device):
        raise ValueError(
            f"{where} returned log-probs on {logp.device}, but the trainer runs on {device}. "
            f"Move the policy with policy.to({str(device)!r}) or set GRPOConfig(device=...)."
        )
    if logp.dim() == 1:
        logp = logp.unsqueeze(-1)
        entropy = entropy.unsqueeze(-1) if entropy is not None and entropy.dim() == 1 else entropy
    mask = _all_valid(logp.shape, logp_device) if mask is None else _checked_mask(mask, logp, where)
    if entropy is not None and entropy.shape != logp.shape:
        raise ValueError(
            f"{where} returned entropy of shape {tuple(entropy.shape)}; expected "
            f"{tuple(logp.shape)} like the log-probs."
        )
    if isinstance(out, PolicyOutput) and out.mask is not None:
        logp = logp.masked_fill(~mask, 0.0)  # padding steps are ignored: any value (-inf, NaN) is fine
    if check_inf:
        _check_no_inf(logp, where)
    return LogProbs(logp, mask, entropy)


def _check_log_probs_tensor(logp: Any, n: int, where: str) -> None:
    """A float Tensor of shape (n,) or (n, T), or a clear error."""
    if not isinstance(logp, Tensor):
        raise TypeError(
            f"{where} returned {type(logp).__name__}; expected a torch.Tensor of shape ({n},) or "
            f"({n}, T), or a grpo.PolicyOutput. Return torch log-probs, not numbers or arrays."
        )
    if logp.dim() not in (1, 2) or logp.shape[0] != n:
        raise ValueError(
            f"{where} returned log-probs of shape {tuple(logp.shape)}; expected ({n},) for one-shot "
            f"actions or ({n}, T) per step, one row per (state, action) pair it was given."
        )
    if not logp.dtype.is_floating_point:
        raise TypeError(f"{where} returned log-probs of dtype {logp.dtype}; expected a float dtype.")


def _checked_mask(mask: Tensor, logp: Tensor, where: str) -> Tensor:
    """The policy's mask as a bool (n, T) on the log-probs' device, or a clear error."""
    if mask.dim() == 1:
        mask = mask.unsqueeze(-1)
    if mask.shape != logp.shape:
        raise ValueError(
            f"{where} returned a mask of shape {tuple(mask.shape)} for log-probs of shape "
            f"{tuple(logp.shape)}; the mask must have the same shape."
        )
    return mask.to(device=logp.device, dtype=torch.bool)


def _check_not_per_component(logp: Tensor, actions: Any, where: str, explicit: str) -> None:
    """Raise on log-probs (n, D) without a mask for float actions (·, D), D > 1: the one shape
    that means two things.

    Per-step log-probs of an action of T = D steps, or one log-prob per component of a single
    D-dimensional action: a Gaussian policy that forgets ``.sum(-1)`` (``Normal(mu, std)
    .log_prob(a)`` is (N, D)) returns exactly this, and read as steps it trains each component
    with its own ratio, clipping and KL, which is not the GRPO objective of a vector action.
    Integer actions (token ids (N, T)), list actions (objects the trainer cannot look into:
    completions, episodes), (N, T, D) actions with (N, T) log-probs, and a `PolicyOutput` with
    a mask are not ambiguous and pass. Only shapes and the dtype are read: no device sync.
    """
    if not isinstance(actions, Tensor) or actions.dim() != 2 or not actions.is_floating_point():
        return
    d = int(actions.shape[1])
    if d < 2 or logp.shape[1] != d:
        return
    n = int(logp.shape[0])
    raise ValueError(
        f"{where} returned log-probs of shape ({n}, {d}) without a mask for float actions of shape "
        f"{tuple(actions.shape)}: that is ambiguous. It reads as per-step log-probs of actions made "
        f"of {d} steps, but it is also what a policy returns when it forgets to sum over the {d} "
        f"components of one vector action (Normal(mu, std).log_prob(a) has shape (N, {d})); trained "
        f"as steps, each component would get its own ratio and clipping. If each action is one "
        f"vector of {d} components, return one log-prob per action, shape ({n},): "
        f"dist.log_prob(a).sum(-1), or build the distribution as "
        f"torch.distributions.Independent(Normal(mu, std), 1). If the {d} columns really are steps "
        f"of one action, say so: {explicit}."
    )


def _check_no_inf(logp: Tensor, where: str) -> None:
    """Raise on +inf anywhere or -inf on a real step (NaN is left to the non-finite policy).

    A log-probability is <= 0, so +inf is always a bug; -inf means the action has probability 0
    under the policy, which makes the ratio and the KL term infinite. Padding steps (mask False)
    were zeroed before this check, so -inf is allowed there.
    """
    if math.isfinite(float(logp.detach().sum())):  # one reduction in the common case; else look closer
        return
    if bool(torch.isinf(logp).any()):
        rows = torch.isinf(logp).any(-1).nonzero().flatten()[:10].tolist()
        sign = "+inf" if bool((logp == torch.inf).any()) else "-inf"
        raise ValueError(
            f"{where} returned log-probs with {sign} at rows {rows} (on steps the mask marks as "
            f"real); expected finite values <= 0. +inf means p > 1 (a bug in the log-prob); -inf "
            f"means the action has probability 0 under this policy. Return a PolicyOutput whose mask "
            f"is False on padding steps, and give every sampled action a positive probability "
            f"(e.g. clamp logits, not probabilities)."
        )
