"""The import graph, read from the source (every import, the lazy ones inside functions included, so a lazy
import cannot hide a circle): no circle between modules, the layers import downwards (the shared rollout
layer no service, the trainer nothing of the generator service), the installed packages ship no test
fixtures and are imported as graft.*, and a private name stays in its module (docs/style.md, "The layout")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from source_tree import (
    CHECKOUT_ONLY,
    GRAFT,
    INSTALLED,
    ROOT,
    SRC,
    cycles,
    first_party_modules,
    import_graph,
    modules_of_the_tests,
)


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_trainer_and_rollouts_import_no_service_but_the_store_client():
    graph = import_graph()
    wrong = sorted(
        (module, imported) for module, imports in graph.items() if module.startswith(("graft.trainer", "graft.rollouts"))
        for imported in imports if imported.startswith("graft.services.generator")
    )
    assert wrong == []
    assert not any(imported.startswith("graft.services") for module, imports in graph.items()
                   if module.startswith("graft.rollouts") for imported in imports)


def test_the_toy_world_imports_nothing_from_the_demo_built_on_it():
    """toy/ (models, task, their setup) is what demo/ runs on: an arrow from toy back up to demo is a layering error
    (toy.setup_models took the SmolLM2 path from demo.real; it is graft.rollouts.models.smollm2_gguf now)."""
    graph = import_graph()
    assert sorted((m, i) for m, imports in graph.items() if m.startswith("toy") for i in imports if i.startswith("demo")) == []


def test_the_installed_packages_ship_no_test_fixtures():
    graph = import_graph()
    for package in (f"graft.{name}" for name in INSTALLED):
        leaks = sorted((m, i) for m, imports in graph.items() if m.startswith(package) for i in imports
                       if i.startswith(("toy", "demo", "tests")))
        assert leaks == [], f"{package} imports the toy world or the demo: {leaks}"


def _imports_of_old_top_level_names(paths: list[Path]) -> list[str]:
    """`file:line imports name` for each import of an installed part by its top-level folder's name (`trainer.loop`,
    `from schemas import ...`) instead of through graft.*: it works only from the checkout's root, and makes a second
    copy of the module beside graft.trainer.loop."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in INSTALLED]
    return found


def test_the_project_imports_its_installed_parts_as_graft():
    """One installed name (issue 40): the code, the demo, the benchmarks and the tests import graft.trainer, never the
    folder's bare name `trainer`, which a user's own trainer.py shadowed."""
    paths = [*first_party_modules().values(), *(ROOT / "tests").rglob("*.py")]
    assert _imports_of_old_top_level_names(paths) == []


def test_the_old_name_finder_finds_one(tmp_path):
    script = ROOT / "tests" / f"_probe_{tmp_path.name}.py"  # inside the checkout: the finder reports paths under ROOT
    script.write_text("import json\nfrom trainer.loop import train\nimport graft.schemas\n")
    try:
        assert _imports_of_old_top_level_names([script]) == [f"tests/{script.name}:2 imports trainer.loop"]
    finally:
        script.unlink()


# imports of a private name from another first-party module that are allowed, and why
PRIVATE_IMPORTS_LEFT = {
    ("graft.services.store_api.lake.writing", "graft.services.store_api.lake.connection._quote"): "the lake's parts, "
    "being reworked with the store's faces (issue 51's second item)",
    ("graft.services.store_api.lake.writing", "graft.services.store_api.lake.connection._rollback_quietly"): "as above",
    ("graft.services.store_api.lake.writing", "graft.services.store_api.lake.connection._storage_error"): "as above",
}


def _private_imports(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, module.name) for each `from <first-party module> import _name` (dunders aside)."""
    first_party = ("graft.", *CHECKOUT_ONLY, "tests")
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(first_party):
                found += [(name, f"{node.module}.{a.name}") for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(found)


def test_no_private_name_is_imported_from_another_module():
    """A leading underscore says "only this module uses it": a benchmark, the demo or a test that needs one imports a
    public name (graft-generate's `sample_batch`, the demo's `save_fig`), so that the owner sees who depends on it."""
    found = _private_imports({**first_party_modules(), **modules_of_the_tests()})
    assert [hit for hit in found if hit not in PRIVATE_IMPORTS_LEFT] == []
    assert sorted(set(PRIVATE_IMPORTS_LEFT) - set(found)) == []  # no stale allowance


def test_the_private_import_finder_finds_one(tmp_path):
    module = tmp_path / "bench.py"
    module.write_text("from graft.services.generator.generate import RunStats, _load\nfrom json import _default\n")
    assert _private_imports({"benchmarks.bench": module}) == [("benchmarks.bench", "graft.services.generator.generate._load")]


def test_a_private_function_is_used_where_it_is_defined():
    """A module-level `_name` that its own module never uses is dead code (demo/report.py's `_std` was), or a private
    that another module imports (listed above)."""
    unused = []
    for name, path in first_party_modules().items():
        text = path.read_text()
        for node in ast.parse(text, filename=str(path)).body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_")
                    and not node.name.startswith("__") and len(re.findall(rf"\b{node.name}\b", text)) < 2):
                unused.append(f"{name}.{node.name}")
    assert [u for u in unused if not any(u == imported for _, imported in PRIVATE_IMPORTS_LEFT)] == []


def test_every_folder_of_modules_is_a_package():
    """Every folder of Python modules has an `__init__.py` (toy/ had none: a namespace package, which any other `toy`
    folder on the path merges into; under src/graft/, a folder without one would be left out of the wheel). At the
    checkout's top, the checkout-only folders and tests/: graft's parts live under src/graft/ alone."""
    folders = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py"))]
    assert {p.name for p in folders} == {*CHECKOUT_ONLY, "tests"}  # tests/: pytest's rootdir imports, no package
    assert sorted(p.name for p in SRC.iterdir() if p.suffix == ".py" or any(p.rglob("*.py"))) == ["graft"]
    installed = [GRAFT, *(p for p in GRAFT.rglob("*") if p.is_dir() and any(p.glob("*.py")))]
    assert {p.name for p in installed if p.parent == GRAFT} == set(INSTALLED)
    packages = [*installed, *(ROOT / name for name in CHECKOUT_ONLY)]
    assert sorted(str(p.relative_to(ROOT)) for p in packages if not (p / "__init__.py").exists()) == []


def _not_on_disk(origins: dict[str, str | None]) -> list[str]:
    """The graft.* modules (name -> the file Python imports it from) whose file is not src/graft/<name's parts>: a
    package mapped from elsewhere (setuptools' package-dir, as graft.trainer once was from trainer/)."""
    def on_disk(name: str, origin: Path) -> bool:
        path = SRC.joinpath(*name.split("."))
        return origin in (path.with_suffix(".py"), path / "__init__.py")

    return sorted(f"{name}: {origin}" for name, origin in origins.items()
                  if origin is None or not on_disk(name, Path(origin).resolve()))


def test_the_installed_name_is_on_disk():
    """Issue 51: `graft.trainer.loop` is src/graft/trainer/loop.py, as Python imports it (this environment's install
    of the checkout), so that grep, code search and import-graph tools follow a `graft.*` import to its file."""
    import importlib.util

    def origin(name: str) -> str | None:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:  # a parent package that is not there
            return None
        return spec.origin if spec else None

    names = ["graft", *(f"graft.{name}" for name in INSTALLED), "graft.trainer.loop", "graft.services.store_api.cli"]
    assert _not_on_disk({name: origin(name) for name in names}) == []


def test_the_on_disk_rule_finds_a_mapped_package():
    assert _not_on_disk({"graft.trainer": str(ROOT / "trainer" / "__init__.py"),
                         "graft.trainer.loop": str(GRAFT / "trainer" / "loop.py")}) == [
        f"graft.trainer: {ROOT / 'trainer' / '__init__.py'}"]
