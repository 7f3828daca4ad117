"""Per-step policy losses: pure functions ``(logp, logp_old, A, mask) -> PolicyLoss``.

Every function returns the per-step loss ``(n, T)`` (to be reduced by
`grpo.algorithms.aggregation.aggregate`),
the importance ratio it used (for metrics) and boolean masks of the steps it clipped. Notation:

    rho_t   = exp(clamp(logp_t - logp_old_t, -c, c))             token ratio (c = log_ratio_clamp)
    A       = advantage, (n,) broadcast over steps, or (n, T)
    sg(x)   = x.detach()                                          stop-gradient

Losses (names as users know them):

* ``"clip"`` — PPO / GRPO clipped surrogate (Schulman et al. 2017; Shao et al. 2024), with
  asymmetric bounds (DAPO "clip-higher", Yu et al. 2025)::

      l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)

  Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; ROLL ``dual_clip_loss``),
  for A < 0 only, with constant c > 1 (default 3)::

      l_t = min(l_t, -c A)          (caps the loss of a negative-advantage step at c |A|)

* ``"gspo"`` — Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071). The
  sequence ratio is the length-normalised geometric mean of the token ratios::

      s_i = exp( sum_t m_it (logp_it - logp_old_it) / |y_i| )          (|y_i| = sum_t m_it)
      l_it = -min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i)
      s_it = sg(s_i) * exp(logp_it - sg(logp_it))                        ("GSPO-token" form)

  ``s_it`` equals ``s_i`` in value, and with ``seq-mean-token-mean`` aggregation the gradient is
  exactly GSPO's ``(1/G) sum_i A_i grad s_i`` (``grad s_i = s_i (1/|y_i|) sum_t grad logp_it``).
  The paper's defaults are eps_low = 3e-4, eps_high = 4e-4.

* ``"cispo"`` — Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585)::

      l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A logp_t

  The weight is clipped, not the update: every token keeps the gradient
  ``-clip(rho_t) A grad logp_t``, including tokens whose ratio is outside the range.

* ``"sapo"`` — Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347). A
  temperature-controlled sigmoid gate replaces the hard clip::

      f(rho) = (4 / tau) * sigmoid(tau (rho - 1)),   tau = tau_pos if A > 0 else tau_neg
      l_t   = -f(rho_t) A

  ``df/drho = 4 sigmoid (1 - sigmoid)``, 1 at rho = 1 (on-policy it is plain policy gradient) and
  decaying smoothly away from 1. Paper defaults: tau_pos = 1.0, tau_neg = 1.05.

* ``"reinforce"`` — plain REINFORCE with the group baseline (Williams 1992), no ratio::

      l_t = -A logp_t

  Exactly on-policy: with several optimizer steps per batch it ignores that the data is stale.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyLossName",
    "cispo_loss",
    "clip_loss",
    "gspo_loss",
    "reinforce_loss",
    "sapo_loss",
]

PolicyLossName = Literal["clip", "gspo", "cispo", "sapo", "reinforce"]
POLICY_LOSSES: tuple[str, ...] = ("clip", "gspo", "cispo", "sapo", "reinforce")


class PolicyLoss(NamedTuple):
    """``loss`` (n, T) carries the gradient; ``ratio`` (n, T) and the clip masks are for metrics.

    ``clip_low``: steps with A < 0 whose ratio is below ``1 - eps_low`` (no gradient through the
    ratio, or for CISPO a clipped weight); ``clip_high``: A > 0 and ratio above ``1 + eps_high``.
    Both are None for losses that never clip.
    """

    loss: Tensor
    ratio: Tensor
    clip_low: Tensor | None = None
    clip_high: Tensor | None = None


class PolicyLossFn(Protocol):
    """A user policy loss for ``GRPOTrainer(loss_fn=...)``.

    Called as ``loss_fn(logp, logp_old, advantages, mask)`` with logp (carries grad), logp_old,
    mask (n, T) and advantages (n,) or (n, T); returns the per-step loss (n, T) (or a
    `PolicyLoss`). The trainer aggregates it with ``loss_aggregation`` over valid steps, so the
    result is independent of how the optimizer step is split into micro-batches.
    """

    def __call__(
        self, logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor
    ) -> Tensor | PolicyLoss: ...


def _per_step(advantages: Tensor, like: Tensor) -> Tensor:
    """(n,) -> (n, 1) so it broadcasts over steps; (n, T) unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == like.dim() - 1 else advantages


def _ratio(logp: Tensor, logp_old: Tensor, log_ratio_clamp: float) -> Tensor:
    # One (n, T) buffer: clamp_ and exp_ work in place on the difference (autograd-safe).
    return (logp - logp_old).clamp_(-log_ratio_clamp, log_ratio_clamp).exp_()


def _clip_objective(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> PolicyLoss:
    """``-min(r A, clip(r, lo, hi) A)`` (and the dual clip) as ONE clamp with per-sample bounds.

    For A >= 0, min(r, clip(r, lo, hi)) = min(r, hi); for A < 0 the objective is A max(r, lo),
    and the dual clip caps the loss -A max(r, lo) at -c A, i.e. clamps r above at c. So
    ``l = -A clamp(r, lo_A, hi_A)`` with (lo_A, hi_A) = (-inf, hi) if A >= 0 else (lo, c or inf).
    The gradient is the same as the min/max form's everywhere except on the measure-zero set
    where the two branches are equal.
    """
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    neg = adv < 0
    c = torch.inf if dual_clip_c is None else dual_clip_c
    upper = torch.full_like(adv, hi, dtype=ratio.dtype).masked_fill(neg, c)
    lower = torch.full_like(adv, -torch.inf, dtype=ratio.dtype).masked_fill(neg, lo)
    loss = ratio.clamp(lower, upper) * (-adv)
    with torch.no_grad():
        r = ratio.detach()
        clip_low = (r < lo) & neg
        clip_high = (r > hi) & (adv > 0)
    return PolicyLoss(loss, ratio, clip_low, clip_high)


def clip_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLoss:
    """PPO/GRPO clipped surrogate ``-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)`` per step.

    ``dual_clip_c``: for A < 0 the loss is capped at ``-c A`` (dual clip, c > 1); None = off.
    Shapes: logp, logp_old (n, T); advantages (n,) or (n, T); mask unused -> loss, ratio (n, T).
    """
    ratio = _ratio(logp, logp_old, log_ratio_clamp)
    return _clip_objective(ratio, _per_step(advantages, logp), eps_low, eps_high, dual_clip_c)


def gspo_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLoss:
    """GSPO: the clipped surrogate on the sequence ratio ``s_i = exp(mean_t (logp - logp_old))``.

    The mean is over the valid steps of sample i (``mask``); ``s_it = sg(s_i) exp(logp - sg(logp))``
    carries the gradient (module docstring). Shapes: (n, T) inputs, advantages (n,) or (n, T)
    -> loss (n, T), ratio (n, T) (= s_i on every step).
    """
    m = mask.to(logp.dtype)
    length = m.sum(-1, keepdim=True).clamp(min=1.0)
    with torch.no_grad():
        row_sum = ((logp - logp_old).unsqueeze(-2) @ m.unsqueeze(-1)).squeeze(-1)  # (n, 1)
        seq_log_ratio = (row_sum / length).clamp(-log_ratio_clamp, log_ratio_clamp)
    s = (logp - logp.detach()).add_(seq_log_ratio).exp_()  # (n, T), value s_i
    return _clip_objective(s, _per_step(advantages, logp), eps_low, eps_high, dual_clip_c)


def cispo_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    log_ratio_clamp: float = 20.0,
) -> PolicyLoss:
    """CISPO: ``-sg(clip(rho, 1-eps_low, 1+eps_high)) A logp`` per step.

    ``eps_low = 1`` means no lower bound (MiniMax-M1 sets it "to a large value").
    Shapes: (n, T) inputs, advantages (n,) or (n, T) -> loss, ratio (n, T).
    """
    adv = _per_step(advantages, logp)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    with torch.no_grad():
        ratio = _ratio(logp.detach(), logp_old, log_ratio_clamp)
        weight = ratio.clamp(lo, hi)
        clip_low = (ratio < lo) & (adv < 0)
        clip_high = (ratio > hi) & (adv > 0)
    return PolicyLoss(-(weight * adv) * logp, ratio, clip_low, clip_high)


def sapo_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> PolicyLoss:
    """SAPO soft gate: ``-(4 / tau) sigmoid(tau (rho - 1)) A``, tau = tau_pos if A > 0 else tau_neg.

    Shapes: (n, T) inputs, advantages (n,) or (n, T) -> loss, ratio (n, T).
    """
    adv = _per_step(advantages, logp)
    ratio = _ratio(logp, logp_old, log_ratio_clamp)
    tau = torch.full_like(adv, tau_neg, dtype=logp.dtype).masked_fill(adv > 0, tau_pos)
    # sigmoid(tau r - tau) * (-4 A / tau): the per-sample factors stay (n, 1) when A is (n,).
    gate = torch.sigmoid(torch.addcmul(-tau, tau, ratio))
    return PolicyLoss(gate * (-4.0 * adv / tau), ratio)


def reinforce_loss(
    logp: Tensor,
    logp_old: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    log_ratio_clamp: float = 20.0,
) -> PolicyLoss:
    """Plain REINFORCE ``-A logp`` per step (no ratio). ``ratio`` is reported for metrics only.

    Shapes: logp (n, T), advantages (n,) or (n, T) -> loss, ratio (n, T).
    """
    with torch.no_grad():
        ratio = (
            torch.ones_like(logp) if logp_old is None else _ratio(logp.detach(), logp_old, log_ratio_clamp)
        )
    return PolicyLoss(-_per_step(advantages, logp) * logp, ratio)
