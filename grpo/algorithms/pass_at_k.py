"""pass@k and maj@k from n samples per problem: unbiased estimates over every k-subset.

Sampling n >= k answers per problem and scoring each k-subset of them estimates the success of k
samples with less variance than drawing k once; both functions return the exact mean over all
``C(n, k)`` subsets, computed without enumerating them.

* `pass_at_k`: the chance that at least one of k samples is correct (Chen et al. 2021, "Evaluating
  Large Language Models Trained on Code", eq. 1): ``1 - C(n - c, k) / C(n, k)``.
* `maj_at_k`: the chance that the majority answer of k samples is correct (majority voting /
  self-consistency: Lewkowycz et al. 2022 "Minerva", Wang et al. 2022), ties split evenly.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["MAJ_AT_K_MAX_SAMPLES", "maj_at_k", "pass_at_k"]

MAJ_AT_K_MAX_SAMPLES = 1000
"""The most samples per problem `maj_at_k` takes (its counts are float64: C(1000, 500) ~ 1e299)."""


def _check_n_k(n: int, k: int, where: str) -> None:
    for name, v in (("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name}={v!r} must be an integer >= 1.")
    if k > n:
        raise ValueError(
            f"{where}: k={k} is larger than n={n}, the number of samples per problem; an estimate "
            f"of k samples needs at least k of them. Sample n >= {k} per problem (e.g. a larger "
            f"evaluation group_size) or use k <= {n}."
        )


def pass_at_k(n: int, c: Tensor | int, k: int) -> Tensor:
    """Unbiased pass@k of problems with ``n`` samples of which ``c`` are correct.

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i=0}^{k-1} (n - c - i) / (n - i)

    the mean over all k-subsets of the n samples of "at least one of the k is correct" (Chen et al.
    2021, eq. 1). The product form (every factor in [0, 1]) is exact for any n: it is 1 when
    n - c < k (some factor is 0) and 0 when c = 0. ``pass_at_k(n, c, 1) = c / n``.

    Shapes: c () or (B,) integer counts in [0, n] -> float64 of the same shape (an int c gives a
    0-d Tensor). Average over problems for a benchmark's pass@k.
    """
    _check_n_k(n, k, "pass_at_k")
    c_t = torch.as_tensor(c)
    if c_t.is_floating_point() or c_t.dtype == torch.bool:
        raise TypeError(f"pass_at_k: c must hold integer counts of correct samples, got dtype {c_t.dtype}.")
    if c_t.numel() and (int(c_t.min()) < 0 or int(c_t.max()) > n):
        raise ValueError(
            f"pass_at_k: every count c must lie in [0, n={n}]; got values in "
            f"[{int(c_t.min())}, {int(c_t.max())}]."
        )
    i = torch.arange(k, dtype=torch.float64, device=c_t.device)  # (k,)
    wrong = (n - c_t.to(torch.float64)).unsqueeze(-1)  # (..., 1)
    factors = ((wrong - i) / (n - i)).clamp(min=0.0)  # (..., k): P(i-th pick is wrong | i wrong before)
    return 1.0 - factors.prod(-1)


def _class_counts(
    answers: Sequence[Hashable | None], correct: Sequence[float]
) -> dict[Hashable, list[float]]:
    """answer -> [m, c]: its number of samples and the sum of their correctness (None left out)."""
    counts: dict[Hashable, list[float]] = {}
    for a, ok in zip(answers, correct, strict=True):
        if a is None:
            continue
        try:
            entry = counts.setdefault(a, [0.0, 0.0])
        except TypeError:
            raise TypeError(
                f"maj_at_k: the answer {a!r} of type {type(a).__name__} is not hashable; map each "
                f"sample to a str, number or tuple (the answer an extractor such as "
                f"grpo.llm.rewards.last_number returns)."
            ) from None
        entry[0] += 1
        entry[1] += float(ok)
    return counts


def _add_class(table: Tensor, m: int, cap: int | None) -> Tensor:
    """The ways table after one more class of ``m`` samples: ``table[s, t]`` counts the ways to
    draw ``s`` samples so far with ``t`` classes at exactly ``cap`` draws; the new class gives
    ``x <= cap`` of its samples, ``C(m, x)`` ways (``cap=None``: any x, never a tie)."""
    out = torch.zeros_like(table)
    size = table.shape[0]
    top = m if cap is None else min(m, cap)
    for x in range(min(top, size - 1) + 1):
        tie = 1 if cap is not None and x == cap else 0
        out[x:, tie:] += math.comb(m, x) * table[: size - x, : table.shape[1] - tie]
    return out


def _win_probability(size: int, others: Sequence[int], abstain: int, n: int, k: int) -> float:
    """The chance that one given answer with ``size`` samples wins the vote of a uniform k-subset
    (ties broken uniformly): sum over its draws j of the ways the other answers (``others``: their
    sample counts) all draw <= j, weighted 1 / (1 + number of them at j); ``abstain`` samples have no
    answer and never tie."""
    total = 0.0
    ties = torch.arange(len(others) + 1, dtype=torch.float64)
    for j in range(1, min(size, k) + 1):
        table = torch.zeros(k - j + 1, len(others) + 1, dtype=torch.float64)  # (s, t)
        table[0, 0] = 1.0
        for m in others:
            table = _add_class(table, m, j)
        if abstain:
            table = _add_class(table, abstain, None)
        total += math.comb(size, j) * float((table[k - j] / (1.0 + ties)).sum())
    return total / math.comb(n, k)


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[float] | Tensor, k: int) -> float:
    """Unbiased maj@k of one problem from its n sampled answers and their correctness.

    maj@k = mean over all C(n, k) k-subsets S of the n samples of score(S), where score(S) is the
    correctness of the answer most frequent in S. Ties between answers are split evenly (the mean
    of the tied answers' scores: what voting over k samples in a random order with
    ``Counter.most_common`` gives in expectation, as lighteval's first-k maj@k does); an answer's
    correctness is the mean ``correct`` of its samples (its ``c_a / m_a``: 0 or 1 when correctness
    is a function of the answer). A ``None`` answer (nothing could be extracted) does not vote; a
    subset of only None answers scores 0. ``maj_at_k(..., 1)`` is the sum of the answered samples'
    correctness over n, and with every sample answered it equals ``pass_at_k(n, c, 1) = c / n``.

    Computed exactly without enumerating subsets: for each answer a (m_a samples) and each j, the
    ways the other answers all draw <= j (a table over drawn samples and ties), weighted by
    1 / (1 + ties); answers with the same m_a share one computation.

    Args:
        answers: n hashable answers (None: no answer).
        correct: n values in [0, 1] (bool or float), one per sample.
        k: the number of voting samples, 1 <= k <= n <= `MAJ_AT_K_MAX_SAMPLES`.
    """
    n = len(answers)
    _check_n_k(n, k, "maj_at_k")
    if n > MAJ_AT_K_MAX_SAMPLES:
        raise ValueError(
            f"maj_at_k: n={n} samples per problem is above the supported {MAJ_AT_K_MAX_SAMPLES} "
            f"(float64 subset counts overflow); evaluate with fewer samples per problem."
        )
    ok = correct.tolist() if isinstance(correct, Tensor) else list(correct)
    if len(ok) != n:
        raise ValueError(f"maj_at_k: got {n} answers but {len(ok)} correctness values; give one per sample.")
    counts = _class_counts(answers, ok)
    sizes = [int(v[0]) for v in counts.values()]
    abstain = n - sum(sizes)
    score = 0.0
    for size in sorted(set(sizes)):
        others = list(sizes)
        others.remove(size)
        p_win = _win_probability(size, others, abstain, n, k)
        score += p_win * sum(c / m for m, c in counts.values() if m == size)
    return score
