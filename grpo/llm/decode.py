"""Sampling with a KV cache in a plain loop: what ``generate(do_sample=True)`` does when only a
temperature and ``min_new_tokens`` shape the distribution, without its per-token overhead.

For n left-padded prompts (ids (n, P), mask (n, P)), positions ``cumsum(mask) - 1`` (1 on the
padding, as ``generate`` sets them), at step t = 0 .. T-1:

    z_t = logits of the last position, float32          (n, V)
    z_t[:, eos] = -inf       while t < min_new_tokens    (the EOS ban)
    s_t = z_t / temperature
    y_t ~ softmax(s_t)                                  (torch.multinomial, as generate draws)
    logp_t = log_softmax(s_t)[y_t]                      (the sampler's log-prob, on request)
    y_t = pad where the row drew an EOS before t

and it stops when every row has drawn an EOS or after ``max_new_tokens`` steps. Fed the same
inputs and the same random stream, it returns bitwise the tokens ``generate`` returns
(tests/test_llm_decode.py: llama, qwen2, gpt2, LoRA, the EOS ban, several temperatures). On a
small model on the CPU a step of ``generate`` is mostly its own bookkeeping (preparing inputs,
the logits-processor list inspecting each processor's signature, the stopping criteria):
benchmarks/llm_throughput.py measures the difference.

This loop is the fast **twin** of Hugging Face ``generate`` (the readable, general route: every
logits processor, synced processes): `SamplingSettings(decoding="auto")` (the default) samples
with it where it applies (no top-k / top-p / min-p / repetition penalty, weights not partitioned
over processes) and with ``generate`` otherwise; ``decoding="generate"`` always uses
``generate``. It is tested equal to ``generate`` (the same tokens from the same seed, bitwise:
tests/test_llm_decode.py) and stays for the workload where sampling is a step's critical path: a
generation worker one step ahead (``generation_engine="worker", async_staleness=1``, tiny Llama,
8 x 8 completions of 32 tokens: 0.047 s a step against 0.053 s with ``generate``, 11 % of a
whole step, benchmarks/RESULTS.md). In process, where a step is generation plus the update on
the same cores, it buys no measurable share (benchmarks/sampling_route.py; docs/llm.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from grpo.llm._deps import require
from grpo.llm.sampling_settings import SamplingSettings

__all__ = ["StopTokens", "sample_with_kv_cache"]


def _forward_keywords(model: Any) -> tuple[str, dict[str, Any], bool]:
    """How ``model``'s forward is called, read from its signature as ``generate`` reads it: (the
    KV-cache keyword: ``cache`` from transformers 5.x on, ``past_key_values`` before; the prefill's
    extra keywords: only the last position's logits (``logits_to_keep``, ``num_logits_to_keep``
    before 4.50), never (n, P, V); whether it takes ``position_ids``). ``model``: the Hugging Face
    model itself (under a PEFT wrapper, its base model: PEFT passes keywords through)."""
    params = inspect.signature(model.forward).parameters
    cache_key = "cache" if "cache" in params else "past_key_values"
    keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    return cache_key, ({} if keep is None else {keep: 1}), "position_ids" in params


def _new_cache(transformers: Any, model: Any) -> Any:
    """An empty ``DynamicCache`` laid out for ``model`` (its config: sliding-window layers)."""
    if "config" in inspect.signature(transformers.DynamicCache).parameters:
        return transformers.DynamicCache(config=model.config)
    return transformers.DynamicCache()


class StopTokens(NamedTuple):
    """The token ids that end a row: any of ``eos_token_ids`` ends it, ``pad_token_id`` fills the
    row after its EOS."""

    eos_token_ids: Sequence[int]
    pad_token_id: int


def sample_with_kv_cache(
    model: Any,
    base_model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    settings: SamplingSettings,
    stop: StopTokens,
    with_log_probs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sample up to ``settings.max_new_tokens`` tokens after each left-padded prompt (module
    docstring), at ``settings.temperature`` with the EOS banned for the first
    ``settings.min_new_tokens`` steps (the loop reads only these three settings: call it where
    ``settings.only_temperature``).

    ``model``: the model to call (a PEFT wrapper applies its adapter); ``base_model``: the Hugging
    Face model under it (``model`` itself without PEFT), whose config and forward signature are
    read. ``input_ids``, ``attention_mask``: (n, P) on the model's device. Returns the (n, T)
    sampled ids (``stop.pad_token_id`` after a row's EOS; T <= max_new_tokens, the steps taken)
    and, with ``with_log_probs``, their (n, T) float32 log-probs under the distribution each was
    drawn from (else None). Call it under ``torch.inference_mode()`` or ``no_grad()``.
    """
    max_new_tokens, temperature = settings.max_new_tokens, settings.temperature
    min_new_tokens, (eos_token_ids, pad_token_id) = settings.min_new_tokens, stop
    cache_key, prefill_extra, takes_positions = _forward_keywords(base_model)
    cache = _new_cache(require("transformers"), base_model)

    def forward(ids: Tensor, mask: Tensor, positions: Tensor, **extra: Any) -> Any:
        pos = {"position_ids": positions} if takes_positions else {}
        return model(input_ids=ids, attention_mask=mask, use_cache=True, **pos, **{cache_key: cache}, **extra)

    n, device = int(input_ids.shape[0]), input_ids.device
    mask = attention_mask.long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (n, P), 1 on the padding as generate
    out = forward(input_ids, mask, positions, **prefill_extra)
    eos = torch.tensor(list(eos_token_ids), device=device)
    unfinished = torch.ones(n, dtype=torch.bool, device=device)
    position = positions[:, -1:]  # (n, 1)
    tokens: list[Tensor] = []
    log_probs: list[Tensor] = []
    for t in range(max_new_tokens):
        scores = out.logits[:, -1].to(dtype=torch.float32, copy=True)  # (n, V)
        if t < min_new_tokens:
            scores[:, eos] = float("-inf")
        scores = scores / temperature
        drawn = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)  # (n,)
        if with_log_probs:
            log_probs.append(torch.log_softmax(scores, dim=-1).gather(1, drawn[:, None]).squeeze(1))
        drawn = torch.where(unfinished, drawn, pad_token_id)
        tokens.append(drawn)
        unfinished &= ~torch.isin(drawn, eos)
        if t == max_new_tokens - 1 or not bool(unfinished.any()):
            break
        mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
        position = position + 1
        out = forward(drawn[:, None], mask, position)
    ids = torch.stack(tokens, dim=1)
    return ids, (torch.stack(log_probs, dim=1) if with_log_probs else None)
