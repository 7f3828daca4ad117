"""Every code block of README.md and docs/*.md runs, so the docs cannot drift.

Each fenced block needs a language: ``python`` and ``bash`` blocks are run, ``text`` blocks
(diagrams, formulas, messages, file trees) are not code. A python block runs in a fresh
subprocess, a bash block in ``bash -eo pipefail``; both in a temporary directory (files they
write land there) that links the checkout's ``examples/`` and ``benchmarks/``, with the checkout
on ``PYTHONPATH``, the interpreter's ``bin/`` first on ``PATH``, the Hugging Face Hub offline and
one torch thread (``OMP_NUM_THREADS=1`` unless set: on a shared 2-core machine torch's default
threads make these small policies 10-40x slower). A failure names the page and the line.

HTML comments on the lines just before a block's opening fence (blank lines may separate them)
say how to run it:

``<!-- continues -->``
    this python block continues the previous python block of the page: they run as one script,
    in page order (the chain is run once, under the id of its first block).
``<!-- not run: REASON -->``
    the block is not run; REASON starts with a key of `NOT_RUN_REASONS` (the allow-list, with why
    each kind cannot run here). Such a block is still checked: a python block parses and every
    name it imports from ``grpo`` exists; a bash block passes only ``--flags`` that the
    repository script (or ``grpo-train``) it calls lists in its ``--help`` (as run blocks do).
``<!-- budget: OLD -> NEW -->``
    run the block with the text OLD replaced by NEW (a smaller budget); OLD must occur in it.
``<!-- slow -->``
    the block's test carries ``pytest.mark.slow`` (it still runs in the suite).
``<!-- output -->``
    before a ``text`` block: it shows the whole output of the previous block, which must print it
    (lines compared as by "It prints", below).

Any other comment just before a block is an error (a misspelt marker would otherwise be silently
ignored). After a run block, the sentence ``It prints `LINE` `` (before the next block) quotes its
last line of output; a quote ending in `` ...`` quotes its beginning. Words must be equal; a number
with a decimal point may differ by 0.03 or 5% (the last digits vary with the torch version, the
CPU and the thread count), other numbers must be equal.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_examples_core import help_texts, missing_module

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 600  # seconds per run; the blocks take seconds, this only catches a hang

NOT_RUN_REASONS = {
    "needs a GPU": "no GPU in the test machine; tests/test_llm_gpu.py runs the GPU paths when one is present",
    "downloads from the Hugging Face Hub": "the tests never use the network; tests/test_llm_*.py build "
    "tiny local models instead",
    "needs several processes": "torchrun / accelerate launch; tests/test_distributed.py, test_fsdp.py and "
    "test_deepspeed.py launch the library's multi-process paths themselves",
    "installs packages": "creates a virtual environment or installs from the package index",
    "needs bubblewrap": "the process sandbox needs bubblewrap and user namespaces, which some machines "
    "lack; tests/test_sandbox.py and tests/test_code_rewards.py run it wherever it can be set up",
    "runs the whole test suite": "this test is part of it",
    "needs MetaWorld": "an optional package (pip install metaworld) that pins mujoco 3.3.0; "
    "tests/test_robot_metaworld.py runs these paths where it is installed",
    "names your own script": "your_script.py, train.py, train_llm.py stand for the reader's script",
}
RUN_LANGUAGES = ("python", "bash")
TEXT_LANGUAGES = ("text",)
MARKERS = ("continues", "not run", "budget", "slow", "output")
SENTINEL = "\x1edoc-block "  # printed before each block of a chain, to split the output per block


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    continues: bool = False
    not_run: str | None = None
    budgets: list[tuple[str, str]] = field(default_factory=list)
    slow: bool = False
    is_output: bool = False
    quote: str | None = None  # "It prints `...`" after the block
    output_block: Block | None = None  # a `<!-- output -->` text block after this one

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGUAGES and self.not_run is None

    def code_to_run(self) -> str:
        code = self.code
        for old, new in self.budgets:
            code = code.replace(old, new)
        return code


FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
COMMENT = re.compile(r"^\s*<!--(.*?)-->\s*$")
QUOTE = re.compile(r"It prints `([^`]+)`")


def parse_page(path: Path, problems: list[str]) -> list[Block]:
    """The fenced blocks of one page, with their markers; what is wrong goes to ``problems``."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, lang = m[1], m[2]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            problems.append(f"{page}:{i + 1}: the block is never closed")
            break
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
        block = Block(page, i + 1, lang, "\n".join(body) + "\n")
        if lang not in RUN_LANGUAGES + TEXT_LANGUAGES:
            problems.append(
                f"{block.where}: a block with language {lang!r}; use python or bash (run) or text "
                f"(diagrams, formulas, messages; not run)"
            )
        _read_markers(block, lines, i, problems)
        nxt = next((k for k in range(end + 1, len(lines)) if FENCE.match(lines[k])), len(lines))
        quote = QUOTE.search("\n".join(lines[end + 1 : nxt]))
        if quote is not None and block.runs:
            block.quote = " ".join(quote[1].split())
        blocks.append(block)
        i = end + 1
    return blocks


def _read_markers(block: Block, lines: list[str], fence: int, problems: list[str]) -> None:
    k = fence - 1
    while k >= 0 and (not lines[k].strip() or COMMENT.match(lines[k])):
        m = COMMENT.match(lines[k])
        k -= 1
        if m is None:
            continue
        text = m[1].strip()
        name, _, arg = text.partition(":")
        name, arg = name.strip(), arg.strip()
        if name == "continues" and not arg:
            block.continues = True
        elif name == "slow" and not arg:
            block.slow = True
        elif name == "output" and not arg:
            block.is_output = True
        elif name == "not run":
            if not any(arg.startswith(key) for key in NOT_RUN_REASONS):
                problems.append(
                    f"{block.where}: 'not run: {arg}' gives no allowed reason; start it with one of "
                    f"{sorted(NOT_RUN_REASONS)} (tests/test_doc_blocks.py NOT_RUN_REASONS), or make the "
                    f"block cheap enough to run"
                )
            block.not_run = arg or "?"
        elif name == "budget" and " -> " in arg:
            old, new = arg.split(" -> ", 1)
            if old not in block.code:
                problems.append(f"{block.where}: 'budget: {arg}': {old!r} is not in the block")
            block.budgets.append((old, new))
        else:
            problems.append(
                f"{block.where}: unknown marker <!-- {text} --> before the block; the markers are "
                f"{', '.join(MARKERS)} (tests/test_doc_blocks.py)"
            )


def collect() -> tuple[list[Block], list[list[Block]], list[str]]:
    """Every block, the run units (chains of blocks run as one script), and the problems found."""
    problems: list[str] = []
    blocks: list[Block] = []
    units: list[list[Block]] = []
    for path in PAGES:
        page_blocks = parse_page(path, problems)
        blocks += page_blocks
        previous: Block | None = None  # the previous fenced block of the page
        chain: list[Block] | None = None  # the chain the last python block joined
        for b in page_blocks:
            if b.is_output:
                if b.lang != "text" or previous is None or not previous.runs:
                    problems.append(f"{b.where}: <!-- output --> needs a text block right after a run block")
                else:
                    previous.output_block = b
            if b.continues:
                if b.lang != "python" or not b.runs or chain is None or chain[-1].lang != "python":
                    problems.append(
                        f"{b.where}: <!-- continues --> needs a run python block after a run python "
                        f"block of the same page"
                    )
                else:
                    chain.append(b)
            elif b.runs:
                chain = [b]
                units.append(chain)
            if b.lang == "python" and not b.runs:
                chain = None  # a later block cannot continue across a block that is not run
            previous = b
    return blocks, units, problems


BLOCKS, UNITS, PROBLEMS = collect()


def _unit_param(unit: list[Block]) -> object:
    marks = [pytest.mark.slow] if any(b.slow for b in unit) else []
    return pytest.param(unit, id=unit[0].where, marks=marks)


def test_every_block_is_run_or_says_why() -> None:
    """The inventory: every block has a language and known markers; a block that is not run says
    why, with an allowed reason. Counts of what runs and what does not go to the test's output."""
    assert not PROBLEMS, "\n".join(PROBLEMS)
    ran = [b for b in BLOCKS if b.runs]
    not_run = [b for b in BLOCKS if b.lang in RUN_LANGUAGES and not b.runs]
    text = [b for b in BLOCKS if b.lang in TEXT_LANGUAGES]
    print(f"\n{len(ran)} blocks run (as {len(UNITS)} scripts), {len(not_run)} not run, {len(text)} text:")
    for b in not_run:
        print(f"  not run {b.where}: {b.not_run}")
    assert len(ran) > len(not_run)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    return env


def _workdir(tmp_path: Path) -> Path:
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp_path


def _script(unit: list[Block]) -> tuple[str, list[tuple[int, Block]]]:
    """The chain as one script, a sentinel line before each block; (first script line, block)."""
    lines: list[str] = []
    starts: list[tuple[int, Block]] = []
    for b in unit:
        lines.append(f"print({SENTINEL + b.where!r}, flush=True)")
        starts.append((len(lines) + 1, b))
        lines += b.code_to_run().splitlines()
    return "\n".join(lines) + "\n", starts


def _failing_line(stderr: str, script: Path, starts: list[tuple[int, Block]]) -> str:
    """The page and line of the innermost traceback frame inside the blocks, if any."""
    found = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', stderr)
    if not found:
        return ""
    n = int(found[-1])
    first, block = max((s for s in starts if s[0] <= n), key=lambda s: s[0], default=starts[0])
    return f" at {block.page}:{block.line + 1 + n - first}"


@pytest.mark.parametrize("unit", [_unit_param(u) for u in UNITS])
def test_doc_block_runs(unit: list[Block], tmp_path: Path) -> None:
    """The block (or chain of blocks) runs to the end, and prints what the page says it prints."""
    work = _workdir(tmp_path)
    if unit[0].lang == "bash":
        starts: list[tuple[int, Block]] = []
        script = work / "doc_block.sh"
        script.write_text(f"echo {shlex.quote(SENTINEL + unit[0].where)}\n{unit[0].code_to_run()}")
        cmd = ["bash", "-eo", "pipefail", str(script)]
    else:
        script = work / "doc_block.py"
        text, starts = _script(unit)
        script.write_text(text)
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        missing = missing_module(proc.stderr)  # an optional extra: skip, as importorskip does
        if missing is not None:
            pytest.skip(f"{unit[0].where}: needs {missing}, an optional extra that is not installed")
        where = _failing_line(proc.stderr, script, starts) if starts else ""
        pytest.fail(
            f"the {unit[0].lang} block at {unit[0].where} failed (exit {proc.returncode}){where}:\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    outputs = {}  # block -> what it printed
    for part in proc.stdout.split(SENTINEL)[1:]:
        label, _, printed = part.partition("\n")
        outputs[label] = printed
    for b in unit:
        out = [line.rstrip() for line in outputs.get(b.where, "").splitlines() if line.strip()]
        if b.quote is not None:
            assert out, f"{b.where}: the page says it prints `{b.quote}`, but it printed nothing"
            problem = compare_line(out[-1], b.quote)
            assert problem is None, f"{b.where}: the page says it prints `{b.quote}`: {problem}"
        if b.output_block is not None:
            shown = [line.rstrip() for line in b.output_block.code.splitlines() if line.strip()]
            assert len(out) == len(shown), f"{b.where}: printed\n" + "\n".join(out)
            for got, want in zip(out, shown, strict=True):
                problem = compare_line(got, want)
                assert problem is None, f"{b.output_block.where} shows its output: {problem}"


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def compare_line(got: str, quoted: str) -> str | None:
    """None when ``got`` is what ``quoted`` shows (see the module docstring), else why not."""
    prefix = quoted.endswith(" ...")
    want = " ".join((quoted[:-4] if prefix else quoted).split())
    got = " ".join(got.split())
    parts = NUMBER.split(want)
    pattern = "(-?\\d+(?:\\.\\d+)?)".join(re.escape(p) for p in parts)
    m = re.match(pattern, got) if prefix else re.fullmatch(pattern, got)
    if m is None:
        return f"it prints `{got}`"
    for seen, shown in zip(m.groups(), NUMBER.findall(want), strict=True):
        a, b = float(seen), float(shown)
        tol = max(0.03, 0.05 * abs(b)) if "." in shown else 0.0
        if abs(a - b) > tol:
            return f"it prints `{got}` ({seen} where the page shows {shown})"
    return None


def test_compare_line() -> None:
    assert compare_line("error: 1.764 -> 0.004", "error: 1.764 -> 0.004") is None
    assert compare_line("error: 1.78 -> 0.01", "error: 1.764 -> 0.004") is None  # last digits vary
    assert compare_line("error: 1.90 -> 0.004", "error: 1.764 -> 0.004") is not None
    assert compare_line("shape (32, 2) and more", "shape (32, 2) ...") is None
    assert compare_line("shape (33, 2) and more", "shape (32, 2) ...") is not None
    assert compare_line("shape (32, 2) and more", "shape (32, 2)") is not None
    assert compare_line("other words 1.0", "some words 1.0") is not None


def test_python_blocks_not_run_parse_and_import_real_names() -> None:
    """A python block that is not run still parses, and every name it imports from ``grpo``
    exists."""
    problems = []
    for b in BLOCKS:
        if b.lang != "python" or b.runs:
            continue
        try:
            tree = ast.parse(b.code)
        except SyntaxError as e:
            problems.append(f"{b.where}: {e}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "grpo":
                try:
                    module = importlib.import_module(str(node.module))
                except ImportError as e:
                    if missing_module(str(e)) is None:
                        problems.append(f"{b.where}: import {node.module}: {e}")
                    continue
                problems += [
                    f"{b.where}: {node.module} has no {a.name}"
                    for a in node.names
                    if not hasattr(module, a.name)
                ]
    assert not problems, "\n".join(problems)


# ---- the commands of the bash blocks use flags that exist ---------------------------------------
def _commands(code: str) -> list[tuple[str, list[str]]]:
    """(repository script or module, the flags passed to it) for each command of a bash block:
    ``python X.py``, ``torchrun ... X.py``, ``-m grpo.llm``, ``grpo-train``; other commands and
    scripts that are not in the repository are left out."""
    found: list[tuple[str, list[str]]] = []
    for line in code.replace("\\\n", " ").splitlines():
        for command in re.split(r"&&|;|\|", line):
            tokens = shlex.split(command, comments=True)
            target, rest = None, []
            for i, tok in enumerate(tokens):
                if tok.endswith(".py") and (ROOT / tok).is_file():
                    target, rest = tok, tokens[i + 1 :]
                    break
                if tok == "grpo-train" or (tok == "-m" and tokens[i + 1 : i + 2] == ["grpo.llm"]):
                    target, rest = "-m grpo.llm", tokens[i + (1 if tok == "grpo-train" else 2) :]
                    break
            if target is not None:
                found.append((target, [t.split("=", 1)[0] for t in rest if t.startswith("--")]))
    return found


def test_commands_in_bash_blocks_use_existing_flags() -> None:
    """Every ``--flag`` a bash block passes to a script of this repository (or to ``grpo-train``)
    appears in that script's ``--help``: blocks that are not run cannot drift either."""
    uses = [(b, target, flags) for b in BLOCKS if b.lang == "bash" for target, flags in _commands(b.code)]
    assert uses  # the parser finds the commands
    helps = help_texts(sorted({target for _, target, _ in uses}))
    problems = []
    for b, target, flags in uses:
        text = helps[target]
        if text.startswith("ERROR"):
            if missing_module(text) is None:
                problems.append(f"{b.where}: `{target} --help` failed: {text}")
            continue
        for flag in flags:
            if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is None:
                problems.append(f"{b.where}: {target} has no {flag} (see its --help)")
    assert not problems, "\n".join(problems)
