"""`CausalLM`: what the generation engines read of the causal-LM policy they sample for.

`grpo.llm.CausalLMPolicy` satisfies it. The engines take this protocol, not the class: the
policy builds its engines (`CausalLMPolicy.generation_engine`, the
`grpo.generation.engine.EngineProvider` hook), so an engine that imported the policy's module
would import back the module that imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from grpo.llm.sampling_settings import SamplingSettings
from grpo.policy_base import PolicyModel

__all__ = ["CausalLM"]


@runtime_checkable
class CausalLM(PolicyModel, Protocol):
    """A `PolicyModel` over a Hugging Face causal LM, with its tokenizer, sampling settings and
    prompt and scoring options (the attributes of `grpo.llm.CausalLMPolicy` of the same names;
    its trainable tensors by name). The worker rebuilds one in its process with
    ``type(policy)(model, tokenizer, sampling, **options)``."""

    model: Any
    tokenizer: Any
    sampling: SamplingSettings
    eos_token_ids: list[int]
    is_peft: bool
    use_chat_template: bool | None
    system_prompt: str | None
    max_prompt_length: int | None
    logprob_chunk_size: int | None
    autocast: bool
    compile_logprobs: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def is_partitioned(self) -> bool: ...

    def encode_prompt(self, state: Any) -> list[int]: ...

    def get_parameters(self) -> Mapping[str, Tensor]: ...

    def save_pretrained(self, directory: str) -> None: ...
