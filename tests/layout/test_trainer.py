"""The trainer's face: the TRL and verl adapters import graft.trainer only through it, it names what it exports,
and GRAFT's tally is spelled in one place for every trainer."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from source_tree import GRAFT, ROOT, first_party_modules, imports_past_the_face

TRAINER = "graft.trainer"
ADAPTERS = ("graft.integrations.trl", "graft.integrations.verl")


def _trainer_face() -> set[str]:
    """The names graft.trainer exports (its `__all__`; imported on first use, so importing the package is cheap)."""
    import graft.trainer

    return set(graft.trainer.__all__)


def _adapters() -> dict[str, Path]:
    return {name: path for name, path in first_party_modules().items() if name.startswith(ADAPTERS)}


def test_the_adapters_import_the_trainer_only_through_its_face():
    """Issue 51: TRL's and verl's trainers host graft-train's GRAFT through `from graft.trainer import ...` (its
    `__all__`), never graft.trainer.batch or .metrics: the trainer's modules can move without breaking them, and what
    they share with graft-train (one tally, one metrics function, one setup) is written down in one place."""
    face = _trainer_face()
    assert {"graft_metrics", "graft_tally", "host_setup", "PeerRowCounts", "TrainConfig"} <= face
    assert imports_past_the_face(TRAINER, face, _adapters()) == []


def test_the_trainer_face_rule_finds_an_import_past_it(tmp_path):
    module = tmp_path / "adapter.py"
    module.write_text("from graft.trainer import TrainConfig, gate\nfrom graft.trainer.batch import TrainSample\n"
                      "import graft.trainer.metrics\n")
    found = imports_past_the_face(TRAINER, {"TrainConfig"}, {"graft.integrations.trl.trainer": module})
    assert found == [("graft.integrations.trl.trainer", "graft.trainer.batch"),
                     ("graft.integrations.trl.trainer", "graft.trainer.gate"),
                     ("graft.integrations.trl.trainer", "graft.trainer.metrics")]


def test_the_trainer_face_names_what_it_exports():
    """Every name of graft.trainer's face resolves (the lazy face names no module or name that is gone), and the package
    imports no torch on its own: `graft-train --help` and the configs' readers stay fast."""
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


GRAFT_PARTS = ("load_peer_tokenizers", "RefusedTokenizers", "StoreCounts")  # the peers' tokenizers, refusals, counts


def graft_part_builders(sources: dict[str, str]) -> dict[str, list[str]]:
    """For each of GRAFT's parts beside a learner (GRAFT_PARTS), the modules of `sources` (name -> source) that build
    it: call it."""
    found: dict[str, list[str]] = {part: [] for part in GRAFT_PARTS}
    for name, source in sorted(sources.items()):
        called = {ast.unparse(node.func).rsplit(".", 1)[-1] for node in ast.walk(ast.parse(source, filename=name))
                  if isinstance(node, ast.Call)}
        for part in GRAFT_PARTS:
            if part in called:
                found[part].append(name)
    return found


def test_graft_train_builds_its_graft_parts_as_the_hosts_do():
    """Issue 59: graft-train's loop built by hand what `host_setup` builds for TRL and verl (the peers' tokenizers, the
    gate's refusals; the store counts in its metrics log). `graft.trainer.host` builds them around any learner
    (`GraftHost.around`), graft-train's included."""
    sources = {name: path.read_text() for name, path in first_party_modules().items() if name.startswith("graft.")}
    assert graft_part_builders(sources) == dict.fromkeys(GRAFT_PARTS, ["graft.trainer.host"])


def test_the_part_finder_finds_each_builder():
    sources = {"graft.trainer.loop": "peer_tokenizers = load_peer_tokenizers(cfg)\nr = gate.RefusedTokenizers(None)\n",
               "graft.trainer.metrics": "self.store = StoreCounts(link)\n", "graft.x": "RefusedTokenizers\n"}
    assert graft_part_builders(sources) == {"load_peer_tokenizers": ["graft.trainer.loop"],
                                            "RefusedTokenizers": ["graft.trainer.loop"],
                                            "StoreCounts": ["graft.trainer.metrics"]}


def lazy_face_mismatches(source: str, name: str) -> list[str]:
    """For a package `__init__` that resolves names lazily (a module-level `__getattr__` over `_FACE`, {module: names}):
    each name that `_FACE`, the imports under `if TYPE_CHECKING:` and `__all__` do not all give alike (from the same
    module). A package without a module-level `__getattr__` has nothing to match."""
    tree = ast.parse(source, filename=name)
    if not any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body):
        return []
    lazy: dict[str, str] = {}
    exported: list[str] = []
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_FACE":
                lazy = {n: module for module, names in ast.literal_eval(node.value).items() for n in names}
            elif node.targets[0].id == "__all__":
                try:
                    exported = list(ast.literal_eval(node.value))
                except ValueError:  # computed: tools that read __all__ see nothing
                    exported = []
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            typed = {a.asname or a.name: i.module for i in node.body if isinstance(i, ast.ImportFrom) for a in i.names}
    found = [f"{name}: {n} is lazy from {lazy.get(n)} but typed from {typed.get(n)}"
             for n in sorted(set(lazy) | set(typed)) if lazy.get(n) != typed.get(n)]
    return found + [f"{name}: __all__ is not _FACE's names"] * (sorted(exported) != sorted(lazy))


def test_each_lazy_face_is_written_out_for_type_checkers():
    """Issue 59: graft.trainer resolved its 16 names through `__getattr__`, so type checkers saw `Any` and "go to
    definition" landed on `__getattr__`. Each lazy face imports the same names under TYPE_CHECKING (as TRL's
    `__init__` does) and in `__all__`, module for module."""
    inits = sorted(GRAFT.rglob("__init__.py"))
    lazy = [path for path in inits if "def __getattr__" in path.read_text()]
    assert GRAFT / "trainer" / "__init__.py" in lazy
    assert [m for path in lazy for m in lazy_face_mismatches(path.read_text(), str(path.relative_to(ROOT)))] == []


def test_the_lazy_face_rule_finds_a_name_typed_from_elsewhere_and_one_missing():
    source = ('_FACE = {"p.a": ("A", "f"), "p.b": ("B",)}\n__all__ = ["A", "B", "f"]\nif TYPE_CHECKING:\n'
              '    from p.a import A\n    from p.c import B\ndef __getattr__(name): ...\n')
    assert lazy_face_mismatches(source, "p/__init__.py") == [
        "p/__init__.py: B is lazy from p.b but typed from p.c", "p/__init__.py: f is lazy from p.a but typed from None"]
    assert lazy_face_mismatches("import os\n", "q/__init__.py") == []
