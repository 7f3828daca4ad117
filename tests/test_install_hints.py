"""Every install hint names this project's distribution (torch-grpo, not the unrelated `grpo` on
the package index) and an extra that pyproject.toml declares; errors name the form that works
for the running copy (a checkout or an installed package)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo.runtime import extras

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "grpo").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.yaml")),
    *sorted((ROOT / "benchmarks").glob("*.md")),
]
# pip install [-e] [quote]target[extras][quote]: the target is a name or a path
HINT = re.compile(r"""pip install (?:-q )?(-e )?["']?([A-Za-z0-9_.\-/]+)\[([a-z0-9_,]+)\]""")


def hints() -> list[tuple[str, bool, str, list[str]]]:
    found = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for m in HINT.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            found.append((where, bool(m.group(1)), m.group(2), m.group(3).split(",")))
    return found


def test_the_distribution_is_named_torch_grpo() -> None:
    assert PYPROJECT["project"]["name"] == extras.DIST_NAME == "torch-grpo"


def test_every_install_hint_names_this_distribution_and_a_declared_extra() -> None:
    found = hints()
    assert len(found) > 10  # the scan sees the hints (README, docs, errors, examples)
    for where, editable, target, names in found:
        if target == "mkdocstrings":  # a third-party package with its own extra (the docs extra)
            continue
        assert (editable and target == ".") or (not editable and target == "torch-grpo"), (
            f"{where}: 'pip install {'-e ' if editable else ''}{target}[...]' installs something else; "
            f"use pip install 'torch-grpo[...]' or, in a checkout, pip install -e '.[...]'"
        )
        assert set(names) <= EXTRAS, f"{where}: extras {names} not all in pyproject.toml ({sorted(EXTRAS)})"


def test_no_hint_installs_the_unrelated_grpo_package() -> None:
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        bad = re.findall(r"""pip install ["']?grpo\[""", text)
        assert not bad, f"{path.relative_to(ROOT)} tells users to install the unrelated 'grpo' package"


def test_install_hint_names_the_checkout_form_here_and_the_index_form_when_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert extras.source_checkout() == ROOT  # the tests run from a checkout
    assert extras.install_hint("llm") == f"pip install -e '.[llm]' (in {ROOT})"
    monkeypatch.setattr(extras, "source_checkout", lambda: None)  # as a wheel installed from the index
    assert extras.install_hint("llm") == "pip install 'torch-grpo[llm]'"
