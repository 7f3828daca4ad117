"""Pending generations of `Completion` groups in a checkpoint: the ``"completions"`` kind of
`grpo.generation.pending_state` (registered by ``import grpo.llm``).

The entry's fields beside the generic ones (version, states_digest, kind, log_probs), for B
groups of G completions without a loss mask, N = B*G flat::

    groups B, group_size G                 int
    prompt_ids / token_ids                 int64, every sample's ids concatenated
    prompt_lengths / token_lengths         (N,) int64
    text, finished, temperature, min_new_tokens   N each (str, bool, float, int)

`COMPLETIONS.decode` checks every field (types, dtypes, shapes, lengths, values) and raises
`ValueError` naming the entry and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo.generation.pending_state import describe_value
from grpo.llm.completion import Completion

__all__ = ["COMPLETIONS", "CompletionsCodec"]

_MAX_ID = 2**31  # token ids and lengths: far above any vocabulary, far below int64 overflow
_LISTS = {"text": str, "finished": bool, "temperature": float, "min_new_tokens": int}


class CompletionsCodec:
    """The `grpo.generation.pending_state.ActionCodec` of B groups of G `Completion` s."""

    kind = "completions"
    keys = frozenset(
        {"groups", "group_size", "prompt_ids", "prompt_lengths", "token_ids", "token_lengths", *_LISTS}
    )

    def encode(self, actions: Any) -> dict[str, Any] | None:
        """The fields of ``actions`` when they are B >= 1 equal-sized groups of Completions with no
        loss mask, else None."""
        if not isinstance(actions, list) or not actions:
            return None
        if not all(isinstance(g, list) and g and len(g) == len(actions[0]) for g in actions):
            return None
        if not all(type(c) is Completion and c.loss_mask is None for g in actions for c in g):
            return None
        flat = [c for g in actions for c in g]
        return {
            "groups": len(actions),
            "group_size": len(actions[0]),
            "prompt_ids": torch.cat([c.prompt_ids.reshape(-1).cpu() for c in flat]).to(torch.int64),
            "prompt_lengths": torch.tensor([c.prompt_ids.numel() for c in flat], dtype=torch.int64),
            "token_ids": torch.cat([c.token_ids.reshape(-1).cpu() for c in flat]).to(torch.int64),
            "token_lengths": torch.tensor([c.token_ids.numel() for c in flat], dtype=torch.int64),
            "text": [c.text for c in flat],
            "finished": [bool(c.finished) for c in flat],
            "temperature": [float(c.temperature) for c in flat],
            "min_new_tokens": [int(c.min_new_tokens) for c in flat],
        }

    def decode(self, state: Mapping[str, Any], where: str) -> tuple[list[list[Completion]], int]:
        """B groups of G Completions from the flat ids, lengths and per-sample lists (checked),
        and N = B*G."""
        b, g = state["groups"], state["group_size"]
        for name, v in (("groups", b), ("group_size", g)):
            if type(v) is not int or not 1 <= v <= _MAX_ID:
                raise ValueError(f"{where}.{name}: must be an integer >= 1, got {v!r}.")
        n = b * g
        prompts = _split_ids(state, "prompt", n, where)
        tokens = _split_ids(state, "token", n, where)
        for name, typ in _LISTS.items():
            values = state[name]
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(
                    f"{where}.{name}: must be a list of N = B*G = {n} values, got {describe_value(values)}."
                )
            bad = [v for v in values if type(v) is not typ]
            if bad:
                raise ValueError(f"{where}.{name}: every value must be a {typ.__name__}, got {bad[0]!r:.80}.")
        if not all(math.isfinite(t) and t >= 0 for t in state["temperature"]):
            raise ValueError(f"{where}.temperature: must be finite and >= 0.")
        if not all(0 <= m < _MAX_ID for m in state["min_new_tokens"]):
            raise ValueError(f"{where}.min_new_tokens: must be integers >= 0.")
        flat = [
            Completion(p, t, text, fin, temp, m)
            for p, t, text, fin, temp, m in zip(
                prompts,
                tokens,
                state["text"],
                state["finished"],
                state["temperature"],
                state["min_new_tokens"],
                strict=True,
            )
        ]
        return [flat[i * g : (i + 1) * g] for i in range(b)], n


COMPLETIONS = CompletionsCodec()


def _split_ids(state: Mapping[str, Any], part: str, n: int, where: str) -> list[Tensor]:
    """``{part}_ids`` split by ``{part}_lengths``: N int64 tensors of ids in [0, 2**31)."""
    ids, lengths = state[f"{part}_ids"], state[f"{part}_lengths"]
    if not isinstance(lengths, Tensor) or lengths.dtype != torch.int64 or tuple(lengths.shape) != (n,):
        raise ValueError(
            f"{where}.{part}_lengths: must be an int64 Tensor of shape ({n},), got {describe_value(lengths)}."
        )
    if bool((lengths < 0).any()) or bool((lengths >= _MAX_ID).any()):
        raise ValueError(f"{where}.{part}_lengths: must be >= 0.")
    total = int(lengths.sum())
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (total,):
        raise ValueError(
            f"{where}.{part}_ids: must be an int64 Tensor of shape ({total},) (the sum of "
            f"{part}_lengths), got {describe_value(ids)}."
        )
    if bool((ids < 0).any()) or bool((ids >= _MAX_ID).any()):
        raise ValueError(f"{where}.{part}_ids: token ids must lie in [0, 2**31).")
    return [t.clone() for t in torch.split(ids, lengths.tolist())]
