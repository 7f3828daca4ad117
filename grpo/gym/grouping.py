"""Groups without resets, when the env cannot restore: grouping by nearest start states.

GRPO's group baseline needs the G episodes of a group to start from one state (see
`grpo.gym.episodes`). This module is for the environments that can neither reset to a chosen state
nor save and restore one (a real robot, an external simulator; when the env can restore, prefer the
exact groups of `grpo.gym.snapshots`). `grpo.gym.resets` re-exports both.

`NearestStartPolicy` plays B·G episodes from B·G independent random starts and partitions them into
B groups of G episodes whose *start observations* are close (`group_by_nearest_start`), and
measures after every batch how much of the within-group return spread the remaining start
differences explain (`grouping_stats`, ``policy.last_grouping_stats``; a `StartStateBiasWarning`
when that is too much). See docs/gym_episodes.md, "Groups without resets", for the algorithm, its
cost and the math of the diagnostic.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from grpo.gym.episodes import Episode, EpisodePolicy, env_seeds, episode_returns, run_episodes

__all__ = [
    "NearestStartPolicy",
    "StartStateBiasWarning",
    "group_by_nearest_start",
    "grouping_stats",
]

logger = logging.getLogger(__name__)


class StartStateBiasWarning(UserWarning):
    """`NearestStartPolicy`: start-state differences explain too much of the within-group returns."""


def _as_matrix(x: Tensor | np.ndarray | Sequence[Any], where: str) -> np.ndarray:
    a = x.detach().cpu().double().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{where}: start observations must be (N, d); got shape {a.shape}.")
    if not np.isfinite(a).all():
        raise ValueError(f"{where}: start observations contain NaN or inf.")
    return a


def _standardize(x: np.ndarray) -> np.ndarray:
    """z = (x - mean) / std per column over the batch; constant columns become 0."""
    mean = x.mean(0)
    std = x.std(0)
    keep = std > 1e-12 * (1.0 + np.abs(mean))
    z = np.zeros_like(x)
    z[:, keep] = (x[:, keep] - mean[keep]) / std[keep]
    return z


def _sq_dists(z: np.ndarray) -> np.ndarray:
    sq = (z * z).sum(1)
    d2: np.ndarray = sq[:, None] + sq[None, :] - 2.0 * (z @ z.T)
    np.maximum(d2, 0.0, out=d2)
    np.fill_diagonal(d2, 0.0)
    return d2


def group_by_nearest_start(starts: Tensor | np.ndarray, group_size: int) -> np.ndarray:
    """Partition N episodes into N/G groups of G whose start observations are close.

    Algorithm (greedy, deterministic): standardise each column of ``starts`` over the batch
    (``z = (x - mean) / std``; constant columns are dropped), then repeat until every episode is
    grouped: among the ungrouped episodes take the one farthest from their centroid (an outlier
    picks its neighbours first, before they are taken), and group it with its G-1 nearest ungrouped
    episodes (Euclidean distance in z; ties go to the lower index).

    Cost: ``O(N^2 d)`` time and ``O(N^2)`` memory for the distance matrix, plus ``O(N log N)`` per
    group, i.e. ``O(N^2 (d + log N / G))``: measured 4 ms for N = 256 and 0.4 s for N = 2048
    (d = 4, one CPU core).

    Args:
        starts: ``(N, d)`` start observations (or features of them); N must be a multiple of G.
        group_size: G.

    Returns:
        ``(N // G, G)`` int64 episode indices; row b is group b, its first entry the outlier that
        opened it.
    """
    x = _as_matrix(starts, "group_by_nearest_start")
    n = x.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_by_nearest_start: group_size={group_size!r}, expected an int >= 1.")
    if n == 0 or n % group_size:
        raise ValueError(f"group_by_nearest_start: {n} episodes do not split into groups of {group_size}.")
    z = _standardize(x)
    d2 = _sq_dists(z)
    ungrouped = np.arange(n)
    groups = []
    while ungrouped.size:
        zu = z[ungrouped]
        far = int(ungrouped[np.argmax(((zu - zu.mean(0)) ** 2).sum(1))])
        others = ungrouped[ungrouped != far]
        nearest = others[np.lexsort((others, d2[far, others]))[: group_size - 1]]
        members = np.concatenate(([far], nearest))
        groups.append(members)
        ungrouped = np.setdiff1d(ungrouped, members, assume_unique=True)
    out: np.ndarray = np.stack(groups).astype(np.int64)
    return out


def _check_groups(groups: Any, n: int) -> np.ndarray:
    g = np.asarray(groups)
    if g.ndim != 2 or g.size != n or not np.array_equal(np.sort(g.ravel()), np.arange(n)):
        raise ValueError(
            f"grouping_stats: groups must be a (B, G) array holding every episode index 0..{n - 1} once; "
            f"got shape {g.shape}."
        )
    return g.astype(np.int64)


def grouping_stats(
    starts: Tensor | np.ndarray,
    returns: Tensor | np.ndarray | Sequence[float],
    groups: Any,
    *,
    degree: int | None = None,
) -> dict[str, float]:
    """How far apart the starts of each group are, and how much of the returns that explains.

    Notation: N episodes in B groups of G; ``z_i`` the standardised start observation of episode
    i (as in `group_by_nearest_start`), ``R_i`` its return, ``g(i)`` its group, bars group means.

    * ``start_dist_within`` = mean over the pairs i < j of one group of ``||z_i - z_j||``.
    * ``start_dist_random`` = mean over all pairs i < j of the batch of ``||z_i - z_j||``: what a
      random partition gives in expectation.
    * ``start_dist_ratio`` = within / random: 0 = every group starts from one state (real resets),
      about 1 = groups no better than random.
    * ``start_share`` (the bias diagnostic): the share of the within-group return variance that
      the start observations explain. Features ``phi_i = [z_i, z_i^2]`` (elementwise square, so an
      even dependence like ``|angle|`` is caught; ``phi_i = z_i`` when ``degree=1``). With
      ``R~_i = R_i - Rbar_g(i)`` and ``phi~_i = phi_i - phibar_g(i)``, least squares
      ``beta = argmin sum_i (R~_i - phi~_i beta)^2``, ``SST = sum_i R~_i^2``,
      ``SSR = sum_i (R~_i - phi~_i beta)^2``, ``p = rank(phi~)``:
      ``start_share = clip(1 - (SSR / (N - B - p)) / (SST / (N - B)), 0, 1)``, the adjusted R^2 of
      the within-group (fixed-effects) regression. It estimates
      ``Var_within(f(x)) / Var_within(R)`` for ``f(x)`` = the expected return from start x: the
      share of GRPO's advantage numerator ``R_i - mean_g R`` that is due to where episode i
      started rather than how it acted. 0 when all starts of a group are equal (real resets),
      about 0 when the return does not depend on the start, NaN when ``N - B - p <= 0``.
    * ``start_share_raw``: the same without the degrees-of-freedom correction, ``1 - SSR / SST``.
    * ``start_share_degree``: the degree used, 1 or 2.
    * ``return_std_within`` = ``sqrt(SST / (N - B))``: the pooled within-group std of the returns.
    * ``start_bias_std`` = ``sqrt(start_share) * return_std_within``: the typical size, in return
      units, of the start-state part of ``R_i - mean_g R``.

    Args:
        starts: ``(N, d)`` start observations (or features of them).
        returns: ``(N,)`` episode returns.
        groups: ``(B, G)`` episode indices, a partition of ``range(N)`` (e.g. from
            `group_by_nearest_start`, or ``np.arange(N).reshape(B, G)``).
        degree: 1 (linear in z) or 2 (z and z^2). None: 2 when ``N - B >= 8 d`` (at least four
            within-group degrees of freedom per coefficient), else 1.

    Returns:
        dict of floats with the keys above.
    """
    x = _as_matrix(starts, "grouping_stats")
    n = x.shape[0]
    r = _as_returns(returns, n)
    grp = _check_groups(groups, n)
    z = _standardize(x)
    stats = _start_distances(z, grp)
    degree = _share_degree(degree, n, grp.shape[0], z.shape[1])
    stats.update(_start_share(z, r, grp, degree))
    stats["start_share_degree"] = float(degree)
    return stats


def _as_returns(returns: Tensor | np.ndarray | Sequence[float], n: int) -> np.ndarray:
    """The (N,) float64 returns of `grouping_stats`; N must match the start observations."""
    r = (
        returns.detach().cpu().double().numpy()
        if isinstance(returns, Tensor)
        else np.asarray(returns, dtype=np.float64)
    ).reshape(-1)
    if r.shape[0] != n:
        raise ValueError(f"grouping_stats: {n} start observations but {r.shape[0]} returns.")
    return r


def _start_distances(z: np.ndarray, grp: np.ndarray) -> dict[str, float]:
    """``start_dist_within``, ``start_dist_random`` and their ratio (see `grouping_stats`)."""
    n, g = z.shape[0], grp.shape[1]
    d = np.sqrt(_sq_dists(z))
    iu = np.triu_indices(n, 1)
    random = float(d[iu].mean()) if n > 1 else 0.0
    if g > 1:
        gi, gj = np.triu_indices(g, 1)
        within = float(np.linalg.norm(z[grp[:, gi]] - z[grp[:, gj]], axis=-1).mean())  # exact differences
    else:
        within = 0.0
    ratio = within / random if random > 0 else 0.0
    return {"start_dist_within": within, "start_dist_random": random, "start_dist_ratio": ratio}


def _share_degree(degree: int | None, n: int, b: int, dims: int) -> int:
    """The features' degree: as given (1 or 2), or 2 when ``N - B >= 8 d`` else 1."""
    if degree is None:
        degree = 2 if n - b >= 8 * dims else 1
    if degree not in (1, 2):
        raise ValueError(f"grouping_stats: degree={degree!r}, expected 1, 2 or None.")
    return degree


def _start_share(z: np.ndarray, r: np.ndarray, grp: np.ndarray, degree: int) -> dict[str, float]:
    """The within-group regression of the returns on the start features (see `grouping_stats`)."""
    n, b = z.shape[0], grp.shape[0]
    phi = np.concatenate([z, z * z], 1) if degree == 2 else z  # (N, d * degree)
    zc = phi[grp] - phi[grp].mean(1, keepdims=True)  # (B, G, d * degree)
    rc = r[grp] - r[grp].mean(1, keepdims=True)  # (B, G)
    xw, yw = zc.reshape(n, -1), rc.reshape(n)
    sst = float(yw @ yw)
    dof = n - b
    if sst > 0 and dof > 0:
        beta, _, rank, _ = np.linalg.lstsq(xw, yw, rcond=None)
        resid = yw - xw @ beta
        ssr = float(resid @ resid)
        raw = 1.0 - ssr / sst
        share = (
            float(np.clip(1.0 - (ssr / (dof - rank)) / (sst / dof), 0.0, 1.0)) if dof > rank else float("nan")
        )
    else:
        raw, share = 0.0, 0.0
    std_within = float(np.sqrt(sst / dof)) if dof > 0 else 0.0
    return {
        "start_share": share,
        "start_share_raw": float(np.clip(raw, 0.0, 1.0)),
        "return_std_within": std_within,
        "start_bias_std": float(np.sqrt(share) * std_within) if np.isfinite(share) else float("nan"),
    }


def _episode_seed(state: int, j: int) -> int:
    """Seed of member j of the group drawn for GRPO state ``state``: independent starts."""
    return int(np.random.SeedSequence([state, j]).generate_state(1, np.uint32)[0])


class NearestStartPolicy(EpisodePolicy):
    """`EpisodePolicy` for envs that cannot reset to one state: groups of nearby random starts.

    ``generate_actions(states (B), G)`` plays N = B·G episodes, each from its own random start
    (episode j of state s is reset with the seed ``SeedSequence([s, j])`` draws; ``Episode.seed``
    records it), then partitions them into B groups of G by nearest start observation
    (`group_by_nearest_start`; ``grouping="random"`` keeps the play order instead, i.e. groups of
    independent random starts: the ablation). The B groups are returned in place of the B states,
    so the group advantage compares episodes that started close together. The grouping looks only
    at start observations, never at actions or returns, so the baseline stays independent of each
    episode's own actions given its start.

    After every batch ``last_grouping_stats`` holds `grouping_stats` of the chosen grouping plus
    ``start_share_random`` (the same diagnostic for the play-order grouping of the same batch,
    i.e. what groups of random starts would have had) and ``num_episodes``; log it each step, e.g.
    ``metrics.update({f"grouping/{k}": v for k, v in policy.last_grouping_stats.items()})``. A
    `StartStateBiasWarning` is issued the first time ``start_share`` exceeds ``warn_start_share``
    (once per policy, not every step). `EpisodePolicy`'s ``check_group_reset`` is always False
    here: the starts differ by design.

    Args:
        env: as for `EpisodePolicy`.
        policy: as for `EpisodePolicy`.
        grouping: ``"nearest"`` (default) or ``"random"``.
        start_features: optional map ``(N, obs_dim) -> (N, k)`` float Tensor from start
            observations to the features to group by and diagnose (e.g. an angle from its cos
            and sin, or only the dimensions that matter). Default: the observation itself.
        gamma: discount of the returns in the diagnostic (use the `EpisodeReturn`'s).
        warn_start_share: warn when ``start_share`` is above this (default 0.5: start states
            explain more of the within-group return variance than the actions do; None = never
            warn).
        max_steps: as for `EpisodePolicy`.
        vectorization_mode: as for `EpisodePolicy`.
        env_kwargs: as for `EpisodePolicy`.
    """

    def __init__(
        self,
        env: str | Callable[[], Any],
        policy: nn.Module,
        *,
        grouping: Literal["nearest", "random"] = "nearest",
        start_features: Callable[[Tensor], Tensor] | None = None,
        gamma: float = 1.0,
        warn_start_share: float | None = 0.5,
        max_steps: int | None = None,
        vectorization_mode: str = "sync",
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if grouping not in ("nearest", "random"):
            raise ValueError(f"grouping={grouping!r}: choose 'nearest' or 'random'.")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma={gamma!r}: expected 0 < gamma <= 1.")
        super().__init__(
            env,
            policy,
            max_steps=max_steps,
            vectorization_mode=vectorization_mode,
            check_group_reset=False,
            env_kwargs=env_kwargs,
        )
        self.grouping = grouping
        self.start_features = start_features
        self.gamma = gamma
        self.warn_start_share = warn_start_share
        self.last_grouping_stats: dict[str, float] = {}
        self._warned = False

    def generate_actions(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> list[list[Episode]]:
        """Play B·G episodes from independent starts; return B groups of G nearby starts."""
        seeds = env_seeds(states)
        g = num_actions_per_state
        flat_seeds = [_episode_seed(s, j) for s in seeds for j in range(g)]
        envs = self.vector_envs(len(flat_seeds))
        episodes = run_episodes(self.policy, envs, flat_seeds, max_steps=self.max_steps, **kwargs)
        self.env_steps += int(sum(e.length for e in episodes))
        starts = torch.stack([e.observations[0] for e in episodes])
        if self.start_features is not None:
            starts = self.start_features(starts)
        rewards = torch.stack([e.rewards for e in episodes])
        mask = torch.stack([e.mask for e in episodes])
        returns = episode_returns(rewards, mask, self.gamma)
        play_order = np.arange(len(episodes)).reshape(len(seeds), g)
        groups = group_by_nearest_start(starts, g) if self.grouping == "nearest" else play_order
        stats = grouping_stats(starts, returns, groups)
        stats["start_share_random"] = (
            stats["start_share"]
            if self.grouping == "random"
            else grouping_stats(starts, returns, play_order)["start_share"]
        )
        stats["num_episodes"] = float(len(episodes))
        self.last_grouping_stats = stats
        logger.debug("nearest-start grouping: %s", stats)
        share = stats["start_share"]
        exceeded = self.warn_start_share is not None and np.isfinite(share) and share > self.warn_start_share
        if exceeded and not self._warned:
            self._warned = True
            warnings.warn(
                f"start states explain {share:.0%} of the within-group return variance (> "
                f"warn_start_share={self.warn_start_share}; random groups: "
                f"{stats['start_share_random']:.0%}): GRPO's group baseline is mostly comparing start "
                f"states. Raise batch_size (denser starts), group by fewer/better start_features, or "
                f"restore snapshots (SnapshotReset) if the env allows it. (Warned once; "
                f"policy.last_grouping_stats has the value of every step.)",
                StartStateBiasWarning,
                stacklevel=2,
            )
        return [[episodes[int(i)] for i in row] for row in groups]

    def __deepcopy__(self, memo: dict[int, Any]) -> NearestStartPolicy:
        new = super().__deepcopy__(memo)
        new.__class__ = type(self)  # EpisodePolicy.__deepcopy__ builds an EpisodePolicy
        assert isinstance(new, NearestStartPolicy)
        new.grouping = self.grouping
        new.start_features = self.start_features
        new.gamma = self.gamma
        new.warn_start_share = self.warn_start_share
        new.last_grouping_stats = dict(self.last_grouping_stats)
        new._warned = self._warned
        return new
