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

Checkpoints. The trainer checkpoints this engine (component ``"async_rollouts"``): `state_dict`
waits for the generations submitted ahead and returns them as plain data
(`grpo.generation.pending_state`); `load_state_dict` keeps them, and the next ``prefetch`` calls
(the resumed run draws the same batches again) take them instead of generating, so the resumed
run trains on exactly what the uninterrupted run trained on, and the first batch it generates is
sampled after the same sync, with the same job seed (`grpo.generation.worker.WorkerEngine.skip_job`
counts the restored jobs).
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo.generation.engine import GenerationEngine, PendingGeneration, ReadyGeneration
from grpo.generation.pending_state import (
    RestoredGeneration,
    generation_state,
    restored_generation,
    states_digest,
)
from grpo.policy_base import PolicyModel

logger = logging.getLogger(__name__)

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
        self._restored: collections.deque[RestoredGeneration] = collections.deque()  # from a checkpoint

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
        if self._restored:
            handle: PendingGeneration = self._take_restored(states)
        else:
            handle = self.inner.submit(states, num_actions_per_state, with_log_probs=True, **kwargs)
        self._pending.append((states, handle))

    def _take_restored(self, states: Any) -> ReadyGeneration:
        """The oldest generation a checkpoint restored, for ``states`` (checked against the
        digest it was saved with); the inner engine counts its job as done (`skip_job`)."""
        restored = self._restored[0]
        if restored.states_digest is not None and states_digest(states) != restored.states_digest:
            raise RuntimeError(
                "async rollouts: the resumed run drew other states than the ones the checkpoint's "
                "pending generation was sampled for (their SHA-256 differs). Resume with the same "
                "states source, batch size and seed as the run that saved the checkpoint."
            )
        if restored.version > self.inner.version:
            raise RuntimeError(
                f"async rollouts: the checkpoint's pending generation has policy version "
                f"{restored.version}, newer than the loaded weights' {self.inner.version}; the "
                f"checkpoint is inconsistent."
            )
        self._restored.popleft()
        skip = getattr(self.inner, "skip_job", None)
        if callable(skip):
            skip()
        return ReadyGeneration(restored.generated(states))

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
        return n + self._drop_restored()

    def _drop_restored(self) -> int:
        n = len(self._restored)
        self._restored.clear()
        return n

    def close(self) -> None:
        self._pending.clear()
        self._restored.clear()
        self.inner.close()

    # ---- checkpoints (grpo.state.trainer_state: component "async_rollouts") ------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"pending": [...]}``: the generations submitted ahead and not yet taken by a step,
        oldest first (waiting for them), then those restored and not yet taken; each in
        `grpo.generation.pending_state.generation_state`'s format. When one cannot be stored
        (actions neither a Tensor nor Completions) none is, with a warning: the resumed run then
        samples those batches again, with its own weights (each batch is still trained once)."""
        entries = [generation_state(handle.result()) for _, handle in self._pending]
        for r in self._restored:  # restored, so storable; with the digest of the states saved
            entry = generation_state(r.generated(None))
            entries.append(None if entry is None else {**entry, "states_digest": r.states_digest})
        if any(e is None for e in entries):
            warnings.warn(
                "async rollouts: the checkpoint cannot hold the generations drawn ahead (their actions "
                "are neither a Tensor nor grpo.llm.Completion groups); a run resumed from it samples "
                "those batches again with the checkpoint's weights, so it is not bit for bit the "
                "uninterrupted run.",
                RuntimeWarning,
                stacklevel=2,
            )
            return {"pending": []}
        return {"pending": entries}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep the checkpoint's pending generations for the next `prefetch` calls (every entry is
        checked first: `ValueError` naming it). Generations submitted before are dropped."""
        if (
            not isinstance(state, Mapping)
            or set(state) != {"pending"}
            or not isinstance(state["pending"], list)
        ):
            raise ValueError("async_rollouts state: expected {'pending': [...]}.")
        pending = state["pending"]
        if len(pending) > self.staleness:
            raise ValueError(
                f"async_rollouts state: {len(pending)} pending generations, but async_staleness="
                f"{self.staleness} keeps at most {self.staleness}; resume with the async_staleness "
                f"of the run that saved it (or larger)."
            )
        restored = [restored_generation(e, f"async_rollouts.pending[{i}]") for i, e in enumerate(pending)]
        versions = [r.version for r in restored]
        if versions != sorted(versions):
            raise ValueError(f"async_rollouts.pending: versions must not decrease, got {versions}.")
        self.discard_pending()
        self._restored = collections.deque(restored)
        logger.debug("restored %d generation(s) drawn ahead, versions %s", len(restored), versions)


def _same_states(prefetched: Any, states: Any) -> bool:
    """``states`` is the batch that was prefetched: the same object, or equal Tensors."""
    if prefetched is states:
        return True
    if isinstance(prefetched, Tensor) and isinstance(states, Tensor):
        return prefetched.shape == states.shape and torch.equal(prefetched.to(states.device), states)
    return False
