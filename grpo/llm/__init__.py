"""grpo.llm: the Hugging Face path — a causal-LM policy, reward helpers, prompt data, a CLI.

Needs the ``llm`` extra (``pip install 'torch-grpo[llm]'``, or ``pip install -e '.[llm]'`` in a
checkout: transformers, peft, accelerate, safetensors, datasets, pyyaml, tqdm). ``import grpo``
never imports this package.

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, RewardFunctions, exact_match_reward, PromptDataset

    policy = CausalLMPolicy(model, tokenizer, max_new_tokens=256, temperature=0.7)
    reward = RewardFunctions({"correct": exact_match_reward(), "format": format_reward()})
    trainer = GRPOTrainer(GRPOConfig(group_size=8, kl_coeff=0.0), policy, reward,
                          reference_policy=policy.reference_policy())
    for batch in PromptDataset.from_jsonl("train.jsonl").batches(8):
        metrics = trainer.step(batch)

See docs/llm.md.
"""

from __future__ import annotations

from grpo.runtime.extras import install_hint as _install_hint

try:
    import transformers  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        f"grpo.llm needs Hugging Face transformers, which is not installed ({_e}). "
        f"Install the LLM extra: {_install_hint('llm')}"
    ) from _e

from grpo.llm.data import PromptDataset, prompt_text
from grpo.llm.logprobs import chunked_token_logprobs, naive_token_logprobs
from grpo.llm.policy import CausalLMPolicy, Completion, DisabledAdapterReference
from grpo.llm.rewards import (
    RewardFunctions,
    after_marker,
    boxed_answer,
    exact_match_reward,
    format_reward,
    last_number,
    overlong_penalty,
    tag_content,
)

__all__ = [
    "CausalLMPolicy",
    "Completion",
    "DisabledAdapterReference",
    "PromptDataset",
    "RewardFunctions",
    "after_marker",
    "boxed_answer",
    "chunked_token_logprobs",
    "exact_match_reward",
    "format_reward",
    "last_number",
    "naive_token_logprobs",
    "overlong_penalty",
    "prompt_text",
    "tag_content",
]
