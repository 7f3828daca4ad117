"""Subnormal floats on CPU: read and write them as zero for the duration of a block.

A float32 below ~1.2e-38 in magnitude (float64: ~2.2e-308) is *subnormal*; x86 and ARM CPUs take
a slow path for arithmetic on them (tens of times slower per operation). They appear in
reinforcement learning when a policy becomes near-deterministic: probabilities ``exp(logp)`` of
the unlikely actions, and the gradients through the softmax, fall below that limit. The setting
is a per-thread CPU flag (x86 MXCSR FTZ/DAZ, set through `torch.set_flush_denormal`); this module
turns it on for a block and puts back what was there before. `GRPOTrainer.step` uses it when
`GRPOConfig.flush_denormals` is True (the default).
"""

from __future__ import annotations

import torch

__all__ = ["flush_denormals_on", "flushing_denormals", "restore_denormals"]

# 1e-300 * 1e-10 = 1e-310 is subnormal in float64: it reads 0.0 exactly when this thread flushes
# subnormals (Python floats run on the same FPU flags as torch's CPU kernels).
_TINY, _SCALE = 1e-300, 1e-10


def flushing_denormals() -> bool:
    """Whether this thread currently flushes subnormal floats to zero."""
    return _TINY * _SCALE == 0.0


def flush_denormals_on() -> bool:
    """Turn flushing on for this thread. Returns True if this call changed the setting (then
    `restore_denormals` must be called), False if it was already on or the CPU cannot flush."""
    if flushing_denormals():
        return False
    return bool(torch.set_flush_denormal(True))


def restore_denormals(changed: bool) -> None:
    """Undo `flush_denormals_on` (``changed`` is what it returned)."""
    if changed:
        torch.set_flush_denormal(False)
