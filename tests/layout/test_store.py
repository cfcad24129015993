"""The store's parts (docs/ARCHITECTURE.md): they import each other downwards and in no circle, each owns its
state and is composed, not inherited, other parts import the local store through its face, the HTTP face
routes on module-level routers, and the lookup file's tables are read by field name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from source_tree import (
    GRAFT,
    ROOT,
    STORE,
    cycles,
    first_party_modules,
    import_graph,
    imports_past_the_face,
    store_parts,
)


def test_the_store_parts_import_each_other_in_no_circle():
    parts = store_parts(import_graph())
    assert {f"{STORE}.{p}" for p in ("local", "lake", "http", "browser", "tables")} <= set(parts)
    assert cycles(parts) == []


def test_the_store_parts_depend_downwards():
    """The local store knows nothing of the lake, the HTTP face or the browser; the lake and the browser know no
    HTTP face; the shared validation imports no part."""
    parts = store_parts(import_graph())
    assert not parts[f"{STORE}.local"] & {f"{STORE}.lake", f"{STORE}.http", f"{STORE}.browser"}
    assert f"{STORE}.http" not in parts[f"{STORE}.lake"] | parts[f"{STORE}.browser"]
    assert parts[f"{STORE}.tables"] == set()


def test_part_graph_finds_a_circle_between_sub_packages():
    graph = {f"{STORE}.local.a": {f"{STORE}.lake.b"}, f"{STORE}.lake.b": {f"{STORE}.local.c"}, f"{STORE}.local.c": set()}
    assert cycles(store_parts(graph)) == [[f"{STORE}.lake", f"{STORE}.local"]]


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


def _outside_local() -> dict[str, Path]:
    return {name: path for name, path in first_party_modules().items() if not (name == LOCAL or name.startswith(LOCAL + "."))}


def test_other_parts_import_the_local_store_only_through_its_face():
    """docs/style.md (a package has a face): `from graft.services.store_api.local import StoreIndex`, never `graft.services.store_api.local.index`:
    local/'s modules can move inside it without breaking the HTTP face, the browser, the lake or the benchmarks."""
    face = _local_face()
    assert "StoreIndex" in face
    found = imports_past_the_face(LOCAL, face, _outside_local())
    assert [wrong for wrong in found if wrong not in LOCAL_WHITE_BOX] == []
    assert sorted(set(LOCAL_WHITE_BOX) - set(found)) == []  # no stale allowance


def _store_part_classes() -> list[type]:
    """Every class defined in a module of local/ or lake/ (imported: the bases are the real ones)."""
    import importlib
    import inspect

    classes = []
    for name in sorted(first_party_modules()):
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


LOOKUP = "services/store_api/local/lookup"  # its layout, writer, rebuild and reader
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
    `blocks[:, BLOCK.row_start]`); `Block` and `PageEntry` in lookup/layout.py are the one definition of both tables'
    layout, which the writer writes and the reader reads."""
    files = sorted((GRAFT / LOOKUP).glob("*.py"))
    assert len(files) >= 4
    assert [f"{path.name}: {hit}" for path in files for hit in _tables_read_by_position(path.read_text())] == []


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
