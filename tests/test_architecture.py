"""docs/architecture.md is true to the code where its claims are mechanical, and the house rules
it states hold: the step list, the layout table, the backend protocol, no private name imported
across modules, no backend class named outside grpo/engine/, no function over 60 lines."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

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
    """No ``from grpo.x import _y``, and no private module (``grpo.llm._deps``) imported from
    outside the package that holds it."""
    found = []
    for path in modules():
        package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo"):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found += [
                    f"{where} from {node.module} import {a.name}" for a in node.names if is_private(a.name)
                ]
                parts = (node.module or "").split(".")
                for i, part in enumerate(parts):
                    owner = ".".join(parts[:i])
                    if is_private(part) and package != owner and not package.startswith(owner + "."):
                        found.append(f"{where} from {node.module} import ... (private module)")
    assert not found, "private names imported across modules:\n" + "\n".join(found)


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


# ---- the package graph --------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in modules()}


def node_of(module: str) -> str:
    """The package-graph node of a grpo module: its front-door module (``grpo.config`` ->
    ``config``), its top-level subpackage (``grpo.llm.cli`` -> ``llm``), or ``grpo`` itself (its
    ``__init__``, which re-exports)."""
    parts = module.split(".")
    return "grpo" if len(parts) == 1 else parts[1]


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> set[str]:
    """The grpo modules one import statement names: ``import grpo.x`` and ``from grpo.x import y``
    -> ``grpo.x`` (``grpo.x.y`` too when y is a submodule); ``from grpo import x`` -> ``grpo.x``
    when x is a submodule, else ``grpo``; relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    subs = {f"{base}.{a.name}" for a in node.names} & set(MODULES)
    whole = {base} if base in MODULES and len(subs) < len(node.names) else set()
    return subs | whole


def import_edges(node: Callable[[str], str]) -> dict[tuple[str, str], list[str]]:
    """(node, node) -> the ``file:line`` of every import that makes the edge, ``node`` mapping a
    grpo module to its graph node: every import statement anywhere in a module (module level,
    inside functions and classes, under ``if TYPE_CHECKING:``), because a module that needs
    another's type or calls it lazily depends on it all the same."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for stmt in ast.walk(tree):
            if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported_modules(stmt, name, path.name == "__init__.py"):
                a, b = node(name), node(target)
                if a != b:
                    edges.setdefault((a, b), []).append(f"{path.relative_to(ROOT)}:{stmt.lineno}")
    return edges


def package_edges() -> dict[tuple[str, str], list[str]]:
    """The import edges between the package graph's nodes (`node_of`)."""
    return import_edges(node_of)


def module_edges() -> dict[tuple[str, str], list[str]]:
    """The import edges between grpo's modules themselves (a package is its ``__init__``)."""
    return import_edges(lambda module: module)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative), in reverse topological
    order; a node on no cycle is a component of one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    nodes = sorted(set(graph) | {b for bs in graph.values() for b in bs})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        u = stack.pop()
                        on_stack.discard(u)
                        component.add(u)
                        if u == v:
                            break
                    components.append(component)
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return components


def knots(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """One description per strongly connected component of more than one node: its members and
    every edge inside it, with the imports that make it."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            inside = [
                f"  {a} -> {b}: {', '.join(where)}"
                for (a, b), where in sorted(edges.items())
                if a in component and b in component
            ]
            found.append(f"knot of {len(component)}: {sorted(component)}\n" + "\n".join(inside))
    return found


def test_strongly_connected_components_by_hand() -> None:
    """Tarjan against components worked out by hand: a 3-cycle with a tail, a self-contained
    pair, a diamond (no cycle)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "x": {"y"}, "y": {"x"}}
    found = sorted(sorted(c) for c in strongly_connected(graph))
    assert found == [["a", "b", "c"], ["d"], ["x", "y"]]
    diamond = {"a": {"b", "c"}, "b": {"d"}, "c": {"d"}}
    assert all(len(c) == 1 for c in strongly_connected(diamond))
    assert knots({("p", "q"): ["p.py:1"], ("q", "p"): ["q.py:7"]}) == [
        "knot of 2: ['p', 'q']\n  p -> q: p.py:1\n  q -> p: q.py:7"
    ]


def test_package_edges_count_every_import() -> None:
    """Function-local and type-only imports are edges (checked on imports that exist today), and
    the nodes are the front-door modules and top-level subpackages."""
    edges = package_edges()
    assert node_of("grpo.llm.cli") == "llm"
    assert node_of("grpo.config") == "config"
    assert node_of("grpo") == "grpo"
    assert ("trainer", "training") in edges  # `from grpo.training.loop import train` inside train()
    assert any(w.startswith("grpo/trainer.py") for w in edges["trainer", "training"])
    assert ("grpo", "trainer") in edges  # the package's re-exports


def test_the_package_graph_has_no_cycle() -> None:
    """The front-door modules and subpackages of grpo (counting every import, see
    `package_edges`) form a DAG: the core never reaches into a wing that reaches back."""
    edges = package_edges()
    assert ("config", "engine") not in edges  # config owns its fields' choices
    found = knots(edges)
    assert not found, "the package graph has a cycle:\n" + "\n".join(found)


def test_the_module_graph_has_no_cycle() -> None:
    """No module of grpo imports one that (through any chain, counting every import as
    `import_edges` does) imports it back: inside a package too (a policy that builds its
    engines, engines that take the policy's protocol, not its module)."""
    edges = module_edges()
    assert ("grpo.llm.policy", "grpo.llm.engines.worker") in edges  # the hook builds its engines
    found = knots(edges)
    assert not found, "the module graph has a cycle:\n" + "\n".join(found)


# ---- private names across modules ---------------------------------------------------------------
NAMEDTUPLE_API = {"_fields", "_field_defaults", "_asdict", "_replace", "_make"}


def is_private(name: str) -> bool:
    """``_x``, not a dunder and not the public API of a NamedTuple (``_fields``, ``_replace``...)."""
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and name not in NAMEDTUPLE_API


def grpo_bindings(tree: ast.Module, module: str, is_package: bool) -> tuple[set[str], dict[str, str]]:
    """The names a module binds by importing grpo: the module aliases (``import grpo.x as m``,
    ``from grpo.x import y`` with y a module) and the other names (``from grpo.x import Cls``),
    each mapped to the module it came from. Imports anywhere in the module count."""
    mods: set[str] = set()
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    mods.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for base in imported_modules(node, module, is_package) - {module}:
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        mods.add(a.asname or a.name)
                    elif base == (node.module or "") or node.level:
                        names[a.asname or a.name] = base
    return mods, names


def annotation_names(node: ast.AST | None) -> set[str]:
    """The plain names an annotation mentions (``Cls``, ``Cls | None``, ``"Cls"``, ``list[Cls]``)."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def typed_from(scope: ast.AST, classes: set[str]) -> tuple[set[str], set[str]]:
    """In a function or class body: the local names and the ``self.<attr>`` names declared with
    (annotation) or built from (``Cls(...)``) one of the imported ``classes``."""
    local: set[str] = set()
    attrs: set[str] = set()
    for node in ast.walk(scope):
        typed: set[str] = set()
        if isinstance(node, ast.arg):
            if annotation_names(node.annotation) & classes:
                local.add(node.arg)
            continue
        if isinstance(node, ast.AnnAssign) and annotation_names(node.annotation) & classes:
            typed = {node.target} if isinstance(node.target, (ast.Name, ast.Attribute)) else set()
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id in classes
        ):
            typed = set(node.targets)
        for t in typed:
            if isinstance(t, ast.Name):
                local.add(t.id)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                attrs.add(t.attr)
    return local, attrs


def private_attribute_uses(path: Path) -> list[str]:
    """``x._y`` in one module where x is (see `test_no_private_name_is_reached_across_modules`)
    another grpo module, a name imported from one, or a variable / ``self`` attribute typed or
    built as a class imported from one."""
    module = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mods, names = grpo_bindings(tree, module, path.name == "__init__.py")
    classes = {n for n in names if n[:1].isupper()}
    found = []
    scopes = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))),
    ]
    class_attrs: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        class_attrs |= typed_from(cls, classes)[1]
    seen: set[tuple[int, int]] = set()
    for scope in scopes:
        local = (
            typed_from(scope, classes)[0]
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
            else set()
        )
        for node in ast.walk(scope):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            if (node.lineno, node.col_offset) in seen:
                continue
            base = node.value
            what = None
            if isinstance(base, ast.Name):
                if base.id in mods:
                    what = f"module {base.id}"
                elif base.id in names:
                    what = f"{base.id} (from {names[base.id]})"
                elif base.id in local:
                    what = f"{base.id} (typed as a class from another module)"
            elif (
                isinstance(base, ast.Attribute)
                and isinstance(base.value, ast.Name)
                and base.value.id == "self"
                and base.attr in class_attrs
            ):
                what = f"self.{base.attr} (typed as a class from another module)"
            if what is not None:
                seen.add((node.lineno, node.col_offset))
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {what}.{node.attr}")
    return found


def is_self_attribute(node: ast.AST) -> TypeGuard[ast.Attribute]:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def private_members(cls: ast.ClassDef) -> set[str]:
    """The private names a class defines: methods, class-level names and ``self._x`` assignments."""
    found = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
            found.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.Assign):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if is_self_attribute(node) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
    return {n for n in found if is_private(n)}


def grpo_classes() -> dict[tuple[str, str], ast.ClassDef]:
    """(module, class name) -> its definition, for every class at the top of a grpo module."""
    found = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                found[name, node.name] = node
    return found


def inherited_private_uses(path: Path, classes: dict[tuple[str, str], ast.ClassDef]) -> list[str]:
    """In a class whose base is a class of another grpo module: ``self._x`` read, written or
    defined (an override) where ``_x`` is a private member of that base."""
    module = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    _, names = grpo_bindings(tree, module, path.name == "__init__.py")
    found = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for base in cls.bases:
            if not isinstance(base, ast.Name) or base.id not in names:
                continue
            base_def = classes.get((names[base.id], base.id))
            private = set() if base_def is None else private_members(base_def)
            for node in ast.walk(cls):
                used = None
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    used = node.attr
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
                    used = node.name
                if used in private:
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {cls.name}: self.{used} of {base.id}"
                    )
    return found


def test_no_private_name_is_reached_across_modules() -> None:
    """No grpo module reaches a private name (``_x``, not a dunder) of another grpo module by
    attribute. What is checked, statically:

    * ``m._x`` where ``m`` is a grpo module bound by an import (``import grpo.a.b as m``,
      ``from grpo.a import b``);
    * ``N._x`` where ``N`` is any name imported from another grpo module (a class, a function);
    * ``v._x`` where ``v`` is a parameter or local annotated with, or assigned ``Cls(...)`` of, a
      class imported from another grpo module, and ``self.a._x`` where ``self.a`` is annotated
      with or built as such a class in the class body or its methods;
    * in a class whose base is imported from another grpo module: ``self._x`` read, written or
      overridden where ``_x`` is a private member of that base (its methods, class-level names and
      ``self._x`` assignments).

    Beyond its reach: objects whose class is known only at run time (a return value, an element
    of a container, an unannotated argument), and private names of third-party packages."""
    classes = grpo_classes()
    found = [
        f
        for path in modules()
        for f in (*private_attribute_uses(path), *inherited_private_uses(path, classes))
    ]
    assert not found, "private names reached across modules:\n" + "\n".join(found)


def test_the_trainer_is_at_most_400_lines() -> None:
    """grpo/trainer.py composes the parts; what is not the trainer's lives in the module named
    after it."""
    lines = (PACKAGE / "trainer.py").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"grpo/trainer.py has {lines} lines"


def test_the_trainer_state_reaches_sharded_weights_only_through_the_protocol() -> None:
    """grpo/state/trainer_state.py runs no collective itself and names no FSDP detail: a sharded
    backend's checkpoint weights go through `ShardedWeights` (three methods)."""
    from grpo.engine.backends import ShardedWeights

    tree = ast.parse((PACKAGE / "state" / "trainer_state.py").read_text(encoding="utf-8"))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    details = {"distributed", "all_gather_object", "rank", "world_size", "fsdp", "state_dict_names"}
    assert not names & details, sorted(names & details)
    assert declared(ShardedWeights) == {"check_policy", "policy_state", "load_policy_state"}
