"""Gymnasium environments as GRPO tasks (the ``gym`` extra; gymnasium is imported lazily).

* `grpo.gym.episodes`: whole episodes as actions (`EpisodePolicy`, `EpisodeRewards`, `run_episodes`)
* `grpo.gym.vector_env`: any gymnasium vector env as an `grpo.envs.Environment`
* `grpo.gym.gymnasium_lib`: gymnasium imported when first needed
* `grpo.gym.resets`: which tool when ``env.reset(seed=s)`` cannot give a group one start state
* `grpo.gym.snapshots`: groups from saved and restored simulator states
* `grpo.gym.branching`: groups of short continuations from states along the policy's trajectories
* `grpo.gym.grouping`: groups by nearest start states, when the env cannot restore
* `grpo.gym.seeded_starts`: ``reset(seed=s)`` gives start s for envs that ignore the seed (MetaWorld)
* `grpo.gym.success`: the env's ``info["success"]`` as the reward, the end of an episode, a metric
* `grpo.gym.exploration`: an exploration bonus for tasks where every group fails
"""

from grpo.gym.episodes import (
    Episode,
    EpisodeEvaluation,
    EpisodePolicy,
    EpisodeReturn,
    EpisodeRewards,
    episode_returns,
    evaluate_episodes,
    evaluate_policy,
    run_episodes,
)
from grpo.gym.exploration import EpisodeSpread
from grpo.gym.grouping import (
    NearestStartPolicy,
    StartStateBiasWarning,
    group_by_nearest_start,
    grouping_stats,
)
from grpo.gym.seeded_starts import SeededStarts, make_metaworld
from grpo.gym.snapshots import Snapshot, SnapshotError, SnapshotReset, SnapshotStore, restore, snapshot
from grpo.gym.success import EndOnSuccess, EpisodeSuccess, LengthBiasWarning

__all__ = [
    "EndOnSuccess",
    "Episode",
    "EpisodeEvaluation",
    "EpisodePolicy",
    "EpisodeReturn",
    "EpisodeRewards",
    "EpisodeSpread",
    "EpisodeSuccess",
    "LengthBiasWarning",
    "NearestStartPolicy",
    "SeededStarts",
    "Snapshot",
    "SnapshotError",
    "SnapshotReset",
    "SnapshotStore",
    "StartStateBiasWarning",
    "episode_returns",
    "evaluate_episodes",
    "evaluate_policy",
    "group_by_nearest_start",
    "grouping_stats",
    "make_metaworld",
    "restore",
    "run_episodes",
    "snapshot",
]
