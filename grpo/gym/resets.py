"""Groups without resets: which tool when `env.reset(seed=s)` cannot give a group one start state.

GRPO's group baseline needs the G episodes of a group to start from one state (see
`grpo.gym.episodes`). `EpisodePolicy` gets that from ``env.reset(seed=s)``. For environments where
that is not possible there are two tools, in two modules; this module re-exports the public names of
both (``from grpo.gym.resets import SnapshotReset, NearestStartPolicy`` works):

* `grpo.gym.snapshots`, **the env can save and restore its state** (any simulator): `snapshot` /
  `restore` capture and set the full simulator state, and the `SnapshotReset` wrapper's
  ``reset(seed=i)`` restores snapshot i of a `SnapshotStore` (`SnapshotError` when no exact method
  applies or the replay check fails). The groups are exact: every episode of a group starts from
  the same state. States reached any way (a long-running simulation, a scripted curriculum, a
  recorded demonstration) become GRPO states, so it is also worth using when ``reset`` does work.
* `grpo.gym.grouping`, **the env cannot restore** (a real robot, an external simulator):
  `NearestStartPolicy` plays B·G episodes from independent random starts and groups those whose
  start observations are close (`group_by_nearest_start`). The groups are approximate: after every
  batch `grouping_stats` measures how much of the within-group return spread the remaining start
  differences explain (``start_share``; a `StartStateBiasWarning` when it is high).

Prefer, in order: seeded resets (`EpisodePolicy`; `grpo.gym.seeded_starts.SeededStarts` for an env
whose reset ignores its seed), then snapshots (exact groups), then
nearest-start groups (approximate; watch ``start_share``), and when ``start_share`` stays high a
learned value baseline instead of GRPO's group mean. See docs/gym_episodes.md, "Groups without
resets". Importing this module does not import gymnasium.
"""

from __future__ import annotations

from grpo.gym.grouping import (
    NearestStartPolicy,
    StartStateBiasWarning,
    group_by_nearest_start,
    grouping_stats,
)
from grpo.gym.snapshots import (
    Snapshot,
    SnapshotError,
    SnapshotReset,
    SnapshotStore,
    restore,
    snapshot,
)
from grpo.gym.snapshots import SnapshotMethod as SnapshotMethod

__all__ = [
    "NearestStartPolicy",
    "Snapshot",
    "SnapshotError",
    "SnapshotReset",
    "SnapshotStore",
    "StartStateBiasWarning",
    "group_by_nearest_start",
    "grouping_stats",
    "restore",
    "snapshot",
]
