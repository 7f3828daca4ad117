"""The sampler's log-probs of what ``generate`` samples, read while it samples.

`ChosenTokenLogProbs` is a Hugging Face ``LogitsProcessor``. ``generate`` runs a user's
processors after its own logits processors (the repetition penalty, the ``min_new_tokens`` EOS
ban) and before its sampling warpers (temperature, top-k, top-p, min-p), so at step t it receives
those scores s_t (n, V) and keeps ``log_softmax(s_t / temperature)``, the distribution the token
is drawn from when no top-k / top-p / min-p truncates it (the caller checks). At step t + 1 the
token y_t drawn at t is the last column of ``input_ids``, so it records

    logp_sampler[:, t] = log_softmax(s_t / temperature)[y_t]     (n,)

and the last step's is read after ``generate`` returns (`finish`). Only one step's (n, V) scores
are held, never the (n, T, V) that ``output_scores`` would keep. These equal the trainer's
log-probs of the completion (the same temperature and EOS ban) up to the float error of a cached
decode.

A generation engine with its own weights (`grpo.generation.worker`) uses them as the sampler's
log-probs of an async rollout, instead of a second forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["ChosenTokenLogProbs"]


class ChosenTokenLogProbs:
    """A ``LogitsProcessor`` (transformers' call signature) that records the log-prob of each
    sampled token under the processed scores it was drawn from. It returns ``scores`` unchanged.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = float(temperature)
        self._last: Tensor | None = None  # (n, V) log_softmax of the previous step's scores
        self._columns: list[Tensor] = []  # one (n,) per sampled token

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self._last is not None:
            self._columns.append(self._chosen(input_ids[:, -1]))
        self._last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _chosen(self, tokens: Tensor) -> Tensor:
        assert self._last is not None
        return self._last.gather(1, tokens.unsqueeze(1).to(self._last.device)).squeeze(1)

    def finish(self, sequences: Tensor) -> Tensor:
        """(n, T') log-probs of the T' generated tokens (the last T' columns of ``sequences``,
        what ``generate`` returned); columns after a row's EOS hold the padding's values, which
        the caller masks."""
        if self._last is not None:
            self._columns.append(self._chosen(sequences[:, -1]))
            self._last = None
        n = int(sequences.shape[0])
        out = torch.stack(self._columns, dim=1) if self._columns else torch.zeros(n, 0)
        self._columns = []
        return out.cpu()

    def processors(self, transformers: Any) -> Any:
        """A ``LogitsProcessorList`` holding only this processor (``generate`` appends the user's
        list after its own processors, so it sees the final scores)."""
        return transformers.LogitsProcessorList([self])
