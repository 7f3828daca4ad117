"""Advantage variants: pure functions of rewards, plus `RunningMeanStd`, the one piece of state.

A sample's advantage is an affine function of its score ``x_i`` (its reward, or per step its
return when a KL penalty is folded into the reward):

    A_i = (x_i - b_i) / d_i

with a baseline ``b_i`` and a divisor ``d_i`` chosen independently (ROLL's ``norm_mean_type`` /
``norm_std_type``). For sample i of group g with n_g members, over a batch of N samples:

    baseline ("mean source")                  divisor ("std source")
    "group"          mean_g(x)        (GRPO)  "group"    std_g(x) + eps      (GRPO)
    "leave_one_out"  (sum_g x - x_i)/(n_g-1)  "batch"    std(x) + eps over the batch
                                      (RLOO)  "running"  std over all steps so far + eps
    "batch"          mean(x) over the batch   "none"     1                   (Dr. GRPO)
    "running"        mean over all steps so far
    "none"           0

std is the unbiased standard deviation (as torch.std). Rules that hold by construction:

* a group whose scores are all equal (including a group of one) gets exactly 0 whenever the
  baseline is "group" or "leave_one_out", or the divisor is "group" (its std is 0 or undefined);
  a singleton group never gets its raw reward as advantage under those sources;
* statistics are float64, two-pass (no E[x^2] - E[x]^2 cancellation);
* "running" statistics (`RunningMeanStd`) are updated with the current batch first, then used.

No Python loop over samples or groups: everything is index_add_ / gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_BASELINES",
    "ADVANTAGE_SCALES",
    "REWARD_COMBINATIONS",
    "AdvantageBaseline",
    "AdvantageNormalisation",
    "AdvantageScale",
    "RewardCombination",
    "RunningMeanStd",
    "affine_terms",
    "discounted_returns",
    "normalise_scores",
    "normalise_step_scores",
    "per_step_group_advantages",
    "whiten",
]

AdvantageBaseline = Literal["group", "leave_one_out", "batch", "running", "none"]
AdvantageScale = Literal["group", "batch", "running", "none"]
RewardCombination = Literal["sum", "per_component"]
ADVANTAGE_BASELINES: tuple[str, ...] = ("group", "leave_one_out", "batch", "running", "none")
ADVANTAGE_SCALES: tuple[str, ...] = ("group", "batch", "running", "none")


class AdvantageNormalisation(NamedTuple):
    """How scores ``x`` become advantages ``A = (x - b) / d`` (`GRPOConfig`'s
    ``advantage_baseline``, ``advantage_scale``, ``advantage_eps``).

    Attributes:
        baseline: the source of ``b``, one of `ADVANTAGE_BASELINES`.
        scale: the source of the std in ``d = std + eps`` (``d = 1`` for "none"), one of
            `ADVANTAGE_SCALES`.
        eps: added to the std.
    """

    baseline: AdvantageBaseline = "group"
    scale: AdvantageScale = "group"
    eps: float = 1e-6


_GRPO_NORMALISATION = AdvantageNormalisation()  # GRPO's: (x - group mean) / (group std + 1e-6)


REWARD_COMBINATIONS: tuple[str, ...] = ("sum", "per_component")


class RunningMeanStd:
    """Count, mean and sum of squared deviations of every value seen, in float64.

    `update` merges a batch exactly (Chan et al. parallel formula), so the result does not depend
    on how the data was split into steps. ``state_dict()`` holds three float64 scalar tensors, for
    checkpoints (safetensors-friendly).
    """

    def __init__(self) -> None:
        self.count = torch.zeros((), dtype=torch.float64)
        self.mean = torch.zeros((), dtype=torch.float64)
        self.m2 = torch.zeros((), dtype=torch.float64)

    def update(self, values: Tensor) -> None:
        """Merge ``values`` (any shape; every element counts once)."""
        x = values.detach().to(torch.float64).flatten().cpu()
        n = float(x.numel())
        if n == 0:
            return
        mean_b = x.mean()
        m2_b = ((x - mean_b) ** 2).sum()
        total = self.count + n
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2_b + delta * delta * (self.count * n / total)
        self.count = total

    @property
    def std(self) -> Tensor:
        """Unbiased standard deviation of everything seen (0 before two values)."""
        return torch.sqrt(self.m2 / (self.count - 1.0).clamp(min=1.0))

    def state_dict(self) -> dict[str, Tensor]:
        return {"count": self.count.clone(), "mean": self.mean.clone(), "m2": self.m2.clone()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise KeyError(f"RunningMeanStd state is missing {sorted(missing)}; got keys {sorted(state)}.")
        self.count, self.mean, self.m2 = (
            torch.as_tensor(state[k], dtype=torch.float64).clone().reshape(())
            for k in ("count", "mean", "m2")
        )

    def __repr__(self) -> str:
        return (
            f"RunningMeanStd(count={float(self.count):g}, mean={float(self.mean):g}, std={float(self.std):g})"
        )


class AffineTerms(NamedTuple):
    """Per-sample terms of ``A_i = (x_i - baseline_i) / divisor_i``; ``zero`` forces A_i = 0."""

    baseline: Tensor  # (N,) float64
    divisor: Tensor  # (N,) float64
    zero: Tensor  # (N,) bool


class _GroupSums(NamedTuple):
    """The statistics of each of the k groups that the baselines and divisors read."""

    members: Tensor  # (k,) float64, the number of members
    total: Tensor  # (k,) float64, sum of the scores
    mean: Tensor  # (k,) float64 (0 for an empty group)
    all_equal: Tensor  # (k,) bool, every member's score is the same


def _group_sums(x: Tensor, ids: Tensor, k: int, group_size: int | None = None) -> _GroupSums:
    """count, sum, mean and all-equal flag of each group, float64; x (N,) float64.

    ``group_size=G`` declares the group-major layout ``ids == arange(k).repeat_interleave(G)``
    (what the collector builds): the same numbers are then computed on the ``(k, G)`` view.
    """
    if group_size is not None and x.numel() == k * group_size:
        xv = x.view(k, group_size)
        total = xv.sum(1)
        xmin, xmax = torch.aminmax(xv, dim=1)
        count = torch.full((k,), float(group_size), dtype=torch.float64, device=x.device)
        return _GroupSums(count, total, total / group_size, xmax == xmin)
    count = torch.zeros(k, dtype=torch.float64, device=x.device).index_add_(0, ids, torch.ones_like(x))
    total = torch.zeros(k, dtype=torch.float64, device=x.device).index_add_(0, ids, x)
    mean = total / count.clamp(min=1.0)
    xmax = torch.full((k,), -torch.inf, dtype=torch.float64, device=x.device).scatter_reduce_(
        0, ids, x, reduce="amax"
    )
    xmin = torch.full((k,), torch.inf, dtype=torch.float64, device=x.device).scatter_reduce_(
        0, ids, x, reduce="amin"
    )
    return _GroupSums(count, total, mean, xmax == xmin)


def affine_terms(
    scores: Tensor,
    group_ids: Tensor,
    num_groups: int,
    normalisation: AdvantageNormalisation = _GRPO_NORMALISATION,
    *,
    running: RunningMeanStd | None = None,
    group_size: int | None = None,
) -> AffineTerms:
    """Baseline and divisor of each sample from the sample scores (module docstring).

    Shapes: scores (N,), group_ids (N,) int -> each (N,). ``running`` is required (and updated with
    ``scores`` first) when either source of ``normalisation`` is "running".
    """
    baseline, scale, eps = normalisation
    if baseline not in ADVANTAGE_BASELINES:
        raise ValueError(f"advantage_baseline must be one of {ADVANTAGE_BASELINES}, got {baseline!r}.")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage_scale must be one of {ADVANTAGE_SCALES}, got {scale!r}.")
    x = scores.detach().to(torch.float64)
    ids = group_ids.long()
    sums = _group_sums(x, ids, num_groups, group_size)
    zero = torch.zeros_like(x, dtype=torch.bool)
    if "running" in (baseline, scale):
        if running is None:
            raise ValueError("running statistics were requested but no RunningMeanStd was given.")
        running.update(x)
    b = _baseline_terms(baseline, x, ids, sums, running)
    if baseline in ("group", "leave_one_out"):
        zero = zero | sums.all_equal[ids]  # leave_one_out: includes groups of one, nothing to leave out
    d = _divisor_terms(scale, x, ids, sums, group_size, eps, running)
    if scale == "group":
        zero = zero | sums.all_equal[ids]
    return AffineTerms(b, d, zero)


def _baseline_terms(
    baseline: AdvantageBaseline,
    x: Tensor,
    ids: Tensor,
    sums: _GroupSums,
    running: RunningMeanStd | None,
) -> Tensor:
    """``b_i`` of `affine_terms` from the group sums (`_group_sums`) or the running statistics."""
    if baseline == "group":
        return sums.mean[ids]
    if baseline == "leave_one_out":
        return (sums.total[ids] - x) / (sums.members[ids] - 1.0).clamp(min=1.0)
    if baseline == "batch":
        return x.mean().expand_as(x)
    if baseline == "running":
        assert running is not None
        return running.mean.to(x.device).expand_as(x)
    return torch.zeros_like(x)


def _divisor_terms(
    scale: AdvantageScale,
    x: Tensor,
    ids: Tensor,
    sums: _GroupSums,
    group_size: int | None,
    eps: float,
    running: RunningMeanStd | None,
) -> Tensor:
    """``d_i`` of `affine_terms`: the group, batch or running std plus ``eps``, or 1."""
    if scale == "group":
        count, num_groups = sums.members, sums.members.shape[0]
        dev = x - sums.mean[ids]
        if group_size is not None and x.numel() == num_groups * group_size:
            ss = (dev * dev).view(num_groups, group_size).sum(1)
        else:
            ss = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, ids, dev * dev)
        std = torch.sqrt(ss / (count - 1.0).clamp(min=1.0))
        return std[ids] + eps
    if scale == "batch":
        std_b = x.std() if x.numel() > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
        return (std_b + eps).expand_as(x)
    if scale == "running":
        assert running is not None
        return (running.std.to(x.device) + eps).expand_as(x)
    return torch.ones_like(x)


def normalise_scores(
    scores: Tensor,
    group_ids: Tensor,
    num_groups: int,
    normalisation: AdvantageNormalisation = _GRPO_NORMALISATION,
    *,
    running: RunningMeanStd | None = None,
    group_size: int | None = None,
) -> Tensor:
    """``A = (x - b) / d`` for scores ``x`` of shape (N,) or per step (N, T), in float64.

    For (N, T) scores (per-step returns) the baseline and divisor come from the sample scores
    ``x[:, 0]`` (each sample's whole return) and are applied to every step.
    """
    baseline, scale, eps = normalisation
    x = scores.detach().to(torch.float64)
    uniform = group_size is not None and x.dim() == 1 and x.numel() == num_groups * group_size
    if uniform and baseline == "group" and scale in ("group", "none"):
        assert group_size is not None
        return _group_normalise(x.view(num_groups, group_size), scale == "group", eps).view(-1)
    x0 = x if x.dim() == 1 else x[:, 0]
    terms = affine_terms(x0, group_ids, num_groups, normalisation, running=running, group_size=group_size)
    if x.dim() == 1:
        adv = (x - terms.baseline) / terms.divisor
        return adv.masked_fill(terms.zero, 0.0)
    adv = (x - terms.baseline[:, None]) / terms.divisor[:, None]
    return adv.masked_fill(terms.zero[:, None], 0.0)


def _group_normalise(xv: Tensor, scale: bool, eps: float) -> Tensor:
    """GRPO's default on the uniform group-major layout, (k, G) float64 -> (k, G): the numbers of
    `affine_terms` with baseline "group" and scale "group" (or "none"), in fewer ops."""
    lo, hi = torch.aminmax(xv, dim=1, keepdim=True)
    if scale:
        if xv.shape[1] > 1:
            std, mean = torch.std_mean(xv, 1, keepdim=True)  # unbiased std, as torch.std
        else:  # one member: std 0 (the unbiased estimate would be NaN); the advantage is 0 anyway
            std, mean = torch.zeros_like(xv), xv
        dev = (xv - mean).div_(std.add_(eps))
    else:
        dev = xv - xv.mean(1, keepdim=True)
    return dev.masked_fill_(lo == hi, 0.0)


def whiten(advantages: Tensor, mask: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """``(A - mean) / (std + eps)`` with mean and unbiased std over the valid steps of the batch.

    Shapes: advantages (N,) with mask (N, T) — each sample counts once per valid step — or
    advantages (N, T) with mask (N, T) (invalid steps set to 0), or mask None (every entry counts).
    """
    a = advantages.to(torch.float64)
    if mask is None:
        w = torch.ones_like(a)
    elif a.dim() == 1:
        w = mask.sum(-1).to(torch.float64)
    else:
        w = mask.to(torch.float64)
    total = w.sum().clamp(min=1.0)
    mean = (w * a).sum() / total
    var = (w * (a - mean) ** 2).sum() / (total - 1.0).clamp(min=1.0)
    out = (a - mean) / (var.sqrt() + eps)
    if a.dim() == 2 and mask is not None:
        out = out.masked_fill(~mask, 0.0)
    return out


# ---- per-step credit (rewards per step, (N, T)) ----------------------------------------------------
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Returns-to-go ``G_t = r_t + gamma * G_{t+1}`` over each sample's valid steps.

    Shapes: rewards (N, T) float, mask (N, T) bool -> (N, T) float64; 0 on invalid steps.
    Invalid steps carry no reward and are skipped (a masked step between two valid ones passes
    the return on undiscounted: steps are counted on the mask). ``gamma`` in [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}.")
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must both be (N, T).")
    r = rewards.detach().to(torch.float64) * mask
    m = mask.to(torch.float64)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):  # a loop over time (T), never over samples
        # a valid step discounts what follows it; an invalid one passes it on unchanged
        running = r[:, t] + torch.where(m[:, t] > 0, gamma * running, running)
        out[:, t] = running
    return out * m


def per_step_group_advantages(
    returns: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    num_groups: int,
    *,
    scale: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages per time step: ``A_it = (G_it - mean_g,t) / (std_g,t + eps)``
    with the mean and (unbiased) std over the members of group g that have step t valid: a
    time-dependent group baseline when a group's members start from one state.

    Shapes: returns (N, T), mask (N, T) bool, group_ids (N,) -> (N, T) float64; 0 on invalid
    steps, and 0 where fewer than two members of the group reach step t or they all have the
    same return. ``scale=False`` subtracts the mean only.
    """
    x = returns.detach().to(torch.float64)
    m = mask.to(torch.float64)
    ids = group_ids.long()
    k, t = num_groups, x.shape[1]
    count = torch.zeros(k, t, dtype=torch.float64, device=x.device).index_add_(0, ids, m)
    total = torch.zeros(k, t, dtype=torch.float64, device=x.device).index_add_(0, ids, x * m)
    mean = total / count.clamp(min=1.0)
    dev = (x - mean[ids]) * m
    ss = torch.zeros(k, t, dtype=torch.float64, device=x.device).index_add_(0, ids, dev * dev)
    std = torch.sqrt(ss / (count - 1.0).clamp(min=1.0))
    hi = torch.full((k, t), -torch.inf, dtype=torch.float64, device=x.device)
    lo = torch.full((k, t), torch.inf, dtype=torch.float64, device=x.device)
    hi = hi.scatter_reduce(0, ids[:, None].expand_as(x), x.masked_fill(~mask, -torch.inf), reduce="amax")
    lo = lo.scatter_reduce(0, ids[:, None].expand_as(x), x.masked_fill(~mask, torch.inf), reduce="amin")
    degenerate = (count < 2) | (hi == lo)
    adv = dev / (std[ids] + eps) if scale else dev
    return adv.masked_fill(degenerate[ids] | ~mask, 0.0)


STEP_BASELINES: tuple[str, ...] = ("group", "none")
STEP_SCALES: tuple[str, ...] = ("group", "batch", "none")


def normalise_step_scores(
    scores: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    num_groups: int,
    normalisation: AdvantageNormalisation = _GRPO_NORMALISATION,
) -> Tensor:
    """Advantages of per-step scores (returns-to-go) ``x_it``: ``A_it = (x_it - b_it) / d_it``.

    ``normalisation.baseline``: "group" = the mean of x at step t over the members of the group that reach t
    (a time-dependent group baseline), "none" = 0. ``normalisation.scale``: "group" = their std at step t
    (`per_step_group_advantages`), "batch" = the std of ``x - b`` over all valid steps of the
    batch, "none" = 1. Shapes: scores (N, T), mask (N, T) bool, group_ids (N,) -> (N, T) float64,
    0 on invalid steps. Raises ValueError for other sources (they describe one score per sample).
    """
    baseline, scale, eps = normalisation
    if baseline not in STEP_BASELINES or scale not in STEP_SCALES:
        raise ValueError(
            f"per-step rewards support advantage_baseline in {STEP_BASELINES} and advantage_scale in "
            f"{STEP_SCALES}; got advantage_baseline={baseline!r}, advantage_scale={scale!r}. Return one "
            f"reward per sample (N,) to use the others."
        )
    x = scores.detach().to(torch.float64)
    if baseline == "group" and scale == "group":
        return per_step_group_advantages(x, mask, group_ids, num_groups, scale=True, eps=eps)
    if baseline == "group":
        dev = per_step_group_advantages(x, mask, group_ids, num_groups, scale=False)
    else:
        dev = x * mask
    if scale == "batch":
        n = mask.sum().to(torch.float64)
        mean = dev.sum() / n.clamp(min=1.0)
        std = torch.sqrt(((dev - mean) * mask).pow(2).sum() / (n - 1.0).clamp(min=1.0))
        dev = dev / (std + eps)
    return dev.masked_fill(~mask, 0.0)
