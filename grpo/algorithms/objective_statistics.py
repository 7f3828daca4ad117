"""The objective's statistics: one reduction of the detached per-step values of a micro-batch.

Both implementations of the loss (`grpo.grpo_objective.GRPOObjective`'s composed path and
`grpo.algorithms.clip_twin`) hand their per-step values here, as rows of (n, T) tensors named in
`ROWS`. With mask m, aggregation weights w (``aggregate(l) = sum(w * l)``, `aggregation_weights`)
and the rows' weighted sums ``W[row] = sum(w * row)`` and masked sums ``M[row] = sum(m * row)``:

    loss         = W[policy] + kl_coeff * W[kl] - entropy_coeff * W[entropy]
    policy_loss  = W[policy]     kl_loss = W[kl]      entropy = W[entropy]
    steps        = M[mask]       clip_low = M[clip_low]    clip_high = M[clip_high]
    kl_old       = M[ratio] - M[mask] - M[log_ratio]   (k3 estimate of KL(old || new))
    kl_ref       = M[kl]         entropy_sum = M[entropy]  ratio_sum = M[ratio]

that is, the stats (`STAT_NAMES`) are the weighted and masked sums times one fixed matrix (cached
per dtype, device, row set and coefficients). The entropy estimate is ``-logp``: its row then holds
logp and the matrix negates it. Without a ratio row the step is on-policy (ratio 1 on every valid
step, nothing clipped, ``kl_old = 0``). The sums are one matrix product on the stacked rows for
inputs up to `STACK_LIMIT` elements (fewest dispatches), else one dot product per sum a stat uses
(no stacked copy of the rows). All in at least float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from grpo.algorithms.aggregation import Aggregation

__all__ = [
    "N_AGGREGATED",
    "ROWS",
    "STACK_LIMIT",
    "STAT_NAMES",
    "ConstantCache",
    "LossTerms",
    "StepWeights",
    "aggregation_weights",
    "objective_statistics",
]

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
"""Entries of `grpo.grpo_objective.ObjectiveOutput.stats`, in order."""

N_AGGREGATED = 4
"""``STAT_NAMES[:N_AGGREGATED]`` are aggregated like the loss; the rest are sums over valid steps."""

# Rows of the per-step value stack that `objective_statistics` reduces, in this order (those given).
# "logp" enters no statistic: a non-finite log-prob on a valid step makes every stat NaN (0 * inf in
# the reduction), so the trainer sees a non-finite loss and contains the step.
ROWS = ("policy", "kl", "entropy", "mask", "clip_low", "clip_high", "ratio", "log_ratio", "logp")
"""Names of the per-step rows `objective_statistics` reduces, in the order they are stacked."""

STACK_LIMIT = 1 << 15
"""Up to this many (n, T) elements the rows are stacked and reduced with one matrix product
(fewest dispatches); above it, one dot product per row (no stacked copy of the rows)."""

# Rows whose weighted sum (aggregated like the loss) some stat uses; every other row is used only
# through its masked sum, and the policy row only through its weighted sum.
_WEIGHTED_ROWS = ("policy", "kl", "entropy")

ConstantCache = dict[str, tuple[tuple[Any, ...], Any]]
"""Per dtype / device constants by slot: ``slot -> (key, value)``, rebuilt when the key (dtype,
device, coefficients) changes. One per objective (`grpo.grpo_objective.GRPOObjective`)."""


class StepWeights(NamedTuple):
    """The mask and aggregation weights of one micro-batch's steps.

    Attributes:
        mask: (n, T) bool, the valid steps.
        mf: ``mask`` as floats (n, T) (the dtype the sums are taken in, at least float32).
        w: (n, T) weights from `aggregation_weights` with ``aggregate(l) = sum(w * l)``; None: the
            weights are ``mf / normaliser`` (weighted sums = masked sums / Z).
        normaliser: ``Z`` of the whole optimizer step, 0-d or a float.
    """

    mask: Tensor
    mf: Tensor
    w: Tensor | None
    normaliser: Tensor | float


class LossTerms(NamedTuple):
    """How the rows enter the loss statistic (the projection's coefficients, its cache key).

    Attributes:
        has_ref: the "kl" row is the KL to a reference, which enters the loss with ``kl_coeff``.
        entropy_is_logp: the "entropy" row holds logp; the entropy estimate is its negative.
        kl_coeff: weight of the KL term in the loss.
        entropy_coeff: weight of the entropy bonus.
    """

    has_ref: bool
    entropy_is_logp: bool
    kl_coeff: float
    entropy_coeff: float


def _as(v: Tensor, dtype: torch.dtype) -> Tensor:
    return v if v.dtype == dtype else v.to(dtype)


def aggregation_weights(mf: Tensor, normaliser: Tensor | float, aggregation: Aggregation) -> Tensor | None:
    """Per-step aggregation weights ``w`` with ``aggregate(l) = sum(w * l)``: ``m / (n_i Z)``
    for "seq-mean-token-mean" (n_i valid steps of sample i), (n, T); ``m / Z`` for the other
    modes, or None above `STACK_LIMIT` elements (the weight is then applied as a scalar: no (n, T)
    tensor is made for it). Shapes: ``mf`` (n, T) float mask, ``normaliser`` 0-d or a float."""
    if aggregation == "seq-mean-token-mean":
        return mf / (mf.sum(-1, keepdim=True).clamp_(min=1.0) * normaliser)
    return mf / normaliser if mf.numel() <= STACK_LIMIT else None  # small: one op less overall


def _stacked_sums(raw: list[Tensor], mf: Tensor, w: Tensor | None, normaliser: Tensor | float) -> Tensor:
    """The k rows' weighted sums, then their masked sums (2k,), with one matrix product on their
    stack (fewest dispatches for small inputs); ``w`` None: the weights are ``mf / normaliser``."""
    stack = torch.stack([_as(v, mf.dtype) for v in raw]).reshape(len(raw), -1)
    if w is None:
        masked = (mf.reshape(1, -1) @ stack.T).view(-1)
        return torch.cat([masked / normaliser, masked])  # weighted, then masked sums
    return (torch.stack([_as(w, mf.dtype), mf]).view(2, -1) @ stack.T).view(-1)


def objective_statistics(
    rows: dict[str, Tensor | None], weights: StepWeights, *, terms: LossTerms, cache: ConstantCache
) -> tuple[Tensor, Tensor]:
    """``stats`` (len(`STAT_NAMES`),) and ``extremes`` (2,) of `grpo.grpo_objective.ObjectiveOutput`
    from the detached per-step values (see the module docstring).

    ``rows`` maps names of `ROWS` (but "mask", taken from ``weights.mf``) to (n, T) values; None
    or absent rows are zero. ``weights``: the micro-batch's mask and aggregation weights;
    ``terms``: how the rows enter the loss; ``cache``: the objective's `ConstantCache`.
    """
    mask, mf, w, normaliser = weights
    dtype = mf.dtype if mf.dtype in (torch.float32, torch.float64) else torch.float32
    names = tuple(k for k in ROWS if k == "mask" or rows.get(k) is not None)
    raw = [mf if name == "mask" else rows[name] for name in names]  # converted where reduced
    proj = _projection(dtype, mf.device, names, terms, cache)
    if mf.numel() <= STACK_LIMIT:  # few elements: fewest ops (the per-op cost dominates)
        reduced = _stacked_sums(raw, _as(mf, dtype), w, normaliser)  # type: ignore[arg-type]
        steps = reduced[len(names) + names.index("mask")]
    else:  # many: no stacked copy of the rows; one dot product per sum that a stat uses
        reduced, used = _dot_sums(raw, names, _as(mf, dtype), w, normaliser)  # type: ignore[arg-type]
        proj = proj[list(used)]
        steps = reduced[used.index(len(names) + names.index("mask"))]
    ratio = rows.get("ratio")
    if ratio is None:  # on-policy: ratio 1 on every valid step
        extremes = _on_policy_extremes(steps, dtype, cache)
    elif mf.numel() <= STACK_LIMIT:
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


def _on_policy_extremes(steps: Tensor, dtype: torch.dtype, cache: ConstantCache) -> Tensor:
    """``(-min rho, max rho) = (-1, 1)`` when there are valid steps, else ``-inf`` for both."""
    key = ("unit", dtype, steps.device)
    cached = cache.get("unit")
    if cached is None or cached[0] != key:
        cached = (key, torch.tensor([-1.0, 1.0], dtype=dtype, device=steps.device))
        cache["unit"] = cached
    unit: Tensor = cached[1]
    return torch.where(steps > 0, unit, -torch.inf)


def _projection(
    dtype: torch.dtype,
    device: torch.device,
    names: tuple[str, ...],
    terms: LossTerms,
    cache: ConstantCache,
) -> Tensor:
    """The (2 * len(names), len(STAT_NAMES)) matrix from the weighted and masked sums of the
    rows ``names`` to the stats (see the module docstring), with the coefficients of ``terms``."""
    # one cache entry per row set: the on-policy first epoch and the later ones alternate
    slot = "projection:" + ",".join(names)
    key = (dtype, device, *terms)
    has_ref, entropy_is_logp, kl_coeff, entropy_coeff = terms
    cached = cache.get(slot)
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
        put(True, "kl", "loss", kl_coeff)
    put(True, "entropy", "loss", -entropy_coeff)
    for term, name in (("policy", "policy_loss"), ("kl", "kl_loss"), ("entropy", "entropy")):
        put(True, term, name, 1.0)
    for term, name in (
        ("mask", "steps"),
        ("clip_low", "clip_low"),
        ("clip_high", "clip_high"),
        ("kl", "kl_ref"),
        ("entropy", "entropy_sum"),
        ("ratio", "ratio_sum"),
    ):
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
    cache[slot] = (key, proj)
    return proj
