"""Members that train the same tensors: one model, each member's weights swapped in when it acts.

A LoRA population keeps one frozen base model: every member's `grpo.llm.CausalLMPolicy` wraps
the same PEFT model, so every member's trainer holds the same adapter tensors (``trainer.params``)
and its own optimizer over them. `SharedWeights` keeps each member's adapter values in a slot
(a CPU-or-device copy of the trainable tensors) and copies them in place (``Tensor.copy_``) when
the member acts (steps, evaluates, saves, loads), after copying the previous member's values
back to its slot. The optimizers keep holding the live tensors, so each member's Adam moments
stay its own and consistent with its weights.

Memory of P members with a base of ``W_base`` bytes and an adapter of ``W_lora`` bytes::

    shared:   W_base + W_lora + P * W_lora      (live adapter + P slots)
    separate: P * (W_base + W_lora)

(`parameter_bytes` measures it). The reference of the KL term must hold no tensors of its own
(the disabled adapter, `grpo.llm.policy.DisabledAdapterReference`); a separate reference adapter
would be shared by every member and is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from grpo.state.checkpoint import policy_state
from grpo.trainer import GRPOTrainer

__all__ = ["SharedWeights", "parameter_bytes", "shares_weights"]


def shares_weights(trainers: Mapping[int, GRPOTrainer]) -> bool:
    """Whether the trainers train the same tensors (all of them, in the same order); a
    `ValueError` when they share only some."""
    ids = {i: [id(p) for p in t.params] for i, t in trainers.items()}
    if len(ids) < 2:
        return False
    first = next(iter(ids.values()))
    overlap = [set(v) & set(first) for v in list(ids.values())[1:]]
    if not any(overlap):
        return False
    if all(v == first for v in ids.values()):
        return True
    raise ValueError(
        "the members' trainers share some trainable tensors but not all (or in another order); "
        "build every member around the same model (one PEFT model: shared) or around its own copy."
    )


class SharedWeights:
    """Slots of the trained tensors of members that share one model (see the module docstring)."""

    def __init__(self, trainers: Mapping[int, GRPOTrainer]) -> None:
        first = next(iter(trainers.values()))
        for i, t in trainers.items():
            ref = t.reference_policy
            if ref is not None and policy_state(ref, "reference_policy"):
                raise ValueError(
                    f"member {i}: a shared-weights population needs a KL reference without tensors of "
                    f"its own (CausalLMPolicy's disabled adapter); its {type(ref).__name__} holds "
                    f"tensors every member would share. Use use_separate_reference_adapter=False."
                )
        self.live: list[Tensor] = list(first.params)
        self.slots: dict[int, list[Tensor]] = {i: [p.detach().clone() for p in self.live] for i in trainers}
        self.active: int | None = None

    def activate(self, index: int) -> None:
        """Put member ``index``'s values into the live tensors (saving the active member's first)."""
        if self.active == index:
            return
        with torch.no_grad():
            if self.active is not None:
                for slot, p in zip(self.slots[self.active], self.live, strict=True):
                    slot.copy_(p)
            for slot, p in zip(self.slots[index], self.live, strict=True):
                p.copy_(slot)
        self.active = index


def parameter_bytes(modules: Iterable[torch.nn.Module], extra: Iterable[Tensor] = ()) -> int:
    """Bytes of the distinct tensor storages of ``modules``' parameters and buffers and of
    ``extra`` (a tensor shared by several modules counts once)."""
    seen: dict[int, int] = {}

    def add(t: Tensor) -> None:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())

    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            add(t)
    for t in extra:
        add(t)
    return sum(seen.values())
