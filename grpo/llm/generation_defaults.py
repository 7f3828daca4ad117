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
the model's config says about them is lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["model_generation_defaults_off"]


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
