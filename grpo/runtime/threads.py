"""Intra-op threads for the trainer's step: one thread for a small policy on CPU.

Where the time goes (a 2-core machine; benchmarks/RESULTS.md, "Threads under contention"): a step
of a small policy is thousands of small torch ops (the quick start's: ~5,000, 40 optimizer
steps). With torch's default of one intra-op thread per core, hundreds of them (the quick
start's: 858; the tiny LM's: ~1,500; CartPole's: ~1,600) open an OpenMP parallel region: matrix
products, ``exp``/``tanh`` in MKL's vector maths, the backward pass, the fused AdamW. A region
ends at a barrier that waits for all of its threads, and OpenMP's threads spin while they wait.
On a quiet machine that gains little on tensors this small (two threads measured from 7% faster
to 1.6x slower than one). Beside another busy process, one of the threads
is often not running: the others spin at the barrier, taking CPU from the very thread they wait
for, until the scheduler runs it; each region costs up to a time slice, and steps take 2-4x
their one-thread time, single steps 5-9x or seconds. One thread has no region and no barrier.

`GRPOConfig.num_threads` chooses (`resolve_num_threads`):

- ``"auto"`` (default): one thread while the trainer steps when the policy runs on CPU and its
  weights (`policy_elements`, frozen ones included) hold at most `SMALL_POLICY_ELEMENTS`
  elements; otherwise torch's setting is left alone;
- an int N: N threads while the trainer steps, whatever the policy;
- None: torch's setting is left alone.

`intra_op_threads` applies the choice for a block and restores the caller's count afterwards
(``torch.set_num_threads`` costs 0.1 microsecond, so it is done in every step).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Literal, TypeAlias

import torch
from torch import nn

from grpo.runtime.denormals import flush_denormals_on, restore_denormals

__all__ = [
    "SMALL_POLICY_ELEMENTS",
    "NumThreads",
    "describe",
    "intra_op_threads",
    "policy_elements",
    "resolve_num_threads",
    "step_numerics",
    "step_threads",
]

logger = logging.getLogger(__name__)

NumThreads: TypeAlias = Literal["auto"] | int | None

# Weights up to which "auto" steps on one thread. Measured with benchmarks/contention.py --scaling
# on 2 cores (MLP policies, 512 samples and 40 optimizer steps per step): on a quiet machine two
# threads took x1.18-x1.57 the one-thread step time from 5.9k to 1.08M weights and x1.03 at 4.25M;
# beside one busy process x2.3-x7.6 at every size up to 4.25M. The threshold keeps one thread where
# it measured faster in both conditions and leaves alone the larger models, where two threads
# already broke even on a quiet machine (and more cores gain sooner).
# The quick start's MLP has 1,738 weights, CartPole's 4,610, the tiny LM 81k; a 0.5B LM is far above.
SMALL_POLICY_ELEMENTS = 2_000_000


def policy_elements(policy: object, trained: Iterable[torch.Tensor]) -> int:
    """Elements of the policy's weights: its trained tensors and, when the policy is an
    ``nn.Module`` or has a ``training_module()`` (`grpo.llm.CausalLMPolicy`), every parameter of
    that module, frozen ones included (the base model under a LoRA adapter). Each tensor once."""
    tensors = {id(t): t for t in trained}
    module = policy if isinstance(policy, nn.Module) else None
    if module is None and callable(getattr(policy, "training_module", None)):
        found = policy.training_module()  # type: ignore[attr-defined]
        module = found if isinstance(found, nn.Module) else None
    if module is not None:
        tensors.update((id(p), p) for p in module.parameters())
    return sum(t.numel() for t in tensors.values())


def resolve_num_threads(setting: NumThreads, *, device: torch.device, elements: int) -> int | None:
    """The intra-op thread count the trainer's step runs with; None = leave torch's setting alone.

    ``setting``: `GRPOConfig.num_threads`; ``device``: where the policy runs; ``elements``: its
    weights (`policy_elements`).
    """
    if setting is None or isinstance(setting, int):
        return setting
    if device.type != "cpu" or elements > SMALL_POLICY_ELEMENTS:
        return None
    return 1


def describe(setting: NumThreads, resolved: int | None, *, device: torch.device, elements: int) -> str:
    """One line for the log: the threads each step runs with, and why."""
    now = torch.get_num_threads()
    if resolved is None:
        if setting is None:
            why = "num_threads=None"
        elif device.type != "cpu":
            why = f"num_threads='auto', the policy runs on {device.type}"
        else:
            why = f"num_threads='auto', {elements:,} policy weights > {SMALL_POLICY_ELEMENTS:,}"
        return f"intra-op threads: torch's setting ({now} now) left alone ({why})"
    after = "torch's setting already" if resolved == now else f"{now} restored after it"
    if setting == "auto":
        return (
            f"intra-op threads: 1 in each step, {after} (num_threads='auto': a CPU policy with "
            f"{elements:,} weights <= {SMALL_POLICY_ELEMENTS:,}; num_threads=None leaves torch's "
            f"setting alone)"
        )
    return f"intra-op threads: {resolved} in each step, {after} (num_threads={setting})"


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (``torch.set_num_threads``), then restore the
    count that was set before; ``n=None`` changes nothing."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_threads(
    setting: NumThreads, policy: object, trained: Iterable[torch.Tensor], device: torch.device
) -> int | None:
    """The intra-op threads of each step for ``setting`` (``GRPOConfig.num_threads``: one for a
    small CPU policy by default, `resolve_num_threads`), logged once with why (`describe`)."""
    elements = policy_elements(policy, trained)
    resolved = resolve_num_threads(setting, device=device, elements=elements)
    logger.info(describe(setting, resolved, device=device, elements=elements))
    return resolved


@contextlib.contextmanager
def step_numerics(flush_denormals: bool, threads: int | None) -> Iterator[None]:
    """A step's numerics for the block: subnormal floats flushed to zero when ``flush_denormals``
    (`grpo.runtime.denormals`) and ``threads`` intra-op threads; the caller's settings are
    restored after it."""
    changed = flush_denormals_on() if flush_denormals else False
    try:
        with intra_op_threads(threads):
            yield
    finally:
        restore_denormals(changed)
