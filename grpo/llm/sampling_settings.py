"""`SamplingSettings`: how a causal LM samples its completions, in one validated object.

One frozen dataclass carries every sampling setting of the LLM path. `grpo.llm.CausalLMPolicy`
takes it (``CausalLMPolicy(model, tokenizer, SamplingSettings(temperature=0.7))``), the
generation worker carries it to its copy of the policy, the vLLM engines translate it into
vLLM's ``SamplingParams`` (`grpo.llm.engines.vllm_engine.sampling_params_kwargs`), and the
CLI builds it once from its flags. A call's overrides (``generate_actions(..., temperature=t)``)
are `SamplingSettings.replace`, checked by the same code.

The fields that shape the sampled distribution (temperature, top_p, top_k, min_p,
repetition_penalty, min_new_tokens) are recorded per completion where the trainer needs them to
score it: the temperature and the ``min_new_tokens`` EOS ban are part of the scored density;
top-k / top-p / min-p truncation and the repetition penalty shape sampling only (as in TRL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["REMOVED_SETTINGS", "SamplingSettings"]

#: Sampling settings that existed and were removed, with what to do instead: a config file, a
#: flag or a keyword that still names one is refused with this text (not "unknown").
REMOVED_SETTINGS: dict[str, str] = {
    "decoding": (
        "was removed in grpo 0.3 (issue 42): Hugging Face generate is the one in-process sampler "
        "(the KV-cache loop of decoding='auto' drew generate's tokens bitwise and bought no "
        "measurable share of a step, benchmarks/RESULTS.md). Leave it out: every run samples as "
        "before"
    ),
}


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings of a `grpo.llm.CausalLMPolicy` (and of the engines sampling for it).

    Every field is checked when the object is built (ValueError naming the field, the value and
    a valid one), so a policy, an engine or a call never sees an invalid one.
    """

    max_new_tokens: int = 256
    """Completion length limit in tokens (>= 1)."""
    min_new_tokens: int = 0
    """EOS is forbidden at the first ``min_new_tokens`` positions of every completion (Hugging
    Face's ``MinNewTokensLengthLogitsProcessor``, vLLM's ``min_tokens``); log-probs are computed
    with the same ban, so they are the density the tokens were drawn from. 0 = off."""
    temperature: float = 1.0
    """Logits are divided by it before sampling, and before scoring (> 0: GRPO needs a density,
    greedy decoding has none)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``, in
    (0, 1]; 1 = off. Shapes sampling only (not the scored density)."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens, >= 0; 0 = off. Shapes sampling only."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely one's, in [0, 1);
    0 = off. Shapes sampling only."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on the logits of tokens already in the context, > 0; 1 = off. Shapes
    sampling only."""
    max_model_len: int | None = None
    """Context window: prompt + completion tokens <= ``max_model_len``. A completion's budget is
    ``min(max_new_tokens, max_model_len - prompt length)``; a prompt that leaves no room raises
    ValueError. None = no limit besides ``max_new_tokens``."""
    generation_batch_size: int | None = None
    """Sequences sampled together (memory); None = all at once. The seed's
    ``hf_generate_chunk_size`` (prompts per call) is this divided by G. Chunking keeps the
    sampling distribution; the samples differ from one call's for the same seed (the random
    stream is consumed in another order). The vLLM engines schedule by themselves and ignore it."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SamplingSettings.{name}={value!r} must be an int.")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingSettings.{name}={value!r} must be a float.")
            object.__setattr__(self, name, float(value))
        _check_ranges(self)

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingSettings:
        """Refuse a removed setting (`REMOVED_SETTINGS`) by name, before the fields are read."""
        _refuse_removed(kwargs)
        return super().__new__(cls)

    def replace(self, **overrides: Any) -> SamplingSettings:
        """A copy with ``overrides`` (checked as a new object is); TypeError naming a removed
        setting and what to do, or an unknown name and the known ones."""
        _refuse_removed(overrides)
        unknown = sorted(set(overrides) - set(self.names()))
        if unknown:
            raise TypeError(f"unknown sampling settings {unknown}; known: {sorted(self.names())}.")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, in order: what ``generate_actions(**overrides)`` accepts."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def completion_budgets(self, prompt_lengths: Sequence[int]) -> list[int]:
        """Tokens each completion may have: ``min(max_new_tokens, max_model_len - P)`` for a prompt
        of P tokens (``max_new_tokens`` without ``max_model_len``). ValueError for a prompt that
        leaves no room, naming its length and the limit."""
        limit = self.max_model_len
        if limit is None:
            return [self.max_new_tokens] * len(prompt_lengths)
        too_long = [(i, n) for i, n in enumerate(prompt_lengths) if n >= limit]
        if too_long:
            i, n = too_long[0]
            raise ValueError(
                f"prompt {i} has {n} tokens, which leaves no room for a completion within "
                f"max_model_len={limit} (prompt + completion tokens). Shorten the prompt, raise "
                f"max_model_len, or set CausalLMPolicy(max_prompt_length=...) below {limit} to keep "
                f"only the last prompt tokens."
            )
        return [min(self.max_new_tokens, limit - n) for n in prompt_lengths]

    @property
    def only_temperature(self) -> bool:
        """True when no top-k / top-p / min-p truncation and no repetition penalty shapes the
        distribution (only the temperature and the min_new_tokens ban do)."""
        return self.top_k == 0 and self.top_p >= 1.0 and self.min_p == 0.0 and self.repetition_penalty == 1.0


def _check_ranges(s: SamplingSettings) -> None:
    """ValueError naming the first field of ``s`` out of range, its value and the fix."""
    if s.max_new_tokens < 1:
        raise ValueError(f"SamplingSettings.max_new_tokens={s.max_new_tokens!r} must be >= 1.")
    if s.min_new_tokens < 0:
        raise ValueError(
            f"SamplingSettings.min_new_tokens={s.min_new_tokens!r} must be >= 0 (0 = EOS allowed "
            "from the first token)."
        )
    if not s.temperature > 0:
        raise ValueError(
            f"SamplingSettings.temperature={s.temperature!r} must be > 0: GRPO needs sampled "
            "completions and their log-probs (greedy decoding has no density). Use e.g. 0.7 or 1.0."
        )
    if not 0 < s.top_p <= 1:
        raise ValueError(
            f"SamplingSettings.top_p={s.top_p!r} must be in (0, 1]; 1 switches nucleus sampling off."
        )
    if s.top_k < 0:
        raise ValueError(f"SamplingSettings.top_k={s.top_k!r} must be >= 0; 0 switches top-k off.")
    if not 0 <= s.min_p < 1:
        raise ValueError(f"SamplingSettings.min_p={s.min_p!r} must be in [0, 1); 0 switches it off.")
    if not s.repetition_penalty > 0:
        raise ValueError(
            f"SamplingSettings.repetition_penalty={s.repetition_penalty!r} must be > 0 (1 = off)."
        )
    for name in ("max_model_len", "generation_batch_size"):
        value = getattr(s, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"SamplingSettings.{name}={value!r} must be an integer >= 1 or None (no limit).")


def _refuse_removed(names: Iterable[str]) -> None:
    """TypeError for the first of ``names`` that is a removed setting, saying why and what to do."""
    for name in names:
        if name in REMOVED_SETTINGS:
            raise TypeError(f"SamplingSettings.{name} {REMOVED_SETTINGS[name]}.")
