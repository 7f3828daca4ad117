"""Sampling exactly what the policy says: no defaults of the model's or of transformers'.

``generate`` fills every field its ``generation_config`` leaves ``None``, first from the model's
own ``generation_config`` (a checkpoint's generation_config.json: Qwen2.5-Instruct ships
``top_k=20, top_p=0.8, repetition_penalty=1.05``) and then from transformers' global defaults,
of which one is not neutral: ``top_k=50``. Either would make the sampler draw from a truncated or
penalised distribution while the trainer scores the full one at the policy's temperature, so the
ratio, the KL term and the sampler correction would all be computed against a distribution that
never produced the tokens (TRL issue #5783 is this bug).

`CausalLMPolicy` therefore sets every sampling field it owns explicitly (``top_k=0``, not None,
for "off") and calls ``generate`` inside `model_generation_defaults_off`, which hides the model's
``generation_config`` behind an empty one for the duration of the call, as older transformers'
``generate(use_model_defaults=False)`` did. The EOS and pad ids are passed explicitly, so nothing
the model's config says about them is lost. The settings a checkpoint ships and the policy does
not apply are named in a warning when the policy is built (`log_unapplied_checkpoint_settings`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "checkpoint_sampling_settings",
    "log_unapplied_checkpoint_settings",
    "model_generation_defaults_off",
]

logger = logging.getLogger(__name__)

# the sampling fields of a GenerationConfig and the values at which they change nothing
_NEUTRAL: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
}


def checkpoint_sampling_settings(model: Any) -> dict[str, Any]:
    """The sampling fields ``model.generation_config`` sets to a value that would change the
    distribution (e.g. Qwen2.5-Instruct's ``{"temperature": 0.7, "top_k": 20, "top_p": 0.8,
    "repetition_penalty": 1.05}``); {} when it sets none or has no generation_config. A policy
    samples with its own settings instead: `CausalLMPolicy` logs these
    (`log_unapplied_checkpoint_settings`) so nobody expects them to apply."""
    cfg = getattr(model, "generation_config", None)
    if cfg is None:
        return {}
    fresh = type(cfg)()  # the library's own defaults (transformers 4.x: top_k=50) are not the checkpoint's
    out = {}
    for name, neutral in _NEUTRAL.items():
        value = getattr(cfg, name, None)
        if value is not None and value != neutral and value != getattr(fresh, name, None):
            out[name] = value
    return out


@contextlib.contextmanager
def model_generation_defaults_off(model: Any, transformers: Any) -> Iterator[None]:
    """During the ``with`` block, ``model.generation_config`` is an empty ``GenerationConfig``;
    the model's own is put back afterwards, also when ``generate`` raises. ``model``: the Hugging
    Face model whose ``generate`` runs (the base model under a PEFT wrapper)."""
    own = getattr(model, "generation_config", None)
    if own is None:
        yield
        return
    model.generation_config = transformers.GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


def log_unapplied_checkpoint_settings(model: Any, own: Mapping[str, Any]) -> None:
    """A warning naming the sampling settings of ``model``'s generation_config that are not
    applied (`checkpoint_sampling_settings`) and the policy's ``own`` that are; nothing when the
    checkpoint sets none."""
    ignored = checkpoint_sampling_settings(model)
    if ignored:
        logger.warning(
            "the model's generation_config sets %s; CausalLMPolicy samples with its own settings (%s), "
            "which the trainer scores. Pass any of these to CausalLMPolicy to use them.",
            ", ".join(f"{k}={v!r}" for k, v in ignored.items()),
            ", ".join(f"{k}={v!r}" for k, v in own.items()),
        )
