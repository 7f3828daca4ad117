"""gymnasium, imported when first needed (the ``gym`` extra), with an error that names the extra."""

from __future__ import annotations

from typing import Any

from grpo.runtime.extras import install_hint

__all__ = ["import_gymnasium"]


def import_gymnasium() -> Any:
    """The ``gymnasium`` module, or ImportError naming the install command of the ``gym`` extra."""
    try:
        import gymnasium
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "grpo.gym.episodes needs gymnasium, which is not installed. Install the extra: "
            f"{install_hint('gym')}"
        ) from e
    return gymnasium
