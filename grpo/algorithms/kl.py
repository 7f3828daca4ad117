"""KL to the reference policy: per-step estimators and the KL-in-reward penalty.

Direction: every estimator estimates **KL(pi_theta || pi_ref)** = E_{a ~ pi_theta}[log pi_theta(a) -
log pi_ref(a)], from actions sampled by the policy (the reverse KL that keeps pi_theta inside the
support of pi_ref). With ``d = logp_ref - logp = log(pi_ref / pi_theta)`` on a sampled step
(Schulman, "Approximating KL divergence", 2020):

    k1 = -d              = logp - logp_ref           unbiased, can be negative, high variance
    k2 = d^2 / 2                                     biased (exact to 2nd order), >= 0
    k3 = exp(d) - d - 1                              unbiased (E[exp(d)] = 1), >= 0, low variance

(Some trainers ship k3 with the ratio reversed, ``exp(-d) + d - 1``; that estimates
KL(pi_ref || pi_theta) only when sampling from pi_ref, and is biased on the policy's samples.)

Three ways the KL enters the update (``GRPOConfig.kl_penalty``):

* ``"loss"`` (DeepSeekMath GRPO): ``beta * k(logp, logp_ref)`` is added to the per-step loss and
  aggregated with it; the gradient flows through ``logp``.
* ``"reward"`` (PPO-RLHF style; verl ``use_kl_in_reward``, ROLL ``add_token_level_kl``): a per-step
  penalty ``p_it = beta * k(logp_old_it, logp_ref_it)`` on the (N, T) grid, computed once at
  collection from the behaviour policy and carrying no gradient, is subtracted from the reward;
  see `kl_return_to_go` for how it enters the advantage.
* ``"advantage"`` (KL-based advantage shaping; the seed's ``use_kl_advantage_shaping``): the
  per-step estimate on the current policy's samples, detached, is subtracted from each step's
  advantage before the policy loss clips, ``A'_it = A_i - beta * sg(k(logp_it, logp_ref_it))``
  (`kl_shaped_advantages`); the loss has no KL term. Unlike ``"reward"`` it uses the policy of
  each optimizer step (not the behaviour policy), charges each step only its own KL, and is not
  normalised with the rewards.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "KLEstimator",
    "KLFn",
    "kl_and_grad",
    "kl_estimate",
    "kl_return_to_go",
    "kl_shaped_advantages",
]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


class KLFn(Protocol):
    """A user KL estimator for ``GRPOTrainer(kl_fn=...)``: ``kl_fn(logp, logp_ref) -> (n, T)``.

    Must be differentiable in ``logp`` when used as a loss term (``kl_penalty="loss"``).
    """

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor: ...


def kl_and_grad(logp: Tensor, logp_ref: Tensor, estimator: str, clamp: float) -> tuple[Tensor, Tensor | None]:
    """Per-step KL estimate and minus its derivative w.r.t. ``logp`` (None for k1, whose
    derivative is the constant 1), without autograd. With d = logp_ref - logp:

        k1 = -d                      -dk1/dlogp = -1
        k2 = d^2 / 2                 -dk2/dlogp = d
        k3 = exp(d) - 1 - d          -dk3/dlogp = exp(d) - 1   (d clamped to [-c, c]; 0 outside)

    k3 is computed as ``expm1(d) - d`` (no cancellation for small d). Shapes: (n, T) -> (n, T).
    """
    with torch.no_grad():
        d = logp_ref - logp  # log(pi_ref / pi_theta)
        if estimator == "k1":
            return d.neg_(), None
        if estimator == "k2":
            return 0.5 * d * d, d
        dc = d.clamp(-clamp, clamp)
        e = torch.expm1(dc)
        return e - dc, e * (dc == d)


class _KLEstimate(torch.autograd.Function):
    """k1/k2/k3 with a hand-written backward (`kl_and_grad`): the forward keeps dk/dlogp (one
    (n, T) tensor), the backward is one multiply. Autograd through the plain formula would
    allocate ~6 (n, T) temporaries in the backward (checked by test_gradcheck and
    benchmarks/objective.py)."""

    @staticmethod
    def forward(ctx: Any, logp: Tensor, logp_ref: Tensor, estimator: str, clamp: float) -> Tensor:
        kl, minus_grad = kl_and_grad(logp, logp_ref, estimator, clamp)
        ctx.save_for_backward(minus_grad)
        return kl

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None]:
        (grad,) = grads
        (minus_grad,) = ctx.saved_tensors
        return (grad if minus_grad is None else -grad * minus_grad), None, None, None


def kl_estimate(
    logp: Tensor, logp_ref: Tensor, estimator: KLEstimator = "k3", *, log_ratio_clamp: float = 20.0
) -> Tensor:
    """Per-step estimate of KL(pi_theta || pi_ref) from samples of pi_theta; carries gradient
    (through ``logp`` only; ``logp_ref`` is a fixed reference).

    k1 = logp - logp_ref;  k2 = (logp - logp_ref)^2 / 2;  k3 = exp(d) - d - 1 with d = logp_ref - logp
    (d clamped to [-c, c] for k3; zero gradient outside). Shapes: (n, T), (n, T) -> (n, T).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}.")
    out: Tensor = _KLEstimate.apply(logp, logp_ref.detach(), estimator, float(log_ratio_clamp))  # type: ignore[no-untyped-call]
    return out


def kl_return_to_go(penalty: Tensor, mask: Tensor) -> Tensor:
    """Sum of the per-step penalties from each step to the end: ``P_it = sum_{t' >= t} m p_it'``.

    With a per-step reward ``r_it = R_i [t = last valid step] - p_it`` and no discount, the return
    from step t is ``R_i - P_it``; step t is charged only for the KL of itself and later steps.
    ``P_i0`` is the sample's total penalty. Shapes: (N, T), (N, T) bool -> (N, T).
    """
    p = penalty * mask.to(penalty.dtype)
    return p.flip(-1).cumsum(-1).flip(-1)


def kl_shaped_advantages(advantages: Tensor, kl: Tensor, beta: float) -> Tensor:
    """KL-based advantage shaping: ``A'_it = A_i - beta * sg(kl_it)``, per step.

    ``kl`` is the per-step estimate of KL(pi_theta || pi_ref) on the policy's samples (`kl_estimate`
    with the configured estimator, or a user ``kl_fn``); it is detached, so the shaped advantage
    carries no gradient and the policy loss clips it like any advantage (the loss then has no KL
    term). Shapes: advantages (n,) or (n, T), kl (n, T) -> (n, T), in the dtype of ``advantages``
    (the KL is rounded to it when narrower).
    """
    if kl.dim() != 2 or advantages.shape[0] != kl.shape[0] or advantages.dim() not in (1, 2):
        raise ValueError(
            f"kl_shaped_advantages: advantages {tuple(advantages.shape)} must be (n,) or (n, T) and "
            f"kl {tuple(kl.shape)} must be (n, T) with the same n."
        )
    a = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return a - beta * kl.detach().to(a.dtype)
