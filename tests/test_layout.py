"""The folders say who uses what (STYLE.md): the shared rollout layer imports no service, the trainer
imports nothing from the generator service, the installed trainer ships no test fixtures, and no
first-party modules import each other in a circle. Read from the source (every import, the lazy ones
inside functions included), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "rollouts", "services", "trainer", "demo", "toy", "benchmarks", "integrations")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    imported.add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_no_import_circles():
    assert _cycles(_import_graph()) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_trainer_and_rollouts_import_no_service_but_the_store_client():
    graph = _import_graph()
    wrong = sorted(
        (module, imported) for module, imports in graph.items() if module.startswith(("trainer", "rollouts"))
        for imported in imports if imported.startswith("services.generator")
    )
    assert wrong == []
    assert not any(imported.startswith("services") for module, imports in graph.items()
                   if module.startswith("rollouts") for imported in imports)


def test_the_installed_packages_ship_no_test_fixtures():
    graph = _import_graph()
    for package in ("schemas", "rollouts", "services", "trainer"):
        leaks = sorted((m, i) for m, imports in graph.items() if m.startswith(package) for i in imports
                       if i.startswith(("toy", "demo", "tests")))
        assert leaks == [], f"{package} imports the toy world or the demo: {leaks}"
