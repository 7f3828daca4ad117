"""Tournament selection with elitism, and the choice of each slot's mutation (pure, seeded).

For a population of P members with fitness ``f`` (higher is better)::

    elite = argmax_i f_i                    (the lowest index on a tie)
    parent[elite] = elite                   (kept unchanged: no clone, no mutation)
    for every other slot j, in index order:
        draw k = tournament_size members uniformly (with replacement) from the P
        parent[j] = the fittest of the k    (the lowest index on a tie)

Each non-elite slot then becomes a copy of its parent (nothing to copy when ``parent[j] == j``)
and mutates one hyperparameter, drawn uniformly from the declared ones, or none with probability
``no_mutation``. Every draw comes from one ``random.Random`` in a fixed order, so every process
of a distributed population draws the same parents and mutations.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.population.hyperparameters import HyperparameterConfig

__all__ = ["Mutation", "choose_mutations", "elite_index", "tournament_parents"]


@dataclass(frozen=True)
class Mutation:
    """One hyperparameter change: ``name`` from ``old`` to ``new`` (``name`` None: no mutation)."""

    name: str | None
    old: float
    new: float

    def as_dict(self) -> dict[str, object]:
        """Plain JSON values (``old`` / ``new`` None for no mutation)."""
        if self.name is None:
            return {"name": None, "old": None, "new": None}
        return {"name": self.name, "old": self.old, "new": self.new}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mutation:
        """The mutation `as_dict` wrote."""
        if d["name"] is None:
            return NO_MUTATION
        return cls(str(d["name"]), float(d["old"]), float(d["new"]))


NO_MUTATION = Mutation(None, math.nan, math.nan)


def elite_index(fitness: Sequence[float]) -> int:
    """The fittest member (the lowest index on a tie; NaN counts as the worst)."""
    return max(range(len(fitness)), key=lambda i: (_key(fitness[i]), -i))


def _key(f: float) -> float:
    return -math.inf if math.isnan(f) else f


def tournament_parents(
    fitness: Sequence[float], rng: random.Random, *, tournament_size: int = 2, elitism: bool = True
) -> list[int]:
    """``parent[j]`` for every slot j (see the module docstring); ``len(fitness)`` draws of
    ``tournament_size`` indices each (the elite's slot draws none when ``elitism``)."""
    p = len(fitness)
    if p < 1:
        raise ValueError("tournament_parents needs at least one member's fitness.")
    if tournament_size < 1:
        raise ValueError(f"tournament_size={tournament_size} must be >= 1 (2 or 3 is usual).")
    elite = elite_index(fitness) if elitism else -1
    parents = []
    for j in range(p):
        if j == elite:
            parents.append(j)
            continue
        entrants = [rng.randrange(p) for _ in range(tournament_size)]
        parents.append(min(entrants, key=lambda i: (-_key(fitness[i]), i)))
    return parents


def choose_mutations(
    hps: Sequence[dict[str, float]],
    parents: Sequence[int],
    hp_config: HyperparameterConfig,
    rng: random.Random,
    *,
    elite: int | None,
    no_mutation: float = 0.0,
) -> list[Mutation]:
    """The mutation of each slot j, applied to its parent's hyperparameters ``hps[parents[j]]``:
    `NO_MUTATION` for the elite; else no mutation with probability ``no_mutation``, or one
    declared hyperparameter grown or shrunk (`grpo.population.hyperparameters.mutate_value`)."""
    names = list(hp_config)
    out: list[Mutation] = []
    for j, parent in enumerate(parents):
        if j == elite:
            out.append(NO_MUTATION)
            continue
        if rng.random() < no_mutation:
            out.append(NO_MUTATION)
            continue
        name = names[rng.randrange(len(names))]
        old = hps[parent][name]
        out.append(Mutation(name, old, hp_config[name].mutate(old, rng)))
    return out
