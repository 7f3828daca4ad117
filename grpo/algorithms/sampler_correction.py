"""Importance weights that correct a sampler/trainer mismatch, and their effective sample size.

The sampler (vLLM, a quantised or differently batched generator) reports log-probs
``logp_sampler`` of the actions it drew; the trainer recomputes ``logp_old`` with the same
weights. Their gap makes the batch slightly off-policy, and each valid step's policy term is
weighted by ``w`` (no gradient; `GRPOConfig.sampler_is_cap` = the cap ``C``,
`GRPOConfig.sampler_correction` = the mode). With ``d_it = logp_old_it - logp_sampler_it`` on the
valid steps (``m_it`` = 1) and ``s_i = sum_t m_it d_it`` (the log-ratio of the whole sequence):

    "token_truncate"     w_it = min(exp(d_it), C)                      (TIS; Yao et al. 2025)
    "token_mask"         w_it = exp(d_it) * 1[exp(d_it) <= C]           (token-level MIS / IcePop)
    "sequence_truncate"  w_it = min(exp(s_i), C)      for every t of i  (sequence-level TIS)
    "sequence_mask"      w_it = exp(s_i) * 1[s_i <= log C]  for every t  (sequence-level MIS;
                                                                        Liu et al. 2025)

A masked unit keeps its ratio when it is kept (as verl's ``rollout_is`` "mask" mode and IcePop
do): below the cap the weight is the unbiased ratio, above it the unit is dropped from the policy
term (weight 0) instead of being pulled down to ``C`` (which truncation does, keeping a biased
gradient). Dropping changes only the policy term: the unit's KL and entropy terms stay, and it
still counts in the loss normaliser. Padding (``m_it`` = 0) gets weight 0. The sequence modes
work in log space (``exp(min(s_i, log C))``), so a long row's ratio never overflows.

The effective sample size of weights ``w_1..w_n`` (Kish) as a fraction of ``n``:
``ESS/n = (sum_j w_j)^2 / (n sum_j w_j^2)`` in [0, 1]; 1 when every weight is equal, near 1/n
when one weight dominates, 0 when every weight is 0 (every unit masked). The units are the valid
steps for the token modes and the rows with a valid step for the sequence modes (``per_row``).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "SAMPLER_CORRECTIONS",
    "CorrectedWeights",
    "ImportanceStatistics",
    "ImportanceSums",
    "SamplerCorrection",
    "corrected_weights",
    "effective_sample_size",
    "effective_sample_size_from_sums",
    "importance_statistics",
    "importance_sums",
    "importance_weights",
    "is_per_row",
]

SamplerCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLER_CORRECTIONS: tuple[SamplerCorrection, ...] = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)


class CorrectedWeights(NamedTuple):
    """``weights`` (N, T): the policy term's weights, 0 on padding; ``capped`` (N, T) bool: valid
    steps whose ratio (the token's, or its row's for the sequence modes) exceeded the cap, i.e.
    were truncated to ``C`` or masked to 0."""

    weights: Tensor
    capped: Tensor


class ImportanceSums(NamedTuple):
    """Sums over the valid units of some micro-batches: they add up across micro-batches,
    optimizer steps and processes (ratios of them do not). Each field a scalar tensor.

    ``weight_sum`` = sum_{i,t} m w, ``capped`` = #valid steps capped or masked, ``steps`` =
    sum_{i,t} m; ``unit_sum`` / ``unit_sq_sum`` / ``units`` = sum w, sum w^2 and the count over
    the ESS's units (valid steps, or rows with a valid step for the sequence modes)."""

    weight_sum: Tensor
    capped: Tensor
    steps: Tensor
    unit_sum: Tensor
    unit_sq_sum: Tensor
    units: Tensor


class ImportanceStatistics(NamedTuple):
    """``weight_mean`` = mean of w over valid steps (a row's weight counts once per valid step),
    ``frac_capped`` = fraction of valid steps capped or masked, ``ess`` = ESS/n of the units."""

    weight_mean: float
    frac_capped: float
    ess: float


def is_per_row(mode: SamplerCorrection) -> bool:
    """Whether ``mode`` weights whole rows (its ESS counts rows, not valid steps)."""
    return mode in ("sequence_truncate", "sequence_mask")


def _check(logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, mode: str, cap: float) -> None:
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(
            f"sampler correction mode={mode!r} is unknown; choose one of {SAMPLER_CORRECTIONS} "
            f"(e.g. mode='token_truncate')."
        )
    if not cap > 0:  # also refuses NaN
        raise ValueError(f"the importance-weight cap must be > 0, got cap={cap!r}; e.g. cap=2.0.")
    if logp_old.dim() != 2 or logp_old.shape != logp_sampler.shape or logp_old.shape != mask.shape:
        raise ValueError(
            f"importance weights need logp_old, logp_sampler and mask of one shape (N, T); got "
            f"{tuple(logp_old.shape)}, {tuple(logp_sampler.shape)} and {tuple(mask.shape)}."
        )


def corrected_weights(
    logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, *, mode: SamplerCorrection, cap: float
) -> CorrectedWeights:
    """The weights of ``mode`` with cap ``C = cap`` (module docstring) and which valid steps the
    cap acted on. No gradient. Shapes: logp_old, logp_sampler (N, T) float, mask (N, T) bool ->
    weights (N, T) in logp_old's dtype (0 on padding), capped (N, T) bool (False on padding).
    Values on padding are never read (they may be anything, NaN included)."""
    _check(logp_old, logp_sampler, mask, mode, cap)
    with torch.no_grad():
        zero = logp_old.new_zeros(())
        if not is_per_row(mode):
            raw = torch.exp(logp_old - logp_sampler)  # (N, T) r_it
            capped = (raw > cap) & mask
            kept = raw.clamp(max=cap) if mode == "token_truncate" else torch.where(capped, zero, raw)
            return CorrectedWeights(torch.where(mask, kept, zero), capped)
        log_cap = math.log(cap)
        s = torch.where(mask, logp_old - logp_sampler, zero).sum(-1, keepdim=True)  # (N, 1) s_i
        over = s > log_cap  # (N, 1)
        row = torch.exp(s.clamp(max=log_cap))  # never overflows
        row = torch.where(over, zero if mode == "sequence_mask" else zero + cap, row)  # exactly C
        return CorrectedWeights(torch.where(mask, row, zero), over & mask)


def importance_weights(
    logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, *, mode: SamplerCorrection, cap: float
) -> Tensor:
    """``w`` (N, T) of ``mode`` (module docstring): the weights of `corrected_weights`.

    Shapes: logp_old, logp_sampler (N, T), mask (N, T) bool -> (N, T), 0 on padding. No gradient.
    """
    return corrected_weights(logp_old, logp_sampler, mask, mode=mode, cap=cap).weights


def _units(weights: Tensor, mask: Tensor, per_row: bool) -> tuple[Tensor, Tensor]:
    """The ESS's unit weights and their validity: the valid steps (flattened), or one weight per
    row (its valid steps share it; rows without a valid step are not units)."""
    if per_row:
        return torch.where(mask, weights, 0).amax(-1), mask.any(-1)  # (N,), (N,)
    return weights.reshape(-1), mask.reshape(-1)


def importance_sums(corrected: CorrectedWeights, mask: Tensor, *, per_row: bool) -> ImportanceSums:
    """`ImportanceSums` of one micro-batch: ``corrected`` of `corrected_weights`, ``mask``
    (N, T) bool the valid steps, ``per_row`` = `is_per_row` of the mode (the ESS's units)."""
    weights = corrected.weights
    mf = mask.to(weights.dtype)
    unit_w, unit_valid = _units(weights, mask, per_row)
    unit_w = torch.where(unit_valid, unit_w, 0)
    return ImportanceSums(
        (weights * mf).sum(),
        (corrected.capped * mf).sum(),
        mf.sum(),
        unit_w.sum(),
        (unit_w * unit_w).sum(),
        unit_valid.to(weights.dtype).sum(),
    )


def effective_sample_size_from_sums(unit_sum: Tensor, unit_sq_sum: Tensor, units: Tensor) -> Tensor:
    """``ESS/n = (sum w)^2 / (n sum w^2)`` from the three sums (scalar tensors): in [0, 1], NaN
    without a unit (n = 0), 0 when every weight is 0. <= 1 by Cauchy-Schwarz; clamped there
    against rounding (equal weights give 1 up to rounding)."""
    ratio = (unit_sum * unit_sum / (units * unit_sq_sum)).clamp(max=1.0)
    zero_or_nan = torch.where(units > 0, 0.0, math.nan).to(ratio.dtype)
    return torch.where((units > 0) & (unit_sq_sum > 0), ratio, zero_or_nan)


def effective_sample_size(weights: Tensor, mask: Tensor, *, per_row: bool = False) -> Tensor:
    """``ESS/n = (sum_j w_j)^2 / (n sum_j w_j^2)`` over the n valid units: a scalar in [0, 1]
    in weights' dtype (NaN when there is no valid unit, 0 when every weight is 0).

    Shapes: weights (N, T) >= 0, mask (N, T) bool -> (). Units: the valid steps, or with
    ``per_row=True`` the rows with a valid step, each weighted by its valid steps' (shared) weight
    (the sequence modes: a row is one sample, however long).
    """
    if weights.shape != mask.shape or weights.dim() != 2:
        raise ValueError(
            f"effective_sample_size needs weights and mask of one shape (N, T); got "
            f"{tuple(weights.shape)} and {tuple(mask.shape)}."
        )
    unit_w, unit_valid = _units(weights, mask, per_row)
    unit_w = torch.where(unit_valid, unit_w, 0)
    return effective_sample_size_from_sums(
        unit_w.sum(), (unit_w * unit_w).sum(), unit_valid.to(weights.dtype).sum()
    )


def importance_statistics(sums: ImportanceSums) -> ImportanceStatistics:
    """Mean weight and fraction capped over the valid steps, and the ESS, of accumulated
    ``sums`` (of every micro-batch, optimizer step and process that shares them). Means of an
    empty set are 0, the ESS of no unit NaN."""
    ess = effective_sample_size_from_sums(sums.unit_sum, sums.unit_sq_sum, sums.units)
    weight_sum, capped, steps, ess_value = torch.stack(
        [sums.weight_sum, sums.capped, sums.steps, ess]
    ).tolist()
    per_step = max(steps, 1.0)  # one host sync above
    return ImportanceStatistics(weight_sum / per_step, capped / per_step, ess_value)
