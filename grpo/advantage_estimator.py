"""Group-relative advantages: pure functions of rewards and explicit group ids.

GRPO (Shao et al., 2024, DeepSeekMath) scores each sample against the other samples drawn for the
same state. For sample i of group g with ``n_g`` members:

    mean_g = (1 / n_g) * sum_{j in g} r_j
    std_g  = sqrt( sum_{j in g} (r_j - mean_g)^2 / (n_g - 1) )          (unbiased, as torch.std)
    A_i    = (r_i - mean_g) / (std_g + eps)     if normalize (GRPO)
    A_i    =  r_i - mean_g                      otherwise (seed 002's formula; Dr. GRPO)

Groups are identified by ``group_ids``, never by position, so uneven groups work. Guarantees, by
construction rather than by luck of rounding:

* a group whose rewards are all equal (including a group of one) gets exactly 0 advantage;
* the statistics are computed in float64 with two passes (no ``E[x^2] - E[x]^2`` cancellation),
  so ``|A_i| <= (n_g - 1) / sqrt(n_g)`` holds up to rounding and nothing is NaN or inf for finite
  rewards.

No Python loop over samples or groups runs here: everything is ``index_add_`` / gather.

`AdvantageEstimator` is the composition point the trainer calls: reward clipping, combination of
reward components, baseline / scale (any source, see `grpo.algorithms.advantages`), a KL penalty folded into
the reward, whitening, advantage clipping and the zero-variance-group filter, in that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from grpo.algorithms.advantages import (
    AdvantageBaseline,
    AdvantageNormalisation,
    AdvantageScale,
    RewardCombination,
    RunningMeanStd,
    discounted_returns,
    normalise_scores,
    normalise_step_scores,
    whiten,
)
from grpo.algorithms.kl import kl_return_to_go

if TYPE_CHECKING:
    from grpo.config import GRPOConfig
    from grpo.rollout.batch import ExperienceBatch

__all__ = [
    "AdvantageEstimator",
    "AdvantageFn",
    "AdvantageResult",
    "GroupStats",
    "advantage_dtype",
    "group_advantages",
    "group_stats",
    "uniform_group_ids",
]


class GroupStats(NamedTuple):
    """Per-group statistics, each ``(num_groups,)`` float64 (``size`` int64: members per group)."""

    size: Tensor
    mean: Tensor
    std: Tensor
    zero_std: Tensor  # bool: all rewards in the group are equal (or the group has one member)


def uniform_group_ids(num_groups: int, group_size: int, device: torch.device | str = "cpu") -> Tensor:
    """``[0]*G + [1]*G + ... + [B-1]*G`` as int64 ``(B*G,)``: the group-major layout."""
    return torch.arange(num_groups, device=device).repeat_interleave(group_size)


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length; got rewards "
            f"{tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)}."
        )
    if group_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}.")


def group_stats(rewards: Tensor, group_ids: Tensor, num_groups: int | None = None) -> GroupStats:
    """Count, mean, unbiased std and the all-equal flag of each group, in float64.

    Shapes: rewards (N,), group_ids (N,) with values in ``[0, num_groups)`` -> each (num_groups,).
    ``std`` of a group of one is 0.
    """
    _check(rewards, group_ids)
    ids = group_ids.long()
    k = int(num_groups) if num_groups is not None else (int(ids.max()) + 1 if ids.numel() else 0)
    r = rewards.detach().to(torch.float64)
    count = torch.zeros(k, dtype=torch.int64, device=r.device).index_add_(0, ids, torch.ones_like(ids))
    n = count.to(torch.float64)
    total = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, ids, r)
    mean = total / n.clamp(min=1.0)
    dev = r - mean[ids]
    ss = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, ids, dev * dev)
    std = torch.sqrt(ss / (n - 1.0).clamp(min=1.0))
    rmax = torch.full((k,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce_(
        0, ids, r, reduce="amax"
    )
    rmin = torch.full((k,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce_(
        0, ids, r, reduce="amin"
    )
    return GroupStats(size=count, mean=mean, std=std, zero_std=rmax == rmin)


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    num_groups: int | None = None,
    stats: GroupStats | None = None,
) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) (``normalize``) or r_i - mean_g, for i in group g.

    Shapes: rewards (N,), group_ids (N,) -> advantages (N,) in ``rewards.dtype``.
    A group whose rewards are all equal, or that has one member, gets exactly 0.
    ``stats``: the result of `group_stats` for these inputs, if already computed.
    """
    if stats is None:
        stats = group_stats(rewards, group_ids, num_groups)
    ids = group_ids.long()
    adv = rewards.detach().to(torch.float64) - stats.mean[ids]
    if normalize:
        adv = adv / (stats.std[ids] + eps)
    adv = adv.masked_fill(stats.zero_std[ids], 0.0)
    return adv.to(rewards.dtype if rewards.dtype.is_floating_point else torch.float32)


class AdvantageFn(Protocol):
    """A user advantage function for ``GRPOTrainer(advantage_fn=...)``.

    ``advantage_fn(scores, group_ids, num_groups) -> advantages`` replaces the baseline / scale
    step. ``scores`` is (N,) rewards (after clipping and combination), or (N, T) per-step returns
    when a KL penalty is folded into the reward; return (N,) or (N, T). Reward clipping,
    whitening, advantage clipping and the zero-variance filter still apply as configured.
    """

    def __call__(self, scores: Tensor, group_ids: Tensor, num_groups: int) -> Tensor: ...


def advantage_dtype(weights: Iterable[Tensor]) -> torch.dtype | None:
    """The dtype of the advantages that train ``weights``: float64 when one of them is float64
    (so that a float64 policy's update is computed in float64 throughout), else None (the
    rewards' dtype, float32)."""
    return torch.float64 if any(w.dtype == torch.float64 for w in weights) else None


class AdvantageResult(NamedTuple):
    """``advantages`` (N,) or (N, T) float32 (float64 when asked for); ``keep`` (N,) bool rows
    that stay in the loss (None = all); ``stats``: scalar tensors for the metrics
    (``advantage/frac_dropped_groups``)."""

    advantages: Tensor
    keep: Tensor | None
    stats: dict[str, Tensor]


class AdvantageEstimator:
    """Rewards -> advantages, following the GRPOConfig knobs (docs/algorithms.md).

    Steps, for rewards r (N,), optional components {name: r_k (N,)} with weights w_k, optional
    per-step KL penalty p (N, T) and mask (N, T):

    1. reward clip: r <- clamp(r, -c, c) (each component in "per_component" mode);
    2. scores: "sum": x = r (= sum_k w_k r_k); with a KL penalty, the per-step return
       x_it = r_i - P_it, P_it = sum_{t' >= t} m p_it' (`grpo.algorithms.kl.kl_return_to_go`);
    3. A = (x - b) / d with baseline / scale sources (`grpo.algorithms.advantages.normalise_scores`), or the
       user's ``advantage_fn``; "per_component": A = sum_k w_k normalise(r_k) (- normalise(P)
       for the KL penalty, as its own component);
    4. whiten over valid steps (optional); 5. clip A to [-c, c] (optional);
    6. ``keep``: with ``drop_zero_variance_groups``, rows of groups whose rewards are all equal
       are dropped from the loss (DAPO's dynamic-sampling filter, without resampling).

    With per-step rewards ``(N, T)`` (``step_rewards``), step 2's score of step t is its
    discounted return-to-go (``gamma``) and step 3 normalises across the group at each t
    (`grpo.algorithms.advantages.normalise_step_scores`).

    State: one `RunningMeanStd` per score stream ("reward", each component, "kl_penalty") when a
    source is "running"; ``state_dict()`` / ``load_state_dict()`` for checkpoints.
    """

    def __init__(
        self,
        *,
        baseline: AdvantageBaseline = "group",
        scale: AdvantageScale = "group",
        eps: float = 1e-6,
        reward_clip: float | None = None,
        advantage_clip: float | None = None,
        whiten_advantages: bool = False,
        drop_zero_variance_groups: bool = False,
        reward_combination: RewardCombination = "sum",
        advantage_fn: AdvantageFn | None = None,
        gamma: float = 1.0,
    ) -> None:
        self.gamma = gamma
        self.baseline: AdvantageBaseline = baseline
        self.scale: AdvantageScale = scale
        self.eps = eps
        self.reward_clip = reward_clip
        self.advantage_clip = advantage_clip
        self.whiten_advantages = whiten_advantages
        self.drop_zero_variance_groups = drop_zero_variance_groups
        self.reward_combination: RewardCombination = reward_combination
        self.advantage_fn = advantage_fn
        self.running: dict[str, RunningMeanStd] = {}

    @classmethod
    def from_config(cls, config: GRPOConfig, advantage_fn: AdvantageFn | None = None) -> AdvantageEstimator:
        return cls(
            baseline=config.advantage_baseline,
            scale=config.advantage_scale,
            eps=config.advantage_eps,
            reward_clip=config.reward_clip,
            advantage_clip=config.advantage_clip,
            whiten_advantages=config.whiten_advantages,
            drop_zero_variance_groups=config.drop_zero_variance_groups,
            reward_combination=config.reward_combination,
            advantage_fn=advantage_fn,
            gamma=config.gamma,
        )

    @property
    def normalisation(self) -> AdvantageNormalisation:
        """``A = (x - b) / d``'s sources and eps, as they are now."""
        return AdvantageNormalisation(self.baseline, self.scale, self.eps)

    @property
    def needs_mask(self) -> bool:
        """Whitening counts valid steps, so the trainer must know the mask at advantage time."""
        return self.whiten_advantages

    def _normalise(
        self, name: str, scores: Tensor, group_ids: Tensor, num_groups: int, group_size: int | None
    ) -> Tensor:
        if self.advantage_fn is not None:
            out = self.advantage_fn(scores, group_ids, num_groups)
            n = scores.shape[0]
            if not isinstance(out, Tensor) or out.dim() not in (1, 2) or out.shape[0] != n:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(
                    f"advantage_fn returned {got}; expected a Tensor of shape ({n},) or ({n}, T)."
                )
            return out.detach().to(torch.float64)
        running = None
        if "running" in (self.baseline, self.scale):
            running = self.running.setdefault(name, RunningMeanStd())
        return normalise_scores(
            scores, group_ids, num_groups, self.normalisation, running=running, group_size=group_size
        )

    def _clip_reward(self, r: Tensor) -> Tensor:
        r = r.detach().to(torch.float64)
        return r if self.reward_clip is None else r.clamp(-self.reward_clip, self.reward_clip)

    def of_batch(
        self,
        batch: ExperienceBatch,
        *,
        weights: Mapping[str, float] | None = None,
        kl_penalty: Tensor | None = None,
        dtype: torch.dtype | None = None,
        count_dropped: bool = False,
    ) -> Advantages:
        """The `Advantages` of ``batch`` (its rewards, components, mask, step rewards and group
        layout; see `__call__` for ``weights``, ``kl_penalty`` and ``dtype``) with the step's
        reward statistics (`with_statistics`; ``reward/dropped_groups`` when ``count_dropped``)."""
        result = self(
            batch.rewards,
            batch.group_ids,
            batch.num_groups,
            components=batch.reward_components,
            weights=weights,
            mask=batch.mask,
            kl_penalty=kl_penalty,
            group_size=batch.group_size,
            step_rewards=batch.step_rewards,
            dtype=dtype,
        )
        return with_statistics(
            result,
            batch.rewards,
            batch.group_ids,
            batch.num_groups,
            batch.group_size,
            batch.reward_components,
            batch.dropped_groups if count_dropped else None,
        )

    def __call__(
        self,
        rewards: Tensor,
        group_ids: Tensor,
        num_groups: int,
        *,
        components: Mapping[str, Tensor] | None = None,
        weights: Mapping[str, float] | None = None,
        mask: Tensor | None = None,
        kl_penalty: Tensor | None = None,
        group_size: int | None = None,
        step_rewards: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> AdvantageResult:
        """Advantages of one batch. Shapes: rewards (N,), group_ids (N,), components name ->
        (N,), mask / kl_penalty (N, T) (the penalty already multiplied by beta, no grad).
        ``group_size=G`` declares the collector's uniform group-major layout (a faster path for
        the same numbers); None = groups given by ``group_ids`` alone. ``dtype``: the advantages'
        dtype (they are computed in float64 and rounded once to it); None = the rewards' (float32
        for integer rewards). The trainer passes float64 for a policy with float64 weights, so
        that its update is not computed from advantages rounded to float32.

        ``step_rewards`` (N, T) with ``mask``: per-step credit. The score of step t is its
        return-to-go ``x_it = sum_{t' >= t} gamma^(t'-t) r_it'`` over valid steps (minus the KL
        penalty's return-to-go), normalised across the group at the same t
        (`grpo.algorithms.advantages.normalise_step_scores`); ``rewards`` then only feed the statistics."""
        ids = group_ids.long()
        penalty_rtg = None
        if kl_penalty is not None:
            m = mask if mask is not None else torch.ones_like(kl_penalty, dtype=torch.bool)
            penalty_rtg = kl_return_to_go(kl_penalty.detach().to(torch.float64), m)

        total = self._clip_reward(rewards)
        if step_rewards is not None:
            adv = self._step_advantages(step_rewards, mask, ids, num_groups, penalty_rtg)
        elif self.reward_combination == "per_component" and components:
            adv = self._component_advantages(components, weights, ids, num_groups, group_size, penalty_rtg)
        else:
            scores = total if penalty_rtg is None else total[:, None] - penalty_rtg
            adv = self._normalise("reward", scores, ids, num_groups, group_size)

        if self.whiten_advantages:
            adv = whiten(adv, mask)
        if self.advantage_clip is not None:
            adv = adv.clamp(-self.advantage_clip, self.advantage_clip)
        if adv.dim() == 2 and mask is not None:
            adv = adv.masked_fill(~mask, 0.0)

        keep = None
        stats: dict[str, Tensor] = {}
        if self.drop_zero_variance_groups:
            zero_std = group_stats(total, ids, num_groups).zero_std  # (num_groups,)
            keep = ~zero_std[ids]
            stats["advantage/frac_dropped_groups"] = zero_std.float().mean()
        if dtype is None:
            dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
        return AdvantageResult(adv.to(dtype), keep, stats)

    def _component_advantages(
        self,
        components: Mapping[str, Tensor],
        weights: Mapping[str, float] | None,
        ids: Tensor,
        num_groups: int,
        group_size: int | None,
        penalty_rtg: Tensor | None,
    ) -> Tensor:
        """``sum_k w_k normalise(r_k)`` (- normalise(P) for a KL penalty): (N,) or (N, T)."""
        adv: Tensor | None = None
        for name, comp in components.items():
            w = 1.0 if weights is None else float(weights.get(name, 1.0))
            a = w * self._normalise(name, self._clip_reward(comp), ids, num_groups, group_size)
            adv = a if adv is None else adv + a
        assert adv is not None
        if penalty_rtg is not None:
            a = self._normalise("kl_penalty", -penalty_rtg, ids, num_groups, group_size)
            adv = (adv[:, None] if adv.dim() == 1 else adv) + a
        return adv

    def _step_advantages(
        self,
        step_rewards: Tensor,
        mask: Tensor | None,
        ids: Tensor,
        num_groups: int,
        penalty_rtg: Tensor | None,
    ) -> Tensor:
        """(N, T) advantages of per-step rewards: returns-to-go normalised at each step."""
        if mask is None or mask.shape != step_rewards.shape:
            got = None if mask is None else tuple(mask.shape)
            raise ValueError(
                f"per-step rewards {tuple(step_rewards.shape)} need the policy's step mask of the "
                f"same shape (got {got}): the policy's log-probs must have one entry per rewarded step."
            )
        if self.advantage_fn is not None or self.reward_combination == "per_component":
            raise ValueError(
                "per-step rewards (N, T) cannot be combined with advantage_fn or "
                "reward_combination='per_component'; return one reward per sample (N,) for those."
            )
        scores = discounted_returns(self._clip_reward(step_rewards), mask, self.gamma)
        if penalty_rtg is not None:
            scores = scores - penalty_rtg
        return normalise_step_scores(scores, mask, ids, num_groups, self.normalisation)

    def state_dict(self) -> dict[str, Tensor]:
        """Running statistics as flat ``{"<stream>.<count|mean|m2>": float64 scalar}``."""
        return {f"{name}.{k}": v for name, rs in self.running.items() for k, v in rs.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        streams: dict[str, dict[str, Tensor]] = {}
        for key, value in state.items():
            name, _, field_name = key.rpartition(".")
            if not name:
                raise KeyError(f"AdvantageEstimator state key {key!r} is not '<stream>.<field>'.")
            streams.setdefault(name, {})[field_name] = value
        self.running = {}
        for name, fields in streams.items():
            rs = RunningMeanStd()
            rs.load_state_dict(fields)
            self.running[name] = rs


class Advantages(NamedTuple):
    """One step's advantages and their statistics (what `GRPOTrainer.advantages` returns).

    ``values`` (N,) or (N, T) float32 (float64 for a policy with float64 weights); ``keep`` (N,)
    bool, the rows that enter the loss (None = all); ``names`` / ``stats`` (len(names),) float32:
    reward and advantage metrics (`grpo.metrics`), one vector so that they reach the host in one
    copy.
    """

    values: Tensor
    keep: Tensor | None
    names: tuple[str, ...]
    stats: Tensor

    def metrics(self) -> dict[str, float]:
        """The statistics as floats by name."""
        return dict(zip(self.names, self.stats.tolist(), strict=True))


_REWARD_METRICS = (
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "advantage/mean",
    "advantage/std",
    "advantage/min",
    "advantage/max",
)


def with_statistics(
    result: AdvantageResult,
    rewards: Tensor,
    group_ids: Tensor,
    num_groups: int,
    group_size: int | None,
    components: Mapping[str, Tensor],
    dropped_groups: int | None,
) -> Advantages:
    """`Advantages` of ``result`` with the step's reward and advantage statistics: mean, std
    (unbiased; 0 for one sample), min and max of the N rewards and of the advantages (all (N, T)
    entries when per step), ``reward/frac_zero_std`` (groups whose rewards are all equal), each
    component's mean, the estimator's own statistics, and ``reward/dropped_groups`` when
    ``dropped_groups`` is not None."""
    r, adv = rewards, result.advantages
    if group_size is not None and r.numel() == num_groups * group_size:  # uniform: a (B, G) view
        lo, hi = torch.aminmax(r.view(num_groups, group_size), dim=1)
        zero_std = lo == hi
    else:
        zero_std = group_stats(r, group_ids, num_groups).zero_std
    if adv.shape == r.shape:  # rows of one (2, N) tensor: a few ops for both
        both = torch.stack([r, adv.to(r.dtype)])
        if r.numel() > 1:
            std, mean = torch.std_mean(both, 1)
        else:
            std, mean = both.new_zeros(2), both[:, 0]
        mn, mx = torch.aminmax(both, dim=1)
        parts = [torch.stack([mean, std, mn, mx], 1).view(-1)]  # reward row, then advantage row
    else:
        r_std = r.std() if r.numel() > 1 else r.new_zeros(())
        a_std = adv.std() if adv.numel() > 1 else adv.new_zeros(())
        parts = [torch.stack([r.mean(), r_std, r.min(), r.max(), adv.mean(), a_std, adv.min(), adv.max()])]
    names = [*_REWARD_METRICS, "reward/frac_zero_std"]
    extra = [zero_std.float().mean()]
    for name, comp in components.items():
        names.append(f"reward/{name}/mean")
        extra.append(comp.mean())
    for name, value in result.stats.items():
        names.append(name)
        extra.append(value)
    if dropped_groups is not None:
        names.append("reward/dropped_groups")
        extra.append(torch.full((), float(dropped_groups), device=r.device))
    parts.append(torch.stack([e.float() for e in extra]))
    return Advantages(adv, result.keep, tuple(names), torch.cat([p.float() for p in parts]))
