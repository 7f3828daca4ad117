"""`make_engine`: the generation engine a `GRPOConfig` asks for (``generation_engine``), wrapped
for async rollouts when ``async_staleness >= 1``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.generation.async_rollouts import PrefetchingEngine
from grpo.generation.engine import GenerationEngine, InProcessEngine
from grpo.policy_base import PolicyModel

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = ["make_engine"]


def make_engine(
    config: GRPOConfig, policy: PolicyModel, engine: GenerationEngine | None = None
) -> GenerationEngine:
    """``engine`` (a user's own), or the one ``config.generation_engine`` names: ``"hf"`` =
    `InProcessEngine`, ``"worker"`` = `grpo.generation.worker.WorkerEngine`, ``"vllm"`` =
    `grpo.generation.vllm_engine.VLLMEngine` (both imported only when asked for); with
    ``config.async_staleness >= 1`` wrapped in a `PrefetchingEngine`."""
    if engine is None:
        engine = _named_engine(config, policy)
    elif not isinstance(engine, GenerationEngine):
        raise TypeError(
            f"engine={type(engine).__name__} is not a grpo.generation.GenerationEngine: it needs version, "
            f"owns_weights, submit(states, G, with_log_probs=...), sync(policy, version) and close()."
        )
    if config.async_staleness > 0:
        return PrefetchingEngine(engine, config.async_staleness)
    return engine


def _named_engine(config: GRPOConfig, policy: PolicyModel) -> GenerationEngine:
    name = config.generation_engine
    if name == "hf":
        return InProcessEngine(policy)
    if name == "worker":
        from grpo.generation.worker import WorkerEngine

        return WorkerEngine.for_policy(policy, seed=config.seed)
    from grpo.generation.vllm_engine import VLLMEngine

    return VLLMEngine.for_policy(policy, seed=config.seed)
