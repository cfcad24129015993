"""The wheel installs what users import (issues 25, 40, 51): one name, graft, on disk as src/graft/ (schemas, rollouts,
services, trainer and integrations), never the checkout-only folders (the demo, the toy world, the benchmarks), which
would shadow, or be shadowed by, a user's own `demo/` or `benchmarks/`; and a user's own trainer.py or schemas.py
shadows none of it. Built for real, as `pip install .` builds it, from a copy of what a build reads (the project files,
src/ and every top-level folder of Python modules), so that the checkout's build/ (the GPU check's offline folder) is
never touched."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
INSTALLED = {"schemas", "rollouts", "services", "trainer", "integrations"}  # src/graft/<name>/
CHECKOUT_ONLY = {"toy", "demo", "benchmarks", "gpu_check", "testbed"}  # run from the checkout: `python -m demo.run`


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    # src/ and every top-level folder of Python modules
    packages = [SRC, *(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py")))]
    assert CHECKOUT_ONLY <= {p.name for p in packages}, "the copy must hold the folders the wheel has to leave out"
    for package in packages:
        shutil.copytree(package, source / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    # this environment's setuptools when it meets pyproject's build requirement (no index needed), else pip's isolated build
    isolation = [] if _build_needs_another_setuptools() else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(source)],
                   check=True, capture_output=True, timeout=600)
    (built,) = out.glob("graft-*.whl")
    return zipfile.ZipFile(built)


def _build_needs_another_setuptools() -> bool:
    """Whether this environment's setuptools misses pyproject's build requirement (then pip builds in isolation)."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    (wanted,) = [Requirement(r) for r in requires if Requirement(r).name == "setuptools"]
    try:
        return not wanted.specifier.contains(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        return True


def test_wheel_holds_only_what_users_import_under_one_name(wheel):
    names = [n for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")]
    assert {n.split("/")[0] for n in names} == {"graft"}, "the wheel's top-level names"
    assert {n.split("/")[1] for n in names if n.count("/") >= 2} == INSTALLED
    assert "graft/services/store_api/browser/ui/index.html" in names  # the browser's page, package data


def test_the_wheel_holds_src_graft_file_for_file(wheel):
    """Issue 51: the installed name is on disk. The wheel's modules are src/graft/'s, each at the same path (src/graft/
    trainer/loop.py is graft/trainer/loop.py), none left out (a folder without its __init__.py would be) and none from
    elsewhere."""
    modules = {n for n in wheel.namelist() if n.endswith(".py")}
    assert modules == {str(p.relative_to(SRC)) for p in (SRC / "graft").rglob("*.py")}


def _mapped_from_elsewhere(setuptools: dict) -> list[str]:
    """What in pyproject's [tool.setuptools] would install graft.* from another folder than src/graft/: a package-dir
    entry other than `"" = "src"`, packages not found under src/ (a list of names, mapped one by one)."""
    wrong = [f"package-dir: {k} = {v}" for k, v in setuptools.get("package-dir", {}).items() if (k, v) != ("", "src")]
    packages = setuptools.get("packages", {})
    if not isinstance(packages, dict) or packages.get("find", {}).get("where") != ["src"]:
        wrong.append(f"packages: {packages!r}, not found under src/")
    return wrong


def test_pyproject_installs_graft_from_src_alone():
    """No package-dir mapping (graft.trainer was mapped from trainer/, so grep and import-graph tools could not follow
    `graft.trainer` to a file): setuptools finds the packages under src/."""
    assert _mapped_from_elsewhere(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]) == []


def test_the_mapping_rule_finds_the_old_mapping():
    old = {"packages": ["graft.trainer"], "package-dir": {"graft.trainer": "trainer"}}
    assert _mapped_from_elsewhere(old) == ["package-dir: graft.trainer = trainer",
                                           "packages: ['graft.trainer'], not found under src/"]


SHADOWS = {"trainer.py": "raise SystemExit('the user trainer.py was imported')",
           "schemas.py": "raise SystemExit('the user schemas.py was imported')",
           "services.py": "", "rollouts.py": "", "integrations.py": ""}


def test_a_users_own_trainer_py_and_schemas_py_do_not_break_the_imports(tmp_path):
    """A script's folder comes first on sys.path: with the old top-level names, a trainer.py beside a TRL script made
    `from integrations.trl import GraftGRPOTrainer` fail ('trainer' is not a package). Run as a user runs a script,
    in this environment (make install-dev's editable install of the checkout), from a folder holding all five names."""
    pytest.importorskip("trl")
    for name, text in SHADOWS.items():
        (tmp_path / name).write_text(text + "\n")
    script = tmp_path / "train_with_trl.py"
    script.write_text("from graft.integrations.trl import GraftConfig, GraftGRPOTrainer\n"
                      "from graft.schemas import PeerLookupRequest\n"
                      "from graft.trainer.config import TrainConfig\n"
                      "import graft.services.store_api.http.client\n"
                      "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_console_scripts_are_in_the_wheel(wheel):
    """Each console script's module ships in the wheel (graft-store, graft-train, ... work outside the checkout)."""
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    lines = wheel.read(entry_points).decode().splitlines()
    targets = {line.split("=")[1].strip().split(":")[0] for line in lines if "=" in line}
    assert targets, lines
    names = set(wheel.namelist())
    missing = [t for t in targets if f"{t.replace('.', '/')}.py" not in names and f"{t.replace('.', '/')}/__init__.py" not in names]
    assert not missing, f"console scripts whose module is not in the wheel: {missing}"


def test_installed_code_imports_no_checkout_folder(wheel):
    """An installed module that imported toy, demo or benchmarks would fail outside the checkout."""
    offenders = []
    for name in wheel.namelist():
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(wheel.read(name), filename=name)):
            modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                       else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{name}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] in CHECKOUT_ONLY]
    assert not offenders, offenders
