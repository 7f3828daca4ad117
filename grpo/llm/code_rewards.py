"""Code-execution rewards: run the completion's program against the sample's tests, in the sandbox.

``code_tests_reward(tests_column="tests")`` is a reward function (``grpo-train --reward
code_tests``) whose value for one completion is the share of its tests passed, in [0, 1]:

    r = (tests passed) / (tests in the sample's ``tests`` column)

**The code** is the last fenced block of the completion (```python, ```py or a bare ```), else the
whole completion (`extract_code`).

**The tests column** holds, per prompt, a list (or a JSON string of one) of either

- assert statements, ``["assert add(1, 2) == 3", "assert add(0, 0) == 0"]`` (MBPP, HumanEval
  style), or
- stdin/stdout pairs, ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` (competitive programming;
  ``{"inputs": [...], "outputs": [...]}`` as in APPS/TACO is accepted too). Outputs are compared
  line by line with trailing white space removed.

**Who counts.** The program runs in `grpo.envs.sandbox`; whatever runs inside can be made to lie
(it can print anything, patch ``print``, exit early, return an object whose ``__eq__`` is always
true). So a test passes only on a comparison made here, outside, against a value the program
never sees:

- a stdin/stdout test runs as its own sandboxed process (one run per test); its stdout is compared
  here with the expected output;
- ``assert CALL == LITERAL`` (either side a literal that `ast.literal_eval` reads): all of a
  sample's such tests run in one process, which prints ``repr(CALL)`` for each on a framed line;
  here the line is read back with `ast.literal_eval` and compared with the literal. A program that
  prints framed lines itself must guess the values; a test with two lines for it fails;
- any other assert (``assert is_prime(7)``, ``assert abs(f(x) - y) < 1e-6``) is evaluated inside
  and its framed line reports the truth value: **a program can forge these** (the expected value
  is always True). Use ``==`` against literals or stdin/stdout tests where a policy may learn to
  game the reward.

Cost: one sandbox run per completion for its assert tests, one per test for stdin/stdout tests
(benchmarks/RESULTS.md, "Sandbox throughput"); runs go ``workers`` at a time in threads.

**Extra columns** (``log_extra``, one value per completion): ``code_passed`` and ``code_total``
(tests), ``code_status``: ``passed`` (all), ``failed`` (some test failed, no run crashed or timed
out), ``compile_error`` (the code does not compile: checked here with `compile`, nothing runs),
``timeout`` (a run hit the wall-clock or CPU limit), ``crash`` (a run ended with an exception
outside the tests, a signal, or the output limit), ``no_code`` (nothing to run). A sample without
tests (None or empty) gets None: not applicable.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo.envs.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "CodeOutcome",
    "CodeTests",
    "code_tests_reward",
    "extract_code",
    "parse_tests",
    "run_tests",
]

CodeStatus = Literal["passed", "failed", "compile_error", "timeout", "crash", "no_code"]
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_FRAME = "\x1egrpo-test\x1f"  # record and unit separators: no printed text carries them by accident


def extract_code(text: str) -> str:
    """The last fenced code block (```python, ```py, ```), else the whole text, stripped."""
    blocks = _FENCE.findall(text)
    return (blocks[-1] if blocks else text).strip()


@dataclass(frozen=True)
class CodeTests:
    """A sample's tests, parsed: ``asserts`` (statements) or ``io`` ((stdin, expected stdout) pairs)."""

    asserts: tuple[str, ...] = ()
    io: tuple[tuple[str, str], ...] = ()

    @property
    def total(self) -> int:
        return len(self.asserts) + len(self.io)


def parse_tests(value: Any) -> CodeTests | None:
    """The tests of one sample's column value (see the module docstring); None for None or empty.

    Raises ValueError naming the format expected when the value is neither.
    """
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    if isinstance(value, dict) and {"inputs", "outputs"} <= set(value):
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"], strict=True)]
    if not value:
        return None
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        for t in value:
            _assert_node(t)  # a SyntaxError / ValueError here names the bad test
        return CodeTests(asserts=tuple(value))
    if isinstance(value, list) and all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in value):
        return CodeTests(io=tuple((str(t["input"]), str(t["output"])) for t in value))
    raise ValueError(
        f"a tests value must be a list of assert statements (['assert f(1) == 2', ...]) or of "
        f"stdin/stdout pairs ([{{'input': '1\\n', 'output': '2\\n'}}, ...]), or a JSON string of one; "
        f"got {str(value)[:200]!r}."
    )


def _assert_node(test: str) -> ast.Assert:
    tree = ast.parse(test.strip())
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"an assert test must be one assert statement; got {test[:200]!r}.")
    return tree.body[0]


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _checks(test: str) -> tuple[str, bool, Any]:
    """(expression the program evaluates, compared outside?, expected value) for one assert."""
    node = _assert_node(test).test
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        left, right = node.left, node.comparators[0]
        for call, other in ((left, right), (right, left)):
            ok, value = _literal(other)
            if ok:
                return ast.unparse(call), True, value
    return f"bool({ast.unparse(node)})", False, True


def _assert_program(code: str, tests: Sequence[str]) -> tuple[str, list[tuple[bool, Any]]]:
    """The program: the code, then each test's value printed on a framed line (or its exception)."""
    harness, expected = [], []
    for i, test in enumerate(tests):
        expression, outside, value = _checks(test)
        expected.append((outside, value))
        harness.append(
            f"try:\n    __grpo_v = repr({expression})\nexcept BaseException as __grpo_e:\n"
            f"    __grpo_v = '!' + type(__grpo_e).__name__\n"
            f"__grpo_out.write({_FRAME!r} + {str(i)!r} + ' ' + __grpo_v.replace('\\n', ' ') + '\\n')\n"
            "__grpo_out.flush()\n"
        )
    prelude = "import sys as __grpo_sys\n__grpo_out = __grpo_sys.stdout\n"
    return f"{code}\n\n{prelude}{''.join(harness)}", expected


def _framed(stdout: str, n: int) -> list[str | None]:
    """Each test's printed value; None for a test with no line or with more than one."""
    seen: dict[int, list[str]] = {}
    for line in stdout.split("\n"):  # not splitlines(): it splits at the separators too
        head, _, value = line.partition(" ")
        if head.startswith(_FRAME) and head[len(_FRAME) :].isdigit():
            seen.setdefault(int(head[len(_FRAME) :]), []).append(value)
    return [seen[i][0] if len(seen.get(i, [])) == 1 else None for i in range(n)]


def _passed(printed: str | None, outside: bool, value: Any) -> bool:
    if printed is None or printed.startswith("!"):
        return False
    ok, got = _literal_text(printed)
    return bool(ok and got == value) if outside else printed == "True"


def _literal_text(text: str) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _same_output(got: str, expected: str) -> bool:
    """Line by line, trailing white space and trailing empty lines ignored."""
    return _lines(got) == _lines(expected)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


@dataclass(frozen=True)
class CodeOutcome:
    """One completion's verdict: tests ``passed`` of ``total`` and the ``status`` (module docstring)."""

    passed: int
    total: int
    status: CodeStatus

    @property
    def reward(self) -> float:
        return self.passed / self.total


def _status(passed: int, total: int, results: Sequence[SandboxResult]) -> CodeStatus:
    if any(r.status in ("timeout", "cpu_limit") for r in results):
        return "timeout"
    if any(r.status in ("killed", "output_limit") for r in results):
        return "crash"
    return "passed" if passed == total else "failed"


@dataclass(frozen=True)
class _Plan:
    """One completion's sandbox runs ((program, stdin) pairs) and how to score their results."""

    tests: CodeTests
    runs: tuple[tuple[str, str], ...]
    expected: tuple[tuple[bool, Any], ...] = ()
    early: CodeStatus | None = None  # decided without running anything


def _plan(code: str, tests: CodeTests) -> _Plan:
    if not code:
        return _Plan(tests, (), early="no_code")
    try:
        compile(code, "main.py", "exec")  # compiles, runs nothing
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return _Plan(tests, (), early="compile_error")
    runs: list[tuple[str, str]] = [(code, stdin) for stdin, _ in tests.io]
    expected: list[tuple[bool, Any]] = []
    if tests.asserts:
        program, expected = _assert_program(code, tests.asserts)
        runs.insert(0, (program, ""))
    return _Plan(tests, tuple(runs), tuple(expected))


def _score(plan: _Plan, results: Sequence[SandboxResult]) -> CodeOutcome:
    total = plan.tests.total
    if plan.early is not None:
        return CodeOutcome(0, total, plan.early)
    passed, crashed = 0, False
    if plan.tests.asserts:
        printed = _framed(results[0].stdout, len(plan.expected))
        passed += sum(_passed(p, *e) for p, e in zip(printed, plan.expected, strict=True))
        crashed = results[0].status == "error" and all(p is None for p in printed)  # died before the tests
    io_results = results[1:] if plan.tests.asserts else results
    passed += sum(
        r.status == "ok" and _same_output(r.stdout, out)
        for r, (_, out) in zip(io_results, plan.tests.io, strict=True)
    )
    crashed = crashed or (bool(io_results) and all(r.status == "error" for r in io_results))
    status = _status(passed, total, results)
    return CodeOutcome(passed, total, "crash" if crashed and status == "failed" else status)


def run_tests(
    codes: Sequence[str], tests: Sequence[CodeTests], limits: SandboxLimits, workers: int = 1
) -> list[CodeOutcome]:
    """Run each ``codes[i]`` against ``tests[i]`` in the sandbox, ``workers`` runs at a time."""
    plans = [_plan(code, t) for code, t in zip(codes, tests, strict=True)]
    jobs = [run for plan in plans for run in plan.runs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda job: run_python(job[0], limits, stdin=job[1]), jobs))
    outcomes, start = [], 0
    for plan in plans:
        outcomes.append(_score(plan, results[start : start + len(plan.runs)]))
        start += len(plan.runs)
    return outcomes


def code_tests_reward(
    tests_column: str = "tests",
    *,
    limits: SandboxLimits | None = None,
    workers: int | None = None,
    extractor: Callable[[str], str] = extract_code,
    check: bool = True,
) -> Callable[..., list[float | None]]:
    """The reward function ``code_tests(prompts, completions, **columns)`` (module docstring).

    Args:
        tests_column: the dataset column with each prompt's tests.
        limits: each sandboxed run's limits; default ``SandboxLimits(cpu_seconds=2,
            wall_seconds=5, memory_bytes=256 MiB)``.
        workers: sandbox runs at a time (threads); default: the CPU count.
        extractor: completion text -> program (default `extract_code`).
        check: run one trivial program now, so that a machine without the sandbox fails here,
            before training (`grpo.envs.sandbox.SandboxUnavailable`), not at the first step.

    Works in both reward conventions: grpo's ``f(prompts, completions, **columns)`` with texts,
    and TRL's keyword call with chat completions (``[{"role": "assistant", "content": ...}]``).
    """
    limits = limits or SandboxLimits(cpu_seconds=2, wall_seconds=5.0, memory_bytes=256 * 2**20)
    n_workers = workers or os.cpu_count() or 2
    if check:
        run_python("pass", limits)

    def code_tests(
        prompts: Sequence[Any], completions: Sequence[Any], *, log_extra: Any = None, **columns: Any
    ) -> list[float | None]:
        if tests_column not in columns:
            raise KeyError(
                f"code_tests_reward needs the column {tests_column!r} in the prompt records; got "
                f"columns {sorted(k for k in columns if not k.startswith('completion_'))}. Pass "
                f"tests_column=<your column> (grpo-train: --tests-column)."
            )
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        tests = [parse_tests(t) for t in columns[tests_column]]
        which = [(i, t) for i, t in enumerate(tests) if t is not None]
        found = run_tests([extractor(texts[i]) for i, _ in which], [t for _, t in which], limits, n_workers)
        outcomes: list[CodeOutcome | None] = [None] * len(texts)
        for (i, _), outcome in zip(which, found, strict=True):
            outcomes[i] = outcome
        if log_extra is not None:
            log_extra("code_passed", [None if o is None else o.passed for o in outcomes])
            log_extra("code_total", [None if o is None else o.total for o in outcomes])
            log_extra("code_status", [None if o is None else o.status for o in outcomes])
        return [None if o is None else o.reward for o in outcomes]

    return code_tests
