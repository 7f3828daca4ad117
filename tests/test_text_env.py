"""grpo.envs.text and the text side of grpo.envs.protocol: protocol conformance, the guessing game's
replies and rewards by hand, tool episodes whose answer only the tool knows, truncation, errors."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from grpo.envs import (
    Environment,
    GuessingGame,
    Problem,
    TextEnv,
    TextEnvironment,
    TextTask,
    ToolBox,
    ToolTask,
    Transition,
    TurnResult,
    calculator_tool,
    lookup_tool,
)
from grpo.envs.pendulum import TensorPendulum


def _contents(obs: list[list[dict[str, str]]]) -> list[list[str]]:
    return [[m["content"] for m in ms] for ms in obs]


def test_protocol_conformance() -> None:
    env = TextEnv(GuessingGame, 2)
    assert isinstance(env, TextEnvironment)
    assert isinstance(env, Environment)
    assert isinstance(TensorPendulum(2), Environment)
    assert isinstance(GuessingGame(), TextTask)
    assert not isinstance(object(), Environment)
    assert not isinstance(object(), TextTask)
    plain = Transition(
        torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool)
    )
    assert plain.infos is None  # the four positional fields of the control path are unchanged
    assert plain._replace(infos=[{}, {}]).infos == [{}, {}]


def test_guessing_game_by_hand() -> None:
    env = TextEnv(lambda: GuessingGame(1, 100), 3)
    obs = env.reset([{"secret": 37}, {"secret": 37}, {"secret": 5}])
    prompt = (
        "I am thinking of a whole number between 1 and 100. Guess it: answer with one number. "
        "I will reply higher, lower or correct."
    )
    assert obs == [[{"role": "user", "content": prompt}]] * 3
    t = env.step(["50", "My guess: 25", "I say 5"])
    assert _contents(t.observations) == [["lower"], ["higher"], ["correct"]]
    assert t.rewards.tolist() == [0.0, 0.0, 1.0]
    assert t.rewards.dtype == torch.float32
    assert t.terminated.tolist() == [False, False, True]
    assert t.truncated.tolist() == [False, False, False]
    assert t.infos == [
        {"guess": 50, "success": False},
        {"guess": 25, "success": False},
        {"guess": 5, "success": True},
    ]
    t = env.step(["40? no, 37", "hmm", "ignored: this episode has ended"])
    assert _contents(t.observations) == [
        ["correct"],
        ["Please answer with one whole number between 1 and 100."],
        [],
    ]
    assert t.rewards.tolist() == [1.0, 0.0, 0.0]
    assert t.terminated.tolist() == [True, False, True]
    assert t.infos == [{"guess": 37, "success": True}, {"guess": None, "success": False}, {}]


def test_seed_starts_and_groups() -> None:
    """A group: G sub-envs reset to one start see the same prompt and answer alike."""
    env = TextEnv(lambda: GuessingGame(1, 10), 4)
    env.reset([3, 3, 8, 8])
    secrets = [task.secret for task in env.tasks]  # type: ignore[attr-defined]
    assert secrets == [random.Random(s).randint(1, 10) for s in (3, 3, 8, 8)]
    t = env.step(["5"] * 4)
    assert t.observations[0] == t.observations[1]
    assert t.observations[2] == t.observations[3]
    with pytest.raises(ValueError, match="int seeds or"):
        env.reset(["x"] * 4)


def test_max_turns_truncates_and_return_sums() -> None:
    env = TextEnv(lambda: GuessingGame(1, 100), 2, max_turns=2)
    env.reset([{"secret": 10}, {"secret": 60}])
    rewards = []
    t = env.step(["1", "60"])
    rewards.append(t.rewards)
    assert t.truncated.tolist() == [False, False]
    t = env.step(["2", "unused"])
    rewards.append(t.rewards)
    assert t.terminated.tolist() == [False, True]
    assert t.truncated.tolist() == [True, False]  # out of turns; the solved one is terminated, not truncated
    assert torch.stack(rewards, 1).sum(1).tolist() == [0.0, 1.0]  # episode returns
    assert env.turns == [2, 1]


def test_tool_task_answer_only_from_the_tool() -> None:
    table = {"zorblax": "417", "quibbit": "902"}
    box = ToolBox([lookup_tool(table), calculator_tool()], timeout=5)
    problems = [
        Problem("What is the code of zorblax?", "417"),
        Problem("What is the code of quibbit?", "902"),
    ]
    env = TextEnv(lambda: ToolTask(problems, box, "Answer with the code."), 3, workers=2)
    obs = env.reset([0, 0, 1])
    assert obs[0][0]["role"] == "system"
    assert obs[0][0]["content"].startswith("Answer with the code.\nYou can call these tools:\n- lookup(key: ")
    assert obs[0][1] == {"role": "user", "content": "What is the code of zorblax?"}
    call = '<tool_call>{{"name": "lookup", "arguments": {{"key": "{}"}}}}</tool_call>'
    t = env.step([call.format("zorblax"), "The code is 417.", call.format("quibbit")])
    assert t.observations == [[{"role": "tool", "name": "lookup", "content": "417"}], [], [
        {"role": "tool", "name": "lookup", "content": "902"}
    ]]  # fmt: skip
    assert t.rewards.tolist() == [0.0, 1.0, 0.0]  # a guess without the tool can be right by luck only
    assert t.terminated.tolist() == [False, True, False]
    t = env.step(["The code is 417.", "", "It is 9021."])
    assert t.rewards.tolist() == [1.0, 0.0, 0.0]  # 9021 does not contain 902 as a whole number
    assert t.terminated.tolist() == [True, True, True]
    assert t.infos == [{"tool_calls": 0, "success": True}, {}, {"tool_calls": 0, "success": False}]
    env.close()


def test_tool_errors_are_observations_in_episodes() -> None:
    box = ToolBox([calculator_tool()], timeout=5)
    env = TextEnv(lambda: ToolTask([Problem("What is 6*7?", "42")], box), 2)
    env.reset([0, 0])
    t = env.step(
        [
            '<tool_call>{"name": "calculator", "arguments": {"expression": "6*"}}</tool_call>',
            "<tool_call>{</tool_call>",
        ]
    )
    assert t.observations[0][0]["content"].startswith(
        "Error: tool 'calculator' raised ValueError: not an arithmetic"
    )
    assert t.observations[1][0]["content"].startswith("Error: malformed tool call (not valid JSON")
    assert t.terminated.tolist() == [False, False]


class _BadTask:
    def reset(self, start: Any) -> Any:
        return [{"role": "user"}]

    def step(self, turn: str) -> TurnResult:
        return TurnResult([], 0.0, True)


def test_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"_BadTask.reset returned the message \{'role': 'user'\}"):
        TextEnv(_BadTask, 1).reset([0])
    with pytest.raises(TypeError, match="make_task\\(\\) returned int"):
        TextEnv(lambda: 3, 1)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"TextEnv\(max_turns=0\)"):
        TextEnv(GuessingGame, 1, max_turns=0)
    env = TextEnv(GuessingGame, 2)
    with pytest.raises(ValueError, match="reset got 1 starts for 2 sub-envs"):
        env.reset([0])
    env.reset([0, 1])
    with pytest.raises(TypeError, match="turn 1 is int; expected str"):
        env.step(["1", 2])  # type: ignore[list-item]
