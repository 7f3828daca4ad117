"""`PrefetchedBatches`: train()'s batches drawn k steps ahead and submitted to the engine.

With ``GRPOConfig.async_staleness = k >= 1`` (`grpo.generation.async_rollouts`) train() takes
each step's states from here: before step s it draws the batches up to s + k from the source and
submits each one's generation (`GRPOTrainer.prefetch`) once, in order; step s then trains on the
generation submitted for batch s.

Exactly once: a checkpoint must describe the batches *trained*, not the ones drawn ahead. A
source train() restarts at ``trainer.step_count`` (lists, tensors, loaders, callables) is right
by construction. A source the trainer checkpoints itself (``register_checkpoint_state``, e.g.
`grpo.llm.PromptBatches`) has moved k batches further: `at_trained_position` sets it back to
where it was before the first untrained batch was drawn while the checkpoint is written, and
`close` leaves it there, so a resumed (or a later) run draws those batches again: none is skipped
and none repeated.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["PrefetchedBatches"]


class _Prefetcher(Protocol):
    @property
    def step_count(self) -> int: ...

    def prefetch(self, states: Any) -> None: ...


class PrefetchedBatches(Iterator[Any]):
    """The batches of ``batches`` with up to ``staleness`` of them submitted ahead.

    Args:
        trainer: has ``prefetch(states)`` and ``step_count``.
        batches: the states batches in training order.
        staleness: k >= 1.
        num_steps: nothing is drawn for steps at or past it.
        source: the checkpointed source object behind ``batches`` (``state_dict`` /
            ``load_state_dict``), or None when train() restarts the source at the step count.
    """

    def __init__(
        self, trainer: _Prefetcher, batches: Iterator[Any], staleness: int, num_steps: int, source: Any = None
    ) -> None:
        self.trainer, self.batches, self.staleness = trainer, batches, staleness
        self.num_steps, self.source = num_steps, source
        self._queue: collections.deque[tuple[Any, Any]] = collections.deque()  # (states, source state before)
        self._exhausted = False

    def __next__(self) -> Any:
        self._top_up()
        if not self._queue:
            raise StopIteration
        return self._queue.popleft()[0]

    def _top_up(self) -> None:
        """Draw and submit batches until the step's own and k ahead are submitted."""
        while not self._exhausted and len(self._queue) <= self.staleness:
            if self.trainer.step_count + len(self._queue) >= self.num_steps:
                return
            before = None if self.source is None else self.source.state_dict()
            try:
                states = next(self.batches)
            except StopIteration:
                self._exhausted = True
                return
            self.trainer.prefetch(states)
            self._queue.append((states, before))

    @property
    def num_pending(self) -> int:
        """Batches drawn and submitted, not yet trained on."""
        return len(self._queue)

    @contextlib.contextmanager
    def at_trained_position(self) -> Iterator[None]:
        """While the block runs (a checkpoint is written), the checkpointed source stands where
        it stood before the first untrained batch was drawn."""
        if self.source is None or not self._queue:
            yield
            return
        live = self.source.state_dict()
        self.source.load_state_dict(self._queue[0][1])
        try:
            yield
        finally:
            self.source.load_state_dict(live)

    def close(self) -> int:
        """The end of a run (or an error): set a checkpointed source back to the trained
        position and forget the batches drawn ahead. Returns how many were dropped; the caller
        drops their generations from the engine (`GRPOTrainer.discard_prefetched`)."""
        n = len(self._queue)
        if self.source is not None and self._queue:
            self.source.load_state_dict(self._queue[0][1])
        self._queue.clear()
        return n
