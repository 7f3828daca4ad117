"""The default optimizer and gradient-norm clipping, with as few dispatches as torch allows.

On small policies (bandits, control MLPs) a GRPO step is dominated by per-op overhead, not by
arithmetic, so these two pieces matter:

* `default_optimizer`: ``torch.optim.AdamW`` with its fused implementation (one kernel for all
  parameters; on CPU about 3x faster than the foreach one for a 16-64-64-10 MLP) where torch has
  it for the parameters' device, else the foreach implementation. Same update rule either way
  (Loshchilov & Hutter, 2019); results agree to float rounding, not bitwise.
* `clip_grad_norm`: the computation of ``torch.nn.utils.clip_grad_norm_`` (foreach norms, the
  total 2-norm, ``coef = min(1, max_norm / (norm + 1e-6))``, one foreach multiply) without its
  per-call grouping of tensors by device and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["clip_grad_norm", "default_optimizer"]

_FUSED_DEVICES = ("cpu", "cuda")


def default_optimizer(params: Sequence[Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over ``params``: fused when every parameter is a floating-point tensor on one CPU or
    CUDA device, foreach otherwise."""
    devices = {p.device for p in params}
    fused = (
        len(devices) == 1
        and next(iter(devices)).type in _FUSED_DEVICES
        and all(p.dtype.is_floating_point for p in params)
    )
    if fused:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


def clip_grad_norm(params: Sequence[Tensor], max_norm: float | None) -> Tensor:
    """Total 2-norm of the gradients of ``params`` (those that have one); if ``max_norm`` is set,
    scale them in place by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` does.

    Returns the norm before clipping (a float32 scalar on the gradients' device; NaN/inf when a
    gradient is not finite, and then the gradients are left to the caller). With no gradient at
    all it returns 0.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    uniform = len({(g.device, g.dtype) for g in grads}) == 1
    norm: Tensor
    if uniform:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    else:  # mixed devices or dtypes: one norm per tensor, summed on the first device in float32
        dev = grads[0].device
        norm = torch.linalg.vector_norm(torch.stack([g.norm().float().to(dev) for g in grads]))
    if max_norm is not None:
        coef = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
        if uniform:
            torch._foreach_mul_(grads, coef)
        else:
            for g in grads:
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return norm
