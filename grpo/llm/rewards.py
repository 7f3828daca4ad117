"""Rewards for the LLM path: plain callables over text, weighted, with per-component metrics.

A reward function is any callable::

    f(prompts: list[Prompt], completions: list[str], **columns) -> list[float | None]

``prompts`` and ``completions`` hold the N samples of a step (group-major); ``columns`` are the
dataset's other columns (``answer=[...]``, one value per sample) plus ``completion_ids`` (lists of
token ids) and ``completion_lengths`` (ints). A function receives only the keyword arguments its
signature names (all of them if it takes ``**kwargs``). ``None`` means "does not apply to this
sample": it counts as 0 in the weighted total and is left out of that component's mean.

`RewardFunctions` combines several with weights, ``r = sum_k w_k r_k``, and is a `RewardModel`
with ``compute_reward_components`` (the trainer logs ``reward/<name>/mean``, where None counts as
0). ``last_metrics`` additionally holds the mean over applicable samples
(``reward/<name>/applicable_mean``) and the fraction applicable (``reward/<name>/applicable``).

Ready rewards: `exact_match_reward` (final answer, with an extractor such as `last_number`,
`boxed_answer`, `after_marker`, `tag_content`), `format_reward` (regex or tags) and
`overlong_penalty` (DAPO's soft over-length penalty).
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.llm.data import prompt_text, state_columns
from grpo.reward_model_base import StatelessReward

__all__ = [
    "Extractor",
    "RewardFn",
    "RewardFunctions",
    "after_marker",
    "boxed_answer",
    "exact_match_reward",
    "format_reward",
    "last_number",
    "overlong_penalty",
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


# ---- combination ---------------------------------------------------------------------------------
def _accepted(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """Keyword names ``fn`` accepts beyond the first two positionals, and whether it has **kwargs."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    params = list(sig.parameters.values())
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = {p.name for p in positional[2:]} | {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    return names, var_kw


def _fn_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


class RewardFunctions(StatelessReward):
    """Weighted text rewards ``r = sum_k w_k r_k`` as a `RewardModel` with components.

    Args:
        rewards: one callable, a sequence (named by ``__name__``) or a mapping ``name -> callable``.
        weights: mapping ``name -> weight`` or a sequence aligned with ``rewards``; default 1.0.
    """

    def __init__(
        self,
        rewards: RewardFn | Sequence[RewardFn] | Mapping[str, RewardFn],
        weights: Mapping[str, float] | Sequence[float] | None = None,
    ) -> None:
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
        self.functions: dict[str, RewardFn] = dict(items)
        if weights is None:
            self.reward_weights: dict[str, float] = dict.fromkeys(names, 1.0)
        elif isinstance(weights, Mapping):
            unknown = set(weights) - set(names)
            if unknown:
                raise ValueError(f"weights name unknown rewards {sorted(unknown)}; known: {names}.")
            self.reward_weights = {n: float(weights.get(n, 1.0)) for n in names}
        else:
            ws = [float(w) for w in weights]
            if len(ws) != len(names):
                raise ValueError(f"got {len(ws)} weights for {len(names)} rewards {names}.")
            self.reward_weights = dict(zip(names, ws, strict=True))
        self.last_metrics: dict[str, float] = {}

    def _call(
        self, name: str, fn: RewardFn, prompts: list[Any], texts: list[str], cols: dict[str, Any]
    ) -> list[float | None]:
        names, var_kw = _accepted(fn)
        kwargs = cols if var_kw else {k: v for k, v in cols.items() if k in names}
        values = fn(prompts, texts, **kwargs)
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(
                f"reward {name!r} returned {type(values).__name__}; expected a list of {len(texts)} "
                "floats (or None where it does not apply)."
            )
        if len(values) != len(texts):
            raise ValueError(
                f"reward {name!r} returned {len(values)} values for {len(texts)} completions; return "
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

    def compute_reward_components(
        self, states: Sequence[Any], actions: Sequence[Any]
    ) -> dict[str, list[float]]:
        """Each function's rewards, None -> 0.0; fills ``last_metrics``."""
        prompts = [prompt_text(s) for s in states]
        texts = [str(getattr(a, "text", a)) for a in actions]
        cols: dict[str, Any] = state_columns(states)
        ids = [getattr(a, "token_ids", None) for a in actions]
        cols["completion_ids"] = [t.tolist() if t is not None else None for t in ids]
        cols["completion_lengths"] = [len(a) if hasattr(a, "__len__") else None for a in actions]
        raw = {n: self._call(n, f, prompts, texts, cols) for n, f in self.functions.items()}
        none_everywhere = [i for i in range(len(texts)) if all(r[i] is None for r in raw.values())]
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
