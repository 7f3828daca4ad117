"""Twin of `grpo.grpo_objective.GRPOObjective.composed` for the built-in "clip" loss, kept
because it saves 10-14 % of a whole small-policy trainer step (benchmarks/objective_twin.py:
readable / twin = 1.11-1.16 on benchmarks/overhead.py's bandit, 2026-11-28; on a tiny causal LM
the step is the model's and the twin is within noise, benchmarks/RESULTS.md "The clip twin").

`GRPOObjective.composed` is the loss as a reader finds it: the pure functions
(`grpo.algorithms.policy_losses.clip_loss`, `grpo.algorithms.kl.kl_estimate`,
`grpo.grpo_objective.entropy_bonus`, `grpo.algorithms.aggregation.aggregate`) composed through
autograd. For ``policy_loss="clip"`` with the built-in KL estimator and entropy term (no
``loss_fn``, no ``kl_fn``) `GRPOObjective.__call__` runs `clip_objective_twin` instead
(`GRPOObjective.uses_clip_twin`; ``GRPOObjective(clip_twin=False)`` turns it off), which computes
the same function: tests/test_objective_variants.py compares the two on random cases (values,
statistics and gradients) and both with plain loops over samples and steps in float64.

Per sample i and step t, with d = logp - logp_old, the log-ratio clamp c and weight ``v`` of the
policy term (``is_weights``, else 1):

    ratio      r = exp(clamp(d, -c, c))
    clip       l_pg = -v min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), at most -v c_dual A for
               A < 0 with the dual clip; computed as one clamp of the log-ratio,
               l_pg = -v A exp(clamp(d, lo_A, hi_A)) with the bounds
               A >= 0: [lo_A, hi_A] = [-c, min(c, log(1 + eps_high))]
               A <  0: [lo_A, hi_A] = [max(-c, log(1 - eps_low)), min(c, log c_dual)]
               dl_pg/dlogp = l_pg where lo_A <= d <= hi_A (the clamp lets d through), else 0
    KL         e = logp_ref - logp clamped to [-c, c];  k3 = exp(e) - 1 - e,
               dk3/dlogp = 1 - exp(e) (0 where the clamp binds); k1 = -e, dk1/dlogp = 1;
               k2 = e^2 / 2, dk2/dlogp = -e  (`grpo.algorithms.kl.kl_and_grad`)
    entropy    H exact (its gradient flows back into ``entropy``: dloss/dH = -entropy_coeff w),
               or the estimate -logp with gradient -logp (the score-function estimate of grad H)
    per step   l = l_pg + kl_coeff * k - entropy_coeff * H
    loss       sum_{i,t} w_it l_it with the aggregation weights w (m / Z, or m / (n_i Z) for
               "seq-mean-token-mean", `grpo.algorithms.objective_statistics.aggregation_weights`)

What the twin does differently: one no-grad pass computes every per-step value and the derivative
of the whole per-step loss w.r.t. logp, ``g = w (dl_pg + kl_coeff dk + entropy_coeff logp)``; the
graph then holds one node (`SavedGradientLoss`) whose backward is one multiply by the saved
``g``, instead of the ~30 element-wise ops autograd would record and replay (on small batches
that Python and dispatch time is what a step saves; on large ones the twin is no faster). The statistics
come from the same pass (`grpo.algorithms.objective_statistics.objective_statistics`). On-policy
(``logp_old`` is ``logp.detach()``), the ratio is exactly 1 and is not computed (same numbers).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from grpo.algorithms.aggregation import Aggregation
from grpo.algorithms.kl import KLEstimator, kl_and_grad
from grpo.algorithms.objective_inputs import ObjectiveInputs
from grpo.algorithms.objective_statistics import (
    ConstantCache,
    LossTerms,
    StepWeights,
    aggregation_weights,
    objective_statistics,
)

__all__ = ["ClipObjectiveSettings", "SavedGradientLoss", "clip_objective_twin"]


class ClipObjectiveSettings(NamedTuple):
    """The settings of a `grpo.grpo_objective.GRPOObjective` the "clip" twin reads (immutable;
    a named tuple: built on every call, so that a changed coefficient takes effect, in well under
    a microsecond).

    Attributes:
        eps_low: eps_low of the ratio clip.
        eps_high: eps_high of the ratio clip.
        dual_clip_c: dual-clip constant c > 1 for A < 0; None = off.
        log_ratio_clamp: log-ratios are clamped to [-c, c] before exp.
        kl_estimator: "k1" | "k2" | "k3".
        kl_coeff: weight of the KL term (0: computed for the statistics only).
        entropy_coeff: weight of the entropy term.
        aggregation: one of `grpo.algorithms.aggregation.AGGREGATIONS`.
    """

    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    log_ratio_clamp: float
    kl_estimator: KLEstimator
    kl_coeff: float
    entropy_coeff: float
    aggregation: Aggregation


class SavedGradientLoss(torch.autograd.Function):
    """A scalar loss whose value and per-step gradients were computed in the forward pass.

    ``apply(logp, entropy, value, g_logp, g_entropy)`` returns ``value``; its backward is
    ``grad * g_logp`` for ``logp`` and ``grad * g_entropy`` for ``entropy`` (None when the entropy
    is not differentiated). Saves the autograd graph of the ~30 element-wise ops of the loss.
    """

    @staticmethod
    def forward(
        ctx: Any, logp: Tensor, entropy: Tensor | None, value: Tensor, g_logp: Tensor, g_ent: Tensor | None
    ) -> Tensor:
        ctx.has_ent = g_ent is not None
        ctx.save_for_backward(g_logp, g_ent)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = grads
        g_logp, g_ent = ctx.saved_tensors
        return grad * g_logp, (grad * g_ent if ctx.has_ent else None), None, None, None


def clip_objective_twin(
    inputs: ObjectiveInputs, settings: ClipObjectiveSettings, cache: ConstantCache, *, on_policy: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Twin of `GRPOObjective.composed` for the "clip" loss with the built-in KL and entropy terms
    (kept for the step time it saves, module docstring): the loss as one `SavedGradientLoss`.

    ``inputs``: the micro-batch's per-step tensors (shapes in `ObjectiveInputs`). ``cache``: the
    objective's `grpo.algorithms.objective_statistics.ConstantCache`. Returns ``(loss, stats,
    extremes)`` of `grpo.grpo_objective.ObjectiveOutput`: loss 0-d (differentiable in logp and
    entropy), stats (len(STAT_NAMES),), extremes (2,). Formulas in the module docstring.
    """
    s = settings
    logp, logp_old, advantages, mask, normaliser, logp_ref, entropy, is_weights = inputs
    with torch.no_grad():
        x = logp  # no graph is recorded under no_grad
        mf = mask.to(x.dtype)
        w = aggregation_weights(mf, normaliser, s.aggregation)  # None: the weight is mf / normaliser
        adv = advantages.unsqueeze(-1) if advantages.dim() == x.dim() - 1 else advantages
        pg, g, ratio, lrc, clip_low, clip_high = _policy_term_and_gradient(
            x, logp_old, adv, on_policy, is_weights, s, cache
        )
        kl = None
        if logp_ref is not None:
            kl, minus_grad = kl_and_grad(x, logp_ref, s.kl_estimator, s.log_ratio_clamp)
            if s.kl_coeff != 0.0:
                g = g.sub_(minus_grad, alpha=s.kl_coeff) if minus_grad is not None else g.add_(s.kl_coeff)
            del minus_grad
        g_ent = None
        if s.entropy_coeff != 0.0:
            if entropy is None:
                g = g.add_(x, alpha=s.entropy_coeff)  # d/dlogp of -c_H * lp (lp - logp - 1)
            elif entropy.requires_grad:
                g_ent = (mf * -s.entropy_coeff).div_(normaliser) if w is None else w * -s.entropy_coeff
        g = g.mul_(mf).div_(normaliser) if w is None else g.mul_(w)
        rows = {
            "policy": pg,
            "kl": kl,
            "clip_low": clip_low,
            "clip_high": clip_high,
            "ratio": ratio,
            "entropy": entropy if entropy is not None else x,  # -logp: sign in the projection
            "log_ratio": lrc,
            "logp": x,
        }
        terms = LossTerms(logp_ref is not None, entropy is None, s.kl_coeff, s.entropy_coeff)
        stats, extremes = objective_statistics(
            rows, StepWeights(mask, mf, w, normaliser), terms=terms, cache=cache
        )
    loss: Tensor = SavedGradientLoss.apply(logp, entropy, stats[0], g, g_ent)  # type: ignore[no-untyped-call]
    return loss, stats, extremes


def _policy_term_and_gradient(
    x: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    on_policy: bool,
    is_weights: Tensor | None,
    settings: ClipObjectiveSettings,
    cache: ConstantCache,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The clipped policy term of `clip_objective_twin` (under no_grad): per-step loss ``pg``, its
    derivative ``g`` w.r.t. logp, and the ratio, clamped log-ratio and clip masks (None
    on-policy: ratio 1, nothing clipped)."""
    if on_policy:
        # log-ratio 0: ratio exp(0) = 1, inside every clip bound, so pg = -A and its
        # gradient is pg: what the general branch computes, bitwise, in a few ops
        pg = (-adv).to(x.dtype).expand_as(x).clone()
        if is_weights is not None:
            pg.mul_(is_weights)
        return pg, pg.clone(), None, None, None, None
    c = settings.log_ratio_clamp
    log_lo, minus_c, log_cap, log_hi = _log_bounds(x.dtype, x.device, settings, cache)
    neg = adv < 0
    log_ratio = x - logp_old
    lrc = log_ratio.clamp(-c, c)
    ratio = lrc.exp()
    # the PPO clip and the log-ratio clamp as one clamp of the log-ratio with per-sample
    # bounds: [-c, min(c, log(1 + eps_high))] for A >= 0, [max(-c, log(1 - eps_low)),
    # min(c, log c_dual)] for A < 0 (eps_low = 1: log 0 = -inf, only the clamp at -c binds)
    clamped = log_ratio.clamp(torch.where(neg, log_lo, minus_c), torch.where(neg, log_cap, log_hi))
    # clipped as the composed path counts them: the clamped ratio outside the clip range (a
    # bound set by the log-ratio clamp alone is not a clip)
    clip_low = (ratio < 1.0 - settings.eps_low) & neg
    clip_high = (ratio > 1.0 + settings.eps_high) & (adv > 0)
    active = clamped == log_ratio
    del log_ratio  # (temporaries are released as soon as possible: peak memory)
    pg = clamped.exp_().mul_(-adv)  # in the clamped log-ratio's buffer
    if is_weights is not None:
        pg.mul_(is_weights)
    g = pg * active  # d pg / d logp: no gradient where clamped (pg is finite)
    return pg, g, ratio, lrc, clip_low, clip_high


def _log_bound(bound: float) -> float:
    """``log(bound)`` of a ratio clip bound; ``-inf`` for a bound <= 0, which a ratio (> 0) never
    reaches: ``clip_epsilon = 1`` means no lower bound, so the low clip never binds."""
    return math.log(bound) if bound > 0.0 else -math.inf


def _log_bounds(
    dtype: torch.dtype, device: torch.device, settings: ClipObjectiveSettings, cache: ConstantCache
) -> tuple[Tensor, ...]:
    """0-d tensors ``max(-c, log(1 - eps_low))``, ``-c``, ``min(c, log c_dual)``,
    ``min(c, log(1 + eps_high))`` in ``dtype`` (Python floats would make `torch.where` build
    float32 bounds); ``log(1 - eps_low)`` is ``-inf`` for ``eps_low = 1`` (`_log_bound`)."""
    s = settings
    key = ("bounds", dtype, device, s.eps_low, s.eps_high, s.dual_clip_c, s.log_ratio_clamp)
    cached = cache.get("bounds")
    if cached is None or cached[0] != key:
        # the composed path clamps the log-ratio to [-c, c] first, then clips the ratio: the
        # tighter of the two bounds wins on each side
        c = s.log_ratio_clamp
        cap = c if s.dual_clip_c is None else min(c, math.log(s.dual_clip_c))
        values = (max(-c, _log_bound(1.0 - s.eps_low)), -c, cap, min(c, math.log(1.0 + s.eps_high)))
        cached = (key, tuple(torch.tensor(v, dtype=dtype, device=device) for v in values))
        cache["bounds"] = cached
    bounds: tuple[Tensor, ...] = cached[1]
    return bounds
