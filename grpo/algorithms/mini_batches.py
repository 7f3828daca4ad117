"""A count of optimizer steps per epoch as a mini-batch size, the one place that reads it.

`GRPOConfig` has one field for the split of a batch into optimizer steps, ``mini_batch_size`` M
(states per optimizer step, so ``B / M`` steps per epoch); a group is never split, so M divides the
batch size B. PPO (and grpo 0.2) say it as a count k of mini-batches per epoch instead; read as a
size, k is the largest divisor M of B with ``M <= B // k`` (at least 1): exactly k steps when k
divides B, otherwise the nearest finer split (B = 6, k = 4: M = 1, 6 steps; B = 2, k = 4: M = 1,
2 steps). `mini_batch_for_count` computes it for the ``num_mini_batches`` spelling
(`grpo.config.SPELLINGS`), and a recipe that wants k steps per epoch whatever batch size the caller
picks gives ``mini_batch_size=StepsPerEpoch(k)``, resolved by `GRPOConfig.recipe` against the
final batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_COUNTED_BATCH", "StepsPerEpoch", "divisors", "mini_batch_for_count"]

MAX_COUNTED_BATCH = 2**40
"""The largest batch size whose divisors are searched (at most 2**20 trial divisions): a count of
mini-batches is refused above it (give ``mini_batch_size``), and messages list no divisors."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (by trial division up to sqrt(n)); [] for ``n``
    above `MAX_COUNTED_BATCH` or below 1."""
    if not 1 <= n <= MAX_COUNTED_BATCH:
        return []
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def mini_batch_for_count(batch_size: int, count: int) -> int:
    """``count`` optimizer steps per epoch as a mini-batch size: the largest divisor of
    ``batch_size`` that is ``<= batch_size // count`` (at least 1). `ValueError` when
    ``batch_size`` is not an integer in [1, `MAX_COUNTED_BATCH`] or ``count`` not an integer >= 1."""
    for name, v, top in (("batch_size", batch_size, MAX_COUNTED_BATCH), ("num_mini_batches", count, None)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (top is not None and v > top):
            bound = "" if top is None else " and <= 2**40 (give mini_batch_size for a larger batch)"
            raise ValueError(f"a count of mini-batches needs {name} as an integer >= 1{bound}; got {v!r}.")
    most = max(1, batch_size // count)
    return max(d for d in divisors(batch_size) if d <= most)


@dataclass(frozen=True)
class StepsPerEpoch:
    """A recipe's ``mini_batch_size`` given as ``count`` optimizer steps per epoch, whatever batch
    size the caller picks: `GRPOConfig.recipe` replaces it by
    ``mini_batch_for_count(batch_size, count)`` once the batch size is known."""

    count: int

    def mini_batch_size(self, batch_size: int) -> int:
        """The mini-batch size for ``batch_size`` (`mini_batch_for_count`)."""
        return mini_batch_for_count(batch_size, self.count)
