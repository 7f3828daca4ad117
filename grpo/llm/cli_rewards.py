"""The reward functions of ``grpo-train``'s ``--reward`` options (and the answer extractors and
``module:function`` loading they use).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpo.llm.code_rewards import code_tests_reward
from grpo.llm.rewards import (
    Convention,
    Extractor,
    RewardFn,
    RewardFunctions,
    after_marker,
    boxed_answer,
    exact_match_reward,
    format_reward,
    last_number,
    overlong_penalty,
    tag_content,
)

__all__ = [
    "StepRewards",
    "build_rewards",
    "extractor_from_spec",
    "load_callable",
]


def extractor_from_spec(spec: str, flag: str = "--answer-extractor") -> Extractor:
    """The extractor named ``spec`` (last_number, boxed, after:MARKER, tag:NAME); `ValueError`
    naming ``flag`` otherwise."""
    if spec == "last_number":
        return last_number
    if spec == "boxed":
        return boxed_answer
    if spec.startswith("after:") and len(spec) > len("after:"):
        return after_marker(spec[len("after:") :])
    if spec.startswith("tag:") and len(spec) > len("tag:"):
        return tag_content(spec[len("tag:") :])
    raise ValueError(
        f"unknown {flag} {spec!r}; use last_number, boxed, after:MARKER (e.g. after:####) or tag:NAME "
        f"(e.g. tag:answer)."
    )


def load_callable(spec: str, flag: str = "--reward") -> Callable[..., Any]:
    """The callable ``attr`` of ``module:attr`` or ``path/to/file.py:attr`` (``flag`` names the
    option in the error)."""
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        s = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if s is None or s.loader is None:
            raise SystemExit(f"grpo-train: error: {flag}: cannot load the file {module_name!r}")
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SystemExit(f"grpo-train: error: {flag} {spec!r}: {module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def build_rewards(args: argparse.Namespace) -> RewardFunctions:
    """The `RewardFunctions` named by ``--reward`` (default: exact_match); the module:function
    ones are called in ``--reward-convention`` (the ready rewards in their own, grpo's)."""
    fns: dict[str, RewardFn] = {}
    weights: dict[str, float] = {}
    conventions: dict[str, Convention] = {}
    for spec in args.reward or ["exact_match"]:
        name, weight = spec, 1.0
        head, sep, tail = spec.rpartition("=")
        if sep:
            try:
                name, weight = head, float(tail)
            except ValueError:
                name = spec
        if name == "exact_match":
            fn = exact_match_reward(args.answer_column, extractor_from_spec(args.answer_extractor))
        elif name == "format":
            fn = format_reward(args.format_pattern, tags=[t for t in args.format_tags.split(",") if t])
        elif name == "overlong":
            cache = args.overlong_cache or max(1, args.max_new_tokens // 4)
            fn = overlong_penalty(args.max_new_tokens, cache)
        elif name == "code_tests":
            fn = code_tests_reward(args.tests_column)
        elif ":" in name:
            fn = load_callable(name)
            name = name.rpartition(":")[2]
            conventions[name] = args.reward_convention
        else:
            raise SystemExit(
                f"grpo-train: error: unknown --reward {name!r}; use exact_match, format, overlong, "
                "code_tests or module:function"
            )
        fns[name] = fn
        weights[name] = weight
    return StepRewards(fns, weights, convention=conventions)


class StepRewards(RewardFunctions):
    """`RewardFunctions` that keep the counters (``last_metrics``) of each call under the step
    count of ``trainer`` at the call: a training step's rewards are computed before its count goes
    up, an evaluation after step k at count k, so `step_counters` gives step k's own counters
    though the evaluation that follows it replaced ``last_metrics``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer: Any = None  # set by StepMetrics when training starts
        self.counters: dict[int, dict[str, float]] = {}  # step count at the call -> its counters

    def compute_reward_components(
        self, states: Sequence[Any], actions: Sequence[Any]
    ) -> dict[str, list[float]]:
        out = super().compute_reward_components(states, actions)
        if self.trainer is not None:
            count = int(self.trainer.step_count)
            self.counters = {k: v for k, v in self.counters.items() if k >= count - 1}
            self.counters[count] = self.last_metrics
        return out

    def step_counters(self, step: int) -> dict[str, float]:
        """The counters of the call made for step ``step`` (the count after it), none if no call."""
        return self.counters.get(step - 1, {})
