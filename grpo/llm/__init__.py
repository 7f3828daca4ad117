"""grpo.llm: the Hugging Face path — a causal-LM policy, reward helpers, prompt data, model
checkpoints, multi-turn episodes against text environments, a CLI.

Needs the ``llm`` extra (``pip install 'torch-grpo[llm]'``, or ``pip install -e '.[llm]'`` in a
checkout: transformers, peft, accelerate, safetensors, datasets, pyyaml, tqdm). ``import grpo``
never imports this package.

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import (CausalLMPolicy, PromptDataset, RewardFunctions, SamplingSettings,
                          exact_match_reward, format_reward, save_llm_checkpoint)

    policy = CausalLMPolicy(model, tokenizer, SamplingSettings(max_new_tokens=256, temperature=0.7))
    reward = RewardFunctions({"correct": exact_match_reward(), "format": format_reward()})
    trainer = GRPOTrainer(GRPOConfig(group_size=8, kl_coeff=0.04), policy, reward)
    for batch in PromptDataset.load("train.jsonl").batches(8):  # also parquet, csv, a Dataset
        metrics = trainer.step(batch)
    save_llm_checkpoint(trainer, "final_model")  # LoRA: the adapter only

The KL reference needs no argument: a LoRA policy offers its model with the adapter disabled
(`DisabledAdapterReference`, no second copy) or, with ``use_separate_reference_adapter=True``, a
frozen second adapter (`SeparateAdapterReference`); for full fine-tuning the trainer keeps a
frozen copy. Reward functions may follow grpo's positional convention or TRL's keyword one
(`reward_signature`). See docs/llm.md.

Multi-turn episodes (`grpo.llm.multiturn`, docs/multiturn.md): `MultiTurnPolicy` plays a
`CausalLMPolicy` against a `grpo.envs.TextEnvironment`, each whole episode one action (a
`Conversation`, environment tokens masked out of the loss); `ConversationReward` scores it (the
cumulative episode reward, or turn-level credit); `MultiTurnReference` is its KL reference.
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

from grpo.generation.pending_state import register_action_codec as _register_action_codec
from grpo.llm import liger as _liger  # noqa: F401  (registers Liger's loss: use_liger_loss)
from grpo.llm.checkpoint import LoadedCheckpoint, load_llm_checkpoint, save_llm_checkpoint
from grpo.llm.completion import Completion
from grpo.llm.completion_state import COMPLETIONS as _COMPLETIONS
from grpo.llm.data import PromptBatches, PromptDataset, ShuffledRecords, prompt_text
from grpo.llm.logprobs import chunked_token_logprobs, naive_token_logprobs
from grpo.llm.lora import SeparateAdapterReference
from grpo.llm.multiturn import Conversation, ConversationReward, MultiTurnPolicy, MultiTurnReference
from grpo.llm.policy import CausalLMPolicy, DisabledAdapterReference
from grpo.llm.rewards import (
    RewardFunctions,
    RewardSignature,
    after_marker,
    boxed_answer,
    exact_match_reward,
    format_reward,
    last_number,
    overlong_penalty,
    reward_signature,
    tag_content,
)
from grpo.llm.sampling_settings import SamplingSettings

__all__ = [
    "CausalLMPolicy",
    "Completion",
    "Conversation",
    "ConversationReward",
    "DisabledAdapterReference",
    "LoadedCheckpoint",
    "MultiTurnPolicy",
    "MultiTurnReference",
    "PromptBatches",
    "PromptDataset",
    "RewardFunctions",
    "RewardSignature",
    "SamplingSettings",
    "SeparateAdapterReference",
    "ShuffledRecords",
    "after_marker",
    "boxed_answer",
    "chunked_token_logprobs",
    "exact_match_reward",
    "format_reward",
    "last_number",
    "load_llm_checkpoint",
    "naive_token_logprobs",
    "overlong_penalty",
    "prompt_text",
    "reward_signature",
    "save_llm_checkpoint",
    "tag_content",
]

_register_action_codec(_COMPLETIONS)  # checkpoints hold the completions drawn ahead (async rollouts)
