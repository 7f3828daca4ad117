"""The generations drawn ahead (async rollouts), as checkpoint state: plain data and tensors.

With ``GRPOConfig.async_staleness = k >= 1`` a checkpoint written after step r (``step_count =
r``) falls while the batches of steps r .. r+k-1 are already sampled, by the weights of versions
``r-k .. r-1`` (`grpo.generation.async_rollouts`). A resumed engine holds version r only, so to
continue as the uninterrupted run does, the checkpoint keeps those k generations and the resumed
run trains on exactly them; every later batch is sampled after the sync of version r in both runs,
by the same weights and (worker engine) the same job seed. Nothing else is needed: the rewards,
reference and behaviour log-probs are computed when a step trains on the batch, and the data
source stands at the trained position (`grpo.training.prefetch`), so the resumed run draws the
same states again; a digest of them checks that it did.

One generation, `generation_state`, as plain data (tensors go to ``state.safetensors``, the rest
to ``state.json``; `grpo.state.checkpoint`)::

    version        int >= 0      the policy version that sampled it
    states_digest  str or None   SHA-256 of the states (`states_digest`), None when not hashable
    kind           "tensor"      actions (B, G, ...) Tensor
                   "completions" B groups of G `grpo.llm.Completion` (no loss mask), N = B*G flat:
                                 groups B, group_size G; prompt_ids / token_ids int64, every
                                 sample's ids concatenated, with prompt_lengths / token_lengths
                                 (N,) int64; text, finished, temperature, min_new_tokens: N each
    log_probs      the sampler's log-probs: {"log_probs": (N,) or (N, T) float, "mask": (N, T)
                   bool or None, "entropy": like log_probs or None, "wrapped": bool (a
                   `PolicyOutput`, not a bare Tensor)}, or None

Bytes on disk per pending completions batch, N = B*G samples, P / T the mean prompt / completion
lengths, T_max the longest completion: ``8 N (P + T + 2)`` (ids and lengths, int64) ``+ 4 N T_max``
(float32 log-probs; ``+ N T_max`` with a mask, as a language model's come, ``+ 4 N T_max`` with
entropy) ``+`` the JSON of the texts and flags (about ``len(text) + 40`` bytes a sample) ``+``
safetensors headers (~100 bytes a tensor). docs/llm.md gives the figure measured on a tiny model.

`restored_generation` checks a loaded entry completely (types, dtypes, shapes, lengths, values)
and raises `ValueError` naming the entry and the field; the checkpoint loader turns that into a
`grpo.state.checkpoint.CheckpointError` and rolls the trainer back.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo.generation.engine import Generated
from grpo.policy_base import PolicyOutput

__all__ = ["RestoredGeneration", "generation_state", "restored_generation", "states_digest"]

_MAX_ID = 2**31  # token ids and lengths: far above any vocabulary, far below int64 overflow
_LOG_PROB_KEYS = ("log_probs", "mask", "entropy", "wrapped")
_COMPLETION_LISTS = {"text": str, "finished": bool, "temperature": float, "min_new_tokens": int}
_KEYS = {
    "tensor": {"version", "states_digest", "kind", "log_probs", "actions"},
    "completions": {
        "version", "states_digest", "kind", "log_probs", "groups", "group_size",
        "prompt_ids", "prompt_lengths", "token_ids", "token_lengths", *_COMPLETION_LISTS,
    },
}  # fmt: skip


@dataclass(frozen=True)
class RestoredGeneration:
    """A generation read back from a checkpoint: its actions, sampler log-probs and version, and
    the digest of the states it was sampled for (None: not checked)."""

    actions: Any
    log_probs: Tensor | PolicyOutput | None
    version: int
    states_digest: str | None

    def generated(self, states: Any) -> Generated:
        return Generated(states, self.actions, self.log_probs, self.version)


def states_digest(states: Any) -> str | None:
    """SHA-256 of ``states``: a Tensor's dtype, shape and bytes (on CPU), or the canonical JSON of
    plain data (prompts, dicts of strings and numbers); None when ``states`` is neither."""
    if isinstance(states, Tensor):
        t = states.detach().cpu().contiguous()
        head = f"{t.dtype}:{tuple(t.shape)}:".encode()
        return hashlib.sha256(head + t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    try:
        text = json.dumps(states, sort_keys=True, allow_nan=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def generation_state(generated: Generated) -> dict[str, Any] | None:
    """``generated`` as plain data and CPU tensors (the module docstring's format); None when its
    actions are neither a Tensor nor groups of `grpo.llm.Completion` without a loss mask."""
    log_probs = _log_probs_state(generated.log_probs)
    head = {"version": int(generated.version), "states_digest": states_digest(generated.states)}
    if isinstance(generated.actions, Tensor):
        return {**head, "kind": "tensor", "log_probs": log_probs, "actions": generated.actions.detach().cpu()}
    groups = _completion_groups(generated.actions)
    if groups is None:
        return None
    flat = [c for g in groups for c in g]
    return {
        **head,
        "kind": "completions",
        "log_probs": log_probs,
        "groups": len(groups),
        "group_size": len(groups[0]),
        "prompt_ids": torch.cat([c.prompt_ids.reshape(-1).cpu() for c in flat]).to(torch.int64),
        "prompt_lengths": torch.tensor([c.prompt_ids.numel() for c in flat], dtype=torch.int64),
        "token_ids": torch.cat([c.token_ids.reshape(-1).cpu() for c in flat]).to(torch.int64),
        "token_lengths": torch.tensor([c.token_ids.numel() for c in flat], dtype=torch.int64),
        "text": [c.text for c in flat],
        "finished": [bool(c.finished) for c in flat],
        "temperature": [float(c.temperature) for c in flat],
        "min_new_tokens": [int(c.min_new_tokens) for c in flat],
    }


def _completion_groups(actions: Any) -> list[list[Any]] | None:
    """``actions`` when they are B >= 1 equal-sized groups of Completions with no loss mask."""
    llm = sys.modules.get("grpo.llm.policy")
    if llm is None or not isinstance(actions, list) or not actions:
        return None
    if not all(isinstance(g, list) and g and len(g) == len(actions[0]) for g in actions):
        return None
    ok = all(type(c) is llm.Completion and c.loss_mask is None for g in actions for c in g)
    return actions if ok else None


def _log_probs_state(log_probs: Tensor | PolicyOutput | None) -> dict[str, Any] | None:
    if log_probs is None:
        return None
    out = log_probs if isinstance(log_probs, PolicyOutput) else PolicyOutput(log_probs)

    def cpu(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().cpu()

    wrapped = isinstance(log_probs, PolicyOutput)
    return {
        "log_probs": cpu(out.log_probs),
        "mask": cpu(out.mask),
        "entropy": cpu(out.entropy),
        "wrapped": wrapped,
    }


# ---- loading: every field checked -------------------------------------------------------------
def restored_generation(state: Any, where: str) -> RestoredGeneration:
    """The generation ``state`` (`generation_state`'s format) describes, checked completely;
    `ValueError` naming ``where`` and the field otherwise."""
    if not isinstance(state, Mapping) or state.get("kind") not in _KEYS:
        kinds = sorted(_KEYS)
        got = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{where}: expected a mapping with 'kind' one of {kinds}, got {got!r}.")
    kind = state["kind"]
    if set(state) != _KEYS[kind]:
        raise ValueError(f"{where}: expected the keys {sorted(_KEYS[kind])}, got {sorted(state)}.")
    version = state["version"]
    if type(version) is not int or not 0 <= version < 2**63:
        raise ValueError(f"{where}.version: must be an integer >= 0, got {version!r}.")
    digest = state["states_digest"]
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
        raise ValueError(f"{where}.states_digest: must be a SHA-256 hex string or None, got {digest!r:.80}.")
    if kind == "tensor":
        actions = state["actions"]
        if not isinstance(actions, Tensor) or actions.dim() < 2:
            raise ValueError(f"{where}.actions: must be a Tensor (B, G, ...), got {_kind(actions)}.")
        n = actions.shape[0] * actions.shape[1]
    else:
        actions = _completions(state, where)
        n = state["groups"] * state["group_size"]
    return RestoredGeneration(actions, _log_probs(state["log_probs"], n, where), version, digest)


def _kind(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"a {v.dtype} Tensor of shape {tuple(v.shape)}"
    return type(v).__name__


def _completions(state: Mapping[str, Any], where: str) -> list[list[Any]]:
    """B groups of G Completions from the flat ids, lengths and per-sample lists (checked)."""
    from grpo.llm.policy import Completion

    b, g = state["groups"], state["group_size"]
    for name, v in (("groups", b), ("group_size", g)):
        if type(v) is not int or not 1 <= v <= _MAX_ID:
            raise ValueError(f"{where}.{name}: must be an integer >= 1, got {v!r}.")
    n = b * g
    prompts = _split_ids(state, "prompt", n, where)
    tokens = _split_ids(state, "token", n, where)
    for name, typ in _COMPLETION_LISTS.items():
        values = state[name]
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"{where}.{name}: must be a list of N = B*G = {n} values, got {_kind(values)}.")
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
            prompts, tokens, state["text"], state["finished"], state["temperature"],
            state["min_new_tokens"], strict=True,
        )
    ]  # fmt: skip
    return [flat[i * g : (i + 1) * g] for i in range(b)]


def _split_ids(state: Mapping[str, Any], part: str, n: int, where: str) -> list[Tensor]:
    """``{part}_ids`` split by ``{part}_lengths``: N int64 tensors of ids in [0, 2**31)."""
    ids, lengths = state[f"{part}_ids"], state[f"{part}_lengths"]
    if not isinstance(lengths, Tensor) or lengths.dtype != torch.int64 or tuple(lengths.shape) != (n,):
        raise ValueError(
            f"{where}.{part}_lengths: must be an int64 Tensor of shape ({n},), got {_kind(lengths)}."
        )
    if bool((lengths < 0).any()) or bool((lengths >= _MAX_ID).any()):
        raise ValueError(f"{where}.{part}_lengths: must be >= 0.")
    total = int(lengths.sum())
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (total,):
        raise ValueError(
            f"{where}.{part}_ids: must be an int64 Tensor of shape ({total},) (the sum of "
            f"{part}_lengths), got {_kind(ids)}."
        )
    if bool((ids < 0).any()) or bool((ids >= _MAX_ID).any()):
        raise ValueError(f"{where}.{part}_ids: token ids must lie in [0, 2**31).")
    return [t.clone() for t in torch.split(ids, lengths.tolist())]


def _log_probs(state: Any, n: int, where: str) -> Tensor | PolicyOutput | None:
    """The sampler's log-probs: ``(N,)`` or ``(N, T)`` float, neither NaN nor +inf (a density's
    log may be > 0); an optional ``(N, T)`` bool mask and an entropy shaped like them; a
    `PolicyOutput` when ``wrapped``."""
    if state is None:
        return None
    if not isinstance(state, Mapping) or set(state) != set(_LOG_PROB_KEYS):
        raise ValueError(f"{where}.log_probs: expected None or the keys {sorted(_LOG_PROB_KEYS)}.")
    lp, mask, ent, wrapped = state["log_probs"], state["mask"], state["entropy"], state["wrapped"]
    if type(wrapped) is not bool:
        raise ValueError(f"{where}.log_probs.wrapped: must be a bool, got {wrapped!r:.80}.")
    if not isinstance(lp, Tensor) or not lp.is_floating_point() or lp.dim() not in (1, 2) or lp.shape[0] != n:
        raise ValueError(f"{where}.log_probs: must be a float Tensor (N={n},) or (N, T), got {_kind(lp)}.")
    if bool(torch.isnan(lp).any()) or bool(torch.isposinf(lp).any()):
        raise ValueError(f"{where}.log_probs: must hold no NaN and no +inf.")
    if mask is not None and (
        not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != lp.shape
    ):
        raise ValueError(f"{where}.log_probs.mask: must be None or a bool Tensor shaped {tuple(lp.shape)}.")
    if ent is not None and (not isinstance(ent, Tensor) or ent.dtype != lp.dtype or ent.shape != lp.shape):
        raise ValueError(f"{where}.log_probs.entropy: must be None or a Tensor like log_probs.")
    if not wrapped:
        if mask is not None or ent is not None:
            raise ValueError(f"{where}.log_probs: a mask or entropy needs wrapped=True.")
        return lp.clone()
    return PolicyOutput(
        lp.clone(), None if mask is None else mask.clone(), None if ent is None else ent.clone()
    )
