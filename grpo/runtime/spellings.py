"""Other names of a dataclass's fields (one alias table per dataclass) and the one "did you mean".

A `Spelling` is another name of one field, with where it comes from (a seed document, another
library). An *accepted* spelling is read wherever values arrive by name (`read_spellings`: a
`SpelledFields.from_dict` mapping, ``GRPOConfig.recipe`` overrides, a config file, a command-line
flag) and becomes its field; its values are mapped when they differ from the field's (seed 001's
``adv_norm="mean_only"`` is ``advantage_scale="none"``). A spelling that is not accepted (another
library's name whose values or meaning differ) is only offered by `did_you_mean`.

`SpelledFields` is the base of such a dataclass: its ``__new__`` runs before the dataclass's own
``__init__`` and refuses a keyword that is no field, naming the field meant (``lr`` ->
``learning_rate``; a spelling -> its field and mapped value). The keyword constructor takes the
fields only (one spelling per knob); `SpelledFields.from_dict` reads every accepted spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "SpelledFields",
    "Spelling",
    "did_you_mean",
    "read_spellings",
    "unknown_names_message",
]

T = TypeVar("T", bound="SpelledFields")


@dataclass(frozen=True)
class Spelling:
    """Another name of ``field``.

    Args:
        field: the field it stands for.
        origin: where the name comes from (``"seed 001"``, ``"TRL"``), shown in messages.
        values: how its values read as the field's: None (the same values), a mapping (its value
            -> the field's; a value mapped to None sets nothing), or a function
            ``(value, others) -> field value`` of the other values given (with the defaults).
        annotation: the type of its values where they differ from the field's (a command-line
            flag of a mapped spelling reads this type).
        accepted: False for a name only offered by `did_you_mean`, never read.
        field_wins: the field, when given too (not None), decides and this spelling is ignored
            (the rule of a field that once deferred to it: grpo 0.2's ``advantage_scale`` over
            ``normalize_advantages``); otherwise a different value is refused.
    """

    field: str
    origin: str
    values: Mapping[Any, Any] | Callable[[Any, Mapping[str, Any]], Any] | None = None
    annotation: Any = None
    accepted: bool = True
    field_wins: bool = False

    def value_for(self, name: str, value: Any, others: Mapping[str, Any]) -> Any:
        """The field's value for ``name=value`` (None: sets nothing); `ValueError` for a value
        the mapping does not hold."""
        if self.values is None:
            return value
        if callable(self.values):
            return self.values(value, others)
        keys = list(self.values)
        bool_keys = isinstance(keys[0], bool)
        if isinstance(value, bool) != bool_keys or value not in self.values:
            raise ValueError(f"{name}={value!r} is not allowed: choose one of {keys}.")
        return self.values[value]


def did_you_mean(name: str, known: Collection[str], spellings: Mapping[str, Spelling]) -> list[str]:
    """The names among ``known`` that ``name`` probably meant: the field it spells (from the
    table), else up to two close spellings. The one "did you mean" of grpo's messages."""
    spelling = spellings.get(name)
    if spelling is not None and spelling.field in known:
        return [spelling.field]
    return difflib.get_close_matches(name, list(known), n=2, cutoff=0.6)


def unknown_names_message(
    unknown: Mapping[str, Any] | Iterable[str],
    known: Collection[str],
    spellings: Mapping[str, Spelling],
) -> str:
    """``'lr' (did you mean learning_rate?), 'xyzzy'. Valid: ...``: each unknown name (with its
    value, ``lr=0.001 (did you mean learning_rate=0.001?)``, when ``unknown`` is a mapping) and
    what it probably meant (`did_you_mean`); the valid names are listed when one has no
    suggestion."""
    values = unknown if isinstance(unknown, Mapping) else None
    parts, lost = [], False
    for name in unknown:
        meant = did_you_mean(name, known, spellings)
        lost = lost or not meant
        if values is None:
            shown, hint = repr(name), " or ".join(meant)
        else:
            shown, hint = f"{name}={values[name]!r}", " or ".join(f"{m}={values[name]!r}" for m in meant)
        parts.append(shown + (f" (did you mean {hint}?)" if meant else ""))
    listing = f" Valid: {', '.join(sorted(known))}." if lost else ""
    return ", ".join(parts) + "." + listing


def read_spellings(
    values: Mapping[str, Any],
    spellings: Mapping[str, Spelling],
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``values`` with every accepted spelling replaced by its field (values mapped); names that
    are neither stay as they are (the caller refuses them). ``defaults``: the values of fields
    not given, for a spelling whose value depends on others (``num_mini_batches`` reads
    ``batch_size``). `ValueError` for a value the spelling does not map, and when the field (or
    another spelling of it) is given too with a different value; a field given as None yields
    (an unset field, as a config saved before the spelling was folded into it holds it)."""
    out = {k: v for k, v in values.items() if not (k in spellings and spellings[k].accepted)}
    given = {k: v for k, v in values.items() if k in spellings and spellings[k].accepted}
    others = {**(defaults or {}), **out}
    direct = {k for k, v in out.items() if v is not None}  # fields given by their own name
    source: dict[str, str] = {k: f"{k}={v!r}" for k, v in out.items()}
    for name, value in given.items():
        spelling = spellings[name]
        mapped = spelling.value_for(name, value, others)
        if mapped is None and spelling.values is not None:
            continue  # e.g. use_kl_advantage_shaping=False: nothing to set
        field_name = spelling.field
        if spelling.field_wins and field_name in direct:
            continue
        if out.get(field_name) is not None and out[field_name] != mapped:  # None: unset, as saved before
            raise ValueError(
                f"{name}={value!r} means {field_name}={mapped!r} ({spelling.origin}'s spelling), but "
                f"{source[field_name]} was given too. Pass only {field_name}."
            )
        out[field_name] = mapped
        source[field_name] = f"{name}={value!r} ({field_name}={mapped!r})"
    return out


def _spelling_error(cls: type, name: str, value: Any) -> str:
    """What ``cls(name=value)`` is told for an accepted spelling: the field and value to pass."""
    spelling = cls.spellings[name]  # type: ignore[attr-defined]
    try:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        mapped = spelling.value_for(name, value, defaults)
    except ValueError as e:
        return f"{cls.__name__} got {e}"
    meant = f"{spelling.field}={mapped!r}" if mapped is not None else "nothing (leave it out)"
    return (
        f"{cls.__name__} got {name}={value!r}, {spelling.origin}'s spelling of {spelling.field}: pass "
        f"{meant}. ({cls.__name__}.from_dict reads every spelling.)"
    )


class SpelledFields:
    """Base of a dataclass with an alias table (``spellings``, a class attribute): a keyword that
    is no field is refused before the dataclass's ``__init__`` runs (`TypeError` naming the field
    meant, see the module docstring); `from_dict` reads the accepted spellings too."""

    spellings: ClassVar[Mapping[str, Spelling]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = {k: v for k, v in kwargs.items() if k not in known}
        spelled = [k for k in unknown if k in cls.spellings and cls.spellings[k].accepted]
        if spelled:
            raise TypeError(_spelling_error(cls, spelled[0], unknown[spelled[0]]))
        if unknown:
            message = unknown_names_message(unknown, known, cls.spellings)
            plural = "s" if len(unknown) > 1 else ""
            raise TypeError(f"{cls.__name__} got unknown field{plural} {message}")
        return super().__new__(cls)

    @classmethod
    def from_dict(cls: type[T], values: Mapping[str, Any]) -> T:
        """An instance from ``values``: field names or accepted spellings (`read_spellings`)."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        try:
            fields = read_spellings(values, cls.spellings, defaults)
        except ValueError as e:
            raise ValueError(f"{cls.__name__}: {e}") from None
        return cls(**fields)
