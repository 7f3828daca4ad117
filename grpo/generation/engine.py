"""The generation engine seam: who samples the actions, with which weights.

Step 1 of `GRPOTrainer.step` asks an engine for B groups of G actions. An engine returns them
as a `Generated`: the actions, the sampler's log-probs of them when it reports them, and the
**policy version** of the weights that sampled them (the trainer's ``step_count`` when the
engine last received its weights). After every update the trainer hands the engine the new
weights (`GenerationEngine.sync`, step 4).

Three engines satisfy the protocol:

- `InProcessEngine` (``GRPOConfig.generation_engine="hf"``, the default): the trainer's own
  policy object generates (Hugging Face ``generate`` for a language model). No copy of the
  weights, nothing to sync; exactly today's synchronous step.
- `grpo.generation.worker.WorkerEngine` (``"worker"``): a copy of the policy in its own process
  that receives the trainable weights after each update through shared memory (a causal LM's
  copy: `grpo.llm.engines.worker.causal_lm_worker`).
- `grpo.llm.engines.vllm_engine.VLLMEngine` (``"vllm"``, optional): vLLM in the
  trainer's process, on CUDA or with vLLM's CPU build.

An engine named in the config other than ``"hf"`` comes from the policy
(`EngineProvider.generation_engine`): the core never imports a wing's engines.

``submit`` starts a generation and returns a handle; `PendingGeneration.result` waits for it.
An engine with its own weights (worker, vLLM) runs the generations and weight syncs it is given
in the order they were submitted, so a generation submitted before ``sync(v)`` samples with the
weights before ``v``: that is what lets `grpo.generation.async_rollouts.PrefetchingEngine`
overlap the next batch's generation with the current update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from grpo.policy_base import PolicyModel, PolicyOutput, has_method, set_training_mode

__all__ = [
    "EngineProvider",
    "Generated",
    "GenerationEngine",
    "InProcessEngine",
    "PendingGeneration",
    "ReadyGeneration",
    "engine_metrics",
]


@dataclass(frozen=True)
class Generated:
    """One generation call's output: B groups of G actions.

    Attributes:
        states: the B states generated for (the object passed to ``submit``).
        actions: the actions as the policy's ``generate_actions`` returns them (B groups of G,
            or N = B*G flat, group-major).
        log_probs: the sampler's log-probs of the N flat actions, ``(N, T)`` (or a
            `PolicyOutput`), as ``get_log_probabilities`` would return them; None when the
            engine was not asked for them and computes none.
        version: the policy version that sampled them: the trainer's ``step_count`` when the
            engine last received weights (0 = the initial weights).
    """

    states: Any
    actions: Any
    log_probs: Tensor | PolicyOutput | None
    version: int


class PendingGeneration(Protocol):
    """A submitted generation; ``result()`` waits for it (once)."""

    def result(self) -> Generated: ...


@dataclass(frozen=True)
class ReadyGeneration:
    """A generation that ran when it was submitted (`InProcessEngine`)."""

    generated: Generated

    def result(self) -> Generated:
        return self.generated


@runtime_checkable
class GenerationEngine(Protocol):
    """Produces actions and behaviour log-probs, tagged with the policy version.

    ``submit(states, G, with_log_probs=..., **kwargs)``: start sampling G actions for each of the
    B states (``kwargs`` are the policy's generate options, e.g. ``temperature``);
    ``with_log_probs``: the sampler's log-probs are wanted (an engine may return them anyway).
    ``sync(policy, version)``: the trainer's weights after ``version`` updates; later submissions
    sample with them. ``version``: the version of the last sync. ``close()``: release the
    engine's processes and memory (idempotent).
    """

    @property
    def version(self) -> int: ...

    @property
    def owns_weights(self) -> bool:
        """True when the engine samples with its own copy of the weights (so it can generate
        while the trainer updates), False when it samples with the trainer's policy object."""
        ...

    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kwargs: Any
    ) -> PendingGeneration: ...

    def sync(self, policy: PolicyModel, version: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineProvider(Protocol):
    """A policy that builds the generation engines it can run on (`grpo.llm.CausalLMPolicy`:
    ``"worker"`` and ``"vllm"``). ``generation_engine(name, seed=...)`` returns a new engine for
    the ``GRPOConfig.generation_engine`` ``name``, or raises ValueError naming the ones it has."""

    def generation_engine(self, name: str, *, seed: int | None) -> GenerationEngine: ...


class InProcessEngine:
    """The trainer's policy generates, in the trainer's process (today's synchronous path).

    ``submit`` runs the policy at once (eval mode; ``generate_actions_with_log_probs`` when the
    log-probs are wanted and the policy has it, else ``generate_actions``) and returns a
    finished handle. ``sync`` only records the version: the weights are the trainer's own.
    """

    owns_weights = False

    def __init__(self, policy: PolicyModel) -> None:
        self.policy = policy
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kwargs: Any
    ) -> ReadyGeneration:
        set_training_mode(self.policy, False)
        log_probs: Tensor | PolicyOutput | None = None
        if with_log_probs and has_method(self.policy, "generate_actions_with_log_probs"):
            actions, log_probs = self.policy.generate_actions_with_log_probs(  # type: ignore[attr-defined]
                states, num_actions_per_state, **kwargs
            )
        else:
            actions = self.policy.generate_actions(states, num_actions_per_state, **kwargs)
        return ReadyGeneration(Generated(states, actions, log_probs, self._version))

    def sync(self, policy: PolicyModel, version: int) -> None:
        if policy is not self.policy:
            raise ValueError(
                "InProcessEngine generates with the trainer's own policy object; sync() was given "
                "another one. Build the engine with the trainer's policy."
            )
        self._version = int(version)

    def close(self) -> None:
        return None


def engine_metrics(engine: GenerationEngine, versions: Tensor | None, step_count: int) -> dict[str, float]:
    """``async/staleness`` = max_i (step_count - version_i) over the batch's samples, and
    ``async/sync_seconds`` (the engine's ``last_sync_seconds``, when it has one), for an engine
    that owns its weights; ``{}`` for the in-process engine (always 0 steps stale)."""
    if not engine.owns_weights or versions is None or versions.numel() == 0:
        return {}
    out = {"async/staleness": float(step_count - int(versions.min()))}
    sync = getattr(engine, "last_sync_seconds", None)
    if isinstance(sync, (int, float)):  # with the wait for the previous sync's acknowledgement
        out["async/sync_seconds"] = float(sync) + float(
            getattr(engine, "last_sync_wait_seconds", None) or 0.0
        )
    return out
