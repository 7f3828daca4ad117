"""Command-line options and YAML/JSON config files from dataclasses: one option per field, with
the help text of the field's ``metadata["help"]`` (in the style of ``transformers.HfArgumentParser``).

    parser = DataclassArgumentParser(prog="train")
    parser.add_dataclass(MyConfig, aliases={"kl_coeff": ("--kl-coef",)}, defaults={"seed": 0})
    parsed = parser.parse(argv)                 # command line > --config file > defaults
    config = MyConfig(**parsed.for_dataclass(MyConfig))

A field ``some_name`` becomes the option ``--some-name`` (``--some_name`` is accepted too, and
not listed). ``aliases`` gives a field more option strings (other libraries' names), declared
once: they are spellings of the same option, listed on its help line, with one destination.
How a value is read, from the field's annotation:

============================  ==============================================  =====================
annotation                    command line                                    config file
============================  ==============================================  =====================
``bool``                      ``--flag`` (True), ``--flag true|false`` (also  ``true`` / ``false``
                              ``yes/no``, ``1/0``, ``on/off``), ``--no-flag``
``int``, ``float``, ``str``   the value                                       the value
``Literal[...]``              one of the choices (argparse ``choices``)       the same
``X | None``                  also ``none`` (or ``null``)                     ``null`` / ``none``
a union of these              each member tried: None, Literal, bool, int,    the same
                              float, str
``list[X]``, ``Sequence[X]``  one or more values, repeatable: ``--x a b``     a list (or one value)
                              = ``--x a --x b`` (a list)
anything else                 JSON text                                       the value as is
============================  ==============================================  =====================

``prefix`` puts a dataclass's options under a name space: ``add_dataclass(EvalOptions,
prefix="eval_")`` makes the field ``group_size`` the option ``--eval-group-size`` (value
``eval_group_size``), and ``parsed.for_dataclass(EvalOptions, prefix="eval_")`` gives the fields
back under their own names.

A string in a file is read as on the command line, so YAML's ``1e-6`` (a string to YAML 1.1)
is the float 1e-6, and an int is accepted where a float is expected. Keys of a file may use
``-`` or ``_`` and may be any option's name (an alias too).

Precedence, lowest first: the field's default, the ``defaults`` given to `add_dataclass`, the
``--config`` file, the command line (a list on the command line replaces the file's). A parser
made with ``spellings=`` (an alias table, `grpo.runtime.spellings`; ``grpo.config.SPELLINGS``)
takes every accepted spelling as a flag and as a file key: a spelling with the field's values is
one more flag of the field's option (``--kl-coef`` = ``--kl-coeff``), one whose values are mapped
is its own option (``--adv-norm mean_only`` = ``--advantage-scale none``), read through
`grpo.runtime.spellings.read_spellings` like a file's keys.
`ParsedValues.explicit` names what the file or the command line gave, so that a caller can put a
preset between the defaults and the explicit values (``GRPOConfig.recipe``). An option or a file
key that is no field is refused with the field meant (`grpo.runtime.spellings.did_you_mean`, the
one "did you mean"); on the command line as argparse errors are (exit status 2).
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from grpo.runtime.extras import install_hint
from grpo.runtime.spellings import Spelling, did_you_mean, read_spellings, unknown_names_message

__all__ = [
    "BoolFlagAction",
    "DataclassArgumentParser",
    "DataclassHelpFormatter",
    "FieldOption",
    "ParsedValues",
    "UsageError",
    "coerce_value",
    "field_options",
    "parse_bool",
    "read_config_file",
    "text_parser",
]

NONE_WORDS = frozenset({"none", "null"})
TRUE_WORDS = frozenset({"true", "yes", "y", "t", "1", "on"})
FALSE_WORDS = frozenset({"false", "no", "n", "f", "0", "off"})


def parse_bool(text: str) -> bool:
    """``true/yes/y/t/1/on`` -> True, ``false/no/n/f/0/off`` -> False (any case); else
    `argparse.ArgumentTypeError`."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (yes/no, 1/0, on/off), got {text!r}")


# ---- annotations -> parsers ----------------------------------------------------------------------
def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | Y``, ``Optional[X]``), flattening nested Literals' unions."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for a in typing.get_args(annotation) for m in _members(a))
    return (annotation,)


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """Every value of the Literal members of ``annotation`` (empty when it has none)."""
    return tuple(
        v for m in _members(annotation) if typing.get_origin(m) is Literal for v in typing.get_args(m)
    )


def _is_optional(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def _none_word(annotation: Any) -> str:
    """How None is typed for ``annotation``: ``none``, or ``null`` where a Literal has 'none'."""
    return "null" if "none" in _literal_values(annotation) else "none"


_LIST_ORIGINS = (list, collections.abc.Sequence)  # read as a list (a list is a Sequence)


def _list_element(annotation: Any) -> Any:
    """X for ``list[X]`` or ``Sequence[X]`` (either ``| None``); None for anything else."""
    lists = [m for m in _members(annotation) if m is not type(None)]
    if len(lists) == 1 and typing.get_origin(lists[0]) in _LIST_ORIGINS and typing.get_args(lists[0]):
        return typing.get_args(lists[0])[0]
    return None


def _is_list(annotation: Any) -> bool:
    return _list_element(annotation) is not None


def _scalar(member: Any, text: str) -> tuple[bool, Any]:
    """(True, value) when ``text`` reads as ``member`` (one union member), else (False, None)."""
    if member is type(None):
        return (text.strip().lower() in NONE_WORDS, None)
    if typing.get_origin(member) is Literal:
        for v in typing.get_args(member):
            if text == str(v) or (isinstance(v, str) and text.lower() == v.lower()):
                return True, v
        return False, None
    if member is bool:
        try:
            return True, parse_bool(text)
        except argparse.ArgumentTypeError:
            return False, None
    if member in (int, float):
        try:
            return True, member(text)
        except ValueError:
            return False, None
    if member is str:
        return True, text
    return False, None


_ORDER = (Literal, type(None), bool, int, float, str)  # a Literal 'none' wins over None (then: null)


def _rank(member: Any) -> int:
    key = Literal if typing.get_origin(member) is Literal else member
    return _ORDER.index(key) if key in _ORDER else len(_ORDER)


def _describe(annotation: Any) -> str:
    """What a value of ``annotation`` may be, for error messages: ``one of 'a', 'b' or none``."""
    parts = [repr(v) for v in _literal_values(annotation)]
    for m in _members(annotation):
        if m in (bool, int, float, str):
            parts.append({bool: "true/false", int: "an integer", float: "a number", str: "a string"}[m])
    if _is_optional(annotation):
        parts.append(_none_word(annotation))
    if not parts:
        return "JSON text"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def text_parser(annotation: Any) -> Callable[[str], Any]:
    """The function that reads a command-line string as a value of ``annotation`` (the element
    type of a list); it raises `argparse.ArgumentTypeError` saying what was expected."""
    if _is_list(annotation):
        return text_parser(_list_element(annotation))
    members = sorted(_members(annotation), key=_rank)
    if any(_rank(m) == len(_ORDER) for m in members):  # a type the table does not know: JSON
        return _json_value

    def read(text: str) -> Any:
        for m in members:
            ok, value = _scalar(m, text)
            if ok:
                return value
        raise argparse.ArgumentTypeError(f"expected {_describe(annotation)}, got {text!r}")

    return read


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected JSON text ({e.msg}), got {text!r}") from None


def coerce_value(name: str, value: Any, annotation: Any) -> Any:
    """A value of a config file (already typed by YAML/JSON) as a value of ``annotation``: strings
    are read as on the command line, an int is accepted for a float, one value for a list.
    `ValueError` naming ``name`` when it does not fit."""
    if value is None and _is_optional(annotation):
        return None
    if _is_list(annotation):
        items = value if isinstance(value, list) else [value]
        return [coerce_value(name, v, _list_element(annotation)) for v in items]
    members = _members(annotation)
    if isinstance(value, str):
        try:
            return text_parser(annotation)(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{name}: {e}") from None
    if value is None and _is_optional(annotation):
        return None
    if any(_rank(m) == len(_ORDER) for m in members):
        return value  # a type the table does not know: taken as the file gives it
    if isinstance(value, bool):
        if bool in members or value in _literal_values(annotation):
            return value
    elif isinstance(value, int) and int in members:
        return value
    elif isinstance(value, (int, float)) and float in members:
        return float(value)
    elif value in _literal_values(annotation):
        return value
    raise ValueError(f"{name}: expected {_describe(annotation)}, got {value!r} ({type(value).__name__})")


# ---- one option per field ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FieldOption:
    """One dataclass field as an option: ``flags`` (``--name`` first, then the aliases) set
    ``name`` (``prefix`` + the field's name); ``default`` is what it takes when neither the
    command line nor a file gives it."""

    name: str
    flags: tuple[str, ...]
    annotation: Any
    default: Any
    help: str
    owner: type
    choices: tuple[Any, ...] | None = None
    const: Any = None
    metavar: str | None = None
    prefix: str = ""

    @property
    def field_name(self) -> str:
        """The name of the dataclass field (``name`` without ``prefix``)."""
        return self.name[len(self.prefix) :]

    @property
    def is_bool(self) -> bool:
        return self.annotation is bool

    def argparse_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``add_argument`` (default SUPPRESS: absent unless given)."""
        kwargs: dict[str, Any] = {"dest": self.name, "default": argparse.SUPPRESS, "help": self.help_text()}
        if self.is_bool:
            return {**kwargs, "action": BoolFlagAction}
        kwargs["type"] = text_parser(self.annotation)
        if _is_list(self.annotation):
            kwargs.update(action="extend", nargs="+")  # --x a b, --x a --x b: [a, b]
        if self.const is not None:
            kwargs.update(nargs="?", const=self.const)
        if self.choices is not None:
            shown = [_show(c, _none_word(self.annotation)) for c in self.choices]
            kwargs.update(choices=self.choices, metavar="{" + ",".join(shown) + "}")
        else:
            kwargs["metavar"] = self.metavar or _metavar(self.annotation)
        return kwargs

    def help_text(self) -> str:
        text = self.help.strip() or f"{self.owner.__name__}.{self.field_name}"
        missing = self.default is dataclasses.MISSING
        default = "unset" if missing else _show(self.default, _none_word(self.annotation))
        return f"{text} (default: {default})".replace("%", "%%")


def _show(value: Any, none: str = "none") -> str:
    """A value as it would be typed: none (``none``), true/false, strings bare, lists with commas."""
    if value is None:
        return none
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ", ".join(_show(v) for v in value) or "[]"
    return str(value)


def _metavar(annotation: Any) -> str:
    names = {int: "INT", float: "FLOAT", str: "STR", bool: "BOOL"}
    parts = [names[m] for m in sorted(_members(annotation), key=_rank) if m in names]
    parts += [str(v) for v in _literal_values(annotation)]
    if _is_list(annotation):
        return _metavar(_list_element(annotation))
    if not parts:
        return "JSON"
    return "|".join(parts + ([_none_word(annotation)] if _is_optional(annotation) else []))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def field_options(
    cls: type,
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    choices: Mapping[str, Sequence[Any]] | None = None,
    exclude: Collection[str] = (),
    prefix: str = "",
) -> list[FieldOption]:
    """A `FieldOption` for every ``init`` field of the dataclass ``cls`` (not ``exclude``d), in
    declaration order. ``aliases``: field -> more option strings; ``defaults``: field -> the
    default to use instead of the field's; ``choices``: field -> the values allowed (a Literal
    field has its own); these and ``exclude`` name the fields without ``prefix``. The option of
    field ``f`` is named ``prefix + f`` (flag ``--<prefix>-f``, ``_`` as ``-``). The help is
    ``metadata["help"]``; ``metadata["const"]`` makes the value optional on the command line
    (``--resume`` alone = ``--resume <const>``)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"field_options() needs a dataclass type, got {cls!r}.")
    if prefix and not prefix.replace("_", "a").isidentifier():
        raise ValueError(f"field_options(prefix={prefix!r}): expected letters, digits and '_', e.g. 'eval_'.")
    aliases, defaults, choices = dict(aliases or {}), dict(defaults or {}), dict(choices or {})
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in exclude]
    unknown = sorted((set(aliases) | set(defaults) | set(choices)) - {f.name for f in fields})
    if unknown:
        raise ValueError(
            f"field_options({cls.__name__}): aliases/defaults/choices name {unknown}, which are not "
            f"fields of {cls.__name__}. {unknown_names_message(unknown, [f.name for f in fields], {})}"
        )
    options = []
    for f in fields:
        annotation = hints[f.name]
        allowed = choices.get(f.name)
        if (
            allowed is None
            and _literal_values(annotation)
            and all(_rank(m) in (0, 1) for m in _members(annotation))
        ):  # Literal (or Optional[Literal]): argparse choices
            allowed = [*_literal_values(annotation), *([None] if _is_optional(annotation) else [])]
        flag = "--" + (prefix + f.name).replace("_", "-")
        options.append(
            FieldOption(
                name=prefix + f.name,
                flags=(flag, *[a for a in aliases.get(f.name, ()) if a != flag]),
                annotation=annotation,
                default=defaults.get(f.name, _default(f)),
                help=str(f.metadata.get("help", "")),
                owner=cls,
                choices=None if allowed is None else tuple(allowed),
                const=f.metadata.get("const"),
                metavar=f.metadata.get("metavar"),
                prefix=prefix,
            )
        )
    return options


class BoolFlagAction(argparse.Action):
    """A bool option: ``--flag`` = True, ``--flag VALUE`` reads VALUE (`parse_bool`), and
    ``--no-flag`` (made from each ``--flag`` string) = False."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        negatives = ["--no-" + s[2:] for s in option_strings if s.startswith("--")]
        kwargs.pop("type", None)
        kwargs.setdefault("metavar", "BOOL")
        super().__init__([*option_strings, *negatives], dest, nargs="?", **kwargs)
        self.negatives = frozenset(negatives)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string in self.negatives:
            if values is not None:
                parser.error(f"{option_string} takes no value (it sets False); got {values!r}")
            setattr(namespace, self.dest, False)
            return
        try:
            setattr(namespace, self.dest, True if values is None else parse_bool(values))
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument {option_string}: {e}")


class DataclassHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option on one line with all its spellings and the value's form once:
    ``--kl-coeff, --kl-coef FLOAT``; ``--lora, --no-lora [BOOL]``."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        if isinstance(action, BoolFlagAction):
            positive = [s for s in action.option_strings if s not in action.negatives]
            return f"{', '.join(positive)} [BOOL], {', '.join(sorted(action.negatives))}"
        strings = ", ".join(action.option_strings)
        if action.nargs == 0:
            return strings
        return f"{strings} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


# ---- parsing ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParsedValues:
    """What `DataclassArgumentParser.parse` found: ``values`` holds every option (command line >
    file > defaults), ``explicit`` the names the command line or the file gave, ``file`` the
    ``--config`` path (None without one), ``extra`` the values of plain argparse arguments."""

    values: dict[str, Any]
    explicit: frozenset[str]
    file: str | None
    extra: dict[str, Any]

    def for_dataclass(self, cls: type, *, prefix: str = "", explicit_only: bool = False) -> dict[str, Any]:
        """The values of the fields of ``cls`` under their field names (those given explicitly
        only, if asked); ``prefix``: the one its options were added with."""
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        return {
            n: self.values[prefix + n]
            for n in names
            if prefix + n in self.values and (not explicit_only or prefix + n in self.explicit)
        }


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (``.yaml``/``.yml``) or JSON file, keys with ``-`` turned to ``_``.
    `ValueError` naming the file when it does not parse or holds no mapping; a key given twice
    (``kl-coeff`` and ``kl_coeff``) is refused."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"config file {str(p)!r} cannot be read: {e.strerror or e}.") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        yaml = _yaml()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"config file {str(p)!r} is not valid JSON ({e}); name a .yaml/.yml file for YAML."
            ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {str(p)!r} must hold a mapping of option names to values, got "
            f"{type(data).__name__}."
        )
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key in out:
            raise ValueError(f"config file {str(p)!r} gives {key!r} twice (with '-' and '_').")
        out[key] = v
    return out


def _yaml() -> Any:
    try:
        return importlib.import_module("yaml")
    except ImportError as e:
        raise ImportError(f"reading a YAML config file needs PyYAML ({e}): {install_hint('llm')}") from e


class DataclassArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose options are dataclass fields (`add_dataclass`), with a
    ``--config FILE`` option (YAML or JSON; ``config_option=None`` for none). `parse` gives the
    values with what was explicit; see the module docstring for types and precedence.
    ``spellings``: the alias table of the fields (`grpo.runtime.spellings.Spelling`): its accepted
    spellings are flags and file keys too (module docstring), and every entry is offered for an
    unknown name (`grpo.runtime.spellings.did_you_mean`). ``removed``: names of options that were
    removed -> why and what to do (``"decoding": "was removed ...; leave it out"``); a flag or file
    key naming one is refused with that text instead of a guess.

    A field name already added (by an earlier dataclass) is skipped: the first dataclass to
    declare a name owns its option, and both read the same value."""

    def __init__(
        self,
        *args: Any,
        config_option: str | None = "--config",
        spellings: Mapping[str, Spelling] | None = None,
        removed: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("formatter_class", DataclassHelpFormatter)
        super().__init__(*args, **kwargs)
        self.options: dict[str, FieldOption] = {}
        self.keys: dict[str, str] = {}  # every accepted name (field, alias; with '_') -> field
        self.config_option = config_option
        self.spellings: dict[str, Spelling] = dict(spellings or {})
        self.spelled: dict[str, FieldOption] = {}  # spellings with mapped values: their own options
        self.removed: dict[str, str] = dict(removed or {})
        if config_option is not None:
            self.add_argument(
                config_option,
                dest="config",
                default=None,
                metavar="FILE",
                help="YAML (.yaml/.yml) or JSON file of option values, keys as the options' names "
                "with '-' or '_'; options on the command line win.",
            )

    def add_dataclass(
        self,
        cls: type,
        *,
        group: Any = None,
        aliases: Mapping[str, Sequence[str]] | None = None,
        defaults: Mapping[str, Any] | None = None,
        choices: Mapping[str, Sequence[Any]] | None = None,
        exclude: Collection[str] = (),
        prefix: str = "",
    ) -> list[str]:
        """Add an option per field of ``cls`` (see `field_options`; ``prefix``: the options are
        named ``prefix + field``) to ``group``: an argument group of this parser, or the title of a
        new one (None: titled with the class name); and one per accepted spelling of its fields
        (`spellings`, without ``prefix``). Returns the option names added."""
        if group is None or isinstance(group, str):
            group = self.add_argument_group(group or cls.__name__)
        target = group
        added = []
        names = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in exclude}
        spelled = (
            {} if prefix else {k: s for k, s in self.spellings.items() if s.accepted and s.field in names}
        )
        flags = {n: list((aliases or {}).get(n, ())) for n in names}
        for key, spelling in spelled.items():
            if spelling.values is None:
                flags[spelling.field].append("--" + key.replace("_", "-"))
        made = field_options(
            cls, aliases=flags, defaults=defaults, choices=choices, exclude=exclude, prefix=prefix
        )
        for opt in made:
            if opt.name in self.options:
                continue
            target.add_argument(*opt.flags, **opt.argparse_kwargs())
            self.options[opt.name] = opt
            for flag in (opt.name, *opt.flags):
                self.keys[flag.lstrip("-").replace("-", "_")] = opt.name
            added.append(opt.name)
        for key, spelling in spelled.items():
            if spelling.values is not None and key not in self.spelled:
                self._add_spelling(target, key, spelling)
        return added

    def _add_spelling(self, target: Any, key: str, spelling: Spelling) -> None:
        """The option of a spelling whose values are mapped (``--adv-norm``): its value is kept
        under ``key`` and read through `read_spellings` in `parse`."""
        field_flag = self.options[spelling.field].flags[0]
        mapping = spelling.values
        means = (
            "; ".join(f"{_show(k)} = {field_flag} {_show(v, 'unchanged')}" for k, v in mapping.items())
            if isinstance(mapping, Mapping)
            else f"read as {field_flag}"
        )
        opt = FieldOption(
            name=key,
            flags=("--" + key.replace("_", "-"),),
            annotation=spelling.annotation,
            default=dataclasses.MISSING,
            help=f"{spelling.origin}'s spelling of {field_flag}: {means}.",
            owner=type(self),
            choices=tuple(_literal_values(spelling.annotation)) or None,
        )
        target.add_argument(*opt.flags, **opt.argparse_kwargs())
        self.spelled[key] = opt

    def normalise(self, argv: Sequence[str]) -> list[str]:
        """``--some_name[=v]`` -> ``--some-name[=v]`` for the options this parser has (up to ``--``)."""
        out = list(argv)
        for i, tok in enumerate(out):
            if tok == "--":
                break
            if tok.startswith("--") and "_" in tok.split("=", 1)[0]:
                name, sep, rest = tok.partition("=")
                dashed = "--" + name[2:].replace("_", "-")
                if dashed in self._option_string_actions:
                    out[i] = dashed + sep + rest
        return out

    def file_values(self, path: str | Path) -> dict[str, Any]:
        """The values of a config file, each under its field's name and of its field's type;
        `ValueError` naming the file for a key that is no option (with the close spellings), a
        field given twice (by two of its names) and a value that does not fit."""
        raw = read_config_file(path)
        gone = [k for k in raw if k in self.removed]
        if gone:
            raise ValueError(f"config file {str(path)!r}: {gone[0]} {self.removed[gone[0]]}.")
        unknown = [k for k in raw if k not in self.keys and k not in self.spelled]
        if unknown:
            raise ValueError(
                f"unknown option{'s' if len(unknown) > 1 else ''} in config file {str(path)!r}: "
                f"{unknown_names_message(unknown, list(self.keys), self.spellings)}"
            )
        out: dict[str, Any] = {}
        for key, value in raw.items():
            name = key if key in self.spelled or key in self.spellings else self.keys[key]
            if name in out:
                raise ValueError(f"config file {str(path)!r} gives {name!r} twice (as {key!r} too).")
            option = self.spelled.get(name) or self.options[self.keys[name]]
            out[name] = coerce_value(f"{path}: {key}", value, option.annotation)
        return out

    def _read_spellings(
        self, values: dict[str, Any], context: Mapping[str, Any], where: str
    ) -> dict[str, Any]:
        """``values`` (fields and spellings) as fields (`read_spellings`); errors exit (status 2)."""
        try:
            return read_spellings(values, self.spellings, context)
        except ValueError as e:
            self.fail(f"{where}: {e}")

    def parse(self, argv: Sequence[str] | None = None) -> ParsedValues:
        """Parse ``argv`` (default ``sys.argv[1:]``) and the ``--config`` file it names. Errors
        (an unknown option or key, a bad value) exit as argparse does (status 2)."""
        import sys

        ns, rest = self.parse_known_args(self.normalise(sys.argv[1:] if argv is None else argv))
        if rest:
            self.fail(self.unrecognized_message(rest))
        given = {k: v for k, v in vars(ns).items() if k in self.options or k in self.spelled}
        extra = {k: v for k, v in vars(ns).items() if k not in given}
        path = extra.get("config") if self.config_option is not None else None
        from_file: dict[str, Any] = {}
        if path is not None:
            try:
                from_file = self.file_values(path)
            except (ValueError, ImportError) as e:
                self.fail(str(e))
        values = {n: o.default for n, o in self.options.items() if o.default is not dataclasses.MISSING}
        context = {**values, **{k: v for k, v in {**from_file, **given}.items() if k in self.options}}
        from_file = self._read_spellings(from_file, context, f"config file {path!r}")
        given = self._read_spellings(given, context, "the command line")
        values.update(from_file)
        values.update(given)
        return ParsedValues(values, frozenset(from_file) | frozenset(given), path, extra)

    def unrecognized_message(self, rest: Sequence[str]) -> str:
        """``unrecognized arguments: --lr 1 (--lr: did you mean --learning-rate?)``: each unknown
        flag with the options it probably meant (`grpo.runtime.spellings.did_you_mean`)."""
        flags = {name: opt.flags[0] for name, opt in self.options.items()}
        notes = []
        for tok in rest:
            if not tok.startswith("--"):
                continue
            key = tok[2:].split("=", 1)[0].replace("-", "_")
            if key in self.removed:
                notes.append(f"{tok.split('=', 1)[0]} {self.removed[key]}")
                continue
            meant = did_you_mean(key, list(self.keys), self.spellings)
            shown = sorted({flags[self.keys[m]] for m in meant})
            if shown:
                notes.append(f"{tok.split('=', 1)[0]}: did you mean {' or '.join(shown)}?")
        hint = f" ({'; '.join(notes)})" if notes else ""
        return f"unrecognized arguments: {' '.join(rest)}{hint}"

    def fail(self, message: str) -> NoReturn:
        """Exit as argparse does on a bad option (`error`)."""
        self.error(message)

    def error(self, message: str) -> NoReturn:
        """As argparse: the usage and ``prog: error: message`` on stderr, exit status 2; the
        `UsageError` raised also carries the message (``str(e)``), for callers and tests."""
        import sys

        self.print_usage(sys.stderr)
        text = f"{self.prog}: error: {message}"
        sys.stderr.write(text + "\n")
        raise UsageError(text)


class UsageError(SystemExit):
    """A bad command line or config file: `SystemExit` with status 2 (as argparse exits) whose
    ``str()`` is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message
