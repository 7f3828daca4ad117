"""Async rollouts: generate the next batches while the trainer updates on the current one.

`PrefetchingEngine` wraps an engine that owns its weights (a worker process, vLLM). `train`
(``GRPOConfig.async_staleness = k >= 1``) submits each batch's generation k steps before the step
that trains on it (`prefetch`); the step's collection then takes the submitted generation instead
of generating (`submit` of the same states object). The inner engine runs generations and weight
syncs in submission order, so with staleness k the batch of step s is sampled by the weights of
step ``s - k`` or later (version ``>= s - k``; at the start, the initial weights)::

    step s:   prefetch(states_{s+k})        # sampled with version s (the sync of step s-1 is queued before)
              step(states_s)                # takes states_s's generation: version >= s - k
                 ... update ...             # the engine generates states_{s+1..s+k} meanwhile
              sync(policy, s + 1)           # queued after those generations

Every sample carries its version (`ExperienceBatch.policy_versions`); the trainer recomputes the
behaviour log-probs with its current weights and weights each term by the importance ratio to the
generating version's log-probs (``GRPOConfig.sampler_correction``), on by default with
``async_staleness >= 1``. With k = 0 nothing is prefetched: each step generates after the
previous update, as the synchronous step does.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import Tensor

from grpo.generation.engine import GenerationEngine, PendingGeneration
from grpo.policy_base import PolicyModel

__all__ = ["PrefetchingEngine"]


class PrefetchingEngine:
    """An engine (the ``inner`` one) whose generations may be submitted ahead of their step.

    Args:
        inner: an engine with its own weights (``inner.owns_weights``), so that it can sample
            while the trainer's weights change.
        staleness: k >= 1, the most batches submitted ahead of the step that trains on them.
    """

    owns_weights = True

    def __init__(self, inner: GenerationEngine, staleness: int) -> None:
        if not inner.owns_weights:
            raise ValueError(
                f"async rollouts (async_staleness={staleness}) need an engine with its own copy of the "
                f"weights, so it can generate while the trainer updates; {type(inner).__name__} "
                f"samples with the trainer's policy. Use generation_engine='worker' (or 'vllm'), or "
                f"async_staleness=0."
            )
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(f"staleness={staleness!r} must be an integer >= 1.")
        self.inner = inner
        self.staleness = staleness
        self._pending: collections.deque[tuple[Any, PendingGeneration]] = collections.deque()

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def last_sync_seconds(self) -> float | None:
        """The inner engine's cost of its last weight sync (None when it keeps none)."""
        return getattr(self.inner, "last_sync_seconds", None)

    @property
    def last_sync_wait_seconds(self) -> float | None:
        return getattr(self.inner, "last_sync_wait_seconds", None)

    @property
    def num_pending(self) -> int:
        """Generations submitted ahead and not yet taken by a step."""
        return len(self._pending)

    def prefetch(self, states: Any, num_actions_per_state: int, **kwargs: Any) -> None:
        """Submit the generation of ``states`` now; the step given the same ``states`` object
        takes it. At most ``staleness + 1`` may wait (the current step's and k ahead)."""
        if len(self._pending) > self.staleness:
            raise RuntimeError(
                f"{len(self._pending)} generations are already submitted ahead; staleness "
                f"{self.staleness} allows at most {self.staleness + 1} (the step's own and k ahead)."
            )
        handle = self.inner.submit(states, num_actions_per_state, with_log_probs=True, **kwargs)
        self._pending.append((states, handle))

    def submit(
        self, states: Any, num_actions_per_state: int, *, with_log_probs: bool, **kwargs: Any
    ) -> PendingGeneration:
        """The prefetched generation of ``states`` (the oldest submitted must be this object, or
        for a Tensor one equal to it: the trainer moves a Tensor to its device each time); with
        nothing prefetched, a generation submitted now."""
        if not self._pending:
            return self.inner.submit(states, num_actions_per_state, with_log_probs=True, **kwargs)
        expected, handle = self._pending[0]
        if not _same_states(expected, states):
            raise RuntimeError(
                "async rollouts: the step's states are not the next prefetched batch. Steps must "
                "take the batches in the order they were prefetched (train() does); call "
                "trainer.step on the same states object that was passed to prefetch()."
            )
        self._pending.popleft()
        return handle

    def sync(self, policy: PolicyModel, version: int) -> None:
        self.inner.sync(policy, version)

    def discard_pending(self) -> int:
        """Wait for and drop the generations submitted ahead (at the end of a run: their batches
        were not trained on, and a resumed run draws them again). Returns how many."""
        n = len(self._pending)
        while self._pending:
            self._pending.popleft()[1].result()
        return n

    def close(self) -> None:
        self._pending.clear()
        self.inner.close()


def _same_states(prefetched: Any, states: Any) -> bool:
    """``states`` is the batch that was prefetched: the same object, or equal Tensors."""
    if prefetched is states:
        return True
    if isinstance(prefetched, Tensor) and isinstance(states, Tensor):
        return prefetched.shape == states.shape and torch.equal(prefetched.to(states.device), states)
    return False
