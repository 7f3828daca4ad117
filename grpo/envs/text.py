"""`TextEnv`: a `grpo.envs.TextEnvironment` of ``num_envs`` chat episodes, built from one episode
class, so a user writes the task, not the batching.

A task is any object with (`TextTask`)::

    reset(start) -> list[Message]          # the episode's first messages (system / user prompt)
    step(turn: str) -> TurnResult          # (messages, reward, terminated, truncated, info)

`TextEnv(make_task, num_envs)` holds ``num_envs`` independent tasks and steps them together:
``reset(starts)`` resets task i to ``starts[i]``; ``step(turns)`` gives turn i to task i while its
episode runs (a finished episode is not called again: it answers ``[]``, reward 0, and its final
flags). ``max_turns`` truncates an episode after that many turns. ``workers > 1`` steps the tasks
in a thread pool (for tasks that wait on tools or the network). A GRPO group is G sub-envs reset to
the same start; a task must give equal first messages for equal starts.

Ready tasks: `GuessingGame` (find a hidden number from "higher" / "lower" replies) and
`ToolTask` (answer a question with tools, e.g. a lookup table the model cannot know).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from grpo.envs.protocol import Message, TextObservation, Transition
from grpo.envs.tools import ToolBox, describe_tools

__all__ = ["GuessingGame", "Problem", "TextEnv", "TextTask", "ToolTask", "TurnResult", "check_messages"]

_INT_RE = re.compile(r"-?\d+")


class TurnResult(NamedTuple):
    """A task's answer to one turn: the messages it adds, the turn's reward, the episode's flags."""

    messages: list[Message]
    reward: float
    terminated: bool
    truncated: bool = False
    info: dict[str, Any] | None = None


@runtime_checkable
class TextTask(Protocol):
    """One chat episode: reset to a start, then answer the model's turns."""

    def reset(self, start: Any) -> list[Message]:
        """Begin an episode from ``start``; returns its first messages (equal for equal starts)."""

    def step(self, turn: str) -> TurnResult:
        """The model said ``turn`` (the assistant message's text); answer it."""


def check_messages(messages: Any, where: str) -> list[Message]:
    """``messages`` if it is a list of ``{"role": str, "content": str, ...}`` dicts, else a TypeError
    naming ``where`` (e.g. ``"GuessingGame.reset"``) and the bad item."""
    if not isinstance(messages, list):
        raise TypeError(f"{where} returned {type(messages).__name__}; expected a list of message dicts.")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TypeError(
                f"{where} returned the message {m!r}; each message must be a dict with str 'role' and "
                f"'content', e.g. {{'role': 'user', 'content': 'Guess a number.'}}."
            )
    return messages


class TextEnv:
    """``num_envs`` text episodes stepped together: a `grpo.envs.TextEnvironment`.

    Args:
        make_task: zero-argument factory of one `TextTask`; called ``num_envs`` times.
        num_envs: number of sub-environments (B*G for a GRPO step).
        max_turns: truncate an episode after this many turns (None: only the task ends it).
        workers: step up to this many tasks at once in threads (1: one after the other).
    """

    def __init__(
        self,
        make_task: Callable[[], TextTask],
        num_envs: int,
        *,
        max_turns: int | None = None,
        workers: int = 1,
    ) -> None:
        checked = {
            "num_envs": num_envs,
            "workers": workers,
            "max_turns": 1 if max_turns is None else max_turns,
        }
        for name, value in checked.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TextEnv({name}={value!r}): expected an integer >= 1.")
        self.tasks = [make_task() for _ in range(num_envs)]
        bad = [t for t in self.tasks if not isinstance(t, TextTask)]
        if bad:
            raise TypeError(
                f"TextEnv: make_task() returned {type(bad[0]).__name__}, which lacks reset(start) -> "
                f"list[Message] or step(turn: str) -> TurnResult."
            )
        self.num_envs = num_envs
        self.max_turns = max_turns
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self.turns = [0] * num_envs
        self.terminated = [True] * num_envs
        self.truncated = [False] * num_envs

    def reset(self, starts: Sequence[Any]) -> TextObservation:
        """Task i begins from ``starts[i]``; returns each episode's first messages."""
        if len(starts) != self.num_envs:
            raise ValueError(f"TextEnv.reset got {len(starts)} starts for {self.num_envs} sub-envs.")
        first = self._map(lambda i: self.tasks[i].reset(starts[i]), range(self.num_envs))
        where = [f"{type(t).__name__}.reset" for t in self.tasks]
        self.turns = [0] * self.num_envs
        self.terminated = [False] * self.num_envs
        self.truncated = [False] * self.num_envs
        return [check_messages(m, w) for m, w in zip(first, where, strict=True)]

    def step(self, actions: Sequence[str]) -> Transition[TextObservation]:
        """Turn ``actions[i]`` to each running episode i; finished ones are not called."""
        if len(actions) != self.num_envs:
            raise ValueError(f"TextEnv.step got {len(actions)} turns for {self.num_envs} sub-envs.")
        running = [i for i in range(self.num_envs) if not (self.terminated[i] or self.truncated[i])]
        for i in running:
            if not isinstance(actions[i], str):
                raise TypeError(f"TextEnv.step: turn {i} is {type(actions[i]).__name__}; expected str.")
        answers = dict(
            zip(running, self._map(lambda i: self.tasks[i].step(actions[i]), running), strict=True)
        )
        observations: TextObservation = [[] for _ in range(self.num_envs)]
        rewards = [0.0] * self.num_envs
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for i, answer in answers.items():
            messages, reward, terminated, truncated, info = TurnResult(*answer)
            observations[i] = check_messages(messages, f"{type(self.tasks[i]).__name__}.step")
            self.turns[i] += 1
            out_of_turns = self.max_turns is not None and self.turns[i] >= self.max_turns
            rewards[i], infos[i] = float(reward), dict(info or {})
            self.terminated[i] = bool(terminated)
            self.truncated[i] = bool(truncated) or (out_of_turns and not self.terminated[i])
        return Transition(
            observations,
            torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(self.terminated, dtype=torch.bool),
            torch.tensor(self.truncated, dtype=torch.bool),
            infos,
        )

    def _map(self, fn: Callable[[int], Any], indices: Sequence[int] | range) -> list[Any]:
        if self.workers == 1 or len(indices) <= 1:
            return [fn(i) for i in indices]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="text-env")
        return list(self._pool.map(fn, indices))

    def close(self) -> None:
        """Close the tasks that have ``close()`` and the thread pool."""
        for task in self.tasks:
            close = getattr(task, "close", None)
            if callable(close):
                close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class GuessingGame:
    """Find a hidden whole number in ``[low, high]``: the environment answers each guess with
    ``"higher"``, ``"lower"`` or ``"correct"``; reward 1 for the correct turn, else 0.

    A start is an int seed (secret = ``random.Random(seed).randint(low, high)``) or a dict
    ``{"secret": n}``. The guess is the *last* integer in the turn; a turn without one gets the
    reply ``"Please answer with one whole number between {low} and {high}."`` (reward 0). The
    answer can only be found from the replies: the prompt is the same for every secret.
    ``info``: ``{"guess": int | None, "success": bool}``.
    """

    def __init__(self, low: int = 1, high: int = 100) -> None:
        if high <= low:
            raise ValueError(f"GuessingGame(low={low}, high={high}): needs low < high.")
        self.low, self.high = low, high
        self.secret = low

    def prompt(self) -> str:
        """The task's one user message (the same for every secret)."""
        return (
            f"I am thinking of a whole number between {self.low} and {self.high}. Guess it: answer "
            f"with one number. I will reply higher, lower or correct."
        )

    def reset(self, start: Any) -> list[Message]:
        """A new secret from ``start``; returns ``[{"role": "user", "content": self.prompt()}]``."""
        if isinstance(start, dict):
            self.secret = int(start["secret"])
        elif isinstance(start, int) and not isinstance(start, bool):
            self.secret = random.Random(start).randint(self.low, self.high)
        else:
            raise ValueError(f"GuessingGame starts are int seeds or {{'secret': n}}; got {start!r}.")
        return [{"role": "user", "content": self.prompt()}]

    def step(self, turn: str) -> TurnResult:
        """The reply to the guess in ``turn`` (see the class docstring)."""
        numbers = _INT_RE.findall(turn)
        if not numbers:
            reply = f"Please answer with one whole number between {self.low} and {self.high}."
            return TurnResult(
                [{"role": "user", "content": reply}], 0.0, False, info={"guess": None, "success": False}
            )
        guess = int(numbers[-1])
        reply = "correct" if guess == self.secret else ("higher" if guess < self.secret else "lower")
        success = guess == self.secret
        info = {"guess": guess, "success": success}
        return TurnResult([{"role": "user", "content": reply}], float(success), success, info=info)


class Problem(NamedTuple):
    """A question and its answer (a string the final turn must contain as a whole word)."""

    question: str
    answer: str


class ToolTask:
    """Answer a question, calling tools on the way: a turn with tool calls gets the tool messages
    (reward 0); the first turn without a call is the final answer: reward 1 if it contains
    ``problem.answer`` as a whole word (case-insensitive), and the episode ends.

    Args:
        problems: the questions; a start is an index into them (or a `Problem`).
        tools: the `ToolBox` the calls run in (its timeout bounds every turn).
        system_prompt: prepended to `describe_tools` of the tools in the first system message.

    ``info``: ``{"tool_calls": calls this turn, "success": bool}`` (success only on the final turn).
    """

    def __init__(self, problems: Sequence[Problem], tools: ToolBox, system_prompt: str = "") -> None:
        if not problems:
            raise ValueError("ToolTask needs at least one Problem(question, answer).")
        self.problems = list(problems)
        self.tools = tools
        self.system = "\n".join(p for p in (system_prompt, describe_tools(list(tools.tools.values()))) if p)
        self.problem = self.problems[0]

    def reset(self, start: Any) -> list[Message]:
        """The system message (tools, how to call them) and the question of problem ``start``."""
        self.problem = start if isinstance(start, Problem) else self.problems[int(start)]
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.problem.question},
        ]

    def step(self, turn: str) -> TurnResult:
        """Tool messages for a turn with calls; else the final answer's reward, and the end."""
        messages = self.tools.respond(turn)
        if messages:
            return TurnResult(messages, 0.0, False, info={"tool_calls": len(messages)})
        pattern = rf"(?<!\w){re.escape(self.problem.answer)}(?!\w|\.\d)"
        success = re.search(pattern, turn, flags=re.IGNORECASE) is not None
        return TurnResult([], float(success), True, info={"tool_calls": 0, "success": success})
