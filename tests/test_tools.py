"""grpo.envs.tools: parsing tool calls, running them (raise, hang, garbage, unknown, concurrent),
and the ready calculator and lookup tools. Every failure must come back as a tool message."""

from __future__ import annotations

import threading
import time

import pytest

from grpo.envs.tools import (
    MalformedCall,
    Tool,
    ToolBox,
    ToolCall,
    calculate,
    calculator_tool,
    describe_tools,
    lookup_tool,
    parse_tool_calls,
)


def test_parse_tool_calls_formats() -> None:
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3*7"}}</tool_call>'
        ' and <tool_call>\n{"tool": "lookup", "parameters": {"key": "x"}}\n</tool_call>'
        ' <tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"y\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "3*7"}),
        ToolCall("lookup", {"key": "x"}),
        ToolCall("lookup", {"key": "y"}),
    ]
    assert parse_tool_calls("The answer is 21.") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [ToolCall("f", {})]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "expected a JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "string that is not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {}}', "missing the closing </tool_call> tag"),
    ],
)
def test_parse_malformed_calls(body: str, problem: str) -> None:
    (call,) = parse_tool_calls(body)
    assert isinstance(call, MalformedCall)
    assert problem in call.problem


def test_calculator_by_hand() -> None:
    assert calculate("3*7") == 21
    assert calculate(" (2 + 3) ** 2 - 4 / 2 ") == 23.0
    assert calculate("7 // 2 + 7 % 2") == 4
    assert calculate("-2**2") == -4
    assert calculate("2**-1") == 0.5
    assert calculate("123456789 * 987654321") == 121932631112635269  # exact integers
    for bad, match in [
        ("__import__('os').system('true')", "unsupported element 'Call'"),
        ("x + 1", "unsupported element 'Name'"),
        ("9**9**9", "result too large"),
        ("2**300", "result too large"),
        ("1e308 * 10", "not finite"),
        ("3 +", "not an arithmetic expression"),
        ("1" * 201, "at most 200 characters"),
        ("(-1) ** 0.5", "complex"),
        ("True + 1", "unsupported element 'Constant'"),
    ]:
        with pytest.raises(ValueError, match=match):
            calculate(bad)
    with pytest.raises(ZeroDivisionError):
        calculate("1/0")


def test_lookup_tool_and_schema() -> None:
    tool = lookup_tool({"Zorblax": "417"})
    assert tool.function(key="Zorblax") == "417"
    assert tool.function(key=" zorblax ") == "417"
    assert tool.function(key="qux") == "No entry for 'qux'."
    assert calculator_tool().schema()["function"]["parameters"] == {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the expression, e.g. (3 + 4) * 7"}},
        "required": ["expression"],
    }
    text = describe_tools([calculator_tool(), tool])
    assert "- calculator(expression: the expression, e.g. (3 + 4) * 7)" in text
    assert "<tool_call>" in text


def _box(*tools: Tool, timeout: float = 2.0) -> ToolBox:
    return ToolBox([calculator_tool(), *tools], timeout=timeout)


def test_results_and_failures_become_messages() -> None:
    def boom(x: int) -> int:
        raise RuntimeError(f"kaput {x}")

    box = _box(Tool("boom", boom), Tool("obj", lambda: object()), Tool("data", lambda: {"a": [1, 2]}))
    results = box.run(
        [
            ToolCall("calculator", {"expression": "3*7"}),
            ToolCall("boom", {"x": 3}),
            ToolCall("nope", {}),
            ToolCall("calculator", {"expr": "1"}),
            ToolCall("calculator", {"expression": "1/0"}),
            MalformedCall("{", "not valid JSON: x"),
            ToolCall("data", {}),
        ]
    )
    assert [r.status for r in results] == [
        "ok", "error", "unknown_tool", "bad_arguments", "error", "malformed", "ok"
    ]  # fmt: skip
    assert results[0].content == "21"
    assert results[1].content == "Error: tool 'boom' raised RuntimeError: kaput 3"
    assert results[2].content == "Error: unknown tool 'nope'. Available tools: calculator, boom, obj, data."
    assert results[3].content.startswith("Error: bad arguments for tool 'calculator': ")
    assert results[3].content.endswith(
        ": missing a required argument: 'expression'. Expected calculator(expression)."
    )
    assert results[4].content == "Error: tool 'calculator' raised ZeroDivisionError: division by zero"
    assert results[5].content.startswith(
        "Error: malformed tool call (not valid JSON: x). Call a tool as <tool_call>"
    )
    assert results[6].content == '{"a": [1, 2]}'
    assert results[0].message() == {"role": "tool", "name": "calculator", "content": "21"}
    assert box.run([ToolCall("obj", {})])[0].content.startswith("<object object at")


def test_hanging_tool_times_out() -> None:
    release = threading.Event()
    box = _box(Tool("hang", lambda: release.wait(60)), timeout=0.2)
    try:
        start = time.monotonic()
        (result,) = box.run([ToolCall("hang", {})])
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert result.status == "timeout"
    assert result.content == "Error: tool 'hang' did not finish within 0.2 s (timed out)."
    assert 0.2 <= elapsed < 0.2 + 2.0  # returns at the timeout, not when the tool would
    assert box.abandoned == 1


def test_calls_run_concurrently() -> None:
    """Four calls that each wait for all four at a barrier: they only finish if they run at once."""
    barrier = threading.Barrier(4, timeout=10)
    box = _box(Tool("meet", lambda i: (barrier.wait(), i)[1]), timeout=20)
    turns = [f'<tool_call>{{"name": "meet", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(3)]
    turns[2] += turns[2].replace('"i": 2', '"i": 3')  # two calls in the last turn
    messages = box.respond_batch([*turns, "no call here"])
    assert [[m["content"] for m in ms] for ms in messages] == [["0"], ["1"], ["2", "3"], []]


def test_max_workers_runs_calls_in_waves() -> None:
    """Five calls, two at a time: each pair meets at a barrier of two; never more than two run."""
    barrier, lock, active, peak = threading.Barrier(2, timeout=10), threading.Lock(), [0], [0]

    def meet(i: int) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        if i < 4:  # the fifth call runs alone in the last wave
            barrier.wait()
        with lock:
            active[0] -= 1
        return i

    box = ToolBox([Tool("meet", meet)], timeout=20, max_workers=2)
    results = box.run([ToolCall("meet", {"i": i}) for i in range(5)])
    assert [r.content for r in results] == ["0", "1", "2", "3", "4"]
    assert peak[0] == 2
    with pytest.raises(ValueError, match="max_workers=0"):
        ToolBox([calculator_tool()], max_workers=0)


def test_output_cut_and_calls_per_turn() -> None:
    box = ToolBox([Tool("long", lambda: "x" * 50)], max_output_chars=10, max_calls_per_turn=2)
    assert box.run([ToolCall("long", {})])[0].content == "xxxxxxxxxx... [cut: 40 more characters]"
    call = '<tool_call>{"name": "long"}</tool_call>'
    contents = [m["content"] for m in box.respond(call * 3)]
    assert contents[:2] == ["xxxxxxxxxx... [cut: 40 more characters]"] * 2
    assert contents[2] == "Error: too many tool calls in one turn (at most 2); not run."
    with pytest.raises(ValueError, match="unique names"):
        ToolBox([calculator_tool(), calculator_tool()])
    with pytest.raises(ValueError, match="each must be positive"):
        ToolBox([calculator_tool()], timeout=0)
