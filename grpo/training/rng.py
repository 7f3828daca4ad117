"""Forked RNG streams: code that must not change the run's random numbers runs on copies.

`grpo.training.evaluation` samples on them (evaluating never changes what training samples), and
`grpo.training.sources` draws on them the batches a resumed run drops.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["forked_rng"]


@contextmanager
def forked_rng(device: torch.device, seed: int | None) -> Iterator[None]:
    """Run the body on copies of every RNG stream; the streams are as before afterwards.

    Args:
        device: with a CUDA device, the CUDA generators are forked too.
        seed: seed the copies (Python, NumPy, torch) with this value; None = continue from the
            current state of each stream.
    """
    py_state = random.getstate()
    np_state = np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed)
                torch.manual_seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
