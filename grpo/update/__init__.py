"""Step 3, the update: the loop over optimizer steps and what protects it.

* `grpo.update.loop`: forwards, objective, backward passes, optimizer steps (`run_update`)
* `grpo.update.plan`: epochs x whole-group optimizer steps x micro-batches, decided once per batch
* `grpo.update.guard`: an update that raises or goes non-finite is undone
* `grpo.update.rollback`: copies of the weights and optimizer state, restored bitwise
* `grpo.update.adaptive_lr`: the learning rate that keeps each optimizer step's KL near a target
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """``from grpo.update import run_update`` (grpo 0.1's module, now `grpo.update.loop`) still
    works for one release, with a DeprecationWarning."""
    import importlib
    import warnings

    from grpo.runtime.moved_modules import deprecation

    loop = importlib.import_module("grpo.update.loop")
    if name not in loop.__all__:
        raise AttributeError(f"module 'grpo.update' has no attribute {name!r}")
    warnings.warn(
        deprecation(f"grpo.update.{name}", f"grpo.update.loop.{name}"), DeprecationWarning, stacklevel=2
    )
    return getattr(loop, name)
