"""Tools for text environments: parse the model's tool calls, run them with a timeout, and answer
with tool messages. Nothing a call does (raise, hang, bad JSON, unknown tool, wrong arguments)
crashes the rollout: every failure becomes the text of the tool message, for the model to read.

What is parsed (`parse_tool_calls`): each ``<tool_call> ... </tool_call>`` block of the model's
turn holds one JSON object, the format of the Hermes / Qwen2.5 / Qwen3 chat templates::

    <tool_call>{"name": "calculator", "arguments": {"expression": "3*7"}}</tool_call>

``"tool"`` is accepted for ``"name"``, ``"parameters"`` for ``"arguments"``, and ``"arguments"``
may also be a JSON-encoded string (the OpenAI wire format). A turn without the tag calls nothing.
Other chat templates' formats (Llama 3.1's bare JSON, Mistral's ``[TOOL_CALLS]``) are not parsed:
pass ``parser=`` to `ToolBox` for them. To show the tools to the model, put `describe_tools` in the
system prompt, or pass ``[t.schema() for t in tools]`` as ``tools=`` to the tokenizer's
``apply_chat_template`` where its template renders tools.

How calls run (`ToolBox.run`): every call of a batch starts at once in its own daemon thread and
is waited for up to its timeout. A call still running then is reported as timed out and
*abandoned*: a Python thread cannot be killed, so a hung function keeps its thread (and whatever
it holds) until it returns; daemon threads never block the interpreter's exit. This is right for
trusted functions (a lookup, a calculator, an HTTP request with its own timeout). For untrusted
code use `grpo.envs.sandbox`, which runs it in a separate, killable, resource-limited process.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from grpo.envs.protocol import Message

__all__ = [
    "MalformedCall",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "calculate",
    "calculator_tool",
    "describe_tools",
    "lookup_tool",
    "parse_tool_calls",
]

logger = logging.getLogger(__name__)

CALL_FORMAT = '<tool_call>{"name": "<tool name>", "arguments": {<argument>: <value>, ...}}</tool_call>'
_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolCall(NamedTuple):
    """One well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


class MalformedCall(NamedTuple):
    """A ``<tool_call>`` block that could not be read as a call; ``problem`` says why."""

    text: str
    problem: str


Status = Literal["ok", "error", "timeout", "malformed", "unknown_tool", "bad_arguments", "skipped"]


class ToolResult(NamedTuple):
    """What one call gave: ``content`` is the tool message's text (the result, or the problem)."""

    name: str
    content: str
    status: Status
    seconds: float

    def message(self) -> Message:
        """The tool message ``{"role": "tool", "name": ..., "content": ...}``."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass(frozen=True)
class Tool:
    """A function the model may call by name with keyword arguments (JSON values).

    Args:
        name: the name the model calls it by.
        function: called as ``function(**arguments)``; its return value is sent back as text
            (``str`` as is, other values as JSON, else ``str()``); what it raises is sent back as
            ``"Error: tool ... raised ..."``.
        description: one line for the model (`describe_tools`, `schema`).
        parameters: argument name -> description, for the model. Types come from the
            function's annotations.
        timeout: seconds to wait for this tool (None: the `ToolBox`'s timeout).
    """

    name: str
    function: Callable[..., Any]
    description: str = ""
    parameters: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the tool in the format ``apply_chat_template(tools=...)`` takes."""
        signature = inspect.signature(self.function)
        properties: dict[str, Any] = {}
        required = []
        for pname, param in signature.parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            prop: dict[str, Any] = {"type": _JSON_TYPES.get(param.annotation, "string")}
            if pname in self.parameters:
                prop["description"] = self.parameters[pname]
            properties[pname] = prop
            if param.default is param.empty:
                required.append(pname)
        parameters = {"type": "object", "properties": properties, "required": required}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }


def describe_tools(tools: Sequence[Tool]) -> str:
    """A system-prompt paragraph: the tools (name, description, arguments) and how to call one."""
    lines = ["You can call these tools:"]
    for tool in tools:
        args = ", ".join(
            f"{p}: {tool.parameters.get(p, '')}".rstrip(": ")
            for p in inspect.signature(tool.function).parameters
        )
        lines.append(f"- {tool.name}({args}): {tool.description}")
    lines.append(f"To call a tool, write {CALL_FORMAT} and wait for its result.")
    return "\n".join(lines)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """The calls in a model turn, in order (the format is in the module docstring).

    An opening ``<tool_call>`` without its closing tag, a body that is not a JSON object, a
    missing or non-string name, or arguments that are not an object give a `MalformedCall`.
    """
    calls: list[ToolCall | MalformedCall] = []
    for match in _CALL_RE.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            calls.append(MalformedCall(body, "missing the closing </tool_call> tag"))
            continue
        calls.append(_parse_call_body(body))
    return calls


def _parse_call_body(body: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"not valid JSON: {e}")
    if not isinstance(obj, dict):
        return MalformedCall(body, f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name", obj.get("tool"))
    if not isinstance(name, str):
        return MalformedCall(body, 'no tool name: the object needs a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return MalformedCall(body, f'"arguments" is a string that is not valid JSON: {e}')
    if not isinstance(args, dict):
        return MalformedCall(body, f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name, args)


class ToolBox:
    """Runs tool calls: concurrently, each with a timeout, every failure turned into text.

    Args:
        tools: the tools the model may call (names must be unique).
        timeout: seconds to wait for a call (a `Tool`'s own ``timeout`` wins).
        max_output_chars: longer results are cut to this many characters (with a note).
        max_calls_per_turn: calls past this many in one turn are not run (each gets a message).
        max_workers: calls running at once (None: all calls of a batch at once); more calls run
            in successive waves, so a batch takes at most ``ceil(calls / max_workers)`` timeouts.
        parser: turns a model turn into calls (default `parse_tool_calls`).

    Attributes:
        abandoned: calls that timed out so far (their threads may still be running).
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        timeout: float = 5.0,
        max_output_chars: int = 2000,
        max_calls_per_turn: int = 8,
        max_workers: int | None = None,
        parser: Callable[[str], list[ToolCall | MalformedCall]] = parse_tool_calls,
    ) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names) or not tools:
            raise ValueError(f"ToolBox needs at least one tool and unique names; got {names}.")
        if (
            timeout <= 0
            or max_output_chars < 1
            or max_calls_per_turn < 1
            or (max_workers is not None and max_workers < 1)
        ):
            raise ValueError(
                f"ToolBox(timeout={timeout}, max_output_chars={max_output_chars}, "
                f"max_calls_per_turn={max_calls_per_turn}, max_workers={max_workers}): each must be positive."
            )
        self.tools = {t.name: t for t in tools}
        self.timeout = timeout
        self.max_output_chars = max_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.max_workers = max_workers
        self.parser = parser
        self.abandoned = 0

    def respond(self, turn: str) -> list[Message]:
        """The tool messages answering the calls in ``turn`` (``[]`` when it calls nothing)."""
        return self.respond_batch([turn])[0]

    def respond_batch(self, turns: Sequence[str]) -> list[list[Message]]:
        """`respond` for many turns, with all their calls running at once."""
        parsed = [self.parser(turn) for turn in turns]
        flat = [call for calls in parsed for call in calls[: self.max_calls_per_turn]]
        results = iter(self.run(flat))
        out = []
        for calls in parsed:
            messages = [next(results).message() for _ in calls[: self.max_calls_per_turn]]
            text = f"Error: too many tool calls in one turn (at most {self.max_calls_per_turn}); not run."
            skipped = ToolResult("", text, "skipped", 0.0).message()
            messages += [skipped for _ in calls[self.max_calls_per_turn :]]
            out.append(messages)
        return out

    def run(self, calls: Sequence[ToolCall | MalformedCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently (one daemon thread each, at most ``max_workers`` at a time);
        one `ToolResult` per call, in order."""
        results: list[ToolResult | None] = [None] * len(calls)
        jobs: list[tuple[int, Tool, dict[str, Any]]] = []
        for i, call in enumerate(calls):
            checked = self._check(call)
            if isinstance(checked, ToolResult):
                results[i] = checked
            else:
                jobs.append((i, *checked))
        wave = self.max_workers or max(len(jobs), 1)
        for w in range(0, len(jobs), wave):
            for i, result in self._run_wave(jobs[w : w + wave]):
                results[i] = result
        return [r for r in results if r is not None]

    def _run_wave(self, jobs: list[tuple[int, Tool, dict[str, Any]]]) -> list[tuple[int, ToolResult]]:
        """Start every job, then wait for each up to its timeout from its start."""
        running = []
        for i, tool, arguments in jobs:
            slot: list[Any] = []
            name = f"tool-{tool.name}"
            thread = threading.Thread(
                target=_call_into, args=(tool.function, arguments, slot), daemon=True, name=name
            )
            running.append((i, tool, thread, slot, time.monotonic()))
            thread.start()
        out = []
        for i, tool, thread, slot, start in running:
            timeout = self.timeout if tool.timeout is None else tool.timeout
            thread.join(max(0.0, start + timeout - time.monotonic()))
            out.append((i, self._result(tool, thread, slot, time.monotonic() - start, timeout)))
        return out

    def _check(self, call: ToolCall | MalformedCall) -> tuple[Tool, dict[str, Any]] | ToolResult:
        """The tool and arguments to run, or the result explaining why the call cannot run."""
        if isinstance(call, MalformedCall):
            text = f"Error: malformed tool call ({call.problem}). Call a tool as {CALL_FORMAT}."
            return ToolResult("", text, "malformed", 0.0)
        tool = self.tools.get(call.name)
        if tool is None:
            text = f"Error: unknown tool {call.name!r}. Available tools: {', '.join(self.tools)}."
            return ToolResult(call.name, text, "unknown_tool", 0.0)
        signature = inspect.signature(tool.function)
        try:
            signature.bind(**call.arguments)
        except TypeError as e:
            expected = f"{call.name}({', '.join(signature.parameters)})"
            text = f"Error: bad arguments for tool {call.name!r}: {e}. Expected {expected}."
            return ToolResult(call.name, text, "bad_arguments", 0.0)
        return tool, call.arguments

    def _result(
        self, tool: Tool, thread: threading.Thread, slot: list[Any], seconds: float, timeout: float
    ) -> ToolResult:
        if thread.is_alive() or not slot:
            self.abandoned += 1
            logger.warning("tool %r did not finish within %g s; its thread is abandoned", tool.name, timeout)
            text = f"Error: tool {tool.name!r} did not finish within {timeout:g} s (timed out)."
            return ToolResult(tool.name, text, "timeout", seconds)
        ok, value = slot[0]
        if not ok:
            text = f"Error: tool {tool.name!r} raised {type(value).__name__}: {value}"
            return ToolResult(tool.name, self._cut(text), "error", seconds)
        return ToolResult(tool.name, self._cut(_as_text(value)), "ok", seconds)

    def _cut(self, text: str) -> str:
        n = self.max_output_chars
        return text if len(text) <= n else f"{text[:n]}... [cut: {len(text) - n} more characters]"


def _call_into(function: Callable[..., Any], arguments: dict[str, Any], slot: list[Any]) -> None:
    """Thread body: ``slot`` gets ``(True, result)`` or ``(False, exception)``."""
    try:
        slot.append((True, function(**arguments)))
    except BaseException as e:  # a tool's failure is an observation, whatever it raised
        slot.append((False, e))


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


# ---- ready tools ---------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS, MAX_INT_BITS = 200, 256


def calculate(expression: str) -> int | float:
    """Evaluate arithmetic safely: numbers, ``+ - * / // % **``, unary ``+ -`` and parentheses.

    Parsed with `ast` and walked; nothing is ``eval``-ed. Integers stay exact; results are
    bounded (``|int| < 2**256``, expression <= 200 characters), so no call can run for long.
    Raises ValueError for anything else (names, calls, too large), ZeroDivisionError for /0.
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expected an arithmetic expression of at most {MAX_EXPRESSION_CHARS} characters.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(
        f"unsupported element {type(node).__name__!r}: only numbers, + - * / // % **, and parentheses."
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse an integer power whose result would exceed the bound before computing it."""
    if not (isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1):
        return
    if exponent * math.log2(abs(base)) >= MAX_INT_BITS:
        raise ValueError(f"result too large: {base}**{exponent} has more than {MAX_INT_BITS} bits.")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is a complex number.")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result too large (more than {MAX_INT_BITS} bits).")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"result is not finite ({value}).")
    return value  # type: ignore[no-any-return]


def calculator_tool(name: str = "calculator") -> Tool:
    """`calculate` as a `Tool`: ``calculator(expression: str)``."""
    return Tool(
        name,
        calculate,
        "evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        {"expression": "the expression, e.g. (3 + 4) * 7"},
    )


def lookup_tool(table: Mapping[str, str], name: str = "lookup", description: str = "") -> Tool:
    """A `Tool` ``lookup(key: str)`` returning ``table[key]`` (case-insensitive on a miss), or
    ``"No entry for <key>."``."""
    folded = {k.casefold().strip(): v for k, v in table.items()}

    def lookup(key: str) -> str:
        key = str(key)
        found = table.get(key, folded.get(key.casefold().strip()))
        return f"No entry for {key!r}." if found is None else str(found)

    return Tool(name, lookup, description or "looks up a key in a table.", {"key": "the key to look up"})
