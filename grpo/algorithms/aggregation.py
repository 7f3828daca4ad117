"""Masked aggregation of per-step losses into one number, independent of the micro-batch split.

For per-step values ``l_it``, mask ``m_it`` and ``n_i = sum_t m_it`` valid steps, over the samples
of **one whole optimizer step** (S = samples with at least one valid step, as verl counts them):

    "token-mean"               (DAPO)        sum_{i,t} m l / sum_{i,t} m
    "seq-mean-token-mean"      (GRPO paper)  (1/|S|) sum_i (1/n_i) sum_t m l
    "seq-mean-token-sum"                     (1/|S|) sum_i sum_t m l
    "seq-mean-token-sum-norm"  (Dr. GRPO)    (1/|S|) sum_i sum_t m l / C,  C a constant the user sets
                                             (Dr. GRPO: the generation budget, e.g. max_new_tokens)

Every mode is ``sum_i w_i sum_t m l / Z`` with a per-sample weight ``w_i`` (1, or 1/n_i) that
depends only on sample i, and a normaliser ``Z`` (`aggregation_normaliser`) that depends only on
the whole optimizer step. The trainer computes ``Z`` once per optimizer step and passes it to every
micro-batch, so the accumulated gradient over micro-batches equals the full-batch gradient exactly.
Dr. GRPO's ``C`` is a fixed number, never the padded length of the current batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "aggregate",
    "aggregation_count",
    "aggregation_normaliser",
    "normaliser_from_count",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _bad(mode: str) -> ValueError:
    return ValueError(f"loss_aggregation must be one of {AGGREGATIONS}, got {mode!r}.")


def aggregation_count(mask: Tensor, mode: Aggregation) -> Tensor:
    """What ``aggregate`` counts, before any clamp: valid steps for "token-mean", samples with a
    valid step for the "seq-mean-*" modes. Counts of several micro-batches or processes add up;
    clamp the total once (`normaliser_from_count`). Shapes: mask (n, T) bool -> float32 scalar."""
    if mode == "token-mean":
        return torch.count_nonzero(mask).to(torch.float32)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return torch.count_nonzero(mask.any(-1)).to(torch.float32)
    raise _bad(mode)


def normaliser_from_count(count: Tensor, mode: Aggregation, *, constant: float | None = None) -> Tensor:
    """``Z = max(1, count)``, times ``constant`` for "seq-mean-token-sum-norm" (0 / Z = 0 for an
    empty step). ``count`` is `aggregation_count` of the whole optimizer step (summed over its
    micro-batches and processes)."""
    z = count.clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        if constant is None or not constant > 0:
            raise ValueError(
                f"loss_aggregation='seq-mean-token-sum-norm' needs a positive constant normaliser, "
                f"got {constant!r}. Set GRPOConfig(loss_normaliser=...) to the generation budget "
                f"(e.g. max_new_tokens), as Dr. GRPO does."
            )
        return z * float(constant)
    if mode not in AGGREGATIONS:
        raise _bad(mode)
    return z


def aggregation_normaliser(mask: Tensor, mode: Aggregation, *, constant: float | None = None) -> Tensor:
    """``Z``: the number ``aggregate`` divides by, for the rows of one whole optimizer step.

    "token-mean": valid steps; "seq-mean-token-mean" / "seq-mean-token-sum": samples with a valid
    step; "seq-mean-token-sum-norm": those samples times ``constant``. The count is clamped to at
    least 1 (0 / 1 = 0 for an empty step). Shapes: mask (n, T) bool -> float32 scalar.
    """
    if mode == "seq-mean-token-sum-norm":  # the constant is checked before the mode's count
        normaliser_from_count(torch.ones(()), mode, constant=constant)
    return normaliser_from_count(aggregation_count(mask, mode), mode, constant=constant)


def aggregate(values: Tensor, mask: Tensor, mode: Aggregation, normaliser: Tensor | float) -> Tensor:
    """``sum_i w_i sum_t m_it values_it / normaliser`` (see the module docstring for w_i).

    Shapes: values (n, T), mask (n, T) bool or float 0/1 (pass it already in ``values.dtype`` to
    save a conversion), normaliser scalar (from `aggregation_normaliser` over the whole optimizer
    step) -> scalar. Masked-out steps must hold finite values (they are multiplied by 0). The
    masked sums are dot products, so no (n, T) temporary is made besides the gradient.
    """
    m = mask if mask.dtype == values.dtype else mask.to(values.dtype)
    if mode == "seq-mean-token-mean":
        row = (values.unsqueeze(-2) @ m.unsqueeze(-1)).reshape(-1)  # (n,) masked row sums
        return (row / m.sum(-1).clamp(min=1.0)).sum() / normaliser
    if mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return torch.dot(values.reshape(-1), m.reshape(-1)) / normaliser
    raise _bad(mode)
