"""The pages that describe the layout agree with it: docs/ARCHITECTURE.md's one layout table has a row for every
top-level folder."""

from __future__ import annotations

import re
import subprocess

import pytest
from source_tree import ROOT


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
