"""Install hints for the optional extras: one place that knows the distribution's name.

The package imports as ``grpo``; it is distributed as ``torch-grpo`` (`DIST_NAME`), because the
package index already holds an unrelated ``grpo``, which a hint naming ``grpo`` would install.
Every error that asks for an extra takes its command from `install_hint`, which names the form
that works where the running copy came from:

* installed from the index: ``pip install 'torch-grpo[llm]'``;
* a source checkout (``pyproject.toml`` of ``torch-grpo`` beside the package, e.g. after
  ``pip install -e .``): ``pip install -e '.[llm]'``, run in the checkout.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

__all__ = ["DIST_NAME", "install_hint", "source_checkout"]

DIST_NAME = "torch-grpo"


@lru_cache(maxsize=1)
def source_checkout() -> Path | None:
    """The checkout the running ``grpo`` was imported from (its ``pyproject.toml`` names
    `DIST_NAME`), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]  # grpo/runtime/extras.py -> the checkout
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if re.search(rf'^name\s*=\s*"{re.escape(DIST_NAME)}"', text, re.MULTILINE) else None


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` (``"llm"``, ``"gym"``, ...) for the running copy."""
    checkout = source_checkout()
    if checkout is not None:
        return f"pip install -e '.[{extra}]' (in {checkout})"
    return f"pip install '{DIST_NAME}[{extra}]'"
