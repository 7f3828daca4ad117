"""Old module paths of grpo 0.1 (one flat folder), kept for one release with a DeprecationWarning.

grpo 0.2 moved its modules into subpackages (docs/architecture.md, "The layout"). ``import
grpo.gym_episodes`` still works: `MovedModuleFinder` (installed on ``sys.meta_path`` by ``import
grpo``) answers an old name with the module at its new path (the same module object, so
``grpo.gym_episodes.EpisodePolicy is grpo.gym.episodes.EpisodePolicy``) and warns once per name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "install"]

#: old module path -> new module path (grpo 0.2)
MOVED_MODULES: dict[str, str] = {
    "grpo.adaptive_lr": "grpo.update.adaptive_lr",
    "grpo.advantages": "grpo.algorithms.advantages",
    "grpo.aggregation": "grpo.algorithms.aggregation",
    "grpo.backends": "grpo.engine.backends",
    "grpo.callbacks": "grpo.training.callbacks",
    "grpo.checkpoint": "grpo.state.checkpoint",
    "grpo.deepspeed_engine": "grpo.engine.deepspeed",
    "grpo.denormals": "grpo.runtime.denormals",
    "grpo.distributed": "grpo.engine.distributed",
    "grpo.engine_setup": "grpo.engine.setup",
    "grpo.exploration": "grpo.gym.exploration",
    "grpo.extras": "grpo.runtime.extras",
    "grpo.fsdp_backend": "grpo.engine.fsdp",
    "grpo.guard": "grpo.update.guard",
    "grpo.gym_episodes": "grpo.gym.episodes",
    "grpo.gym_grouping": "grpo.gym.grouping",
    "grpo.gym_resets": "grpo.gym.resets",
    "grpo.gym_snapshots": "grpo.gym.snapshots",
    "grpo.kl": "grpo.algorithms.kl",
    "grpo.lr_schedules": "grpo.engine.lr_schedules",
    "grpo.metric_sinks": "grpo.metrics.sinks",
    "grpo.optim": "grpo.engine.optim",
    "grpo.plotting": "grpo.metrics.plotting",
    "grpo.policy_losses": "grpo.algorithms.policy_losses",
    "grpo.recipes": "grpo.algorithms.recipes",
    "grpo.reward_guard": "grpo.rollout.reward_guard",
    "grpo.reward_shift": "grpo.training.reward_shift",
    "grpo.rollback": "grpo.update.rollback",
    "grpo.stall_watch": "grpo.training.stall_watch",
    "grpo.state_checks": "grpo.state.checks",
    "grpo.threads": "grpo.runtime.threads",
    "grpo.trainer_state": "grpo.state.trainer_state",
    "grpo.training_loop": "grpo.training.loop",
    "grpo.update_plan": "grpo.update.plan",
}


def deprecation(old: str, new: str) -> str:
    return f"{old} moved to {new} in grpo 0.2; import it from there ({old} goes in the next release)."


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the already imported module at its new path."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        return None


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of `MOVED_MODULES` (and only those)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        warnings.warn(deprecation(fullname, new), DeprecationWarning, stacklevel=2)  # skips importlib
        module = importlib.import_module(new)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module))


def install() -> None:
    """Put one `MovedModuleFinder` on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
