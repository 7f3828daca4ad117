"""A generation worker for a `grpo.llm.CausalLMPolicy`: the policy saved, rebuilt in the worker.

``GRPOConfig.generation_engine="worker"`` with a causal LM. `causal_lm_worker` saves the
policy's model (with LoRA: the base model and the active adapter) and tokenizer to a temporary
directory and starts a `grpo.generation.worker.WorkerEngine` whose process rebuilds the policy
from it (`load_causal_lm_policy`) with the trainer's policy's `SamplingSettings` object and its
prompt and scoring options; the generic engine (process, pipe, shared-memory weight sync,
lifetime) knows nothing of language models.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo.generation.worker import DeferredCall, WorkerEngine
from grpo.generation.worker_lifetime import owned_temp_dir, remove_owned_dir
from grpo.llm._deps import require
from grpo.llm.engines.causal_lm import CausalLM
from grpo.llm.lora import base_model_state_dict
from grpo.llm.sampling_settings import SamplingSettings
from grpo.policy_base import PolicyModel

__all__ = ["causal_lm_factory", "causal_lm_worker", "load_causal_lm_policy", "save_causal_lm"]


def causal_lm_worker(
    policy: PolicyModel,
    *,
    seed: int | None = None,
    name: str = "grpo-generation-worker",
    num_threads: int = 1,
    device: str | None = None,
) -> WorkerEngine:
    """A `WorkerEngine` sampling for ``policy`` (a `grpo.llm.CausalLMPolicy`) in its own process,
    with a copy built by `causal_lm_factory` on ``device`` (None = the policy's). TypeError for a
    policy that is no `CausalLM`: pass ``WorkerEngine(make_policy)`` yourself."""
    if not isinstance(policy, CausalLM):
        raise TypeError(
            f"causal_lm_worker copies a grpo.llm.CausalLMPolicy (saved with save_pretrained); got "
            f"{type(policy).__name__}. Build the engine yourself with "
            f"grpo.generation.worker.WorkerEngine(make_policy, seed=...), make_policy a picklable "
            f"function that builds the same policy in the worker, and pass it as "
            f"GRPOTrainer(..., engine=engine)."
        )
    directory = owned_temp_dir("grpo-worker-")  # removes copies whose trainer was killed
    try:
        make = causal_lm_factory(policy, directory, device=device)
    except BaseException:
        remove_owned_dir(directory)
        raise
    return WorkerEngine(make, seed=seed, name=name, num_threads=num_threads, cleanup_dir=directory)


def causal_lm_factory(policy: CausalLM, directory: str, *, device: str | None = None) -> DeferredCall:
    """Save ``policy`` to ``directory`` (`save_causal_lm`) and return the picklable call that
    rebuilds it there (`load_causal_lm_policy`): its class, the same `SamplingSettings` object, prompt options
    (chat template, system prompt, prompt length) and scoring options (log-prob chunk, autocast,
    compile), none of the training-only ones (gradient checkpointing: the worker runs no
    backward; a separate reference adapter: the KL reference stays the trainer's). A
    `DeferredCall`: the worker imports this package (transformers) only when it builds the policy,
    after it watches for its trainer's death."""
    return DeferredCall(
        load_causal_lm_policy,
        type(policy),
        directory,
        policy.sampling,
        adapter=save_causal_lm(policy, directory),
        dtype=next(iter(policy.model.parameters())).dtype,
        device=str(policy.device) if device is None else device,
        use_chat_template=policy.use_chat_template,
        system_prompt=policy.system_prompt,
        max_prompt_length=policy.max_prompt_length,
        logprob_chunk_size=policy.logprob_chunk_size,
        autocast=policy.autocast,
        compile_logprobs=policy.compile_logprobs,
    )


def save_causal_lm(policy: CausalLM, directory: str) -> str | None:
    """Save ``policy``'s model and tokenizer to ``directory/base`` (a PEFT model: its base model
    there, the active adapter to ``directory/adapter``). Returns the adapter's name, or None.
    The base of a PEFT model is its weights without the adapters
    (`grpo.llm.lora.base_model_state_dict`: no copy of the model)."""
    base_dir = os.path.join(directory, "base")
    model = policy.model
    if not policy.is_peft:
        policy.save_pretrained(base_dir)
        return None
    adapter = model.active_adapter
    if not isinstance(adapter, str):
        raise TypeError(
            f"the PEFT model has several active adapters {adapter!r}; the worker rebuilds one. "
            f"Pass WorkerEngine(make_policy) that builds the worker's model instead."
        )
    model.get_base_model().save_pretrained(
        base_dir, state_dict=base_model_state_dict(model), safe_serialization=True
    )
    policy.tokenizer.save_pretrained(base_dir)
    model.save_pretrained(os.path.join(directory, "adapter"), selected_adapters=[adapter])
    return str(adapter)


def load_causal_lm_policy(
    policy_class: Callable[..., CausalLM],
    directory: str,
    sampling: SamplingSettings,
    *,
    adapter: str | None,
    dtype: torch.dtype,
    device: str,
    **options: Any,
) -> CausalLM:
    """The worker's policy, a ``policy_class`` (`grpo.llm.CausalLMPolicy`) built from what
    `save_causal_lm` wrote to ``directory``: the base
    model in ``dtype`` (with ``adapter``: PEFT's adapter on it, trainable so that
    ``get_parameters`` names the trainer's tensors), on ``device``, with ``sampling`` and the
    other constructor ``options``."""
    transformers = require("transformers")
    base_dir = Path(directory) / "base"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    if adapter is not None:
        peft = require("peft")
        where = Path(directory) / "adapter"
        where = where if adapter == "default" else where / adapter
        model = peft.PeftModel.from_pretrained(model, str(where), adapter_name=adapter, is_trainable=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base_dir))
    model.to(device)
    return policy_class(model, tokenizer, sampling, **options)
