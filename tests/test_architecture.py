"""docs/architecture.md is true to the code where its claims are mechanical, and the house rules
it states hold: the step list, the layout table, the backend protocol, no private name imported
across modules, no backend class named outside grpo/engine/, no function over 60 lines."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from grpo import GRPOTrainer
from grpo.engine.backends import Backend, DataParallelBackend, LocalBackend
from grpo.engine.deepspeed import DeepSpeedBackend
from grpo.engine.fsdp import FSDPBackend

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo"
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
FRONT_DOOR = {
    "__init__.py",
    "config.py",
    "policy_base.py",
    "reward_model_base.py",
    "experience_collector.py",
    "advantage_estimator.py",
    "grpo_objective.py",
    "trainer.py",
}
BACKEND_CLASSES = {"LocalBackend", "DataParallelBackend", "DeepSpeedBackend", "FSDPBackend"}
MAX_LINES = 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end >= 0 else len(DOC)]


def test_step_is_the_numbered_list_of_the_doc() -> None:
    """`GRPOTrainer.step` numbers its lines 1..7 in order, in one function, and the doc's step
    diagram has the same seven numbered steps."""
    source = inspect.getsource(GRPOTrainer.step)
    in_code = [int(n) for n in re.findall(r"#\s*(\d)\.\s", source)]
    assert in_code == list(range(1, 8)), in_code
    diagram = section("A step, as data")
    in_doc = [int(n) for n in re.findall(r"│ (\d)\. ", diagram)]
    assert in_doc == list(range(1, 8)), in_doc


def test_every_path_the_doc_names_exists() -> None:
    named = set(re.findall(r"`?(grpo/[\w/]*(?:\.py|/))`?", DOC))
    assert named, "the doc names no path"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_layout_table_covers_the_package() -> None:
    """The top of grpo/ holds only the front door; every subpackage has a row in the layout
    table and every row names a file or folder that exists."""
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == FRONT_DOOR, (
        f"modules at the top of grpo/ besides the front door: {sorted(top - FRONT_DOOR)}"
    )
    rows = re.findall(r"^\| `(grpo/[\w/.]*)` \|", section("The layout"), flags=re.MULTILINE)
    subpackages = {f"grpo/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    front = {f"grpo/{name}" for name in FRONT_DOOR}
    assert set(rows) == subpackages | front, sorted(set(rows) ^ (subpackages | front))


def test_every_subpackage_says_what_it_holds() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{init.relative_to(ROOT)} has no docstring"


def declared(cls: type) -> set[str]:
    names = {n for n in vars(cls) if not n.startswith("_")}
    return names | set(getattr(cls, "__annotations__", {}))


def test_the_doc_sketch_declares_exactly_the_backend_protocol() -> None:
    sketch = section("How to add a backend")
    in_doc = set(re.findall(r"^    (\w+): ", sketch, flags=re.MULTILINE))
    in_doc |= set(re.findall(r"^    def (\w+)\(", sketch, flags=re.MULTILINE))
    assert in_doc == declared(Backend)


@pytest.mark.parametrize("cls", [LocalBackend, DataParallelBackend, DeepSpeedBackend, FSDPBackend])
def test_every_backend_has_every_member_of_the_protocol(cls: type) -> None:
    source = "".join(inspect.getsource(k) for k in cls.__mro__ if k.__module__.startswith("grpo."))
    lacking = sorted(
        m for m in declared(Backend) if not hasattr(cls, m) and not re.search(rf"self\.{m}\b.*=", source)
    )
    assert not lacking, f"{cls.__name__} lacks {lacking}"


def test_no_private_name_is_imported_across_modules() -> None:
    found = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo"):
                found += [
                    f"{path.relative_to(ROOT)}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert not found, found


def test_no_backend_class_is_named_outside_the_engine() -> None:
    """The trainer, its state and the loop reach the backend through the protocol only."""
    found = []
    for path in modules():
        if path.parent.name == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if name in BACKEND_CLASSES or name in {"_deepspeed", "_fsdp_backend"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not found, found


def test_no_function_is_longer_than_sixty_lines() -> None:
    long = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
