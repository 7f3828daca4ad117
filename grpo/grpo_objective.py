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
                   (KL-based advantage shaping, ``kl_in_advantage``: l = l_pg(A') - entropy_coeff * l_H
                   with A'_t = A - kl_coeff * sg(l_kl,t), see grpo.algorithms.kl.kl_shaped_advantages)
    loss = aggregate(l, mask, mode, Z)    Z = aggregation_normaliser over the whole optimizer step

The normaliser counts the whole optimizer step, not the micro-batch, so accumulating gradients
over micro-batches gives exactly the gradient of the full batch.

Where the loss lives: `GRPOObjective.composed` is this function, composed from the pure functions
through autograd (any loss and KL). The built-in "clip" loss with the built-in KL and entropy
terms runs on its twin, `grpo.algorithms.clip_twin.clip_objective_twin` (values and per-step
gradients in one no-grad pass), kept because it saves 10-14 % of a whole small-policy step
(benchmarks/objective_twin.py) and tested equal to `composed` (tests/test_clip_twin.py);
``GRPOObjective(clip_twin=False)`` runs `composed` for every loss. Both reduce their per-step
values to the statistics with `grpo.algorithms.objective_statistics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

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
from grpo.algorithms.clip_twin import ClipObjectiveSettings, clip_objective_twin
from grpo.algorithms.kl import KL_ESTIMATORS, KLEstimator, KLFn, kl_estimate, kl_shaped_advantages
from grpo.algorithms.objective_inputs import ObjectiveInputs
from grpo.algorithms.objective_statistics import (
    N_AGGREGATED,
    STAT_NAMES,
    ConstantCache,
    LossTerms,
    StepWeights,
    aggregation_weights,
    objective_statistics,
)
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


def update_metrics(stats: Tensor, extremes: Tensor, optimizer_steps: int) -> tuple[dict[str, float], float]:
    """The update's metrics from its objective statistics: ``stats`` summed over every
    micro-batch of every optimizer step, ``extremes`` merged with ``torch.maximum``. Returns the
    metrics by name and the number of valid steps they were averaged over (one host sync)."""
    values = torch.cat([stats, extremes.to(stats.dtype)]).tolist()
    named = dict(zip(STAT_NAMES, values, strict=False))
    steps = named["steps"]
    per_step = max(steps, 1.0)
    out = {
        metric: named[stat] / (optimizer_steps if i < N_AGGREGATED else per_step)
        for i, (stat, metric) in enumerate(_STAT_METRICS)
    }
    out["ratio/min"], out["ratio/max"] = -values[-2], values[-1]
    return out, steps


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
        return torch.cat([stats[:N_AGGREGATED] / divisor, stats[N_AGGREGATED:]])

    @property
    def sums(self) -> dict[str, Tensor]:
        """The sums over valid steps by name (``steps``, ``clip_low``, ``clip_high``, ``kl_old``,
        ``kl_ref``, ``entropy``, ``ratio``) plus ``ratio_min`` / ``ratio_max``."""
        named = dict(zip(STAT_NAMES, self.stats, strict=True))
        out = {k: named[k] for k in ("steps", "clip_low", "clip_high", "kl_old", "kl_ref")}
        out["entropy"], out["ratio"] = named["entropy_sum"], named["ratio_sum"]
        out["ratio_min"], out["ratio_max"] = -self.extremes[0], self.extremes[1]
        return out


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
        config: the `GRPOConfig` to read ``clip_epsilon``, ``clip_epsilon_high``, ``kl_coeff`` and
            ``entropy_coeff`` from at each use (`from_config` passes it), instead of the
            arguments: a run-time change of one is one assignment to the config.
        kl_in_advantage: KL-based advantage shaping (``GRPOConfig.kl_penalty="advantage"``): the
            per-step KL, detached and times ``kl_coeff``, is subtracted from the advantages
            before the policy loss; the loss then has no KL term.
        clip_twin: let the built-in "clip" loss run on its twin (`uses_clip_twin`); False: every
            loss runs the composed path, `composed` (benchmarks/objective_twin.py times both).
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
        kl_in_advantage: bool = False,
        clip_twin: bool = True,
        config: GRPOConfig | None = None,
    ) -> None:
        if policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}.")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}.")
        if dual_clip_c is not None and not dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (3 is typical), got {dual_clip_c!r}.")
        self.config = config  # the live config (from_config): the coefficients are read from it
        self._eps_low = clip_epsilon
        self._eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
        self._kl_coeff = kl_coeff
        self.kl_estimator: KLEstimator = kl_estimator
        self._entropy_coeff = entropy_coeff
        self.aggregation: Aggregation = aggregation
        self.log_ratio_clamp = log_ratio_clamp
        self.policy_loss: PolicyLossName = policy_loss
        self.dual_clip_c = dual_clip_c
        self.sapo_tau_pos = sapo_tau_pos
        self.sapo_tau_neg = sapo_tau_neg
        self.loss_normaliser = loss_normaliser
        self.loss_fn = loss_fn
        self.kl_fn = kl_fn
        self.kl_in_advantage = kl_in_advantage
        self.clip_twin = clip_twin
        # per dtype / device constants, rebuilt when a coefficient changes
        self._cache: ConstantCache = {}
        if aggregation == "seq-mean-token-sum-norm":  # fail at construction, not mid-step
            aggregation_normaliser(torch.ones(1, 1, dtype=torch.bool), aggregation, constant=loss_normaliser)

    @classmethod
    def from_config(
        cls, config: GRPOConfig, *, loss_fn: PolicyLossFn | None = None, kl_fn: KLFn | None = None
    ) -> GRPOObjective:
        """The objective a `GRPOConfig` describes (no KL loss term when the KL is folded into the
        reward, ``kl_penalty="reward"``, or into the advantages, ``kl_penalty="advantage"``)."""
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
            kl_in_advantage=config.kl_penalty == "advantage",
            config=config,
        )

    # The coefficients a run may change (grpo.population.settings): read from the live config at
    # each use when built from one, so that a change is one assignment to the config.
    @property
    def eps_low(self) -> float:
        """eps_low of the clip (``config.clip_epsilon``)."""
        return self._eps_low if self.config is None else self.config.clip_epsilon

    @property
    def eps_high(self) -> float:
        """eps_high of the clip (``config.clip_epsilon_high``, None = ``clip_epsilon``)."""
        return self._eps_high if self.config is None else self.config.resolved_clip_epsilon_high

    @property
    def kl_coeff(self) -> float:
        """beta (``config.kl_coeff``; 0 when the KL is folded into the reward)."""
        c = self.config
        return self._kl_coeff if c is None else (0.0 if c.kl_penalty == "reward" else c.kl_coeff)

    @property
    def entropy_coeff(self) -> float:
        """The entropy bonus's weight (``config.entropy_coeff``)."""
        return self._entropy_coeff if self.config is None else self.config.entropy_coeff

    @property
    def loss_kl_coeff(self) -> float:
        """The weight of the KL term in the loss: ``kl_coeff``, or 0 when the KL shapes the
        advantages instead (``kl_in_advantage``)."""
        return 0.0 if self.kl_in_advantage else self.kl_coeff

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
            return self._user_policy_term(self.loss_fn, logp, logp_old, advantages, mask)
        c, name = self.log_ratio_clamp, self.policy_loss
        lo, hi = self.eps_low, self.eps_high
        args = (logp, logp_old, advantages, mask)
        if name in ("clip", "gspo"):
            loss = clip_loss if name == "clip" else gspo_loss
            return loss(*args, eps_low=lo, eps_high=hi, dual_clip_c=self.dual_clip_c, log_ratio_clamp=c)
        if name == "cispo":
            return cispo_loss(*args, eps_low=lo, eps_high=hi, log_ratio_clamp=c)
        if name == "sapo":
            return sapo_loss(*args, tau_pos=self.sapo_tau_pos, tau_neg=self.sapo_tau_neg, log_ratio_clamp=c)
        return reinforce_loss(*args, log_ratio_clamp=c)

    def _user_policy_term(
        self, loss_fn: PolicyLossFn, logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLoss:
        """`policy_term` of a user's ``loss_fn``: its `PolicyLoss`, or its per-step loss (n, T)
        with the ratio computed here."""
        out = loss_fn(logp, logp_old, advantages, mask)
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

        The loss is `composed` (the formulas of the module docstring, through autograd); the
        built-in "clip" loss with the built-in KL and entropy terms runs on its twin,
        `grpo.algorithms.clip_twin.clip_objective_twin` (same values and gradients, tested equal;
        kept for the whole-step time it saves on small policies, see `uses_clip_twin`).

        ``on_policy=True`` declares ``logp_old`` to be ``logp.detach()`` (nothing has changed since
        the actions were sampled, as in the first optimizer step of a trainer step): the ratio is
        exactly 1 and the twin skips computing it (same numbers, bitwise).

        ``is_weights`` (n, T), no gradient: per-step weights of the policy term (the truncated
        importance-sampling correction of a sampler/trainer mismatch, see
        `GRPOConfig.sampler_is_cap`); the KL and entropy terms are not weighted.

        The KL is computed (for metrics) whenever ``logp_ref`` is given; it enters the loss only
        when ``kl_coeff != 0``. With ``kl_in_advantage`` and ``logp_ref`` given, the advantages
        are shaped first (`grpo.algorithms.kl.kl_shaped_advantages`: ``A - kl_coeff * sg(KL)``,
        per step) and the loss has no KL term; the KL is still reported.
        """
        if self.kl_in_advantage and logp_ref is not None and self.kl_coeff != 0.0:
            with torch.no_grad():
                kl = self.kl_term(logp.detach(), logp_ref)
            advantages = kl_shaped_advantages(advantages, kl, self.kl_coeff)
        inputs = ObjectiveInputs(logp, logp_old, advantages, mask, normaliser, logp_ref, entropy, is_weights)
        if self.uses_clip_twin:
            loss, stats, extremes = clip_objective_twin(
                inputs, self._clip_settings(), self._cache, on_policy=on_policy
            )
            return ObjectiveOutput(loss, stats, extremes)
        return self.composed(inputs)

    @property
    def uses_clip_twin(self) -> bool:
        """Whether `__call__` runs `grpo.algorithms.clip_twin.clip_objective_twin` in place of
        `composed`: for the built-in "clip" loss with the built-in KL estimator and entropy term
        (no ``loss_fn`` / ``kl_fn``), unless ``clip_twin=False``. The twin saves 10-14 % of a
        small-policy trainer step (benchmarks/objective_twin.py, benchmarks/RESULTS.md)."""
        return self.clip_twin and self.policy_loss == "clip" and self.loss_fn is None and self.kl_fn is None

    def _clip_settings(self) -> ClipObjectiveSettings:
        """The settings the "clip" twin (`grpo.algorithms.clip_twin`) reads, as they are now."""
        return ClipObjectiveSettings(
            self.eps_low,
            self.eps_high,
            self.dual_clip_c,
            self.log_ratio_clamp,
            self.kl_estimator,
            self.loss_kl_coeff,
            self.entropy_coeff,
            self.aggregation,
        )

    def composed(self, inputs: ObjectiveInputs) -> ObjectiveOutput:
        """The objective composed from the pure functions through autograd, for any loss and KL:
        the definition of the loss (module docstring); `__call__` takes it unless
        `uses_clip_twin`. ``inputs``: `__call__`'s tensors (``on_policy`` is not needed here)."""
        logp, logp_old, advantages, mask, z, logp_ref, entropy, is_weights = inputs
        mf = mask.to(logp.dtype)  # the one float mask, shared by every masked sum below
        pg = self.policy_term(logp, logp_old, advantages, mask)
        if is_weights is not None:
            pg = pg._replace(loss=pg.loss * is_weights)
        per_step = pg.loss  # aggregate() is linear: aggregate the sum of the terms once
        kl: Tensor | None = None
        beta = self.loss_kl_coeff
        if logp_ref is not None:
            if beta != 0.0:
                kl = self.kl_term(logp, logp_ref)
                per_step = per_step + beta * kl
            else:
                with torch.no_grad():
                    kl = self.kl_term(logp.detach(), logp_ref)
        if self.entropy_coeff != 0.0:
            per_step = per_step - self.entropy_coeff * entropy_bonus(logp, entropy)
        loss = aggregate(per_step, mf, self.aggregation, z)
        with torch.no_grad():
            stats, extremes = self._statistics(inputs, mf, pg, kl)
        return ObjectiveOutput(loss, stats, extremes)

    def _statistics(
        self, inputs: ObjectiveInputs, mf: Tensor, pg: PolicyLoss, kl: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """`composed`'s statistics (under no_grad) from its policy term ``pg`` and KL ``kl`` (n, T)
        or None; ``mf`` (n, T) the float mask."""
        logp, logp_old, entropy = inputs.logp, inputs.logp_old, inputs.entropy
        z = inputs.normaliser
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
        weights = StepWeights(inputs.mask, mf, aggregation_weights(mf, z, self.aggregation), z)
        terms = LossTerms(
            inputs.logp_ref is not None, entropy is None, self.loss_kl_coeff, self.entropy_coeff
        )
        return objective_statistics(rows, weights, terms=terms, cache=self._cache)
