"""The core's generation package reaches into no wing (issue 42, item 3): `grpo.generation`
imports nothing from `grpo.llm` (nor `grpo.gym`), counting function-local and type-only imports,
and no module outside `grpo.llm` reaches its private `grpo.llm._deps`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATION = ROOT / "grpo" / "generation"


def _imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in it (top level, functions, TYPE_CHECKING), with
    the line: ``import a.b`` -> a.b; ``from a.b import c`` -> a.b and a.b.c; relative imports
    resolved against the grpo package."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _reaches(module: str, wing: str) -> bool:
    return module == wing or module.startswith(wing + ".")


@pytest.mark.parametrize("wing", ["grpo.llm", "grpo.gym"])
def test_the_generation_package_imports_no_wing(wing: str) -> None:
    found = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in sorted(GENERATION.rglob("*.py"))
        for line, m in _imported_modules(p)
        if _reaches(m, wing)
    ]
    assert not found, found


def test_the_walk_sees_function_local_and_type_only_imports(tmp_path: Path) -> None:
    """The check itself: an import inside a function or under TYPE_CHECKING is found."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo.llm.policy import Completion\n"
        "def f():\n    import grpo.llm._deps\n    from ..llm import CausalLMPolicy\n"
    )
    probe = tmp_path / "grpo" / "generation" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    mods = {m for _, m in _imported_modules(probe, tmp_path)}
    assert {"grpo.llm.policy", "grpo.llm._deps", "grpo.llm.CausalLMPolicy"} <= mods


def test_no_module_outside_grpo_llm_imports_its_private_deps() -> None:
    llm = ROOT / "grpo" / "llm"
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for top in ("grpo", "tests", "benchmarks", "examples")
        for p in sorted((ROOT / top).rglob("*.py"))
        if llm not in p.parents
        for line, m in _imported_modules(p)
        if _reaches(m, "grpo.llm._deps")
    ]
    assert not found, found
