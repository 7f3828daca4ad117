"""Rewards for the LLM path: plain callables over text, weighted, with per-component metrics.

A reward function returns one ``float | None`` per sample for the N samples of a step
(group-major). It may be written in either of two conventions; `RewardFunctions` inspects each
signature once, at construction (`reward_signature`), and calls it accordingly:

* **grpo** (positional): ``f(prompts, completions, **columns)`` is called as
  ``f(prompts, texts, **named)``. ``completions`` are always texts (str), also for chat prompts.
* **TRL** (keyword): ``f(prompts=..., completions=..., completion_ids=..., **columns)``, as TRL's
  ``GRPOTrainer`` calls it; e.g. ``f(completions, **kwargs)``, ``f(completions, solution,
  **kwargs)``, ``f(*, completions, answer, **kwargs)``. For a chat prompt (a list of
  ``{"role", "content"}`` messages) ``prompts`` holds that message list and the completion is
  ``[{"role": "assistant", "content": text}]``; for a string prompt both are strings.

The names available to either convention: ``prompts``, ``completions``, ``completion_ids``
(lists of token ids), ``completion_lengths`` (ints), ``trainer_state`` (`RewardFunctions.
trainer_state`, None by default), ``log_metric(name, value)``, ``log_extra(column, values)`` and
the dataset's other columns (``answer=[...]``, one value per sample). A function receives every
name it declares; with ``**kwargs`` a TRL-convention function receives all of them and a
grpo-convention one the columns, ``completion_ids`` and ``completion_lengths``. A required
parameter that nothing provides is a TypeError naming it and the available names. ``None``
means "does not apply to this sample": it counts as 0 in the weighted total and is left out of
that component's mean. ``async def`` rewards are awaited.

`RewardFunctions` combines several with weights, ``r = sum_k w_k r_k``, and is a `RewardModel`
with ``compute_reward_components`` (the trainer logs ``reward/<name>/mean``, where None counts as
0). ``last_metrics`` additionally holds the mean over applicable samples
(``reward/<name>/applicable_mean``) and the fraction applicable (``reward/<name>/applicable``).

Ready rewards: `exact_match_reward` (final answer, with an extractor such as `last_number`,
`boxed_answer`, `after_marker`, `tag_content`), `format_reward` (regex or tags) and
`overlong_penalty` (DAPO's soft over-length penalty).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from grpo.llm.data import is_chat, prompt_text, state_columns
from grpo.reward_model_base import StatelessReward

__all__ = [
    "CONVENTIONS",
    "REWARD_ARGUMENTS",
    "Convention",
    "Extractor",
    "RewardFn",
    "RewardFunctions",
    "RewardSignature",
    "after_marker",
    "boxed_answer",
    "exact_match_reward",
    "format_reward",
    "last_number",
    "overlong_penalty",
    "reward_signature",
    "tag_content",
]

RewardFn = Callable[..., Sequence[float | None]]
Extractor = Callable[[str], str | None]


# ---- extractors: completion text -> final answer (or None) ---------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _clean_number(s: str) -> str:
    s = s.replace(",", "").strip()
    try:
        v = float(s)
    except ValueError:
        return s
    return str(int(v)) if v.is_integer() else repr(v)


def last_number(text: str) -> str | None:
    """The last number in ``text`` (commas dropped, ``"3.0"`` -> ``"3"``), or None."""
    found = _NUMBER.findall(text)
    return _clean_number(found[-1]) if found else None


def boxed_answer(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def after_marker(marker: str = "####") -> Extractor:
    """An extractor returning the text after the last ``marker`` (GSM8K's ``#### 42``), stripped."""

    def extract(text: str) -> str | None:
        k = text.rfind(marker)
        return text[k + len(marker) :].strip() or None if k >= 0 else None

    extract.__name__ = f"after_marker({marker!r})"
    return extract


def tag_content(tag: str = "answer") -> Extractor:
    """An extractor returning the content of the last ``<tag>...</tag>``, stripped."""
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)

    def extract(text: str) -> str | None:
        found = pattern.findall(text)
        return found[-1].strip() if found else None

    extract.__name__ = f"tag_content({tag!r})"
    return extract


# ---- ready rewards -------------------------------------------------------------------------------
def exact_match_reward(
    answer_column: str = "answer",
    extractor: Extractor = last_number,
    *,
    reference_extractor: Extractor | None = None,
    numeric: bool = True,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> RewardFn:
    """``correct`` if the completion's extracted final answer equals the sample's answer, else ``wrong``.

    Args:
        answer_column: the dataset column with the reference answer. Samples whose answer is
            None get None (not applicable).
        extractor: completion text -> answer string (or None = no answer found -> ``wrong``).
        reference_extractor: applied to the reference answer first (e.g. ``after_marker("####")``
            for raw GSM8K solutions); None = use it as given.
        numeric: compare as numbers when both parse (``"3.0" == "3"``, ``"1,000" == "1000"``).
    """

    def norm(s: str) -> str:
        s = s.strip()
        return _clean_number(s) if numeric else s

    def exact_match(prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> list[float | None]:
        if answer_column not in columns:
            raise KeyError(
                f"exact_match_reward needs the column {answer_column!r} in the prompt records; "
                f"got columns {sorted(k for k in columns if not k.startswith('completion_'))}. "
                f"Pass answer_column=<your column>."
            )
        out: list[float | None] = []
        for text, ref in zip(completions, columns[answer_column], strict=True):
            if ref is None:
                out.append(None)
                continue
            ref_s = str(ref)
            if reference_extractor is not None:
                ref_s = reference_extractor(ref_s) or ref_s
            got = extractor(text)
            out.append(correct if got is not None and norm(got) == norm(ref_s) else wrong)
        return out

    return exact_match


def format_reward(
    pattern: str | None = None,
    *,
    tags: Sequence[str] = ("think", "answer"),
    full_match: bool = True,
    reward: float = 1.0,
) -> RewardFn:
    r"""``reward`` if the completion has the expected format, else 0.

    Args:
        pattern: a regex; default: the ``tags`` in order, e.g.
            ``<think>.*?</think>\s*<answer>.*?</answer>``.
        full_match: the whole (stripped) completion must match; False = found anywhere.
    """
    if pattern is None:
        if not tags:
            raise ValueError("format_reward needs a pattern or at least one tag.")
        pattern = r"\s*".join(rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in tags)
    rx = re.compile(pattern, re.DOTALL)

    def format_ok(prompts: Sequence[Any], completions: Sequence[str]) -> list[float | None]:
        match = rx.fullmatch if full_match else rx.search
        return [reward if match(c.strip()) else 0.0 for c in completions]

    return format_ok


def overlong_penalty(max_length: int, cache: int) -> RewardFn:
    """DAPO's soft over-length penalty on the completion length L (tokens).

    ``0`` if ``L <= max_length - cache``; ``(max_length - cache - L) / cache`` (from 0 down to -1)
    if ``max_length - cache < L <= max_length``; ``-1`` beyond.
    """
    if not 0 < cache <= max_length:
        raise ValueError(
            f"overlong_penalty needs 0 < cache <= max_length; got cache={cache}, max_length={max_length}."
        )
    start = max_length - cache

    def overlong(
        prompts: Sequence[Any], completions: Sequence[str], completion_lengths: Sequence[int]
    ) -> list[float | None]:
        return [
            0.0 if n <= start else (-1.0 if n > max_length else (start - n) / cache)
            for n in completion_lengths
        ]

    return overlong


# ---- how each function is called: decided once, from its signature --------------------------------
Convention = Literal["auto", "grpo", "trl"]
CONVENTIONS: tuple[str, ...] = ("auto", "grpo", "trl")

REWARD_ARGUMENTS: tuple[str, ...] = (
    "prompts",
    "completions",
    "completion_ids",
    "completion_lengths",
    "trainer_state",
    "log_metric",
    "log_extra",
)
"""The names a reward function may take besides the dataset's columns (no column may reuse one)."""


@dataclass(frozen=True)
class RewardSignature:
    """How `RewardFunctions` calls one reward function, decided once from its signature.

    Attributes:
        name: the reward's name (``reward/<name>/mean``).
        where: the function's qualified name and ``file:line``, for error messages.
        convention: ``"grpo"``: ``f(prompts, completions, **named)`` with completions as text;
            ``"trl"``: ``f(prompts=..., completions=..., completion_ids=..., **named)``, where the
            completion of a chat prompt is ``[{"role": "assistant", "content": text}]``.
        accepts: the names it takes by keyword (for "grpo": after the two leading positionals).
        required: the names in ``accepts`` without a default, in signature order.
        var_kw: it takes ``**kwargs``.
    """

    name: str
    where: str
    convention: Literal["grpo", "trl"]
    accepts: frozenset[str]
    required: tuple[str, ...]
    var_kw: bool


def _where(fn: Callable[..., Any]) -> str:
    """``qualname (file.py:line)`` of a function, a partial's function or a callable object."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    code = getattr(target, "__code__", None) or getattr(type(target).__call__, "__code__", None)
    qual = str(getattr(target, "__qualname__", type(target).__qualname__))
    return f"{qual} ({Path(code.co_filename).name}:{code.co_firstlineno})" if code is not None else qual


def _auto_convention(params: Sequence[inspect.Parameter]) -> Literal["grpo", "trl"]:
    """grpo's positional call or TRL's keyword call, from the parameter names (see `reward_signature`)."""
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if [p.name for p in positional[:2]] == ["prompts", "completions"]:
        note = positional[1].annotation
        return "trl" if note is not inspect.Parameter.empty and "dict" in str(note) else "grpo"
    if any(
        p.name in ("prompts", "completions")
        for p in params
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ):
        return "trl"
    two_slots = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
    return "grpo" if two_slots else "trl"


def reward_signature(
    fn: Callable[..., Any], name: str | None = None, convention: Convention = "auto"
) -> RewardSignature:
    """Inspect ``fn`` once and decide how `RewardFunctions` calls it.

    ``convention="auto"`` reads the parameter names:

    * the first two positional parameters are ``prompts, completions`` (grpo's documented
      ``f(prompts, completions, **columns)``, also one of TRL's): ``"grpo"``, so chat completions
      arrive as text. Both calls bind such a function the same way; only chat completions differ.
      If ``completions`` is annotated with a ``dict`` type (TRL's ``list[list[dict[str, str]]]``):
      ``"trl"``.
    * ``prompts`` or ``completions`` anywhere else (``f(completions, **kwargs)``,
      ``f(completions, solution, **kwargs)``, ``f(*, completions, answer, **kwargs)``): ``"trl"``.
    * otherwise two positional slots (``lambda p, c: ...``, ``f(*args)``): ``"grpo"``; fewer
      (``f(completion_ids, **kwargs)``, ``f(**kwargs)``): ``"trl"``.

    ``"grpo"`` or ``"trl"`` forces the convention (for a TRL function ``f(prompts, completions,
    **kwargs)`` on chat data: ``"trl"``).

    Raises:
        ValueError: an unknown ``convention``.
        TypeError: a parameter that can be neither positional slot nor passed by name (a required
            positional-only one), or ``"grpo"`` forced on a function without two positional slots.
    """
    label = name or _fn_name(fn)
    if convention not in CONVENTIONS:
        raise ValueError(f"reward {label!r}: convention={convention!r}; choose one of {CONVENTIONS}.")
    where = _where(fn)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): pass everything, as before
        conv: Literal["grpo", "trl"] = "trl" if convention == "trl" else "grpo"
        return RewardSignature(label, where, conv, frozenset(), (), True)
    conv = _auto_convention(params) if convention == "auto" else convention
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if conv == "grpo" and len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"reward {label!r} ({where}) takes {len(positional)} positional argument(s), but the grpo "
            "convention calls f(prompts, completions, ...). Use convention='trl' (keyword call) or add "
            "the two parameters."
        )
    named = positional[2 if conv == "grpo" else 0 :] + [p for p in params if p.kind is p.KEYWORD_ONLY]
    for p in named:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise TypeError(
                f"reward {label!r} ({where}): parameter {p.name!r} is positional-only (before '/'), so "
                f"the {conv} convention cannot pass it by name; make it an ordinary parameter."
            )
    keyword = [p for p in named if p.kind is not p.POSITIONAL_ONLY]
    required = tuple(p.name for p in keyword if p.default is p.empty)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return RewardSignature(label, where, conv, frozenset(p.name for p in keyword), required, var_kw)


@dataclass
class _Inputs:
    """One step's reward inputs: N prompts, N completion texts, the same completions in TRL's form
    (message lists for chat prompts), the columns (dataset + ``completion_ids/_lengths``) and the
    TRL extras (``trainer_state``, ``log_metric``, ``log_extra``)."""

    prompts: list[Any]
    texts: list[str]
    trl_completions: list[Any]
    columns: dict[str, Any]
    extras: dict[str, Any]
    dataset_columns: list[str] = field(default_factory=list)


def _missing_message(sig: RewardSignature, missing: str, inputs: _Inputs) -> str:
    cols = inputs.dataset_columns or "none (the prompts are plain strings or chats, not records)"
    return (
        f"reward {sig.name!r} ({sig.where}) needs the argument {missing!r}, which no input provides. "
        f"Available: {', '.join(REWARD_ARGUMENTS)} and the dataset columns {cols}. Add a {missing!r} "
        "column to the prompt records, rename the parameter to one of these, or give it a default."
    )


def _arguments(sig: RewardSignature, inputs: _Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments for one call.

    grpo: ``(prompts, texts)`` and, with ``**kwargs``, the columns; trl: no positionals and, with
    ``**kwargs``, everything. Either way every name the function declares is passed when available.
    """
    grpo = sig.convention == "grpo"
    pool = {
        "prompts": inputs.prompts,
        "completions": inputs.texts if grpo else inputs.trl_completions,
        **inputs.columns,
        **inputs.extras,
    }
    for r in sig.required:
        if r not in pool:
            raise TypeError(_missing_message(sig, r, inputs))
    kwargs: dict[str, Any] = {}
    if sig.var_kw:
        kwargs.update(inputs.columns if grpo else pool)
    kwargs.update({k: pool[k] for k in sig.accepts if k in pool})
    return ((inputs.prompts, inputs.texts) if grpo else ()), kwargs


def _resolve(values: Any, sig: RewardSignature) -> Any:
    """The result of an ``async def`` reward (awaited here), or ``values`` as they are."""
    if not inspect.isawaitable(values):
        return values
    try:
        asyncio.get_running_loop()
    except RuntimeError:

        async def wait() -> Any:
            return await values

        return asyncio.run(wait())
    if inspect.iscoroutine(values):
        values.close()
    raise RuntimeError(
        f"reward {sig.name!r} ({sig.where}) is async, but an event loop is already running in this "
        "thread; call the trainer outside the loop, or make the reward synchronous."
    )


def _checked(name: str, values: Any, n: int) -> list[float | None]:
    """``values`` as N finite floats or None; a clear error for anything else."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"reward {name!r} returned {type(values).__name__}; expected a list of {n} "
            "floats (or None where it does not apply)."
        )
    if len(values) != n:
        raise ValueError(
            f"reward {name!r} returned {len(values)} values for {n} completions; return "
            "one per completion (None where it does not apply)."
        )
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"reward {name!r} returned {v!r} at position {i}; expected a float or None."
            ) from e
        if not math.isfinite(f):
            raise ValueError(f"reward {name!r} returned {f} at position {i}; rewards must be finite.")
        out.append(f)
    return out


# ---- combination ---------------------------------------------------------------------------------
def _fn_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _named(rewards: RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn]) -> list[tuple[str, RewardFn]]:
    if callable(rewards):
        items = [(_fn_name(rewards), rewards)]
    elif isinstance(rewards, Mapping):
        items = [(str(k), v) for k, v in rewards.items()]
    else:
        items = [(_fn_name(f), f) for f in rewards]
    if not items:
        raise ValueError("RewardFunctions needs at least one reward function.")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"RewardFunctions got duplicate names {names}; pass a dict {{'name': fn, ...}}.")
    for n, f in items:
        if not callable(f):
            raise TypeError(f"reward {n!r} is a {type(f).__name__}, not a callable.")
    return items


def _weights(names: list[str], weights: Mapping[str, float] | Sequence[float] | None) -> dict[str, float]:
    if weights is None:
        return dict.fromkeys(names, 1.0)
    if isinstance(weights, Mapping):
        unknown = set(weights) - set(names)
        if unknown:
            raise ValueError(f"weights name unknown rewards {sorted(unknown)}; known: {names}.")
        return {n: float(weights.get(n, 1.0)) for n in names}
    ws = [float(w) for w in weights]
    if len(ws) != len(names):
        raise ValueError(f"got {len(ws)} weights for {len(names)} rewards {names}.")
    return dict(zip(names, ws, strict=True))


def _conventions(
    names: list[str], convention: Convention | Mapping[str, Convention]
) -> dict[str, Convention]:
    if not isinstance(convention, Mapping):
        return dict.fromkeys(names, convention)
    unknown = set(convention) - set(names)
    if unknown:
        raise ValueError(f"convention names unknown rewards {sorted(unknown)}; known: {names}.")
    return {n: convention.get(n, "auto") for n in names}


class RewardFunctions(StatelessReward):
    """Weighted text rewards ``r = sum_k w_k r_k`` as a `RewardModel` with components.

    Each function is called in its own convention, decided once here (`reward_signature`):
    grpo's ``f(prompts, completions, **columns)`` (completions as text) or TRL's keyword call
    ``f(prompts=, completions=, completion_ids=, **columns)`` (a chat prompt's completion as
    ``[{"role": "assistant", "content": text}]``). ``signatures`` holds the decisions.

    Args:
        rewards: one callable, a sequence (named by ``__name__``) or a mapping ``name -> callable``.
        weights: mapping ``name -> weight`` or a sequence aligned with ``rewards``; default 1.0.
        convention: ``"auto"`` (default), ``"grpo"`` or ``"trl"`` for all functions, or a mapping
            ``name -> convention`` (unnamed ones: ``"auto"``).

    Attributes:
        trainer_state: passed as ``trainer_state`` to functions that take it (TRL's curriculum
            hook); None unless you set it.
        last_metrics: after each call, ``reward/<name>/applicable``, ``.../applicable_mean`` and
            the means of the values functions gave ``log_metric(name, value)``.
        last_extra: the columns functions gave ``log_extra(column, values)`` in the last call.
    """

    def __init__(
        self,
        rewards: RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn],
        weights: Mapping[str, float] | Sequence[float] | None = None,
        *,
        convention: Convention | Mapping[str, Convention] = "auto",
    ) -> None:
        items = _named(rewards)
        names = [n for n, _ in items]
        conventions = _conventions(names, convention)
        self.functions: dict[str, RewardFn] = dict(items)
        self.signatures: dict[str, RewardSignature] = {
            n: reward_signature(f, n, conventions[n]) for n, f in items
        }
        self.reward_weights: dict[str, float] = _weights(names, weights)
        self.trainer_state: Any = None
        self.last_metrics: dict[str, float] = {}
        self.last_extra: dict[str, list[Any]] = {}

    def _inputs(
        self, states: Sequence[Any], actions: Sequence[Any], logged: dict[str, list[float]]
    ) -> _Inputs:
        prompts = [prompt_text(s) for s in states]
        texts = [str(getattr(a, "text", a)) for a in actions]
        cols: dict[str, Any] = state_columns(states)
        clash = sorted(set(cols) & set(REWARD_ARGUMENTS))
        if clash:
            raise ValueError(
                f"the prompt records have the column(s) {clash}, names RewardFunctions gives its own "
                f"values ({', '.join(REWARD_ARGUMENTS)}); rename the column(s) in the data."
            )
        dataset_columns = list(cols)
        ids = [getattr(a, "token_ids", None) for a in actions]
        cols["completion_ids"] = [t.tolist() if t is not None else None for t in ids]
        cols["completion_lengths"] = [len(a) if hasattr(a, "__len__") else None for a in actions]
        chat = [
            [{"role": "assistant", "content": t}] if is_chat(p) else t
            for p, t in zip(prompts, texts, strict=True)
        ]

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(name, []).append(float(value))

        def log_extra(column: str, values: Sequence[Any]) -> None:
            self.last_extra[column] = list(values)

        extras = {"trainer_state": self.trainer_state, "log_metric": log_metric, "log_extra": log_extra}
        return _Inputs(prompts, texts, chat, cols, extras, dataset_columns)

    def _call(self, name: str, inputs: _Inputs) -> list[float | None]:
        sig = self.signatures[name]
        args, kwargs = _arguments(sig, inputs)
        values = _resolve(self.functions[name](*args, **kwargs), sig)
        return _checked(name, values, len(inputs.texts))

    def compute_reward_components(
        self, states: Sequence[Any], actions: Sequence[Any]
    ) -> dict[str, list[float]]:
        """Each function's rewards, None -> 0.0; fills ``last_metrics`` and ``last_extra``."""
        logged: dict[str, list[float]] = {}
        self.last_extra = {}
        inputs = self._inputs(states, actions, logged)
        raw = {n: self._call(n, inputs) for n in self.functions}
        n_samples = len(inputs.texts)
        none_everywhere = [i for i in range(n_samples) if all(r[i] is None for r in raw.values())]
        if none_everywhere:
            warnings.warn(
                f"no reward function applies to samples {none_everywhere[:10]} (all returned None); "
                "they get reward 0. Make at least one function return a number for every sample.",
                UserWarning,
                stacklevel=3,
            )
        metrics: dict[str, float] = {}
        for n, r in raw.items():
            applicable = [v for v in r if v is not None]
            metrics[f"reward/{n}/applicable"] = len(applicable) / max(len(r), 1)
            if applicable:
                metrics[f"reward/{n}/applicable_mean"] = sum(applicable) / len(applicable)
        metrics.update({k: sum(v) / len(v) for k, v in logged.items()})
        self.last_metrics = metrics
        return {n: [0.0 if v is None else v for v in r] for n, r in raw.items()}

    def compute_rewards(self, states: Sequence[Any], actions: Sequence[Any]) -> list[float]:
        comps = self.compute_reward_components(states, actions)
        total = [0.0] * len(actions)
        for n, values in comps.items():
            w = self.reward_weights[n]
            total = [t + w * v for t, v in zip(total, values, strict=True)]
        return total

    def __repr__(self) -> str:
        return f"RewardFunctions({self.reward_weights})"
