"""Losses a wing plugs into the update by name, in place of log-probs + `GRPOObjective`.

The core names no such loss and imports none: a wing registers one when it is imported, and
the core looks it up when a config asks for it. Today there is one, ``"liger"``: Liger-Kernel's
fused linear GRPO loss (`grpo.llm.liger`, registered by ``import grpo.llm``), asked for with
``GRPOConfig.use_liger_loss``. What a registered loss is:

* ``problems(config) -> list[str]``: what the config asks for that the loss does not compute,
  each as "setting: why / what to set" (empty: none). `GRPOConfig` validation calls it when the
  loss is registered; otherwise ``build`` checks the same before any weight changes.
* ``build(config, device)``: the loss, an object with the `grpo.update.loop.FusedLoss` methods.

Configs and devices are typed ``Any`` here: this module sits below `grpo.config` in the package
graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["LossPlugin", "loss_plugin", "register_loss_plugin"]


class LossPlugin(NamedTuple):
    """A loss registered by name (see the module docstring)."""

    problems: Callable[[Any], list[str]]
    build: Callable[[Any, Any], Any]


_PLUGINS: dict[str, LossPlugin] = {}


def register_loss_plugin(name: str, plugin: LossPlugin) -> None:
    """Register ``plugin`` under ``name`` (registering a name again replaces it)."""
    _PLUGINS[name] = plugin


def loss_plugin(name: str) -> LossPlugin | None:
    """The loss registered under ``name``, or None when no imported module registered it."""
    return _PLUGINS.get(name)
