"""`Completion`: one sampled completion, the action of the LLM path.

Every sampler of a causal LM builds these (`grpo.llm.CausalLMPolicy`, the generation worker's
copy of it, the vLLM engines, `grpo.llm.multiturn`), and `CausalLMPolicy.evaluate_actions` scores
them. It lives apart from the policy so that the engines, which the policy builds
(`CausalLMPolicy.generation_engine`), need no import of the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Completion"]


@dataclass(frozen=True, eq=False)
class Completion:
    """One sampled completion (the action of the LLM path).

    Attributes:
        prompt_ids: (P,) int64, the prompt's token ids (no padding), on CPU.
        token_ids: (T,) int64, the completion's token ids, ending with the EOS token when
            ``finished``; no padding. On CPU.
        text: the decoded completion (special tokens skipped).
        finished: True if generation stopped at an EOS token, False if cut at the token limit
            (``max_new_tokens``, or what ``max_model_len`` leaves after the prompt).
        temperature: the temperature it was sampled at (log-probs are computed at it).
        min_new_tokens: EOS was forbidden at its first ``min_new_tokens`` positions when it was
            sampled; log-probs are computed with the same ban (the density it was drawn from).
        loss_mask: None (every token is the model's and scored), or (T,) bool: False at tokens
            that stay in the context but are not the model's (a multi-turn episode's environment
            tokens, `grpo.llm.multiturn`): their log-probs are 0 and masked out of the loss.
    """

    prompt_ids: Tensor
    token_ids: Tensor
    text: str
    finished: bool
    temperature: float = 1.0
    min_new_tokens: int = 0
    loss_mask: Tensor | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def truncated(self) -> bool:
        """True when it hit the token limit without ending (``not finished``): the generic flag
        ``GRPOConfig.mask_truncated_completions`` and the step's ``completion/*`` metrics read."""
        return not self.finished

    def __str__(self) -> str:
        return self.text

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle the ids as lists of ints (a worker's reply, a process boundary): torch's reducer
        costs ~60 us a tensor (10 ms a batch of 64 on a small CPU), lists a few percent of it."""
        mask = None if self.loss_mask is None else self.loss_mask.tolist()
        ids = (self.prompt_ids.tolist(), self.token_ids.tolist())
        return _completion_from_lists, (
            *ids,
            self.text,
            self.finished,
            self.temperature,
            self.min_new_tokens,
            mask,
        )


def _completion_from_lists(
    prompt_ids: list[int],
    token_ids: list[int],
    text: str,
    finished: bool,
    temperature: float,
    min_new_tokens: int,
    loss_mask: list[bool] | None,
) -> Completion:
    """`Completion.__reduce__`'s inverse: int64 (and bool) tensors on CPU."""
    mask = None if loss_mask is None else torch.tensor(loss_mask, dtype=torch.bool)
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    tokens = torch.tensor(token_ids, dtype=torch.long)
    return Completion(prompt, tokens, text, finished, temperature, min_new_tokens, mask)
