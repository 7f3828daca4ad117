"""Lazy imports of the optional LLM dependencies, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from grpo.runtime.extras import install_hint

__all__ = ["require"]


def require(module: str, extra: str = "llm") -> ModuleType:
    """Import ``module`` or raise ImportError naming the install command of ``extra``
    (`grpo.runtime.extras.install_hint`)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"grpo.llm needs the optional package {module.split('.')[0]!r}, which is not installed "
            f"({e}). Install the {extra!r} extra: {install_hint(extra)}"
        ) from e
