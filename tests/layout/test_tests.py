"""The tests' own layout: tests/<part>/ mirrors the code, and what a part's tests share that is not a test (factories,
worlds, worker scripts) lives in its helpers/ folder, importable by module name (pytest's pythonpath)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from source_tree import ROOT

TESTS = ROOT / "tests"


def helpers_out_of_place(paths: list[Path]) -> list[str]:
    """Each module under tests/ (paths relative to the checkout) that is neither a test (test_*.py), nor a conftest.py,
    nor in a helpers/ folder; and each helper whose module name another helper has (they share one sys.path)."""
    out = [str(p) for p in paths if not (p.name.startswith("test_") or p.name == "conftest.py" or "helpers" in p.parts)]
    names: dict[str, list[str]] = {}
    for path in paths:
        if "helpers" in path.parts:
            names.setdefault(path.stem, []).append(str(path))
    return out + [f"{name}: {' and '.join(found)}" for name, found in sorted(names.items()) if len(found) > 1]


def test_test_helpers_live_in_a_helpers_folder_per_area():
    """Issue 59 (a third review running): helper modules sat among the tests (7 beside 12 test files in tests/trainer).
    Each area's non-test modules are in its helpers/ folder, each such folder is on pytest's pythonpath (so a test
    imports `from store_factory import make_group` wherever it runs, .venv-verl included, whose verl ships a package
    called `tests`), and each pythonpath entry is there."""
    modules = sorted(p.relative_to(ROOT) for p in TESTS.rglob("*.py"))
    assert helpers_out_of_place(modules) == []
    pythonpath = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["pythonpath"]
    folders = sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("helpers") if p.is_dir())
    assert sorted(entry for entry in pythonpath if entry.startswith("tests/")) == folders
    assert [entry for entry in pythonpath if not (ROOT / entry).is_dir()] == []


def test_the_helpers_rule_finds_a_helper_among_the_tests_and_two_of_one_name():
    paths = [Path("tests/store/test_api.py"), Path("tests/store/conftest.py"), Path("tests/store/factory.py"),
             Path("tests/store/helpers/world.py"), Path("tests/trainer/helpers/world.py")]
    assert helpers_out_of_place(paths) == [
        "tests/store/factory.py", "world: tests/store/helpers/world.py and tests/trainer/helpers/world.py"]
