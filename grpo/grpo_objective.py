"""The GRPO loss: `GRPOObjective` composes a policy loss, a KL term, an entropy term and an
aggregation. The pieces are pure functions in `grpo.algorithms.policy_losses`, `grpo.algorithms.kl` and
`grpo.algorithms.aggregation` (re-exported here); docs/algorithms.md lists every formula.

Notation (per sample i and step t; one-shot actions have T = 1):

    logp = log pi_theta(a_t | s, a_<t)     logp_old: the behaviour policy that sampled the actions
    logp_ref: the reference policy         A_i: advantage of sample i (or A_it per step)
    rho = exp(logp - logp_old)             (log-ratio clamped to [-c, c] for numerical safety)

    policy term   l_pg  = one of "clip" (GRPO/PPO, optional dual clip), "gspo", "cispo", "sapo",
                          "reinforce" (see grpo.algorithms.policy_losses), or a user ``loss_fn``
    KL term       l_kl  = k(logp, logp_ref), an estimate of KL(pi_theta || pi_ref) on samples
                          drawn from the policy (k1 / k2 / k3, see grpo.algorithms.kl), or a user ``kl_fn``
    entropy term  l_H   = H(pi_theta(. | s, a_<t)) exact when the policy gives it, otherwise the
                          Monte Carlo estimate -logp (value) whose gradient is -logp * grad(logp),
                          the score-function estimate of grad H on the policy's own samples.

    per-step loss  l = l_pg + kl_coeff * l_kl - entropy_coeff * l_H
    loss = aggregate(l, mask, mode, Z)    Z = aggregation_normaliser over the whole optimizer step

The normaliser counts the whole optimizer step, not the micro-batch, so accumulating gradients
over micro-batches gives exactly the gradient of the full batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from grpo.algorithms.aggregation import (
    AGGREGATIONS,
    Aggregation,
    aggregate,
    aggregation_count,
    aggregation_normaliser,
    normaliser_from_count,
)
from grpo.algorithms.kl import KL_ESTIMATORS, KLEstimator, KLFn, kl_and_grad, kl_estimate
from grpo.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossFn,
    PolicyLossName,
    cispo_loss,
    clip_loss,
    gspo_loss,
    reinforce_loss,
    sapo_loss,
)

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "STAT_NAMES",
    "Aggregation",
    "GRPOObjective",
    "KLEstimator",
    "ObjectiveOutput",
    "aggregate",
    "aggregation_normaliser",
    "clipped_surrogate",
    "entropy_bonus",
    "kl_estimate",
    "update_metrics",
]


def clipped_surrogate(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, Tensor]:
    """Per-step PPO loss ``-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)`` and the ratio ``rho``.

    Shapes: logp, logp_old (n, T); advantages (n,) or (n, T) -> loss (n, T), ratio (n, T).
    """
    out = clip_loss(
        logp, logp_old, advantages, eps_low=eps_low, eps_high=eps_high, log_ratio_clamp=log_ratio_clamp
    )
    return out.loss, out.ratio


def entropy_bonus(logp: Tensor, entropy: Tensor | None = None) -> Tensor:
    """Per-step entropy term: the exact ``entropy`` if given, else a Monte Carlo estimate.

    Estimate: value ``-logp`` (unbiased for H on the policy's own samples); gradient
    ``-logp * grad(logp)``, the score-function estimate of grad H (``E[grad logp] = 0``).
    Shapes: (n, T) -> (n, T).
    """
    if entropy is not None:
        return entropy
    lp = logp.detach()
    return (lp - 1.0).sub_(logp).mul_(lp)  # lp (lp - logp - 1): value -lp, gradient -lp grad(logp)


STAT_NAMES: tuple[str, ...] = (
    "loss",
    "policy_loss",
    "kl_loss",
    "entropy",
    "steps",
    "clip_low",
    "clip_high",
    "kl_old",
    "kl_ref",
    "entropy_sum",
    "ratio_sum",
)
"""Entries of `ObjectiveOutput.stats`, in order."""

_N_AGGREGATED = 4  # STAT_NAMES[:4] are aggregated like the loss; the rest are sums over valid steps

# The metric (grpo.metrics) each statistic becomes in `update_metrics`: the aggregated ones are
# averaged over optimizer steps, the sums divided by the valid steps ("steps" is that count).
_STAT_METRICS: tuple[tuple[str, str], ...] = (
    ("loss", "loss/total"),
    ("policy_loss", "loss/policy"),
    ("kl_loss", "loss/kl"),
    ("entropy", "loss/entropy"),
    ("clip_low", "clip/frac_low"),
    ("clip_high", "clip/frac_high"),
    ("kl_old", "kl/old"),
    ("kl_ref", "kl/ref"),
    ("entropy_sum", "policy/entropy"),
    ("ratio_sum", "ratio/mean"),
)


def _log_bound(bound: float) -> float:
    """``log(bound)`` of a ratio clip bound; ``-inf`` for a bound <= 0, which a ratio (> 0) never
    reaches: ``clip_epsilon = 1`` means no lower bound, so the low clip never binds."""
    return math.log(bound) if bound > 0.0 else -math.inf


def _as(v: Tensor, dtype: torch.dtype) -> Tensor:
    return v if v.dtype == dtype else v.to(dtype)


def _stacked_sums(raw: list[Tensor], mf: Tensor, w: Tensor | None, normaliser: Tensor | float) -> Tensor:
    """The k rows' weighted sums, then their masked sums (2k,), with one matrix product on their
    stack (fewest dispatches for small inputs); ``w`` None: the weights are ``mf / normaliser``."""
    stack = torch.stack([_as(v, mf.dtype) for v in raw]).reshape(len(raw), -1)
    if w is None:
        masked = (mf.reshape(1, -1) @ stack.T).view(-1)
        return torch.cat([masked / normaliser, masked])  # weighted, then masked sums
    return (torch.stack([_as(w, mf.dtype), mf]).view(2, -1) @ stack.T).view(-1)


def update_metrics(stats: Tensor, extremes: Tensor, optimizer_steps: int) -> tuple[dict[str, float], float]:
    """The update's metrics from its objective statistics: ``stats`` summed over every
    micro-batch of every optimizer step, ``extremes`` merged with ``torch.maximum``. Returns the
    metrics by name and the number of valid steps they were averaged over (one host sync)."""
    values = torch.cat([stats, extremes.to(stats.dtype)]).tolist()
    named = dict(zip(STAT_NAMES, values, strict=False))
    steps = named["steps"]
    per_step = max(steps, 1.0)
    out = {
        metric: named[stat] / (optimizer_steps if i < _N_AGGREGATED else per_step)
        for i, (stat, metric) in enumerate(_STAT_METRICS)
    }
    out["ratio/min"], out["ratio/max"] = -values[-2], values[-1]
    return out, steps


# Rows of the per-step value stack that `_statistics` reduces, in this order (those given).
# "logp" enters no statistic: a non-finite log-prob on a valid step makes every stat NaN (0 * inf in
# the reduction), so the trainer sees a non-finite loss and contains the step.
_ROWS = ("policy", "kl", "entropy", "mask", "clip_low", "clip_high", "ratio", "log_ratio", "logp")
# Up to this many (n, T) elements `_statistics` stacks the rows and reduces them with one matrix
# product (fewest dispatches); above it, one dot product per row (no stacked copy of the rows).
_SMALL = 1 << 15
# Rows whose weighted sum (aggregated like the loss) some stat uses; every other row is used only
# through its masked sum, and the policy row only through its weighted sum.
_WEIGHTED_ROWS = ("policy", "kl", "entropy")


class ObjectiveOutput(NamedTuple):
    """The loss of one micro-batch and its statistics.

    ``loss`` (scalar) carries the gradient. ``stats`` (len(`STAT_NAMES`),) is detached, in at least
    float32: ``loss``, ``policy_loss``, ``kl_loss``, ``entropy`` (aggregated like ``loss``, with
    the same normaliser, so they add up across the micro-batches of an optimizer step), then sums
    over valid steps: ``steps``, ``clip_low``, ``clip_high`` (clipped-step counts), ``kl_old``
    (k3 estimate of KL(old || new), ``sum rho - 1 - log rho``), ``kl_ref``, ``entropy_sum``,
    ``ratio_sum``. ``extremes`` (2,) is ``(-min rho, max rho)`` over valid steps (``-inf`` for
    both when there is none): negated so that one ``torch.maximum`` merges two micro-batches.
    Statistics live in one tensor so that a trainer accumulates them with one op per micro-batch.
    """

    loss: Tensor
    stats: Tensor
    extremes: Tensor

    @property
    def policy_loss(self) -> Tensor:
        return self.stats[1]

    @property
    def kl_loss(self) -> Tensor:
        return self.stats[2]

    @property
    def entropy(self) -> Tensor:
        return self.stats[3]

    @staticmethod
    def rescale(stats: Tensor, divisor: Tensor) -> Tensor:
        """``stats`` whose aggregated entries (loss, policy_loss, kl_loss, entropy) were computed
        with normaliser 1, divided by the optimizer step's ``divisor`` (the counts stay)."""
        return torch.cat([stats[:_N_AGGREGATED] / divisor, stats[_N_AGGREGATED:]])

    @property
    def sums(self) -> dict[str, Tensor]:
        """The sums over valid steps by name (``steps``, ``clip_low``, ``clip_high``, ``kl_old``,
        ``kl_ref``, ``entropy``, ``ratio``) plus ``ratio_min`` / ``ratio_max``."""
        named = dict(zip(STAT_NAMES, self.stats, strict=True))
        out = {k: named[k] for k in ("steps", "clip_low", "clip_high", "kl_old", "kl_ref")}
        out["entropy"], out["ratio"] = named["entropy_sum"], named["ratio_sum"]
        out["ratio_min"], out["ratio_max"] = -self.extremes[0], self.extremes[1]
        return out


class _FusedLoss(torch.autograd.Function):
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


class GRPOObjective:
    """Policy loss + ``kl_coeff`` * KL to the reference - ``entropy_coeff`` * entropy, aggregated.

    Args:
        clip_epsilon: eps_low of the ratio clip ("clip", "gspo") or of the IS-weight clip
            ("cispo").
        clip_epsilon_high: eps_high of the same clip; None = ``clip_epsilon``.
        kl_coeff: beta of the KL loss term (0, or a KL folded into the reward: no term).
        kl_estimator: "k1" | "k2" | "k3"; ignored when ``kl_fn`` is given.
        entropy_coeff: weight of the entropy bonus.
        aggregation: one of `AGGREGATIONS`.
        log_ratio_clamp: log-ratios are clamped to [-c, c] before exp.
        policy_loss: one of `POLICY_LOSSES`; ignored when ``loss_fn`` is given.
        dual_clip_c: dual-clip constant c > 1 for A < 0 ("clip" and "gspo"); None = off.
        sapo_tau_pos: SAPO gate temperature for A > 0.
        sapo_tau_neg: SAPO gate temperature for A <= 0.
        loss_normaliser: the constant C of "seq-mean-token-sum-norm".
        loss_fn: a `PolicyLossFn` replacing the built-in policy loss.
        kl_fn: a `KLFn` replacing the built-in KL estimator.
    """

    def __init__(
        self,
        *,
        clip_epsilon: float = 0.2,
        clip_epsilon_high: float | None = None,
        kl_coeff: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        entropy_coeff: float = 0.0,
        aggregation: Aggregation = "token-mean",
        log_ratio_clamp: float = 20.0,
        policy_loss: PolicyLossName = "clip",
        dual_clip_c: float | None = None,
        sapo_tau_pos: float = 1.0,
        sapo_tau_neg: float = 1.05,
        loss_normaliser: float | None = None,
        loss_fn: PolicyLossFn | None = None,
        kl_fn: KLFn | None = None,
    ) -> None:
        if policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}.")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}.")
        if dual_clip_c is not None and not dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (3 is typical), got {dual_clip_c!r}.")
        self.eps_low = clip_epsilon
        self.eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
        self.kl_coeff = kl_coeff
        self.kl_estimator: KLEstimator = kl_estimator
        self.entropy_coeff = entropy_coeff
        self.aggregation: Aggregation = aggregation
        self.log_ratio_clamp = log_ratio_clamp
        self.policy_loss: PolicyLossName = policy_loss
        self.dual_clip_c = dual_clip_c
        self.sapo_tau_pos = sapo_tau_pos
        self.sapo_tau_neg = sapo_tau_neg
        self.loss_normaliser = loss_normaliser
        self.loss_fn = loss_fn
        self.kl_fn = kl_fn
        # per dtype / device constants, rebuilt when a coefficient changes
        self._cache: dict[str, tuple[tuple[Any, ...], Any]] = {}
        if aggregation == "seq-mean-token-sum-norm":  # fail at construction, not mid-step
            aggregation_normaliser(torch.ones(1, 1, dtype=torch.bool), aggregation, constant=loss_normaliser)

    @classmethod
    def from_config(
        cls, config: GRPOConfig, *, loss_fn: PolicyLossFn | None = None, kl_fn: KLFn | None = None
    ) -> GRPOObjective:
        """The objective a `GRPOConfig` describes (no KL loss term when the KL is folded into the
        reward, ``kl_penalty="reward"``)."""
        return cls(
            clip_epsilon=config.clip_epsilon,
            clip_epsilon_high=config.clip_epsilon_high,
            kl_coeff=0.0 if config.kl_penalty == "reward" else config.kl_coeff,
            kl_estimator=config.kl_estimator,
            entropy_coeff=config.entropy_coeff,
            aggregation=config.loss_aggregation,
            log_ratio_clamp=config.log_ratio_clamp,
            policy_loss=config.policy_loss,
            dual_clip_c=config.dual_clip_c if config.dual_clip else None,
            sapo_tau_pos=config.sapo_tau_pos,
            sapo_tau_neg=config.sapo_tau_neg,
            loss_normaliser=config.loss_normaliser,
            loss_fn=loss_fn,
            kl_fn=kl_fn,
        )

    def normaliser(self, mask: Tensor) -> Tensor:
        """``Z`` of `aggregation_normaliser` for the rows of one whole optimizer step."""
        return aggregation_normaliser(mask, self.aggregation, constant=self.loss_normaliser)

    def count(self, mask: Tensor) -> Tensor:
        """The raw count behind ``Z`` (`aggregation_count`): add the counts of several
        micro-batches or processes, then `normaliser_from_count` once."""
        return aggregation_count(mask, self.aggregation)

    def normaliser_from_count(self, count: Tensor) -> Tensor:
        """``Z`` from the whole optimizer step's count (clamped to >= 1 once)."""
        return normaliser_from_count(count, self.aggregation, constant=self.loss_normaliser)

    def policy_term(self, logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor) -> PolicyLoss:
        """The per-step policy loss (n, T), its ratio and clip masks."""
        if self.loss_fn is not None:
            out = self.loss_fn(logp, logp_old, advantages, mask)
            if isinstance(out, PolicyLoss):
                return out
            if not isinstance(out, Tensor) or out.shape != logp.shape:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(
                    f"loss_fn returned {got}; expected a per-step loss Tensor of shape "
                    f"{tuple(logp.shape)} (same as logp), which the trainer aggregates."
                )
            with torch.no_grad():
                ratio = torch.exp((logp - logp_old).clamp(-self.log_ratio_clamp, self.log_ratio_clamp))
            return PolicyLoss(out, ratio)
        c = self.log_ratio_clamp
        name = self.policy_loss
        if name == "clip":
            return clip_loss(
                logp, logp_old, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high,
                dual_clip_c=self.dual_clip_c, log_ratio_clamp=c,
            )  # fmt: skip
        if name == "gspo":
            return gspo_loss(
                logp, logp_old, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high,
                dual_clip_c=self.dual_clip_c, log_ratio_clamp=c,
            )  # fmt: skip
        if name == "cispo":
            return cispo_loss(
                logp, logp_old, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high,
                log_ratio_clamp=c,
            )  # fmt: skip
        if name == "sapo":
            return sapo_loss(
                logp, logp_old, advantages, mask, tau_pos=self.sapo_tau_pos, tau_neg=self.sapo_tau_neg,
                log_ratio_clamp=c,
            )  # fmt: skip
        return reinforce_loss(logp, logp_old, advantages, mask, log_ratio_clamp=c)

    def kl_term(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        """Per-step KL(pi_theta || pi_ref) estimate (n, T), differentiable in ``logp``."""
        if self.kl_fn is not None:
            kl = self.kl_fn(logp, logp_ref)
            if not isinstance(kl, Tensor) or kl.shape != logp.shape:
                got = tuple(kl.shape) if isinstance(kl, Tensor) else type(kl).__name__
                raise ValueError(f"kl_fn returned {got}; expected a Tensor of shape {tuple(logp.shape)}.")
            return kl
        return kl_estimate(logp, logp_ref, self.kl_estimator, log_ratio_clamp=self.log_ratio_clamp)

    def __call__(
        self,
        logp: Tensor,
        logp_old: Tensor,
        advantages: Tensor,
        mask: Tensor,
        normaliser: Tensor | float,
        *,
        logp_ref: Tensor | None = None,
        entropy: Tensor | None = None,
        on_policy: bool = False,
        is_weights: Tensor | None = None,
    ) -> ObjectiveOutput:
        """Loss of one micro-batch. Shapes: logp, logp_old, mask, logp_ref, entropy (n, T);
        advantages (n,) or (n, T); ``normaliser`` from `normaliser` over the whole step.

        ``on_policy=True`` declares ``logp_old`` to be ``logp.detach()`` (nothing has changed since
        the actions were sampled, as in the first optimizer step of a trainer step): the ratio is
        exactly 1 and the fused path skips computing it (same numbers, bitwise).

        ``is_weights`` (n, T), no gradient: per-step weights of the policy term (the truncated
        importance-sampling correction of a sampler/trainer mismatch, see
        `GRPOConfig.sampler_is_cap`); the KL and entropy terms are not weighted.

        The KL is computed (for metrics) whenever ``logp_ref`` is given; it enters the loss only
        when ``kl_coeff != 0``. The built-in "clip" loss with the built-in KL takes a fused path
        (values and per-step gradients in one no-grad pass, `_FusedLoss`); it equals the composed
        path (tests compare both to plain loops in float64).
        """
        if self.policy_loss == "clip" and self.loss_fn is None and self.kl_fn is None:
            return self._fused(
                logp, logp_old, advantages, mask, normaliser, logp_ref, entropy, on_policy, is_weights
            )
        return self._composed(logp, logp_old, advantages, mask, normaliser, logp_ref, entropy, is_weights)

    def _composed(
        self,
        logp: Tensor,
        logp_old: Tensor,
        advantages: Tensor,
        mask: Tensor,
        normaliser: Tensor | float,
        logp_ref: Tensor | None,
        entropy: Tensor | None,
        is_weights: Tensor | None,
    ) -> ObjectiveOutput:
        """The objective composed from the pure functions, through autograd (any loss / KL)."""
        mf = mask.to(logp.dtype)  # the one float mask, shared by every masked sum below
        agg, z = self.aggregation, normaliser
        pg = self.policy_term(logp, logp_old, advantages, mask)
        if is_weights is not None:
            pg = pg._replace(loss=pg.loss * is_weights)
        per_step = pg.loss  # aggregate() is linear: aggregate the sum of the terms once
        kl: Tensor | None = None
        if logp_ref is not None:
            if self.kl_coeff != 0.0:
                kl = self.kl_term(logp, logp_ref)
                per_step = per_step + self.kl_coeff * kl
            else:
                with torch.no_grad():
                    kl = self.kl_term(logp.detach(), logp_ref)
        if self.entropy_coeff != 0.0:
            per_step = per_step - self.entropy_coeff * entropy_bonus(logp, entropy)
        loss = aggregate(per_step, mf, agg, z)
        with torch.no_grad():
            ratio = pg.ratio.detach()
            rows = {
                "policy": pg.loss.detach(),
                "kl": kl.detach() if kl is not None else None,
                "entropy": entropy.detach() if entropy is not None else logp.detach(),  # sign below
                "clip_low": pg.clip_low,
                "clip_high": pg.clip_high,
                "ratio": ratio,
                # log(ratio) for the built-in losses: the clamped log-ratio (a clamp is cheaper than a log)
                "log_ratio": (logp.detach() - logp_old).clamp_(-self.log_ratio_clamp, self.log_ratio_clamp)
                if self.loss_fn is None and self.policy_loss != "gspo"
                else torch.log(ratio),
                "logp": logp.detach(),
            }
            stats, extremes = self._statistics(
                rows, mask, mf, self._weights(mf, z), z, logp_ref is not None, entropy is None
            )
        return ObjectiveOutput(loss, stats, extremes)

    def _fused(
        self,
        logp: Tensor,
        logp_old: Tensor,
        advantages: Tensor,
        mask: Tensor,
        normaliser: Tensor | float,
        logp_ref: Tensor | None,
        entropy: Tensor | None,
        on_policy: bool = False,
        is_weights: Tensor | None = None,
    ) -> ObjectiveOutput:
        """The "clip" loss with the built-in KL and entropy terms, as one `_FusedLoss`.

        Per valid step, with r = exp(clamp(logp - logp_old, -c, c)) and A < 0 / A >= 0 bounds
        (lo_A, hi_A) as in `grpo.algorithms.policy_losses.clip_loss`, the gradients w.r.t. logp are
        ``-A r [lo_A <= r <= hi_A]`` (zero where the log-ratio clamp is active), for the KL
        k1: ``1``, k2: ``-(logp_ref - logp)``, k3: ``1 - exp(d)`` (zero outside the clamp), and for
        the entropy estimate ``-logp`` (`entropy_bonus`): ``-logp``; each times the aggregation
        weight ``w`` (`_weights`).
        """
        c = self.log_ratio_clamp
        with torch.no_grad():
            x = logp  # no graph is recorded under no_grad
            mf = mask.to(x.dtype)
            w = self._weights(mf, normaliser)  # None: the weight is mf / normaliser
            adv = advantages.unsqueeze(-1) if advantages.dim() == x.dim() - 1 else advantages
            pg, g, ratio, lrc, clip_low, clip_high = self._fused_policy_term(
                x, logp_old, adv, on_policy, is_weights
            )
            kl = None
            if logp_ref is not None:
                kl, minus_grad = kl_and_grad(x, logp_ref, self.kl_estimator, c)
                if self.kl_coeff != 0.0:
                    g = (
                        g.sub_(minus_grad, alpha=self.kl_coeff)
                        if minus_grad is not None
                        else g.add_(self.kl_coeff)
                    )
                del minus_grad
            g_ent = None
            if self.entropy_coeff != 0.0:
                if entropy is None:
                    g = g.add_(x, alpha=self.entropy_coeff)  # d/dlogp of -c_H * lp (lp - logp - 1)
                elif entropy.requires_grad:
                    g_ent = (
                        (mf * -self.entropy_coeff).div_(normaliser) if w is None else w * -self.entropy_coeff
                    )
            g = g.mul_(mf).div_(normaliser) if w is None else g.mul_(w)
            rows = {
                "policy": pg, "kl": kl, "clip_low": clip_low, "clip_high": clip_high, "ratio": ratio,
                "entropy": entropy if entropy is not None else x,  # -logp: sign in the projection
                "log_ratio": lrc, "logp": x,
            }  # fmt: skip
            stats, extremes = self._statistics(
                rows, mask, mf, w, normaliser, logp_ref is not None, entropy is None
            )
        loss: Tensor = _FusedLoss.apply(logp, entropy, stats[0], g, g_ent)  # type: ignore[no-untyped-call]
        return ObjectiveOutput(loss, stats, extremes)

    def _fused_policy_term(
        self, x: Tensor, logp_old: Tensor, adv: Tensor, on_policy: bool, is_weights: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """The clipped policy term of `_fused` (under no_grad): per-step loss ``pg``, its
        derivative ``g`` w.r.t. logp, and the ratio, clamped log-ratio and clip masks (None
        on-policy: ratio 1, nothing clipped)."""
        if on_policy:
            # log-ratio 0: ratio exp(0) = 1, inside every clip bound, so pg = -A and its
            # gradient is pg: what the general branch computes, bitwise, in a few ops
            pg = (-adv).to(x.dtype).expand_as(x).clone()
            if is_weights is not None:
                pg.mul_(is_weights)
            return pg, pg.clone(), None, None, None, None
        c = self.log_ratio_clamp
        log_lo, minus_c, log_cap, log_hi = self._log_bounds(x.dtype, x.device)
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
        clip_low = (ratio < 1.0 - self.eps_low) & neg
        clip_high = (ratio > 1.0 + self.eps_high) & (adv > 0)
        active = clamped == log_ratio
        del log_ratio  # (temporaries are released as soon as possible: peak memory)
        pg = clamped.exp_().mul_(-adv)  # in the clamped log-ratio's buffer
        if is_weights is not None:
            pg.mul_(is_weights)
        g = pg * active  # d pg / d logp: no gradient where clamped (pg is finite)
        return pg, g, ratio, lrc, clip_low, clip_high

    def _log_bounds(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
        """0-d tensors ``max(-c, log(1 - eps_low))``, ``-c``, ``min(c, log c_dual)``,
        ``min(c, log(1 + eps_high))`` in ``dtype`` (Python floats would make `torch.where` build
        float32 bounds); ``log(1 - eps_low)`` is ``-inf`` for ``eps_low = 1`` (`_log_bound`)."""
        key = ("bounds", dtype, device, self.eps_low, self.eps_high, self.dual_clip_c, self.log_ratio_clamp)
        cached = self._cache.get("bounds")
        if cached is None or cached[0] != key:
            # the composed path clamps the log-ratio to [-c, c] first, then clips the ratio: the
            # tighter of the two bounds wins on each side
            c = self.log_ratio_clamp
            cap = c if self.dual_clip_c is None else min(c, math.log(self.dual_clip_c))
            values = (max(-c, _log_bound(1.0 - self.eps_low)), -c, cap, min(c, math.log(1.0 + self.eps_high)))
            cached = (key, tuple(torch.tensor(v, dtype=dtype, device=device) for v in values))
            self._cache["bounds"] = cached
        bounds: tuple[Tensor, ...] = cached[1]
        return bounds

    def _weights(self, mf: Tensor, normaliser: Tensor | float) -> Tensor | None:
        """Per-step aggregation weights ``w`` with ``aggregate(l) = sum(w * l)``: ``m / (n_i Z)``
        for "seq-mean-token-mean" (n_i valid steps of sample i), (n, T); ``m / Z`` for the other
        modes, or None above `_SMALL` elements (the weight is then applied as a scalar: no (n, T)
        tensor is made for it)."""
        if self.aggregation == "seq-mean-token-mean":
            return mf / (mf.sum(-1, keepdim=True).clamp_(min=1.0) * normaliser)
        return mf / normaliser if mf.numel() <= _SMALL else None  # small: one op less overall

    def _statistics(
        self,
        rows: dict[str, Tensor | None],
        mask: Tensor,
        mf: Tensor,
        w: Tensor | None,
        normaliser: Tensor | float,
        has_ref: bool,
        entropy_is_logp: bool,
    ) -> tuple[Tensor, Tensor]:
        """``stats`` and ``extremes`` of `ObjectiveOutput` from the detached per-step values.

        ``rows`` maps names of `_ROWS` (but "mask", taken from ``mf``) to (n, T) values; None or
        absent rows are zero. Without a "ratio" row the step is on-policy: ratio 1 on every
        valid step, nothing clipped, ``kl_old = 0``, so those rows need no reduction.

        The rows times the weights and the mask give the aggregated terms and the masked sums
        (one matrix product on their stack for small inputs, one dot product per used sum for
        large ones), and a fixed matrix maps those to the stats (the loss is
        ``policy + beta kl - c_H entropy``, ``kl_old = sum rho - steps - sum log rho``).
        ``w`` None: the weights are ``mf / normaliser`` (weighted sums = masked sums / Z).
        ``entropy_is_logp``: the "entropy" row holds logp, the estimate is its negative.
        """
        dtype = mf.dtype if mf.dtype in (torch.float32, torch.float64) else torch.float32
        names = tuple(k for k in _ROWS if k == "mask" or rows.get(k) is not None)
        raw = [mf if name == "mask" else rows[name] for name in names]  # converted where reduced
        proj = self._projection(dtype, mf.device, names, has_ref, entropy_is_logp)
        if mf.numel() <= _SMALL:  # few elements: fewest ops (the per-op cost dominates)
            reduced = _stacked_sums(raw, _as(mf, dtype), w, normaliser)  # type: ignore[arg-type]
            steps = reduced[len(names) + names.index("mask")]
        else:  # many: no stacked copy of the rows; one dot product per sum that a stat uses
            reduced, used = self._dot_sums(raw, names, _as(mf, dtype), w, normaliser)  # type: ignore[arg-type]
            proj = proj[list(used)]
            steps = reduced[used.index(len(names) + names.index("mask"))]
        ratio = rows.get("ratio")
        if ratio is None:  # on-policy: ratio 1 on every valid step
            extremes = self._on_policy_extremes(steps, dtype)
        elif mf.numel() <= _SMALL:
            signed = torch.stack([-_as(ratio, dtype), _as(ratio, dtype)])
            extremes = torch.where(mask, signed, -torch.inf).reshape(2, -1).amax(1)
        else:
            # min / max over valid steps with one temporary: invalid steps hold the valid mean,
            # which lies between the valid min and max (none valid: -inf for both entries).
            # lerp(mean, r, m) is exactly r where m = 1 and the mean where m = 0, and on CPU ~10x
            # faster than torch.where with a scalar on large tensors
            r = _as(ratio, dtype)
            ratio_sum = reduced[used.index(len(names) + names.index("ratio"))]
            lo, hi = torch.aminmax(torch.lerp((ratio_sum / steps).expand_as(r), r, _as(mf, dtype)))
            extremes = torch.where(steps > 0, torch.stack([-lo, hi]).to(dtype), -torch.inf)
        return reduced @ proj, extremes

    @staticmethod
    def _dot_sums(
        raw: list[Tensor], names: tuple[str, ...], mf: Tensor, w: Tensor | None, normaliser: Tensor | float
    ) -> tuple[Tensor, tuple[int, ...]]:
        """The weighted and masked sums a stat uses, one dot product each (no stacked copy of the
        rows), and their indices among the 2k sums of `_stacked_sums`."""
        k = len(names)
        mff = mf.reshape(-1)
        if w is None:
            # rows are converted one dot at a time (a bool row's float copy lives for one dot)
            masked = torch.stack([torch.dot(_as(v, mf.dtype).reshape(-1), mff) for v in raw])
            return torch.cat([masked / normaliser, masked]), tuple(range(2 * k))
        wf = _as(w, mf.dtype).reshape(-1)
        used = tuple(i for i, n in enumerate(names) if n in _WEIGHTED_ROWS) + tuple(
            k + i for i, n in enumerate(names) if n != "policy"
        )
        reduced = torch.stack(
            [torch.dot(_as(raw[i % k], mf.dtype).reshape(-1), wf if i < k else mff) for i in used]
        )
        return reduced, used

    def _on_policy_extremes(self, steps: Tensor, dtype: torch.dtype) -> Tensor:
        """``(-min rho, max rho) = (-1, 1)`` when there are valid steps, else ``-inf`` for both."""
        key = ("unit", dtype, steps.device)
        cached = self._cache.get("unit")
        if cached is None or cached[0] != key:
            cached = (key, torch.tensor([-1.0, 1.0], dtype=dtype, device=steps.device))
            self._cache["unit"] = cached
        unit: Tensor = cached[1]
        return torch.where(steps > 0, unit, -torch.inf)

    def _projection(
        self,
        dtype: torch.dtype,
        device: torch.device,
        names: tuple[str, ...],
        has_ref: bool,
        entropy_is_logp: bool,
    ) -> Tensor:
        """The (2 * len(names), len(STAT_NAMES)) matrix from the weighted and masked sums of the
        rows ``names`` to the stats (see `_statistics`)."""
        # one cache entry per row set: the on-policy first epoch and the later ones alternate
        slot = "projection:" + ",".join(names)
        key = (dtype, device, has_ref, entropy_is_logp, self.kl_coeff, self.entropy_coeff)
        cached = self._cache.get(slot)
        if cached is not None and cached[0] == key:
            proj: Tensor = cached[1]
            return proj
        k = len(names)
        col = {name: i for i, name in enumerate(STAT_NAMES)}
        row = {name: i for i, name in enumerate(names)}
        p = torch.zeros(2 * k, len(STAT_NAMES), dtype=torch.float64)

        def put(weighted: bool, term: str, stat: str, value: float) -> None:
            if term in row:
                p[(0 if weighted else k) + row[term], col[stat]] = value

        put(True, "policy", "loss", 1.0)
        if has_ref:
            put(True, "kl", "loss", self.kl_coeff)
        put(True, "entropy", "loss", -self.entropy_coeff)
        for term, name in (("policy", "policy_loss"), ("kl", "kl_loss"), ("entropy", "entropy")):
            put(True, term, name, 1.0)
        for term, name in (
            ("mask", "steps"), ("clip_low", "clip_low"), ("clip_high", "clip_high"), ("kl", "kl_ref"),
            ("entropy", "entropy_sum"), ("ratio", "ratio_sum"),
        ):  # fmt: skip
            put(False, term, name, 1.0)
        if "ratio" in row:
            put(False, "ratio", "kl_old", 1.0)
            put(False, "mask", "kl_old", -1.0)
            put(False, "log_ratio", "kl_old", -1.0)
        else:  # on-policy: ratio 1 on every valid step, kl_old 0
            put(False, "mask", "ratio_sum", 1.0)
        if entropy_is_logp and "entropy" in row:  # the row holds logp; the entropy estimate is -logp
            p[row["entropy"]] *= -1.0
            p[k + row["entropy"]] *= -1.0
        proj = p.to(dtype=dtype, device=device)
        self._cache[slot] = (key, proj)
        return proj
