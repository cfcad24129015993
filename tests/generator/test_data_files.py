"""The repository carries the data it reads: every file that data/SOURCES.md lists is there with its row
count and sha256, every data set a config or a known name points at resolves inside the repository with no
GRAFT_DATA_DIR set, and GRAFT_DATA_DIR, when set, replaces the folder."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import yaml

from graft.rollouts.datasets import KNOWN_DATASETS, data_dir, load_problems

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
# | file | origin | rows | sha256 | licence |  (the table under "## Files" in data/SOURCES.md)
FILE_ROW = re.compile(r"^\| ([\w/]+\.jsonl) \| [^|]+ \| (\d+) \| ([0-9a-f]{64}) \|", re.MULTILINE)


def listed_files() -> dict[str, tuple[int, str]]:
    return {name: (int(rows), sha) for name, rows, sha in FILE_ROW.findall((DATA / "SOURCES.md").read_text())}


def config_datasets() -> list[str]:
    """Every data set named by a config in configs/: the trainer's data.dataset and eval benchmarks, the
    generator's dataset, graft-eval's benchmarks. Files that `make demo` writes (demo_out/) and that compose's one-shot
    `models` service writes into its volume (/models/, configs/compose_cpu_*.yaml), the offline GPU check into its
    run folder (runs/gpu-check-offline/) or `python -m toy.setup_models runs/pair` beside the toy pair
    (configs/train_toy_pair.yaml) are not data sets."""
    names = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.name.startswith("demo"):
            continue
        cfg = yaml.safe_load(path.read_text())
        data_section, eval_section = cfg.get("data") or {}, cfg.get("eval") or {}
        names += [data_section["dataset"]] if "dataset" in data_section else []
        names += list((eval_section.get("benchmarks") or {}).values())
        names += [cfg["dataset"]] if "dataset" in cfg else []
        names += list(cfg["benchmarks"]) if isinstance(cfg.get("benchmarks"), list) else []
    return [name for name in names if not name.startswith(("demo_out/", "/models/", "runs/gpu-check-offline/", "runs/pair/"))]


def test_every_listed_file_is_in_the_repository_with_its_rows_and_checksum():
    listed = listed_files()
    assert len(listed) == 8, f"data/SOURCES.md's file table should list 8 files, found {sorted(listed)}"
    on_disk = {str(p.relative_to(DATA)) for p in DATA.rglob("*.jsonl")}
    assert on_disk == set(listed), f"files in data/ and in data/SOURCES.md differ: {on_disk ^ set(listed)}"
    for name, (rows, sha) in listed.items():
        content = (DATA / name).read_bytes()
        assert hashlib.sha256(content).hexdigest() == sha, f"{name} differs from the sha256 in data/SOURCES.md"
        assert sum(1 for line in content.splitlines() if line.strip()) == rows, name


def test_known_names_and_config_data_sets_resolve_inside_the_repository(monkeypatch):
    monkeypatch.delenv("GRAFT_DATA_DIR", raising=False)
    assert data_dir() == DATA
    for relative, _ in KNOWN_DATASETS.values():
        assert (DATA / relative).is_file(), relative
    names = config_datasets()
    assert "math_train/train_level3to5.jsonl" in names and "math500" in names and "gsm8k" in names
    for name in names:
        assert load_problems(name, limit=3), f"configs name {name!r}, which loads no problem"


def test_graft_data_dir_replaces_the_folder(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"problem": "What is 2 + 2?", "answer": "4"}\n')
    monkeypatch.setenv("GRAFT_DATA_DIR", str(tmp_path))
    problems = load_problems("gsm8k")
    assert [(p.problem, p.answer, p.dataset) for p in problems] == [("What is 2 + 2?", "4", "gsm8k")]
    with pytest.raises(FileNotFoundError, match="GRAFT_DATA_DIR"):
        load_problems("math500")  # not in the override folder: no silent fallback to the repository's copy
