"""`make_engine`: the generation engine a `GRPOConfig` asks for (``generation_engine``), wrapped
for async rollouts when ``async_staleness >= 1``. An engine that runs elsewhere (``"worker"``,
``"vllm"``) is built by the policy (`grpo.generation.engine.EngineProvider`), so this package
imports no wing (`grpo.llm` holds the causal LM's engines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.generation.async_rollouts import PrefetchingEngine
from grpo.generation.engine import EngineProvider, GenerationEngine, InProcessEngine
from grpo.policy_base import PolicyModel

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

__all__ = ["make_engine"]


def make_engine(
    config: GRPOConfig, policy: PolicyModel, engine: GenerationEngine | None = None
) -> GenerationEngine:
    """``engine`` (a user's own), or the one ``config.generation_engine`` names: ``"hf"`` =
    `InProcessEngine`, ``"worker"`` / ``"vllm"`` = ``policy.generation_engine(name, seed=...)``
    (a `grpo.llm.CausalLMPolicy`: `grpo.llm.engines.worker.causal_lm_worker`,
    `grpo.llm.engines.vllm_engine.VLLMEngine`); with ``config.async_staleness >= 1`` wrapped in a
    `PrefetchingEngine`."""
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
    """``"hf"``: `InProcessEngine`; any other name: the policy builds it (`EngineProvider`)."""
    name = config.generation_engine
    if name == "hf":
        return InProcessEngine(policy)
    if not isinstance(policy, EngineProvider):
        raise TypeError(
            f"generation_engine={name!r} copies the policy into another place to run, which "
            f"{type(policy).__name__} cannot build (it has no generation_engine(name, seed=...) "
            f"method; grpo.llm.CausalLMPolicy has). Use generation_engine='hf', or build the engine "
            f"yourself (e.g. grpo.generation.worker.WorkerEngine(make_policy, seed=...)) and pass "
            f"GRPOTrainer(..., engine=engine)."
        )
    return policy.generation_engine(name, seed=config.seed)
