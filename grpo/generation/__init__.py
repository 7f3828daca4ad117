"""Generation engines (who samples the actions, with which weights) and async rollouts.

`engine`: the `GenerationEngine` protocol, `Generated` (actions, sampler log-probs, policy
version) and the in-process engine; `worker`: a generation worker process with weight sync;
`worker_lifetime`: the worker dies with its trainer and leaves no model copy behind;
`vllm_engine`: vLLM (optional extra); `async_rollouts`: `PrefetchingEngine`, generation k steps
ahead; `setup`: `make_engine` from `GRPOConfig`.
"""

from grpo.generation.async_rollouts import PrefetchingEngine
from grpo.generation.engine import (
    Generated,
    GenerationEngine,
    InProcessEngine,
    PendingGeneration,
    ReadyGeneration,
    engine_metrics,
)

__all__ = [
    "Generated",
    "GenerationEngine",
    "InProcessEngine",
    "PendingGeneration",
    "PrefetchingEngine",
    "ReadyGeneration",
    "engine_metrics",
]
