"""Per-token log-probs and exact entropy of a causal LM, chunked so (B, T, V) logits never exist.

For hidden states ``h`` (n, H) of the positions that predict the target tokens ``y`` (n,) and the
LM head ``W`` (V, H) (+ bias ``b``), with sampling temperature ``tau``::

    z = (h W^T + b) * scale          (optionally soft-capped: z = c * tanh(z / c))
    z = z / tau
    log p(y) = z[y] - logsumexp(z)
    H       = logsumexp(z) - sum_v softmax(z)_v z_v        (exact entropy, nats)

The n rows are processed ``chunk_size`` at a time. With gradients enabled, each chunk runs under
`torch.utils.checkpoint`, so the backward pass recomputes the chunk's (chunk_size, V) logits
instead of keeping every chunk's logits alive: peak extra memory is O(chunk_size * V), not
O(n * V). The values are the same as the naive full-logits computation up to float rounding
(tested to 1e-5 in float32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_token_logprobs", "naive_token_logprobs"]


def _chunk_stats(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    inv_temperature: float,
    logit_scale: float,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """Log-prob of ``targets`` and entropy for one chunk. Shapes: h (c, H), targets (c,) -> (c,), (c,)."""
    logits = F.linear(h, weight, bias)  # (c, V)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax statistics in float32 even for half-precision weights
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if inv_temperature != 1.0:
        logits = logits * inv_temperature
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


class _ChunkedLogProbs(torch.autograd.Function):
    """Log-probs and entropy over row chunks with a hand-written backward.

    Forward keeps only ``lse = logsumexp(z)`` and ``m = E_p[z]`` per row; backward recomputes each
    chunk's logits and forms the gradient w.r.t. the logits in place (two (chunk, V) buffers)::

        d logp / dz = onehot(y) - p          d H / dz = -p * (z - E_p[z])

    then ``grad_h = g_z W * c`` and ``grad_W += g_z^T h * c`` with ``c = logit_scale / tau``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        y: Tensor,
        scale: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = h.shape[0]
        acc = torch.promote_types(h.dtype, torch.float32)
        logp = h.new_empty(n, dtype=acc)
        ent = h.new_zeros(n, dtype=acc)
        lse_all = h.new_empty(n, dtype=acc)
        mean_all = h.new_zeros(n, dtype=acc)
        for s in range(0, n, chunk):
            z = _logits(h[s : s + chunk], weight, bias, scale)
            lse = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(-1, y[s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse
            lse_all[s : s + chunk] = lse
            if with_entropy:
                p = (z - lse.unsqueeze(-1)).exp_()
                m = torch.linalg.vecdot(p, z)  # E_p[z], no (c, V) product buffer
                del p
                mean_all[s : s + chunk] = m
                ent[s : s + chunk] = lse - m
        ctx.save_for_backward(h, weight, bias, y, lse_all, mean_all)
        ctx.scale, ctx.chunk, ctx.with_entropy = scale, chunk, with_entropy
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skipped
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> Any:
        h, weight, bias, y, lse_all, mean_all = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        if g_logp is None:
            g_logp = torch.zeros_like(lse_all)
        use_ent = ctx.with_entropy and g_ent is not None  # no gradient reached the entropy: skip
        scale, chunk = ctx.scale, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(h) if need_h else None
        acc = lse_all.dtype
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b and bias is not None else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s : s + chunk]
            z = _logits(hc, weight, bias, scale)  # (c, V) float32
            p = (z - lse_all[s : s + chunk].unsqueeze(-1)).exp_()
            gl = g_logp[s : s + chunk].unsqueeze(-1).to(z.dtype)
            if use_ent:
                assert g_ent is not None
                # g_z = -g_H * p * (z - m) - g_lp * p  (+ g_lp at the target)
                z.sub_(mean_all[s : s + chunk].unsqueeze(-1)).mul_(p).mul_(
                    -g_ent[s : s + chunk].unsqueeze(-1).to(z.dtype)
                )
                z.sub_(p.mul_(gl))
            else:
                z = p.mul_(-gl)
            del p
            z.scatter_add_(-1, y[s : s + chunk].unsqueeze(-1), gl)
            z.mul_(scale)  # chain rule through z = (h W^T + b) * scale
            if grad_h is not None:
                grad_h[s : s + chunk] = (z.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(z.t(), hc.to(acc))
            if grad_b is not None:
                grad_b.add_(z.sum(0))
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        gb = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, gw, gb, None, None, None, None


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """(c, H) -> (c, V) float32 logits times ``scale`` (= logit_scale / temperature)."""
    z = F.linear(h, weight, bias)
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    return z.mul_(scale) if scale != 1.0 else z


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = 512,
    with_entropy: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    recompute: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` (and exact entropy) from hidden states, ``chunk_size`` rows at a time.

    Shapes: hidden (..., H), weight (V, H), targets (...) int64 -> log_probs (...) float32,
    entropy (...) float32 or None. ``hidden[..., i, :]`` must be the state that predicts
    ``targets[..., i]`` (for a causal LM: the hidden state at position t scores token t + 1).

    Args:
        temperature: logits are divided by it (the sampling temperature, > 0).
        chunk_size: rows (tokens) per chunk; None = all rows at once (the naive computation).
        with_entropy: also return the exact entropy of each row's distribution.
        logit_scale, softcap: model-specific logit transforms (Cohere's ``logit_scale``,
            Gemma 2's ``final_logit_softcapping``), applied before the temperature.
        recompute: checkpoint each chunk so the backward recomputes its logits; default: when
            gradients are enabled and ``hidden`` or ``weight`` requires grad.
    """
    _check_logprob_inputs(hidden, targets, temperature)
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])  # (n, H)
    y = targets.reshape(-1).to(torch.long)
    n = h.shape[0]
    size = n if chunk_size is None or chunk_size >= n else max(1, int(chunk_size))
    if recompute is None:
        recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    inv_t = 1.0 / float(temperature)
    if softcap is None and size < n:
        # Hand-written backward: no per-chunk autograd graph, two (chunk, V) buffers at a time.
        lp_flat, ent_flat = _ChunkedLogProbs.apply(  # type: ignore[no-untyped-call]
            h, weight, bias, y, logit_scale * inv_t, size, with_entropy
        )
        return lp_flat.reshape(lead), (ent_flat.reshape(lead) if with_entropy else None)
    logp, entropy = _autograd_chunks(
        h, weight, bias, y, size, inv_t, logit_scale, softcap, with_entropy, recompute=recompute and size < n
    )
    return logp.reshape(lead), (entropy.reshape(lead) if entropy is not None else None)


def _check_logprob_inputs(hidden: Tensor, targets: Tensor, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(
            f"temperature={temperature!r}: log-probs need a temperature > 0 (greedy decoding has "
            "no density). Use the temperature the completions were sampled at, e.g. 1.0."
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)} but targets {tuple(targets.shape)}; expected "
            "hidden (..., H) and targets (...) with the same leading dimensions."
        )


def _autograd_chunks(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    y: Tensor,
    size: int,
    inv_t: float,
    logit_scale: float,
    softcap: float | None,
    with_entropy: bool,
    *,
    recompute: bool,
) -> tuple[Tensor, Tensor | None]:
    """`_chunk_stats` over ``size`` rows at a time through autograd (checkpointed if ``recompute``):
    log-probs (n,) and entropies (n,) (None when not ``with_entropy``)."""
    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, max(h.shape[0], 1), size):
        hc, yc = h[start : start + size], y[start : start + size]
        if recompute:
            lp, ent = checkpoint(
                _chunk_stats,
                hc,
                weight,
                bias,
                yc,
                inv_t,
                logit_scale,
                softcap,
                with_entropy,
                use_reentrant=False,
            )
        else:
            lp, ent = _chunk_stats(hc, weight, bias, yc, inv_t, logit_scale, softcap, with_entropy)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def naive_token_logprobs(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Reference implementation on full logits: (..., V), (...) -> log_probs (...), entropy (...)."""
    z = (logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
