"""What the layout rules (tests/layout/) read: the checkout's first-party modules by the names they are
imported as, their import graph (every import, the lazy ones inside functions included), its circles,
and the imports that go past a package's face."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src"  # the installed name on disk: graft.trainer.loop is src/graft/trainer/loop.py
GRAFT = SRC / "graft"
INSTALLED = ("schemas", "rollouts", "services", "trainer", "integrations")  # graft.<name>: src/graft/<name>/
CHECKOUT_ONLY = ("demo", "studies", "toy", "benchmarks", "gpu_check", "testbed")  # top-level folders, run from the checkout
PACKAGES = (*INSTALLED, *CHECKOUT_ONLY)


def first_party_modules() -> dict[str, Path]:
    """Every first-party module by the name it is imported as, its path under the folder that goes on sys.path (src/
    for graft.*, the checkout's root for the rest): graft.trainer.loop for src/graft/trainer/loop.py, demo.run."""
    found = {}
    for top, paths in ((SRC, GRAFT.rglob("*.py")), *((ROOT, (ROOT / p).rglob("*.py")) for p in CHECKOUT_ONLY)):
        for path in paths:
            found[".".join(path.relative_to(top).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports anywhere in its body."""
    modules = first_party_modules()
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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def modules_of_the_tests() -> dict[str, Path]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): path for path in (ROOT / "tests").rglob("*.py")}


def imports_past_the_face(package: str, face: set[str], modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, what it imports) for each import of `package`'s own modules from `modules`: `package.x` in any form, or a
    name from `package` that its face does not export (a submodule)."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith(package + "."):
                    found.append((name, node.module))
                elif node.module == package:
                    found.extend((name, f"{package}.{a.name}") for a in node.names if a.name not in face)
            elif isinstance(node, ast.Import):
                found.extend((name, a.name) for a in node.names if a.name.startswith(package + "."))
    return sorted(set(found))


STORE = "graft.services.store_api"


def store_parts(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The store's import graph with each sub-package drawn as one node (its modules' imports together); the
    modules at the store's top (shared validation and settings) stay nodes of their own."""
    def part(module: str) -> str:
        inside = module.removeprefix(STORE + ".").split(".")
        return f"{STORE}.{inside[0]}"

    parts: dict[str, set[str]] = {}
    for module, imports in graph.items():
        if module.startswith(STORE + "."):
            node = part(module)
            parts.setdefault(node, set()).update(part(i) for i in imports if i.startswith(STORE + ".") and part(i) != node)
    return parts
