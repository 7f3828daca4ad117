"""The core imports only torch, numpy and typing-extensions; the public names resolve; the
modules of grpo import each other without a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import grpo

PROBE = """
import sys
import numpy, torch, typing_extensions
before = set(sys.modules)
import grpo
added = sorted({m.split('.')[0] for m in set(sys.modules) - before} - {'grpo'})
stdlib = set(sys.stdlib_module_names)
print(','.join(m for m in added if m not in stdlib and not m.startswith('_')))
"""


def test_import_grpo_pulls_in_no_optional_dependency() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"import grpo imported third-party modules: {out.stdout.strip()}"


CORE = {
    "GRPOTrainer",
    "GRPOConfig",
    "PolicyModel",
    "RewardModel",
    "PolicyOutput",
    "ExperienceBatch",
    "check_policy",
    "check_reward_model",
    "__version__",
}


def test_the_top_level_is_the_small_core() -> None:
    """`grpo.__all__` is the core (the quick start's trainer and config, the two protocols with
    their checkers and the types they exchange with the trainer); every public name resolves, and
    what moved to its module is no longer reachable as ``grpo.<name>``."""
    assert set(grpo.__all__) == CORE
    for name in grpo.__all__:
        assert getattr(grpo, name) is not None
    for name in ("categorical_mlp", "Backend", "aggregation_normaliser", "CombinedReward", "StallWarning"):
        assert not hasattr(grpo, name), name


def test_what_left_the_top_level_imports_from_its_module() -> None:
    from grpo.algorithms.aggregation import aggregation_normaliser
    from grpo.engine.backends import Backend
    from grpo.policies import categorical_mlp
    from grpo.reward_model_base import CombinedReward
    from grpo.training.callbacks import Callback

    assert all(
        callable(x) for x in (aggregation_normaliser, Backend, categorical_mlp, CombinedReward, Callback)
    )


PACKAGE = Path(grpo.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The grpo modules an ``import`` / ``from ... import`` statement names: ``import grpo.x`` and
    ``from grpo.x import name`` are edges to ``grpo.x``; ``from grpo import x`` to ``grpo.x`` when
    x is a submodule, else to the package ``grpo`` itself (its ``__init__``). A submodule's parent
    package is no edge: Python imports it before the submodule anyway."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        found = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        subs = {f"{base}.{a.name}" for a in node.names} & modules
        found = subs if subs and len(subs) == len(node.names) else {base} | subs
    return {m for m in found if m in modules and m != module}


def _top_level_imports(tree: ast.Module, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Imports that run when the module is imported or type-checked: at module level, including
    under ``if TYPE_CHECKING:``, ``try`` and class bodies, but not inside functions (lazy imports
    are allowed: they run after every module is loaded)."""
    edges: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges |= _imported(node, module, is_package, modules)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return edges


def import_graph() -> dict[str, set[str]]:
    """grpo module -> the grpo modules it imports at module level (TYPE_CHECKING included)."""
    files = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    modules = set(files)
    return {
        name: _top_level_imports(
            ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", modules
        )
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search).

    ``grpo/__init__`` imports most modules, so a module importing a name from the package itself
    (``from grpo import GRPOTrainer``) closes a cycle through it."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(graph):
        if state.get(root):
            continue
        path = [root]
        iters = [iter(sorted(graph[root]))]
        state[root] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None  # a diamond


def test_import_graph_sees_type_checking_and_skips_lazy_imports() -> None:
    source = """
import grpo.a
from grpo.b import thing
from grpo import c, not_a_module
from . import d
from .e import f
if TYPE_CHECKING:
    from grpo.g import G
try:
    import grpo.h
except ImportError:
    pass
class K:
    from grpo.i import I
def lazy():
    from grpo.j import J
async def lazy_too():
    import grpo.k
"""
    names = {f"grpo.{x}" for x in "abcdeghijk"} | {"grpo", "grpo.x", "grpo.e.f"}
    edges = _top_level_imports(ast.parse(source), "grpo.x", False, names)
    # a submodule's parent package is no edge: it is always imported first, whatever the order
    assert edges == {f"grpo.{x}" for x in "abcdghi"} | {"grpo", "grpo.e.f"}

    graph = import_graph()
    assert "grpo.metrics.sinks" in graph["grpo.training.loop"]  # module level
    assert "grpo.config" in graph["grpo.training.callbacks"]  # under TYPE_CHECKING
    assert "grpo.training.loop" not in graph["grpo.training.callbacks"]
    assert "grpo.trainer" in graph["grpo"]  # `from grpo.trainer import GRPOTrainer` in __init__


def test_no_import_cycle() -> None:
    """No module of grpo imports (at module level or under TYPE_CHECKING) one that imports it back,
    directly or through others; imports inside functions are not counted."""
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_grpo_0_1_module_paths_are_gone() -> None:
    """grpo 0.1's flat module paths (served for one release by an import hook, removed in 0.3) no
    longer import, and `grpo.update` no longer answers for its `loop` module's names."""
    import importlib.util

    for old in ("grpo.gym_episodes", "grpo.training_loop", "grpo.backends", "grpo.checkpoint"):
        assert importlib.util.find_spec(old) is None, old
    with pytest.raises(ImportError):
        from grpo.update import run_update  # noqa: F401
    assert not any(type(f).__name__ == "MovedModuleFinder" for f in sys.meta_path)
