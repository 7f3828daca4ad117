"""The default optimizer and gradient clipping agree with torch's reference implementations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from grpo.engine.optim import clip_coefficient, clip_grad_norm, default_optimizer


def _grads(seed: int, scale: float) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in [(5, 3), (3,), (7,)]]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm: float | None) -> None:
    ours, ref = _grads(0, 3.0), _grads(0, 3.0)
    norm = clip_grad_norm(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, math.inf if max_norm is None else max_norm)
    expected = math.sqrt(sum(float((p.grad**2).sum()) for p in _grads(0, 3.0)))  # type: ignore[operator]
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    for a, b in zip(ours, ref, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if max_norm == 0.5:
        total = math.sqrt(sum(float((p.grad**2).sum()) for p in ours))  # type: ignore[operator]
        assert total == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_clipped_gradients_are_bitwise_torchs(dtype: torch.dtype) -> None:
    # the coefficient is computed on the host from the norm's value (clip_coefficient); it must
    # round exactly as torch's tensor arithmetic does, over many scales and max norms
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        scale = float(10 ** torch.empty(()).uniform_(-4, 4, generator=g))
        max_norm = float(10 ** torch.empty(()).uniform_(-3, 3, generator=g))
        shapes = [(7, 5), (5,), (3, 2)]
        grads = [(scale * torch.randn(s, generator=g)).to(dtype) for s in shapes]
        ours = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        ref = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        for p, q, gr in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        norm = clip_grad_norm(ours, max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        assert norm.dtype == ref_norm.dtype
        assert float(norm) == float(ref_norm), trial
        for p, q in zip(ours, ref, strict=True):
            assert torch.equal(p.grad, q.grad), (trial, scale, max_norm)  # type: ignore[arg-type]


def test_clip_coefficient_by_hand() -> None:
    assert clip_coefficient(0.5, 1.0, torch.float32) == 1.0  # below the max: no scaling
    assert clip_coefficient(4.0, 1.0, torch.float64) == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-15)
    assert clip_coefficient(4.0, 1.0, torch.float32) == pytest.approx(0.25, rel=1e-6)


def test_clip_grad_norm_skips_missing_grads_and_reports_nan() -> None:
    params = _grads(1, 1.0)
    params[1].grad = None
    expected = math.sqrt(float((params[0].grad ** 2).sum() + (params[2].grad ** 2).sum()))  # type: ignore[operator]
    assert float(clip_grad_norm(params, None)) == pytest.approx(expected, rel=1e-6)
    assert float(clip_grad_norm([nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradient at all
    params[0].grad[0, 0] = float("nan")  # type: ignore[index]
    assert math.isnan(float(clip_grad_norm(params, 1.0)))


def test_clip_grad_norm_mixed_dtypes() -> None:
    a = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    b = nn.Parameter(torch.zeros(4))
    a.grad = torch.full((3,), 2.0, dtype=torch.float64)
    b.grad = torch.full((4,), 1.0)
    norm = clip_grad_norm([a, b], 1.0)
    assert float(norm) == pytest.approx(math.sqrt(12 + 4), rel=1e-6)
    assert a.grad.dtype == torch.float64
    total = math.sqrt(float((a.grad**2).sum()) + float((b.grad**2).sum()))
    assert total == pytest.approx(1.0, rel=1e-5)


def test_default_optimizer_is_fused_on_cpu_and_matches_foreach() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.load_state_dict(net.state_dict())
    opt = default_optimizer(list(net.parameters()), 1e-2, 0.01)
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=True)
    x = torch.randn(16, 4)
    for _ in range(5):
        for model, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_default_optimizer_falls_back_to_foreach_without_a_fused_kernel() -> None:
    params = [nn.Parameter(torch.zeros(2, device="meta"))]  # no fused AdamW for this device
    opt = default_optimizer(params, 1e-3, 0.0)
    assert not opt.defaults["fused"]
    assert opt.defaults["foreach"] is True
