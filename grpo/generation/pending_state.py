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
                   another kind  the fields of a registered `ActionCodec` (`register_action_codec`):
                                 "completions", B groups of G `grpo.llm.Completion`, is
                                 `grpo.llm.completion_state`'s (registered by ``import grpo.llm``)
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.generation.engine import Generated
from grpo.policy_base import PolicyOutput

__all__ = [
    "ActionCodec",
    "RestoredGeneration",
    "describe_value",
    "generation_state",
    "register_action_codec",
    "restored_generation",
    "states_digest",
]

_LOG_PROB_KEYS = ("log_probs", "mask", "entropy", "wrapped")
_HEAD = {"version", "states_digest", "kind", "log_probs"}


class ActionCodec(Protocol):
    """How one kind of non-tensor actions (a wing's: `grpo.llm.Completion` groups) is written to
    a checkpoint and read back. ``kind``: its name in the entry; ``keys``: its fields beside
    version, states_digest, kind and log_probs. ``encode(actions)``: those fields (plain data and
    CPU tensors), or None when ``actions`` are not of this kind. ``decode(state, where)``: the
    actions and their number N = B*G, every field checked (ValueError naming ``where`` and the
    field)."""

    kind: str
    keys: frozenset[str]

    def encode(self, actions: Any) -> dict[str, Any] | None: ...

    def decode(self, state: Mapping[str, Any], where: str) -> tuple[Any, int]: ...


_CODECS: dict[str, ActionCodec] = {}


def register_action_codec(codec: ActionCodec) -> None:
    """Let checkpoints hold the pending generations of ``codec.kind`` actions (idempotent)."""
    if codec.kind == "tensor":
        raise ValueError("the action kind 'tensor' is built in; register another name.")
    _CODECS[codec.kind] = codec


def _keys(kind: str) -> set[str]:
    return _HEAD | ({"actions"} if kind == "tensor" else set(_CODECS[kind].keys))


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
    actions are neither a Tensor nor of a registered kind (`register_action_codec`)."""
    log_probs = _log_probs_state(generated.log_probs)
    head = {"version": int(generated.version), "states_digest": states_digest(generated.states)}
    if isinstance(generated.actions, Tensor):
        return {**head, "kind": "tensor", "log_probs": log_probs, "actions": generated.actions.detach().cpu()}
    for codec in _CODECS.values():
        fields = codec.encode(generated.actions)
        if fields is not None:
            return {**head, "kind": codec.kind, "log_probs": log_probs, **fields}
    return None


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
    kinds = ["tensor", *_CODECS]
    if not isinstance(state, Mapping) or state.get("kind") not in kinds:
        got = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{where}: expected a mapping with 'kind' one of {sorted(kinds)}, got {got!r} (the "
            f"kind 'completions' is registered by importing grpo.llm)."
        )
    kind = state["kind"]
    if set(state) != _keys(kind):
        raise ValueError(f"{where}: expected the keys {sorted(_keys(kind))}, got {sorted(state)}.")
    version = state["version"]
    if type(version) is not int or not 0 <= version < 2**63:
        raise ValueError(f"{where}.version: must be an integer >= 0, got {version!r}.")
    digest = state["states_digest"]
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
        raise ValueError(f"{where}.states_digest: must be a SHA-256 hex string or None, got {digest!r:.80}.")
    if kind == "tensor":
        actions = state["actions"]
        if not isinstance(actions, Tensor) or actions.dim() < 2:
            raise ValueError(f"{where}.actions: must be a Tensor (B, G, ...), got {describe_value(actions)}.")
        n = actions.shape[0] * actions.shape[1]
    else:
        actions, n = _CODECS[kind].decode(state, where)
    return RestoredGeneration(actions, _log_probs(state["log_probs"], n, where), version, digest)


def describe_value(v: Any) -> str:
    """A value as an error message names it: a Tensor's dtype and shape, else its type."""
    if isinstance(v, Tensor):
        return f"a {v.dtype} Tensor of shape {tuple(v.shape)}"
    return type(v).__name__


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
        raise ValueError(
            f"{where}.log_probs: must be a float Tensor (N={n},) or (N, T), got {describe_value(lp)}."
        )
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
