"""The main demo runs as a subprocess with a tiny budget, so it never rots."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    assert "pip install -e '.[llm]'" in out.stderr  # this is a checkout (grpo.extras)
