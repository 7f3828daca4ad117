"""The main demo runs as a subprocess with a tiny budget, so it never rots; every example's
``--help`` describes the script and every flag, with its default."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.py"))


def test_quickstart_runs_and_prints_learning_signal() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "25"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "reward/oracle" in line]
    first, last = (float(line.split("reward/oracle")[1].split()[0]) for line in (lines[0], lines[-1]))
    assert last > first + 0.2  # it learns within 25 steps
    assert "GRPOConfig(" not in out.stdout  # no config dump
    start, end = oracle_fraction(out.stdout)  # the README's closing line
    assert (start, end) == (round(first, 2), round(last, 2))


def oracle_fraction(stdout: str) -> tuple[float, float]:
    """The two numbers of the last line, ``fraction of the oracle's reward: 0.00 -> 0.97``."""
    last = stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"fraction of the oracle's reward: (-?\d+\.\d\d) -> (-?\d+\.\d\d)", last)
    assert m is not None, stdout[-2000:]
    return float(m[1]), float(m[2])


@pytest.mark.slow
def test_readme_quick_start_snippet_runs_and_learns() -> None:
    """The README's snippet as written (200 steps, a few seconds): it prints one line a reader
    understands, and it shows what the README says it does (>= 0.95 of the oracle's reward)."""
    text = (ROOT / "README.md").read_text()
    code = text.split("## Quick start", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    start, end = oracle_fraction(out.stdout)
    assert start < 0.2  # arms at random earn about 0
    assert end >= 0.95
    quoted = re.search(r"It prints `(fraction of the oracle's reward: [^`]*)`", text)
    assert quoted is not None  # the README quotes the output (the last digit may vary by CPU)
    q_start, q_end = oracle_fraction(quoted[1])
    assert abs(q_start - start) <= 0.02, (quoted[1], out.stdout)
    assert abs(q_end - end) <= 0.02, (quoted[1], out.stdout)


def test_readme_snippet_and_quickstart_script_agree() -> None:
    """Same problem, same settings: the script is the snippet with progress lines."""
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / "examples" / "quickstart.py").read_text()
    line = "print(f\"fraction of the oracle's reward: {start:.2f} -> "
    settings = ('GRPOConfig.recipe("small_policy"', "group_size=8", "batch_size=64", "entropy=")
    for text in (readme, script):
        assert line in text
        for setting in settings:
            assert setting in text, setting


# The [llm] extra missing: transformers cannot be imported (None in sys.modules makes the import
# fail, as an uninstalled package does), then the script runs as `python examples/<script> ...`.
WITHOUT_TRANSFORMERS = """
import runpy, sys
sys.modules["transformers"] = None
script, *args = sys.argv[1:]
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("script", ["llm_tiny.py", "llm_gsm8k.py"])
def test_llm_example_help_works_without_the_llm_extra(script: str) -> None:
    path = str(ROOT / "examples" / script)
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMERS, path, "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {script}")
    assert "--steps" in out.stdout


def test_llm_example_run_without_the_llm_extra_names_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMERS, str(ROOT / "examples" / "llm_tiny.py"), "--steps", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "pip install -e '.[llm]'" in out.stderr  # this is a checkout (grpo.runtime.extras)


# All the --help texts in one interpreter (one torch import): each script runs as `python SCRIPT
# --help` would run it (its folder first on sys.path), a module as `python -m MODULE --help`.
HELP = r"""
import contextlib, io, json, os, runpy, sys
out = {}
for target in sys.argv[1:]:
    buf = io.StringIO()
    module = target[3:] if target.startswith("-m ") else None
    sys.argv = [module or target, "--help"]
    if module is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    try:
        with contextlib.redirect_stdout(buf):
            if module is None:
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    except BaseException as e:
        buf = io.StringIO(f"ERROR {type(e).__name__}: {e}")
    finally:
        if module is None:
            sys.path.pop(0)
    out[target] = buf.getvalue()
print(json.dumps(out))
"""


def help_texts(targets: list[str]) -> dict[str, str]:
    """``--help`` of each script (a path relative to the repository root) or ``-m MODULE``, run
    from the root with a wide terminal; ``"ERROR <exception>"`` where it raised."""
    proc = subprocess.run(
        [sys.executable, "-c", HELP, *targets],
        cwd=ROOT, env={**os.environ, "COLUMNS": "1000"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts: dict[str, str] = json.loads(proc.stdout.splitlines()[-1])
    return texts


def missing_module(error: str) -> str | None:
    """The module named by a ModuleNotFoundError in ``error`` when it is not installed."""
    m = re.search(r"No module named '([\w.]+)'", error)
    return m[1] if m and importlib.util.find_spec(m[1].split(".")[0]) is None else None


def option_entries(help_text: str) -> list[str]:
    """Each argument of an argparse help, its invocation and help text joined on one line."""
    entries: list[str] = []
    current = False
    for line in help_text.splitlines():
        if re.match(r"^  \S", line):
            entries.append(line.strip())
            current = True
        elif current and re.match(r"^   +\S", line):
            entries[-1] += " " + line.strip()
        else:
            current = False
    return entries


@pytest.fixture(scope="module")
def example_helps() -> dict[str, str]:
    return help_texts(EXAMPLES)


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_help_describes_every_flag_with_its_default(
    script: str, example_helps: dict[str, str]
) -> None:
    text = example_helps[script]
    if text.startswith("ERROR"):
        missing = missing_module(text)
        if missing is not None:
            pytest.skip(f"{script} needs {missing}")
        pytest.fail(f"{script} --help: {text}")
    usage, description, *_ = text.split("\n\n")
    assert usage.startswith(f"usage: {Path(script).name}")
    assert not description.rstrip().endswith(":"), f"{script}: no description before {description!r}"
    entries = option_entries(text)
    assert any(e.startswith("-h, --help") for e in entries)
    bare = [e for e in entries if not e.startswith("-h, --help") and "(default: " not in e]
    assert not bare, f"{script} --help: flags without a help text and its default: {bare}"


def test_option_entries() -> None:
    text = "\n".join(
        [
            "usage: x.py [-h]",
            "       [--b B]",
            "",
            "Does x.",
            "",
            "options:",
            "  -h, --help  show",
            "  --a A       an a (default:",
            "              1)",
            "  --long-name LONG_NAME",
            "              help (default: 2)",
            "  --b B",
        ]
    )
    assert option_entries(text) == [
        "-h, --help  show",
        "--a A       an a (default: 1)",
        "--long-name LONG_NAME help (default: 2)",
        "--b B",
    ]
