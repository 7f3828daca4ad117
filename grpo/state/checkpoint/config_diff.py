"""A checkpoint's saved config against the live trainer's, field by field, by the current names.

`load_checkpoint` keeps the live trainer's config and warns when the saved one differs (the run
then does not continue exactly as the saved one). A checkpoint saved before a field was renamed
holds the old name (grpo 0.2's ``normalize_advantages``, ``num_mini_batches``), so the saved config
is read through `GRPOConfig.from_dict`, the one alias table (`grpo.config.SPELLINGS`): each field
is compared by its current name and meaning (``normalize_advantages=True`` is
``advantage_scale='group'``; ``num_mini_batches=2`` of ``batch_size=4`` is ``mini_batch_size=2``),
and a field the saved config lacks (saved before the field existed) is its default.

A saved config is untrusted input, and this comparison only informs a warning, so reading it never
fails the load: a name this grpo does not know is reported as a difference under its saved name,
and a config that is not a valid `GRPOConfig` here (a value out of range, a choice of a later
version) is compared as saved, the warning saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpo.config import SPELLINGS, GRPOConfig
from grpo.runtime.spellings import read_spellings
from grpo.state.checkpoint.codec import TensorTable
from grpo.state.checkpoint.errors import short
from grpo.state.checkpoint.tree import encode

__all__ = ["ConfigDiff", "config_differences"]


@dataclass(frozen=True)
class ConfigDiff:
    """The fields in which a saved config differs from the live one (current names, sorted; a name
    unknown to this grpo as saved), their saved and live values, and why the saved config was
    compared as saved ("" when it was read by `GRPOConfig.from_dict`)."""

    names: list[str]
    saved: list[Any]
    now: list[Any]
    unread: str = ""

    def warning(self, ckpt: object) -> str:
        """The message of the warning `load_checkpoint` gives after loading ``ckpt``."""
        return (
            f"loading {ckpt} into a trainer whose config differs in {self.names} "
            f"(saved: {[short(v) for v in self.saved]}, now: {self.now}); "
            f"the run will not continue exactly as the saved one.{self.unread}"
        )


def _read(saved: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``saved`` with every field under its current name and meaning (`GRPOConfig.from_dict`; the
    fields it lacks at their defaults) and names unknown here as they are. When it is not a valid
    `GRPOConfig` here: its values unchecked, under current names where the spellings map them
    (else as saved), with a sentence saying why."""
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    known = set(fields) | {name for name, spelling in SPELLINGS.items() if spelling.accepted}
    given = {k: v for k, v in saved.items() if k in known}
    unknown = {k: v for k, v in saved.items() if k not in known}
    try:
        config = GRPOConfig.from_dict(given)
    except Exception as e:  # untrusted values: the reason goes into the warning, the load goes on
        text = str(e)  # it may quote a huge saved value: its start and its end
        why = f"{type(e).__name__}: {text if len(text) <= 300 else text[:150] + ' ... ' + text[-150:]}"
        note = f" (The saved config is not a valid GRPOConfig here, compared unchecked: {why}.)"
        try:
            return {**fields, **read_spellings(given, SPELLINGS, fields), **unknown}, note
        except Exception:  # a spelling's value it cannot map
            return dict(saved), note
    return {**encode(config.to_dict(), TensorTable().add, "config"), **unknown}, ""


def config_differences(saved: Mapping[str, Any], config: GRPOConfig) -> ConfigDiff:
    """How ``saved`` (a checkpoint's ``state.json`` ``config``: plain values, checked by
    `grpo.state.checkpoint.meta`) differs from ``config`` (the live trainer's), by current names."""
    now = encode(config.to_dict(), TensorTable().add, "config")
    read, unread = _read(saved)
    names = sorted(k for k in set(read) | set(now) if read.get(k) != now.get(k))
    return ConfigDiff(names, [read.get(k) for k in names], [now.get(k) for k in names], unread)
