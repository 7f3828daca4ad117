"""grpo.llm.code_rewards: written completions (right, wrong, hostile, looping) run against assert
and stdin/stdout tests in the sandbox; both reward conventions; a grpo-train run on coding tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from grpo.envs.sandbox import SandboxLimits
from grpo.llm.code_rewards import CodeTests, code_tests_reward, extract_code, parse_tests, run_tests
from grpo.llm.rewards import RewardFunctions

ROOT = Path(__file__).resolve().parent.parent
ASSERTS = [
    "assert add(1, 2) == 3",
    "assert add(-1, 1) == 0",
    "assert 15 == add(10, 5)",
    "assert add(0, 0) == 0",
]
IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=256 * 2**20)


def fenced(code: str) -> str:
    return f"Here is my answer.\n```python\n{code}\n```\nDone."


def score(completions: list[str], tests: Any, **kw: Any) -> tuple[list[float | None], dict[str, list[Any]]]:
    extra: dict[str, list[Any]] = {}
    fn = code_tests_reward(limits=LIMITS, workers=2, check=False, **kw)
    rewards = fn(["p"] * len(completions), completions, tests=[tests] * len(completions),
                 log_extra=extra.__setitem__)  # fmt: skip
    return rewards, extra


def test_extract_code() -> None:
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2"
    assert extract_code("```\nc = 3\n```") == "c = 3"
    assert extract_code("  d = 4\n") == "d = 4"  # no fence: the whole text


def test_parse_tests_formats_and_errors() -> None:
    assert parse_tests(ASSERTS) == CodeTests(asserts=tuple(ASSERTS))
    assert parse_tests(json.dumps(IO)) == CodeTests(io=(("1 2\n", "3\n"), ("10 -4\n", "6\n")))
    assert parse_tests({"inputs": ["1\n"], "outputs": ["2\n"]}) == CodeTests(io=(("1\n", "2\n"),))
    assert parse_tests(None) is None
    assert parse_tests([]) is None
    with pytest.raises(ValueError, match="must be a list of assert statements"):
        parse_tests([1, 2])
    with pytest.raises(ValueError, match="must be one assert statement"):
        parse_tests(["x = 1"])


@pytest.mark.usefixtures("sandbox")
def test_right_wrong_and_partial_credit() -> None:
    right = fenced("def add(a, b):\n    return a + b")
    half = fenced("def add(a, b):\n    return a + b if a > 0 else 99")  # passes tests 1 and 3 of 4
    wrong = fenced("def add(a, b):\n    return a - b")
    rewards, extra = score([right, half, wrong], ASSERTS)
    assert rewards == [1.0, 0.5, 0.25]  # a - b: add(0, 0) == 0 still holds
    assert extra["code_status"] == ["passed", "failed", "failed"]
    assert extra["code_passed"] == [4, 2, 1]
    io_right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    io_half = fenced("a, b = map(int, input().split())\nprint(3)")
    rewards, extra = score([io_right, io_half], IO)
    assert rewards == [1.0, 0.5]
    assert extra["code_total"] == [2, 2]


@pytest.mark.usefixtures("sandbox")
def test_compile_error_timeout_and_crash_are_told_apart() -> None:
    syntax = fenced("def add(a, b)\n    return a + b")
    loop = fenced("def add(a, b):\n    while True:\n        pass")
    crash = fenced("import sys\nsys.exit(3)\ndef add(a, b):\n    return a + b")
    rewards, extra = score([syntax, loop, crash, "no code at all ```python\n```"], ASSERTS)
    assert rewards == [0.0, 0.0, 0.0, 0.0]
    assert extra["code_status"] == ["compile_error", "timeout", "crash", "no_code"]
    rewards, extra = score([fenced("import time\ntime.sleep(60)"), fenced("raise ValueError")], IO)
    assert extra["code_status"] == ["timeout", "crash"]


HOSTILE = {
    # prints the harness's framed lines for every test, with guessed values, then exits early
    "fake frames": "import os\nfor i in range(4):\n"
    "    print('\\x1egrpo-test\\x1f' + str(i), 3, flush=True)\nos._exit(0)",
    # an object equal to everything: `assert add(...) == 3` would pass in-process
    "always equal": "class E:\n    def __eq__(self, o): return True\n    def __repr__(self): return '3'\n"
    "def add(a, b):\n    return E()",
    # replaces print and repr, the harness's tools
    "patched builtins": "import builtins\nbuiltins.repr = lambda v: '3'\ndef add(a, b):\n    return 0",
    # reads the tests it could find: the program, its directory, stdin
    "snooping": "import os, sys\nprint(open(__file__).read()[-300:], os.listdir('.'), sys.stdin.read())\n"
    "def add(a, b):\n    return 0",
}


@pytest.mark.usefixtures("sandbox")
def test_hostile_programs_cannot_forge_passes() -> None:
    rewards, _ = score([fenced(code) for code in HOSTILE.values()], ASSERTS)
    # Each ends with the value 3 or 0 for every test, whatever it tried: a guess of 3 is right for
    # add(1, 2) only, 0 for add(-1, 1) and add(0, 0). The same constants honestly returned score so.
    assert dict(zip(HOSTILE, rewards, strict=True)) == {
        "fake frames": 0.25, "always equal": 0.25, "patched builtins": 0.25, "snooping": 0.5,
    }  # fmt: skip
    rewards, _ = score(
        [fenced("print(3)"), fenced("import sys\nprint(sys.stdin.read(), open(__file__).read())")], IO
    )
    assert rewards == [0.5, 0.0]  # a constant is right once; the program never sees the expected output


@pytest.mark.usefixtures("sandbox")
def test_bare_asserts_are_the_programs_word() -> None:
    """The documented limit: an assert without `== literal` is judged inside, so it can be forged."""
    tests = ["assert is_prime(7)", "assert not is_prime(8)"]
    honest = fenced("def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))")
    forger = fenced(
        "import os\nfor i in range(2):\n"
        "    print('\\x1egrpo-test\\x1f' + str(i), True, flush=True)\nos._exit(0)"
    )
    rewards, _ = score([honest, forger], tests)
    assert rewards == [1.0, 1.0]


@pytest.mark.usefixtures("sandbox")
def test_both_reward_conventions() -> None:
    fn = code_tests_reward(limits=LIMITS, workers=2)
    right = fenced("def add(a, b):\n    return a + b")
    chat = [[{"role": "assistant", "content": right}], [{"role": "assistant", "content": "no"}]]
    # TRL's keyword call, chat completions, as TRL's GRPOTrainer makes it
    assert fn(prompts=[[{"role": "user", "content": "q"}]] * 2, completions=chat, tests=[ASSERTS, None]) == [
        1.0,
        None,
    ]
    for convention in ("grpo", "trl"):
        rewards = RewardFunctions({"code": fn}, convention={"code": convention})
        components = rewards.compute_reward_components(
            [{"prompt": "q", "tests": ASSERTS}, {"prompt": "q", "tests": json.dumps(IO)}], [right, right]
        )
        assert components["code"] == [1.0, 0.0]
        assert rewards.last_extra["code_status"] == ["passed", "failed"]  # runs, prints nothing


def test_missing_column_is_named() -> None:
    fn = code_tests_reward(check=False)
    with pytest.raises(KeyError, match=r"needs the column 'tests'.*--tests-column"):
        fn(["p"], ["c"], answer=["1"])


@pytest.mark.usefixtures("sandbox")
def test_run_tests_directly() -> None:
    (outcome,) = run_tests(["def add(a, b):\n    return a + b"], [CodeTests(asserts=tuple(ASSERTS))], LIMITS)
    assert (outcome.passed, outcome.total, outcome.status, outcome.reward) == (4, 4, "passed", 1.0)


@pytest.mark.slow  # a tiny model's load, two steps, 16 sandboxed programs: ~30 s on the loaded machine
@pytest.mark.usefixtures("sandbox")
def test_grpo_train_on_coding_tasks(tmp_path: Path) -> None:
    """`grpo-train --reward code_tests` on examples/data/code_tasks.jsonl, end to end: a tiny random
    model writes no working code (reward 0), but every completion went through the sandbox."""
    pytest.importorskip("transformers")
    from grpo.llm.cli import main
    from tests.llm_helpers import build_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "model")
    build_model(tmp_path / "model", tok)
    out = tmp_path / "out"
    argv = [
        "--model-name", str(tmp_path / "model"), "--dataset", str(ROOT / "examples/data/code_tasks.jsonl"),
        "--prompt-column", "prompt", "--reward", "code_tests", "--batch-size", "2", "--num-generations", "2",
        "--max-new-tokens", "6", "--device", "cpu", "--output-dir", str(out), "--max-steps", "2",
        "--no-progress", "--logging-steps", "1", "--log-completions-every", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1.0, 2.0]
    assert all(m["reward/code_tests/mean"] == 0.0 for m in steps)
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert {row["reward/code_tests"] for row in rows} == {0.0}
