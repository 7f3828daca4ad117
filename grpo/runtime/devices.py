"""Devices: whether two `torch.device` values name the same device."""

from __future__ import annotations

import torch

__all__ = ["same_device"]


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when ``a`` is ``b`` (``cuda`` matches any ``cuda:N``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
