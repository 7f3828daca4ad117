"""What each generation did (fitness, who cloned whom, which mutation), and its plot.

`GenerationRecord` is one generation's line of the lineage; ``Population.history`` is the list
of them, saved in the population checkpoint. `plot_lineage` draws it: x = generation, y = slot,
each point coloured by the slot's fitness, a line from the parent's point of generation g to the
child's of g + 1 (a horizontal line: the slot kept its own weights), the mutation written beside
the child's point, the elite ringed. Needs matplotlib (the ``notebook`` extra), imported only when
a figure is drawn; the figure uses matplotlib's object API and the Agg renderer, never pyplot.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.population.selection import Mutation
from grpo.runtime.extras import install_hint

__all__ = ["GenerationRecord", "plot_lineage"]


@dataclass(frozen=True)
class GenerationRecord:
    """One generation, after its training steps (P slots).

    Attributes:
        generation: 0-based number of the generation.
        fitness: (P,) each slot's fitness after training, before selection.
        elite: the slot kept unchanged (None without elitism).
        parents: (P,) the slot each slot was copied from (itself: kept its own weights).
        mutations: (P,) the mutation applied after the copy (``name`` None: none).
        hyperparameters: (P,) each slot's hyperparameters after the mutation.
        samples: (P,) actions sampled by each slot so far (cumulative).
    """

    generation: int
    fitness: tuple[float, ...]
    elite: int | None
    parents: tuple[int, ...]
    mutations: tuple[Mutation, ...]
    hyperparameters: tuple[dict[str, float], ...]
    samples: tuple[int, ...]

    @property
    def best_fitness(self) -> float:
        """The highest fitness of the generation (NaN values ignored; NaN if all are)."""
        finite = [f for f in self.fitness if not math.isnan(f)]
        return max(finite) if finite else math.nan

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {
            "generation": self.generation,
            "fitness": list(self.fitness),
            "elite": self.elite,
            "parents": list(self.parents),
            "mutations": [m.as_dict() for m in self.mutations],
            "hyperparameters": [dict(h) for h in self.hyperparameters],
            "samples": list(self.samples),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GenerationRecord:
        """The record `as_dict` wrote (checked by `grpo.population.checkpoint` before this)."""
        return cls(
            generation=int(d["generation"]),
            fitness=tuple(float(f) for f in d["fitness"]),
            elite=None if d["elite"] is None else int(d["elite"]),
            parents=tuple(int(p) for p in d["parents"]),
            mutations=tuple(Mutation.from_dict(m) for m in d["mutations"]),
            hyperparameters=tuple(dict(h) for h in d["hyperparameters"]),
            samples=tuple(int(s) for s in d["samples"]),
        )


_ABBREVIATIONS = {
    "learning_rate": "lr",
    "clip_epsilon": "clip",
    "kl_coeff": "kl",
    "entropy_coeff": "ent",
    "group_size": "G",
    "temperature": "T",
}


def _short(m: Mutation) -> str:
    """``lr 3e-05`` (the new value; the arrow into the point says where it came from)."""
    if m.name is None:
        return ""
    return f"{_ABBREVIATIONS.get(m.name, m.name)} {m.new:.2g}"


def plot_lineage(
    lineage: Sequence[GenerationRecord], path: str | os.PathLike[str], *, title: str = "population lineage"
) -> Path:
    """Draw ``lineage`` (``Population.history``) to the PNG ``path`` (see the module docstring).
    Returns the path written."""
    if not lineage:
        raise ValueError("plot_lineage: the lineage is empty; run at least one generation first.")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"plot_lineage needs matplotlib: {install_hint('notebook')}") from None
    size = len(lineage[0].fitness)
    fig = Figure(figsize=(2.5 + 1.2 * len(lineage), 1.5 + 0.7 * size))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    finite = [f for r in lineage for f in r.fitness if not math.isnan(f)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    for r in lineage:
        g = r.generation
        for j, parent in enumerate(r.parents):
            ax.plot([g, g + 1], [parent, j], color="0.6", linewidth=1.0, zorder=1)
            label = _short(r.mutations[j])
            if label:
                ax.annotate(label, (g + 1, j), textcoords="offset points", xytext=(3, 5), fontsize=6)
        points = ax.scatter(
            [g] * size, range(size), c=list(r.fitness), cmap="viridis", vmin=lo, vmax=hi, s=60, zorder=2
        )
        if r.elite is not None:
            ax.scatter([g], [r.elite], s=160, facecolors="none", edgecolors="red", zorder=3)
    fig.colorbar(points, ax=ax, label="fitness")
    ax.set_xlabel("generation (fitness measured; lines: the copy made for the next)")
    ax.set_ylabel("slot (member index)")
    ax.set_yticks(range(size))
    ax.set_title(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out
