"""The hyperparameters a population may mutate, their ranges, and the mutation rule (pure).

A mutation multiplies one hyperparameter by ``grow_factor`` or ``shrink_factor`` (chosen with
probability 1/2 each) and clamps the result to ``[min, max]``::

    v' = clamp(v * f, min, max),   f in {shrink_factor, grow_factor}

An integer hyperparameter (``dtype=int``, e.g. ``group_size``) is rounded; when rounding leaves it
unchanged (``round(8 * 1.05) = 8``) it moves by one in the chosen direction instead (still
clamped), so a mutation of an integer always changes it unless it sits at the bound.

`HyperparameterConfig` (AgileRL's name) declares which of `MUTABLE` a population mutates::

    hp_config = HyperparameterConfig(
        learning_rate=RLParameter(min=1e-5, max=1e-1),
        clip_epsilon=RLParameter(min=0.05, max=0.4),
        group_size=RLParameter(min=2, max=16, dtype=int),
    )
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MUTABLE",
    "HyperparameterConfig",
    "RLParameter",
    "mutate_value",
    "sample_hyperparameters",
]

MUTABLE: tuple[str, ...] = (
    "learning_rate",
    "clip_epsilon",
    "kl_coeff",
    "entropy_coeff",
    "group_size",
    "temperature",
)
"""The hyperparameters `grpo.population.settings.apply_hyperparameters` knows how to change in a
live trainer (``temperature``: only for a policy with a ``temperature`` attribute, such as
`grpo.llm.CausalLMPolicy`)."""

_INTEGER = frozenset({"group_size"})


@dataclass(frozen=True)
class RLParameter:
    """One mutable hyperparameter: its range and its multiplicative steps (AgileRL's name).

    Args:
        min: the smallest value a mutation may give (> 0: a multiplicative mutation never crosses
            0, and ``kl_coeff`` / ``entropy_coeff`` switch parts of the trainer on at 0).
        max: the largest value (>= min).
        shrink_factor: f < 1 of a shrinking mutation.
        grow_factor: f > 1 of a growing mutation.
        dtype: ``float``, or ``int`` for counts (``group_size``).
    """

    min: float
    max: float
    shrink_factor: float = 0.8
    grow_factor: float = 1.2
    dtype: type = float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min) and math.isfinite(self.max) and 0 < self.min <= self.max):
            raise ValueError(
                f"RLParameter(min={self.min}, max={self.max}) needs finite 0 < min <= max; e.g. "
                f"RLParameter(min=1e-5, max=1e-2)."
            )
        if not 0 < self.shrink_factor < 1 < self.grow_factor or not math.isfinite(self.grow_factor):
            raise ValueError(
                f"RLParameter needs 0 < shrink_factor < 1 < grow_factor, got shrink_factor="
                f"{self.shrink_factor}, grow_factor={self.grow_factor}; e.g. 0.8 and 1.2."
            )
        if self.dtype not in (int, float):
            raise ValueError(f"RLParameter dtype must be int or float, got {self.dtype!r}.")

    def contains(self, value: float) -> bool:
        """``min <= value <= max`` (and an integer for ``dtype=int``)."""
        if self.dtype is int and (isinstance(value, bool) or not float(value).is_integer()):
            return False
        return self.min <= value <= self.max

    def mutate(self, value: float, rng: random.Random) -> float:
        """``value`` grown or shrunk (probability 1/2 each, drawn from ``rng``), clamped."""
        return mutate_value(value, self, grow=rng.random() < 0.5)


def mutate_value(value: float, spec: RLParameter, *, grow: bool) -> float:
    """``clamp(value * f, min, max)`` with ``f = grow_factor`` if ``grow`` else ``shrink_factor``;
    for ``dtype=int`` rounded, and moved by one in that direction when rounding undid the step."""
    f = spec.grow_factor if grow else spec.shrink_factor
    new = min(max(value * f, spec.min), spec.max)
    if spec.dtype is not int:
        return float(new)
    rounded = round(new)
    if rounded == round(value):
        rounded += 1 if grow else -1
    lo, hi = math.ceil(spec.min), math.floor(spec.max)
    return int(min(max(rounded, lo), hi))


class HyperparameterConfig(Mapping[str, RLParameter]):
    """The hyperparameters a population mutates: name (one of `MUTABLE`) -> `RLParameter`.

    ``HyperparameterConfig(learning_rate=RLParameter(min=1e-5, max=1e-1))``. An integer
    hyperparameter (``group_size``) must be declared with ``dtype=int``.
    """

    def __init__(self, **params: RLParameter) -> None:
        if not params:
            raise ValueError(
                "HyperparameterConfig needs at least one hyperparameter, e.g. "
                "HyperparameterConfig(learning_rate=RLParameter(min=1e-5, max=1e-1))."
            )
        for name, spec in params.items():
            if name not in MUTABLE:
                raise ValueError(f"HyperparameterConfig: {name!r} cannot be mutated; choose from {MUTABLE}.")
            if not isinstance(spec, RLParameter):
                raise TypeError(
                    f"HyperparameterConfig: {name}= must be an RLParameter, got {type(spec).__name__}."
                )
            if (name in _INTEGER) != (spec.dtype is int):
                want = "int" if name in _INTEGER else "float"
                raise ValueError(
                    f"HyperparameterConfig: {name} is a {want}; declare RLParameter(..., dtype={want})."
                )
        self._params = dict(params)

    def __getitem__(self, name: str) -> RLParameter:
        return self._params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._params.items())
        return f"HyperparameterConfig({inner})"

    def check(self, hp: Mapping[str, float], where: str) -> None:
        """``ValueError`` naming ``where`` unless ``hp`` holds exactly these names, each in range."""
        if set(hp) != set(self._params):
            raise ValueError(
                f"{where}: hyperparameters {sorted(hp)} differ from the declared ones {sorted(self._params)}."
            )
        for name, value in hp.items():
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or not self._params[name].contains(value):
                spec = self._params[name]
                raise ValueError(
                    f"{where}: {name}={value!r} is outside its declared range [{spec.min}, {spec.max}]"
                    f"{' (an integer)' if spec.dtype is int else ''}."
                )


def sample_hyperparameters(hp_config: HyperparameterConfig, size: int, seed: int) -> list[dict[str, float]]:
    """``size`` random starting points: each value log-uniform in ``[min, max]`` (integers
    rounded), drawn from ``random.Random(seed)``. The same ``seed`` gives the same list."""
    rng = random.Random(seed)
    out: list[dict[str, float]] = []
    for _ in range(size):
        hp: dict[str, float] = {}
        for name, spec in hp_config.items():
            v = math.exp(rng.uniform(math.log(spec.min), math.log(spec.max)))
            hp[name] = (
                int(min(max(round(v), math.ceil(spec.min)), math.floor(spec.max))) if spec.dtype is int else v
            )
        out.append(hp)
    return out


def checked_starts(
    hp_config: HyperparameterConfig, starts: Sequence[Mapping[str, float]]
) -> list[dict[str, float]]:
    """The starting hyperparameters of each member as plain dicts, each checked against ``hp_config``."""
    out = []
    for i, hp in enumerate(starts):
        hp_config.check(hp, f"hyperparameters of member {i}")
        out.append(dict(hp))
    return out
