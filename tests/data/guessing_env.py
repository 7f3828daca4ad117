"""An environment factory for ``grpo-train --env tests/data/guessing_env.py:make_env``.

``make_env(num_envs)`` returns a `grpo.envs.TextEnv` of ``num_envs`` guessing games (a hidden
whole number in 1..5, replies "higher" / "lower" / "correct"); its start states are int seeds or
``{"secret": n}`` records. ``make_shaped_env`` adds a dense reward (`ShapedGuessingGame`).
tests/test_llm_cli_args.py trains on them from the command line.
"""

from __future__ import annotations

from grpo.envs import GuessingGame, TextEnv, TurnResult


def make_env(num_envs: int) -> TextEnv:
    """``num_envs`` guessing games over 1..5."""
    return TextEnv(lambda: GuessingGame(1, 5), num_envs)


class ShapedGuessingGame(GuessingGame):
    """`GuessingGame` whose every turn also earns 0.1 per character: a dense reward that varies
    within a group of a tiny random model's episodes, so a few steps have a gradient."""

    def step(self, turn: str) -> TurnResult:
        result = super().step(turn)
        return result._replace(reward=result.reward + 0.1 * len(turn))


def make_shaped_env(num_envs: int) -> TextEnv:
    """``num_envs`` shaped guessing games over 1..5."""
    return TextEnv(lambda: ShapedGuessingGame(1, 5), num_envs)


def not_an_env(num_envs: int) -> list[int]:
    """A factory that returns the wrong thing (for the error test)."""
    return list(range(num_envs))
