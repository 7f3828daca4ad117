"""Per-token log-probs and exact entropy of a causal LM, chunked so (B, T, V) logits never exist.

For hidden states ``h`` (n, H) of the positions that predict the target tokens ``y`` (n,) and the
LM head ``W`` (V, H) (+ bias ``b``), with sampling temperature ``tau``::

    z = (h W^T + b) * scale          (optionally soft-capped: z = c * tanh(z / c))
    z = z / tau
    log p(y) = z[y] - logsumexp(z)
    H       = logsumexp(z) - sum_v softmax(z)_v z_v        (exact entropy, nats)

The n rows are processed ``chunk_size`` at a time. The forward keeps two numbers per row
(logsumexp and E_p[z]); the hand-written backward recomputes each chunk's (chunk_size, V) logits
instead of keeping every chunk's logits alive: peak extra memory is O(chunk_size * V), not
O(n * V). Each chunk needs one (chunk_size, V) float32 buffer (the logsumexp runs in place, the
entropy is summed over vocabulary blocks), two in a backward that differentiates the entropy.
(Soft-capped logits take an autograd path with `torch.utils.checkpoint` per chunk.) The values are
the same as the naive full-logits computation up to float rounding (tested to 1e-5 in float32).

``compiled=True`` runs the per-chunk work of the hand-written path (the LM-head matmul, the softmax
statistics, the logit gradient) through `torch.compile` (`compiled_chunk_kernels`): the
element-wise passes over each (chunk, V) block are fused into one or two kernels, and the forward
needs no (chunk, V) probability buffer. Same formulas, so the same values up to float rounding
(tests/test_llm_fused.py: 1e-5 in float32, values and gradients). The first call compiles (seconds
to a minute, needs a C++ compiler on CPU / Triton on CUDA); whether it pays off is measured in
benchmarks/llm_memory.py, and it is off by default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "VOCAB_BLOCK",
    "ChunkKernels",
    "checked_compile_option",
    "chunked_token_logprobs",
    "compiled_chunk_kernels",
    "naive_token_logprobs",
]


class _Head(NamedTuple):
    """The LM head: ``weight`` (V, H) and ``bias`` (V,) or None."""

    weight: Tensor
    bias: Tensor | None


class _LogitTransform(NamedTuple):
    """How raw logits ``h W^T + b`` become the scored ones: times ``logit_scale``, soft-capped
    (``c * tanh(z / c)`` with ``c = softcap``; None: not capped), times ``inv_temperature``."""

    inv_temperature: float
    logit_scale: float
    softcap: float | None


class _RowStats(NamedTuple):
    """A chunk's forward statistics kept for the backward: ``lse = logsumexp(z)`` (c,) and
    ``mean = E_p[z]`` (c,) (zeros without entropy)."""

    lse: Tensor
    mean: Tensor


class _Upstream(NamedTuple):
    """The gradients arriving at a chunk's outputs: ``g_logp`` (c,) and ``g_ent`` (c,) or None
    (the entropy gets no gradient)."""

    g_logp: Tensor
    g_ent: Tensor | None


class _ChunkSettings(NamedTuple):
    """The non-tensor settings of `_ChunkedLogProbs`: ``scale = logit_scale / temperature``,
    ``chunk`` rows per chunk, whether the entropy is computed, whether the compiled kernels run."""

    scale: float
    chunk: int
    with_entropy: bool
    compiled: bool


def _chunk_stats(
    h: Tensor, head: _Head, targets: Tensor, transform: _LogitTransform, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """Log-prob of ``targets`` and entropy for one chunk. Shapes: h (c, H), targets (c,) -> (c,), (c,)."""
    logits = F.linear(h, head.weight, head.bias)  # (c, V)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax statistics in float32 even for half-precision weights
    if transform.logit_scale != 1.0:
        logits = logits * transform.logit_scale
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    if transform.inv_temperature != 1.0:
        logits = logits * transform.inv_temperature
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
    chunk's logits and forms the gradient w.r.t. the logits in place (one (chunk, V) buffer; two
    when the entropy is differentiated)::

        d logp / dz = onehot(y) - p          d H / dz = -p * (z - E_p[z])

    then ``grad_h = g_z W * c`` and ``grad_W += g_z^T h * c`` with ``c = logit_scale / tau``.
    """

    @staticmethod
    def forward(
        ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, settings: _ChunkSettings
    ) -> tuple[Tensor, Tensor]:
        scale, chunk, with_entropy, compiled = settings
        n = h.shape[0]
        acc = torch.promote_types(h.dtype, torch.float32)
        logp = h.new_empty(n, dtype=acc)
        ent = h.new_zeros(n, dtype=acc)
        lse_all = h.new_empty(n, dtype=acc)
        mean_all = h.new_zeros(n, dtype=acc)
        kernels = compiled_chunk_kernels() if compiled else None
        for s in range(0, n, chunk):
            if kernels is not None:
                lp_c, lse_c, mean_c = kernels.forward(
                    h[s : s + chunk], weight, bias, y[s : s + chunk], scale, with_entropy
                )
                logp[s : s + chunk], lse_all[s : s + chunk] = lp_c, lse_c
                if with_entropy:
                    mean_all[s : s + chunk], ent[s : s + chunk] = mean_c, lse_c - mean_c
                continue
            z = _logits(h[s : s + chunk], weight, bias, scale)
            lp_c, lse_c, mean_c = _chunk_forward(z, y[s : s + chunk], with_entropy)
            del z
            logp[s : s + chunk], lse_all[s : s + chunk] = lp_c, lse_c
            if with_entropy:
                mean_all[s : s + chunk], ent[s : s + chunk] = mean_c, lse_c - mean_c
        ctx.save_for_backward(h, weight, bias, y, lse_all, mean_all)
        ctx.settings = settings
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skipped
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> Any:
        h, weight, bias, y, lse_all, mean_all = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        if g_logp is None:
            g_logp = torch.zeros_like(lse_all)
        scale, chunk, with_entropy, compiled = ctx.settings
        use_ent = with_entropy and g_ent is not None  # no gradient reached the entropy: skip
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(h) if need_h else None
        acc = lse_all.dtype
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b and bias is not None else None
        logit_grad = compiled_chunk_kernels().logit_grad if compiled else _logit_grad
        head = _Head(weight, bias)
        for s in range(0, h.shape[0], chunk):
            hc, sl = h[s : s + chunk], slice(s, s + chunk)
            g_e = g_ent[sl] if use_ent and g_ent is not None else None
            stats = _RowStats(lse_all[sl], mean_all[sl])
            z = logit_grad(hc, head, y[sl], stats, _Upstream(g_logp[sl], g_e), scale)
            if grad_h is not None:
                grad_h[s : s + chunk] = (z.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(z.t(), hc.to(acc))
            if grad_b is not None:
                grad_b.add_(z.sum(0))
            del z  # before the next chunk's buffers are allocated
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        gb = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, gw, gb, None, None


def _logit_grad(
    h: Tensor, head: _Head, y: Tensor, stats: _RowStats, upstream: _Upstream, scale: float
) -> Tensor:
    """The gradient w.r.t. the chunk's pre-scale logits, in place in the recomputed logits' buffer::

        g_z = (g_lp (onehot(y) - p) - g_H p (z - E_p[z])) * scale

    Shapes: h (c, H), y (c,), stats and upstream of (c,) rows -> (c, V) float32."""
    (lse, mean), (g_logp, g_ent) = stats, upstream
    z = _logits(h, head.weight, head.bias, scale)  # (c, V) float32
    gl = g_logp.unsqueeze(-1).to(z.dtype)
    if g_ent is not None:
        p = (z - lse.unsqueeze(-1)).exp_()  # a second (c, V) buffer: the entropy term needs z too
        # g_z = -g_H * p * (z - m) - g_lp * p  (+ g_lp at the target)
        z.sub_(mean.unsqueeze(-1)).mul_(p).mul_(-g_ent.unsqueeze(-1).to(z.dtype))
        z.sub_(p.mul_(gl))
        del p
    else:
        z = z.sub_(lse.unsqueeze(-1)).exp_().mul_(-gl)  # -g_lp * p, in the logits' own buffer
    z.scatter_add_(-1, y.unsqueeze(-1), gl)
    return z.mul_(scale)  # chain rule through z = (h W^T + b) * scale


# vocabulary columns per block where a chunk's forward needs exp(u) beside u (the entropy): the
# second buffer is (chunk, VOCAB_BLOCK), not (chunk, V)
VOCAB_BLOCK = 4096


def _chunk_forward(z: Tensor, y: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's ``log p(y)``, ``lse = logsumexp(z)`` and ``E_p[z]`` (zeros without entropy) from
    its scaled logits ``z`` (c, V) float32, which it overwrites: one (c, V) buffer per chunk.

    With ``u = z - max_v z`` (in place), ``s = sum_v exp(u)``: ``lse = max + log s`` and
    ``E_p[z] = max + sum_v exp(u) u / s``. Without the entropy ``exp(u)`` is taken in place too;
    with it, ``exp(u)`` is formed `VOCAB_BLOCK` columns at a time (a (c, VOCAB_BLOCK) buffer), as
    ``E_p[z]`` needs ``u`` and ``exp(u)`` together. Shapes: y (c,) -> three (c,)."""
    zy = z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    top = z.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows of -inf: no nan
    u = z.sub_(top)
    if not with_entropy:
        lse = top.squeeze(-1) + u.exp_().sum(-1).log_()
        return zy - lse, lse, torch.zeros_like(lse)
    total = u.new_zeros(u.shape[0])
    weighted = u.new_zeros(u.shape[0])
    for j in range(0, u.shape[1], VOCAB_BLOCK):
        ub = u[:, j : j + VOCAB_BLOCK]
        e = ub.exp()
        total += e.sum(-1)
        weighted += torch.linalg.vecdot(e, ub)
    lse = top.squeeze(-1) + total.log()
    return zy - lse, lse, top.squeeze(-1) + weighted / total


def _forward_stats_pure(
    h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, scale: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's ``log p(y)``, ``lse = logsumexp(z)`` and ``E_p[z]`` (zeros without entropy), with
    no in-place ops (for `torch.compile`). Shapes: h (c, H), y (c,) -> three (c,) float32."""
    z = F.linear(h, weight, bias).float() * scale
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    mean = (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1) if with_entropy else torch.zeros_like(lse)
    return logp, lse, mean


def _logit_grad_pure(
    h: Tensor, head: _Head, y: Tensor, stats: _RowStats, upstream: _Upstream, scale: float
) -> Tensor:
    """`_logit_grad` without in-place ops (for `torch.compile`): the same formula, (c, V) float32."""
    (lse, mean), (g_logp, g_ent) = stats, upstream
    z = F.linear(h, head.weight, head.bias).float() * scale
    p = torch.exp(z - lse.unsqueeze(-1))
    gl = g_logp.unsqueeze(-1).float()
    g = -gl * p
    if g_ent is not None:
        g = g - g_ent.unsqueeze(-1).float() * p * (z - mean.unsqueeze(-1))
    g = g.scatter_add(-1, y.unsqueeze(-1), gl)
    return g * scale


class ChunkKernels:
    """The compiled per-chunk functions of `chunked_token_logprobs(compiled=True)`.

    Attributes:
        forward: ``(h, weight, bias, y, scale, with_entropy) -> (log p(y), lse, E_p[z])``.
        logit_grad: ``(h, head, y, stats, upstream, scale) -> g_z`` (c, V) (see `_logit_grad`).
    """

    def __init__(self, forward: Callable[..., Any], logit_grad: Callable[..., Any]) -> None:
        self.forward = forward
        self.logit_grad = logit_grad


@functools.cache
def compiled_chunk_kernels() -> ChunkKernels:
    """`torch.compile` of the chunk functions, built once per process (compilation itself happens
    at the first call of each shape; the last, shorter chunk compiles once more, then shapes are
    dynamic)."""
    return ChunkKernels(torch.compile(_forward_stats_pure), torch.compile(_logit_grad_pure))


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
    compiled: bool = False,
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
        compiled: run each chunk's work through `torch.compile` (`compiled_chunk_kernels`; same
            values up to float rounding). Needs ``chunk_size`` (not None) and no ``softcap``.
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
    if compiled:
        _check_compiled(chunk_size, softcap)
    if softcap is None and (size < n or compiled):
        # Hand-written backward: no per-chunk autograd graph, one or two (chunk, V) buffers.
        settings = _ChunkSettings(logit_scale * inv_t, size, with_entropy, compiled)
        lp_flat, ent_flat = _ChunkedLogProbs.apply(h, weight, bias, y, settings)  # type: ignore[no-untyped-call]
        return lp_flat.reshape(lead), (ent_flat.reshape(lead) if with_entropy else None)
    transform = _LogitTransform(inv_t, logit_scale, softcap)
    logp, entropy = _autograd_chunks(
        h, _Head(weight, bias), y, size, transform, with_entropy, recompute=recompute and size < n
    )
    return logp.reshape(lead), (entropy.reshape(lead) if entropy is not None else None)


def checked_compile_option(compile_logprobs: bool, logprob_chunk_size: int | None) -> bool:
    """``compile_logprobs`` of `grpo.llm.CausalLMPolicy`, checked against its chunk size: a
    TypeError for a non-bool, a ValueError when it is True without chunks (the compiled kernels
    are the chunked path's)."""
    if not isinstance(compile_logprobs, bool):
        raise TypeError(f"compile_logprobs={compile_logprobs!r} must be True or False.")
    if compile_logprobs and logprob_chunk_size is None:
        raise ValueError(
            "compile_logprobs=True compiles the chunked LM-head kernels, but logprob_chunk_size=None "
            "scores with the model's full logits; set logprob_chunk_size (e.g. 512) or "
            "compile_logprobs=False."
        )
    return compile_logprobs


def _check_compiled(chunk_size: int | None, softcap: float | None) -> None:
    """ValueError for the settings ``compiled=True`` does not cover."""
    if chunk_size is None:
        raise ValueError(
            "compiled=True compiles the chunked LM-head kernels, but chunk_size=None asks for the "
            "full-logits computation; give a chunk size (e.g. chunk_size=512) or compiled=False."
        )
    if softcap is not None:
        raise ValueError(
            f"compiled=True does not cover soft-capped logits (softcap={softcap!r}, Gemma 2's "
            "final_logit_softcapping); use compiled=False for this model."
        )


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
    head: _Head,
    y: Tensor,
    size: int,
    transform: _LogitTransform,
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
            lp, ent = checkpoint(_chunk_stats, hc, head, yc, transform, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(hc, head, yc, transform, with_entropy)
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
